"""docs/api.md and the public docstrings agree with the code (CPU only, no GPU needed).

The public names: ``cuflash.__all__``, the public methods of :class:`cuflash.Generator`, and (where
torch and CuPy are installed) the functions of ``cuflash.interop.torch.__all__``. For each one:

- docs/api.md has a ``## <dotted name>`` heading whose first fenced block is the name and its
  signature, equal to ``inspect.signature`` of the object (annotations left out, ``self`` left out
  of methods, whitespace aside);
- no parameter of its signature starts with ``_`` (private ways in have private names);
- its docstring has a Parameters section naming every parameter (if it takes any), a Returns
  section (if it is a function that returns a value) and an Examples section;
- its api.md entry holds the docstring's summary line.

Every other ``## `` heading of api.md (cuflash.distributed, cuflash.reference, cuflash.testing) must
name an object whose signature matches too, so that no entry describes a signature that is gone.
"""

import ast
import importlib
import importlib.util
import inspect
import pathlib
import re
import sys
import textwrap
import types

import pytest

import cuflash

API_MD = pathlib.Path(__file__).resolve().parents[2] / "docs" / "api.md"
TORCH = "cuflash.interop.torch"
SECTION = re.compile(r"^(\w[\w ]*)\n-{3,}$", re.M)


def _entries() -> dict:
    """{dotted name: entry text} of the ``## `` headings of api.md."""
    parts = re.split(r"^## +(.+?)[ \t]*$", API_MD.read_text(), flags=re.M)
    return {name: body for name, body in zip(parts[1::2], parts[2::2])}


def _resolve(dotted: str):
    """(object, the object it is an attribute of) for a dotted name, importing modules on the way
    (``cuflash.attention`` is the function the package exports, not the module)."""
    parts = dotted.split(".")
    obj, parent = importlib.import_module(parts[0]), None
    for i, part in enumerate(parts[1:], 1):
        parent = obj
        try:
            obj = getattr(obj, part)
        except AttributeError:
            obj = importlib.import_module(".".join(parts[:i + 1]))
    return obj, parent


def _is_method(obj, parent) -> bool:
    return inspect.isclass(parent) and inspect.isfunction(obj) and not isinstance(
        inspect.getattr_static(parent, obj.__name__), staticmethod)


def _signature(obj, parent) -> inspect.Signature:
    sig = inspect.signature(obj)
    params = list(sig.parameters.values())[1:] if _is_method(obj, parent) else list(sig.parameters.values())
    return sig.replace(parameters=[p.replace(annotation=inspect.Parameter.empty) for p in params],
                       return_annotation=inspect.Signature.empty)


def _public_names() -> list:
    names = [f"cuflash.{name}" for name in cuflash.__all__]
    names += [f"cuflash.Generator.{name}" for name, value in vars(cuflash.Generator).items()
              if not name.startswith("_") and inspect.isfunction(value)]
    return names


def _torch_module():
    """cuflash.interop.torch, or None where it cannot be imported (no torch, or no CuPy)."""
    if importlib.util.find_spec("torch") is None:
        return None
    try:
        return importlib.import_module(TORCH)
    except ImportError:
        return None


def _sections(doc: str) -> dict:
    """{section title: its text} of a numpydoc docstring."""
    pieces = SECTION.split(doc)
    return {pieces[i]: pieces[i + 1] for i in range(1, len(pieces) - 1, 2)}


def _documented_parameters(text: str) -> set:
    """The names a Parameters section documents: its unindented lines, ``a, b : type`` or ``a, b``."""
    names = set()
    for line in textwrap.dedent(text).splitlines():
        if line and not line[0].isspace():
            names.update(n.strip().lstrip("*") for n in line.split(" : ")[0].split(","))
    return names


def _returns_value(fn) -> bool:
    """Whether the function's own body (not nested functions) returns a value or yields."""
    try:
        source = textwrap.dedent(inspect.getsource(inspect.unwrap(fn)))
    except (OSError, TypeError):
        return False

    def search(node) -> bool:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                continue
            if isinstance(child, ast.Return) and child.value is not None and not (
                    isinstance(child.value, ast.Constant) and child.value.value is None):
                return True
            if isinstance(child, (ast.Yield, ast.YieldFrom)) or search(child):
                return True
        return False

    return search(ast.parse(source).body[0])


def _squeeze(text: str) -> str:
    """Text without white space, and a module default shown by its name alone (its path is the
    machine's)."""
    return "".join(re.sub(r"<module '([\w.]+)' from '[^']*'>", r"<module '\1'>", text).split())


def _plain(text: str) -> str:
    """Text without its markup (reST roles and literals, Markdown links and code), squeezed."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"\1", text)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return _squeeze(text.replace("`", ""))


def _signature_problems(name: str, entry: str, obj, parent) -> list:
    block = re.search(r"```[a-z]*\n(.*?)```", entry, flags=re.S)
    if block is None:
        return [f"{name}: its api.md entry has no fenced signature block"]
    want = f"{name}{_signature(obj, parent)}"
    if _squeeze(block.group(1)) != _squeeze(want):
        return [f"{name}: api.md says\n    {' '.join(block.group(1).split())}\n  the code says\n    {want}"]
    return []


def _problems(name: str, entries: dict) -> list:
    """Everything wrong with one public name's signature, docstring and api.md entry."""
    obj, parent = _resolve(name)
    sig = _signature(obj, parent)
    problems = [f"{name}: parameter {p!r} of a public signature starts with '_'" for p in sig.parameters
                if p.startswith("_")]
    doc = inspect.getdoc(obj) or ""
    sections = _sections(doc)
    if sig.parameters:
        if "Parameters" not in sections:
            problems.append(f"{name}: the docstring has no Parameters section")
        else:
            missing = set(sig.parameters) - _documented_parameters(sections["Parameters"])
            if missing:
                problems.append(f"{name}: the Parameters section does not name {sorted(missing)}")
    if inspect.isfunction(obj) and _returns_value(obj) and "Returns" not in sections and "Yields" not in sections:
        problems.append(f"{name}: the function returns a value, and the docstring has no Returns section")
    if "Examples" not in sections:
        problems.append(f"{name}: the docstring has no Examples section")
    if name not in entries:
        return problems + [f"{name}: docs/api.md has no '## {name}' heading"]
    problems += _signature_problems(name, entries[name], obj, parent)
    summary = doc.splitlines()[0] if doc else ""
    if _plain(summary) not in _plain(entries[name]):
        problems.append(f"{name}: the api.md entry does not hold the docstring's summary line {summary!r}")
    return problems


@pytest.mark.parametrize("name", _public_names())
def test_public_name_is_documented(name):
    problems = _problems(name, _entries())
    assert not problems, "\n".join(problems)


def test_torch_interop_is_documented():
    module = _torch_module()
    if module is None:
        pytest.skip("cuflash.interop.torch needs torch and CuPy")
    entries = _entries()
    names = [f"{TORCH}.{name}" for name in module.__all__ if inspect.isfunction(getattr(module, name))]
    problems = [p for name in names for p in _problems(name, entries)]
    assert not problems, "\n".join(problems)


def test_every_api_md_entry_matches_its_object():
    entries = _entries()
    problems = []
    have_torch = _torch_module() is not None
    for name, entry in entries.items():
        if name.startswith(TORCH + ".") and not have_torch:
            continue
        try:
            obj, parent = _resolve(name)
        except (AttributeError, ImportError) as exc:
            problems.append(f"api.md has an entry for {name}, which does not exist ({exc})")
            continue
        problems += _signature_problems(name, entry, obj, parent)
        problems += [f"{name}: parameter {p!r} of a public signature starts with '_'"
                     for p in _signature(obj, parent).parameters if p.startswith("_")]
    assert not problems, "\n".join(problems)


def test_the_checks_catch_a_wrong_signature():
    # The comparison must see a changed default, a missing parameter and a private one.
    entries = _entries()
    entry = entries["cuflash.attention"]
    obj, parent = _resolve("cuflash.attention")
    assert not _signature_problems("cuflash.attention", entry, obj, parent)
    for wrong in (entry.replace("causal=False", "causal=True", 1), entry.replace("scale=None, ", "", 1),
                  entry.replace("out=None)", "out=None, _private=0)", 1)):
        assert wrong != entry
        assert _signature_problems("cuflash.attention", wrong, obj, parent)

    def sample(q, k, *, _origin=(0, 0)):
        """Sample.

        Parameters
        ----------
        q, k : arrays
        """
        return q

    problems = "\n".join(_problems_of(sample))
    assert "'_origin'" in problems and "no Returns section" in problems and "no Examples section" in problems


def _problems_of(fn) -> list:
    """_problems for a function outside cuflash (as a module's ``sample``; no api.md entry)."""
    module = types.ModuleType("cuflash_api_docs_sample")
    module.sample = fn
    sys.modules[module.__name__] = module
    try:
        return _problems(f"{module.__name__}.sample", {})
    finally:
        del sys.modules[module.__name__]

"""Kernel choice and forward plans, checked without a GPU.

Which family runs a call (fwd_sm90 where TMA can describe the tensors, fwd_sm80 otherwise, never a
silent fallback when forced) and what each plan compiles are pure functions of shapes, strides
and options, so they are tested here on duck-typed arrays.
"""

from types import SimpleNamespace

import numpy as np
import pytest

from cuflash import kernels
from cuflash._runtime import launch as _launch, params as _params, tma as _tma
from cuflash._forward_plan import _choose_family, _sm90_obstacle
from cuflash.attention import force_kernel


def fake(shape, strides_elems=None, itemsize=2, ptr=1 << 20):
    """Just enough of a CuPy array for the dispatcher: shape, byte strides, itemsize, nbytes,
    data.ptr."""
    if strides_elems is None:
        strides_elems = tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
    return SimpleNamespace(shape=shape, strides=tuple(s * itemsize for s in strides_elems),
                           itemsize=itemsize, nbytes=int(np.prod(shape)) * itemsize, data=SimpleNamespace(ptr=ptr))


def qkv(d=128, **kw):
    return fake((2, 300, 8, d), **kw), fake((2, 400, 2, d), **kw), fake((2, 400, 2, d), **kw)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_sm90_takes_every_option(d):
    # Options never reach the choice (it sees only q, k, v): any head dim and varlen's packed rows.
    assert _sm90_obstacle(*qkv(d)) is None
    packed = fake((700, 8, d)), fake((900, 2, d)), fake((900, 2, d))   # varlen: (total, H, D)
    assert _sm90_obstacle(*packed) is None


@pytest.mark.parametrize("case, expected", [
    (dict(strides=(300 * 8 * 128, -8 * 128, 128, 1)), "strides"),   # negative sequence stride
    (dict(strides=(300 * 8 * 136, 8 * 136, 136 + 4, 1)), "strides"),  # head stride not 16-byte
    (dict(ptr=(1 << 20) + 8), "strides"),                             # base not 16-byte aligned
])
def test_sm90_obstacles_are_named(case, expected):
    q, k, v = qkv(case.get("d", 128))
    if "strides" in case:
        q = fake(q.shape, case["strides"])
    if "ptr" in case:
        q = fake(q.shape, ptr=case["ptr"])
    reason = _sm90_obstacle(q, k, v)
    assert reason is not None and expected in reason


def test_forced_sm90_raises_instead_of_falling_back():
    with force_kernel("fwd_sm90"):
        q, k, v = qkv()
        q = fake(q.shape, (300 * 8 * 128, -8 * 128, 128, 1))
        with pytest.raises(ValueError, match="fwd_sm90 cannot run this call: the strides"):
            _choose_family("bfloat16", q, k, v)
        with pytest.raises(ValueError, match="runs float16/bfloat16, not float32"):
            _choose_family("float32", *qkv())


def test_forced_sm80_and_simt_are_kept():
    with force_kernel("fwd_sm80"):
        assert _choose_family("float16", *qkv()) == "fwd_sm80"
    with force_kernel("fwd_simt"):
        assert _choose_family("float32", *qkv()) == "fwd_simt"
    with pytest.raises(ValueError, match="family must be one of"):
        with force_kernel("fwd_sm70"):
            pass


def test_tma_compatibility_rule():
    assert _tma.tma_compatible(fake((1, 5, 2, 64)))
    assert not _tma.tma_compatible(fake((1, 5, 2, 64), (640, 128, 64, 2)))  # last axis strided
    assert not _tma.tma_compatible(fake((1, 5, 2, 60)))                    # 120-byte rows


@pytest.mark.parametrize("d, kdim, block_n, q_slots, stages",
                         [(8, 64, 128, 2, 4), (64, 64, 128, 2, 4), (72, 128, 128, 2, 2), (128, 128, 128, 2, 2),
                          (136, 256, 64, 1, 2), (256, 256, 64, 1, 2)])
@pytest.mark.parametrize("mods", [False, True])
def test_sm90_plan(d, kdim, block_n, q_slots, stages, mods):
    plan = kernels.forward.forward_plan("fwd_sm90", "bfloat16", d, score_mods=mods, dropout=mods)
    defines = dict(plan.variant.defines)
    assert plan.head_dim == kdim and defines["CUFLASH_HEAD_DIM"] == kdim
    assert plan.threads == 384 and plan.block_m == 128
    assert (defines["CUFLASH_BLOCK_N"], defines["CUFLASH_Q_SLOTS"], defines["CUFLASH_STAGES"]) == (block_n, q_slots,
                                                                                                  stages)
    # The Q slots + the stages of K and V + 1 KB alignment slack + the staged output (128 rows, at
    # most 128 columns), within a Hopper block's 227 KB.
    expected = 1024 + q_slots * 128 * kdim * 2 + stages * 2 * block_n * kdim * 2 + 128 * min(kdim, 128) * 2
    assert plan.smem_bytes == defines["CUFLASH_SMEM_BYTES"] == expected
    assert plan.smem_bytes <= 227 * 1024
    assert defines["CUFLASH_PARAMS_SIZE"] == _params.FWD_PARAMS.itemsize
    assert (defines["CUFLASH_SCORE_MODS"], defines["CUFLASH_DROPOUT"]) == (31 if mods else 0, int(mods))
    with pytest.raises(ValueError, match="float32"):
        kernels.forward.forward_plan("fwd_sm90", "float32", d, score_mods=False, dropout=False)


def test_sm90_only_built_for_sm90a():
    families_80 = {v.family for v in kernels.catalogue.precompile_variants(arch="sm_80")}
    families_90 = {v.family for v in kernels.catalogue.precompile_variants(arch="sm_90a")}
    assert "fwd_sm90" not in families_80 and "fwd_sm90" in families_90
    pairs = kernels.catalogue.ci_variants()
    assert all(arch == "sm_90a" for v, arch in pairs if v.family == "fwd_sm90")
    # Every family that the dispatcher, decode or backward can launch is in the CI compile list.
    assert {v.family for v, _ in pairs} >= {"fwd_sm90", "fwd_sm80", "fwd_simt", "decode", "merge",
                                            "bwd_sm80", "bwd_simt", "bwd_preprocess", "bwd_convert"}


def test_tensor_maps_are_cached_by_value(monkeypatch):
    # A map is a pure function of (address, shape, strides, box rows, dtype), so a second launch on
    # the same tensors reuses it; anything else that differs gets its own.
    calls = []
    monkeypatch.setattr(_tma, "_encode", lambda *args: calls.append(args) or object())
    monkeypatch.setattr(_tma, "_cache", {})
    a, b = (fake((2, 300, 8, 64)) for _ in range(2))   # equal, distinct objects
    first = _tma.encode(a, 128, "bfloat16")
    assert _tma.encode(b, 128, "bfloat16") is first and len(calls) == 1
    moved = fake((2, 300, 8, 64), ptr=(1 << 20) + 4096)
    for other in ((moved, 128, "bfloat16"), (a, 64, "bfloat16"), (a, 128, "float16")):
        assert _tma.encode(*other) is not first
    assert len(calls) == 4
    monkeypatch.setattr(_tma, "_CACHE_ENTRIES", 4)   # full: cleared, then refilled
    _tma.encode(fake((1, 1, 1, 64), ptr=1 << 30), 64, "bfloat16")
    assert len(_tma._cache) == 1


@pytest.mark.parametrize("layout", ["FWD", "BWD", "CONVERT", "DECODE", "MERGE", "CHECK"])
def test_params_pack_like_the_structured_dtype(layout):
    # Layout.pack builds the bytes with one struct.pack (fast); they must be what NumPy's field-by-
    # field assignment gives, for every kind of field (pointers, negative strides, ints, floats),
    # nested structs (BwdParams.fwd, DecodeParams.score) included.
    rng = np.random.default_rng(7)
    lay = getattr(_params, layout)
    expected = np.zeros((), dtype=lay.dtype)
    fields = {}
    for name, offset, code in lay.fields:
        value = {"Q": int(rng.integers(0, 2**63)) * 2 + 1, "q": -int(rng.integers(0, 2**40)),
                 "I": (1 << 32) - 1, "i": int(rng.integers(-2**31, 2**31)), "f": 0.125}[code]
        fields[name] = value
        target = expected
        *outer, leaf = name.split(".")
        for part in outer:
            target = target[part]
        target[leaf] = value
    assert lay.pack(fields) == expected[()].tobytes()
    assert lay.unpack(lay.pack(fields)) == pytest.approx(fields)
    with pytest.raises(KeyError, match="no_such_field"):
        lay.pack({"no_such_field": 1})


def test_template_fills_only_its_slots():
    template = _params.Template(_params.FWD, {"seqlen_q": 1025, "scale": 0.5}, {"q": 0, "o": 1, "dropout_offset": 2})
    values = [(1 << 40) + 16, 4096, (1 << 32) - 1]
    got = _params.FWD.unpack(template.fill(values))
    assert (got["q"], got["o"], got["dropout_offset"]) == tuple(values)
    assert got["seqlen_q"] == 1025 and got["scale"] == 0.5 and got["k"] == 0 and got["dropout_rescale"] == 1.0


def test_planners_import_no_api_module():
    # The planners, the tables and the packer are leaves: they import (at module level or inside
    # functions) only each other, never the entry points, the compiler or the launcher.
    import ast
    from pathlib import Path

    package = Path(_params.__file__).parents[1]
    planners = {f"kernels.{p.stem}" for p in (package / "kernels").glob("*.py") if p.stem != "__init__"}
    leaves = planners | {"kernels", "features", "_runtime.params", "_build.variant"}
    # cuflash.modifiers imports nothing of cuflash but itself (the catalogue builds the user
    # modifiers whose variants CI compiles).
    allowed = leaves | {"modifiers"}
    for name in leaves:
        path = package / (name.replace(".", "/") + ("/__init__.py" if name == "kernels" else ".py"))
        tree = ast.parse(path.read_text())
        imported = set()
        here = ["cuflash"] + name.split(".")[:-1] if name != "kernels" else ["cuflash", "kernels"]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = here[:len(here) - node.level + 1] if node.level else []
                module = ".".join(base + ([node.module] if node.module else []))
                if not module.startswith("cuflash"):
                    continue
                if node.module:
                    imported.add(module.removeprefix("cuflash").lstrip("."))
                else:
                    imported.update(f"{module}.{a.name}".removeprefix("cuflash").lstrip(".") for a in node.names)
            elif isinstance(node, ast.Import):
                imported.update(a.name.removeprefix("cuflash.") for a in node.names if a.name.startswith("cuflash"))
        assert imported <= allowed, (name, imported - allowed)

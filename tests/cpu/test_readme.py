"""Every ```python block of README.md runs, in order, in one namespace (as a reader would run them).

On a GPU only: the blocks call the kernels. A block that needs torch or JAX is skipped when the
package is missing (the rest still run).
"""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def _blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples():
    blocks = _blocks()
    assert len(blocks) >= 4, "the README's examples are its python blocks"
    assert any("cuflash.plan(cuflash.decode" in b for b in blocks)


@pytest.mark.gpu
def test_readme_blocks_run():
    namespace = {}
    skipped = []
    for i, block in enumerate(_blocks()):
        needs = [name for name in ("torch", "jax") if re.search(rf"^\s*import {name}\b", block, flags=re.M)]
        missing = [name for name in needs if not _importable(name)]
        if missing:
            skipped.append((i, missing))
            continue
        exec(compile(block, f"README.md block {i}", "exec"), namespace)   # noqa: S102 - our own README
        namespace["cp"].cuda.Device().synchronize()
    assert len(skipped) < len(_blocks())


def _importable(name):
    try:
        __import__(name)
        return True
    except ImportError:
        return False

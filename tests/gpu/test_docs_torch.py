"""docs/torch.md's code runs: its ```python blocks are executed in order in one namespace, and what
they compute is checked here against eager calls (so a block that silently did nothing fails).
Needs torch with CUDA (skipped otherwise)."""

import pathlib
import re

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():  # pragma: no cover - depends on the machine
    pytest.skip("torch has no CUDA device", allow_module_level=True)

pytestmark = pytest.mark.gpu

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "torch.md"


def test_the_torch_page_runs():
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) == 4, "docs/torch.md should hold the eager, compile, graph and modifier examples"
    namespace = {}
    for block in blocks:
        exec(compile(block, str(DOC), "exec"), namespace)
    torch.cuda.synchronize()
    ct = namespace["ct"]
    # The eager block's gradients exist and are finite.
    for name in ("q", "k", "v"):
        grad = namespace[name].grad
        assert grad is not None and bool(torch.isfinite(grad).all()), f"{name}.grad"
    # The compiled block's input got a gradient.
    assert namespace["x"].grad is not None and bool(torch.isfinite(namespace["x"].grad).all())
    # The graph block: the last replay's output is the eager decode of the last step (the append
    # happened in the replay, at the lengths before `lens += 1`).
    q_step, k_cache, v_cache, lens = (namespace[n] for n in ("q_step", "k_cache", "v_cache", "lens"))
    want = ct.decode(q_step, k_cache, v_cache, cache_seqlens=lens)   # the cache now holds the appended row
    got = namespace["out"]
    # Not bit for bit: the appending call and this one are different kernels' variants.
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    # The modifier block: gradients through a ScoreMod, and a MaskMod window in decode equal to the
    # built-in window that hides the same keys (decode is causal: query at T - 1 sees j >= T - 257).
    assert all(bool(torch.isfinite(namespace[n].grad).all()) for n in ("qm", "km", "vm"))
    want_near = ct.decode(q_step, k_cache, v_cache, cache_seqlens=lens, window=(256, 0))
    torch.testing.assert_close(namespace["out_near"], want_near, rtol=2e-2, atol=2e-2)

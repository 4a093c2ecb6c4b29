"""The README's modifier examples (relative bias, T5 buckets, document mask, prefix-LM, window with a
softcap and its backward, a speculative-decoding tree) give what the float64 reference gives for the
same modifiers (issue 52, item 7).

The block runs as a reader would run it (tests/cpu/test_readme.py runs every block in order); here it
runs alone, on fresh random data, and each of its results is checked: the attention results by the
accuracy rule against the same-dtype baseline (cuflash.testing), the tree decode against the reference
within the bf16 decode tolerance. The decode appended the drafts in place, so the reference runs on the
caches after the call with the same appends (rewriting the same rows).
"""

import re
from pathlib import Path

import numpy as np
import pytest

from tests.gpu._hardware import gpu_available as _gpu_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _gpu_available(), reason="no CUDA GPU found by CuPy")]

import cuflash.testing as tt  # noqa: E402
from cuflash import reference  # noqa: E402

README = Path(__file__).resolve().parents[2] / "README.md"

# Each attention result of the block: its name, the function's options (names from the block's namespace).
ATTENTION = {
    "out_relative": dict(causal=True, score_mod="relative"),
    "out_t5": dict(causal=True, score_mod="t5"),
    "out_document": dict(causal=True, mask_mod="document"),
    "out_prefix": dict(mask_mod="prefix_lm"),
    "out_window": dict(causal=True, score_mod="capped", mask_mod="near"),
}


@pytest.fixture(scope="module")
def block():
    [code] = [b for b in re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
              if "cuflash.ScoreMod(" in b]
    namespace = {}
    exec(compile(code, "README.md modifiers block", "exec"), namespace)   # noqa: S102 - our own README
    namespace["cp"].cuda.Device().synchronize()
    return namespace


def _host(x):
    return x.get() if hasattr(x, "get") else np.asarray(x)


def _f64(x):
    return _host(x).astype(np.float64)


def _options(ns, options):
    return {key: ns[value] if isinstance(value, str) else value for key, value in options.items()}


@pytest.mark.parametrize("name", sorted(ATTENTION))
def test_the_attention_examples_match_the_reference(block, name):
    options = _options(block, ATTENTION[name])
    q, k, v = (_host(block[x]) for x in ("q", "k", "v"))
    want, _ = reference.attention_forward(_f64(q), _f64(k), _f64(v), **options)
    base = tt.baseline_attention(q, k, v, **options)
    tt.assert_attention_close(_host(block[name]), want, base, dtype="bfloat16", name=name)


def test_the_window_examples_backward_matches_the_reference(block):
    options = _options(block, ATTENTION["out_window"])
    q, k, v, dout = (_f64(block[x]) for x in ("q", "k", "v", "dout"))
    want = reference.attention_backward(dout, q, k, v, **options)
    for got, ref, name in zip((block["dq"], block["dk"], block["dv"]), want, ("dq", "dk", "dv")):
        got = _host(got).astype(np.float64)
        scale = max(1.0, float(np.abs(ref).max()))
        np.testing.assert_allclose(got, ref, rtol=0, atol=3e-2 * scale, err_msg=name)


def test_the_tree_decode_matches_the_reference(block):
    ns = block
    args = [_f64(ns[x]) for x in ("q_draft", "k_cache", "v_cache")]
    appends = dict(cache_seqlens=_host(ns["lens"]), k_new=_f64(ns["k_draft"]), v_new=_f64(ns["v_draft"]))
    want, _ = reference.decode(*args, mask_mod=ns["tree"], **appends)
    got = _f64(ns["out_tree"])
    atol = 2e-2 * max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, rtol=0, atol=atol)
    # The tree is seen: with few cached tokens, drafts attending causally to each other differ by far more.
    causal, _ = reference.decode(*args, **appends)
    assert np.abs(causal - want).max() > 5 * atol

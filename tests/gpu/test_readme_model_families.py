"""The README's model-family examples (issue 53, item 6) give what the float64 reference gives.

The block runs alone, on fresh random data, as a reader would run it (tests/cpu/test_readme.py runs
every block in order). Then:

- gpt-oss layer: out and lse by the accuracy rule against the same-dtype baseline (cuflash.testing),
  dq, dk, dv and dsinks by tests/gpu/test_sinks.py's gradient rules;
- MLA step: out against cuflash.reference.decode on the latent cache after the call with the same
  append (rewriting the same row), within the bf16 decode tolerance, and the appended row bit for bit;
- fp8 cache: out against the reference on the same e4m3 bytes (the kernel's own error: a 16-bit
  decode's), the appended bytes bit for bit against the reference's quantisation, and out against
  the reference on the unquantised bf16 cache within the bound the README derives from e4m3's
  rounding (2^-4 relative, Frobenius).
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
DECODE_TOL_BF16 = 2e-2     # tests/gpu/test_decode_fp8.py and test_decode_mla.py: bf16, relative to the values' scale
E4M3_BOUND = 2.0 ** -4     # half the spacing of three mantissa bits, relative


@pytest.fixture(scope="module")
def block():
    [code] = [b for b in re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
              if "v_head_dim=512" in b and 'kv_dtype="float8_e4m3fn"' in b]
    ns = {}
    exec(compile(code, "README.md model families", "exec"), ns)   # noqa: S102 - our own README
    ns["cp"].cuda.Device().synchronize()
    return ns


def _host(ns, *names):
    return [ns["cp"].asnumpy(ns[name]) for name in names]


def test_gpt_oss_layer_forward_and_backward(block):
    from tests.gpu import test_sinks as sinks_rules

    options = dict(causal=True, window=(127, 0))
    q, k, v, dout, sinks = (block[name] for name in ("q", "k", "v", "dout", "sinks"))
    out, lse = block["out_oss"], block["lse_oss"]
    want, want_lse = reference.attention_forward(q, k, v, sinks=sinks, **options)
    base = tt.baseline_attention(q, k, v, sinks=sinks, **options)
    tt.assert_attention_close(out, want, base, dtype="bfloat16", name="out_oss")
    tt.assert_attention_close(lse, want_lse, dtype="float32", name="lse_oss")

    # The exact gradients, and those given the stored bf16 out (its rounding is no error of the backward).
    exact = reference.attention_backward(dout, q, k, v, sinks=sinks, **options)
    stored = reference.attention_backward(dout, q, k, v, out=out, sinks=sinks, return_dsinks=True, **options)
    base = sinks_rules.baseline_backward(dout, q, k, v, out, sinks, **options)
    magnitude = sinks_rules._magnitude(*exact)
    for name, got, ref, base_g, stored_g in zip(("dq", "dk", "dv"), (block["dq"], block["dk"], block["dv"]),
                                                exact, base, stored[:3]):
        sinks_rules.assert_grad_close(got, ref, base_g, "bfloat16", name, magnitude, stored_g)
    sinks_rules.assert_dsinks_close(block["dsinks"], stored[3], dout, out, lse, sinks)


def test_mla_decode_step(block):
    q, latent, table, lens, row, out = _host(block, "q_mla", "latent", "mla_table", "mla_lens", "latent_new",
                                             "out_mla")
    before = lens - 1
    want, _, latent_want, _ = reference.decode(q, latent, None, v_head_dim=512, cache_seqlens=before,
                                               block_table=table, k_new=row, scale=192 ** -0.5, return_cache=True)
    assert out.shape == (4, 1, 16, 512)
    assert np.array_equal(latent.view(np.uint16), np.asarray(latent_want).view(np.uint16)), "appended latent rows"
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(out.astype(np.float64), want, rtol=0, atol=DECODE_TOL_BF16 * scale)


def test_fp8_cache_decode(block):
    names = ("q8", "k8", "v8", "fp8_lens", "k8_new", "v8_new", "k_scale", "v_scale", "out_fp8", "k_prefix", "v_prefix")
    q, k8, v8, lens, k_new, v_new, k_scale, v_scale, out, k_prefix, v_prefix = _host(block, *names)
    before = lens - 1
    fp8 = dict(kv_dtype="float8_e4m3fn", k_scale=k_scale, v_scale=v_scale)
    want, _, k_want, v_want = reference.decode(q, k8, v8, cache_seqlens=before, k_new=k_new, v_new=v_new,
                                               return_cache=True, **fp8)
    assert np.array_equal(k8, k_want) and np.array_equal(v8, v_want), "appended e4m3 bytes"
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(out.astype(np.float64), want, rtol=0, atol=DECODE_TOL_BF16 * scale)

    # Against the unquantised cache: the prefix in bf16, the appended rows as given.
    n = k_prefix.shape[1]
    k16, v16 = np.zeros(k8.shape, k_new.dtype), np.zeros(v8.shape, v_new.dtype)
    k16[:, :n], v16[:, :n] = k_prefix, v_prefix
    exact, _ = reference.decode(q, k16, v16, cache_seqlens=before, k_new=k_new, v_new=v_new)
    error = np.linalg.norm(out.astype(np.float64) - exact) / np.linalg.norm(exact)
    print(f"fp8 cache: out within {error:.4f} of the bf16 cache's (relative Frobenius)")
    assert error <= E4M3_BOUND, f"out is {error:.4f} (relative) from the bf16 cache's, above 2^-4"

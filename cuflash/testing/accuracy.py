"""The accuracy rule (see :mod:`cuflash.testing`)."""

from __future__ import annotations

import numpy as np

from ._arrays import _dtype, _host64

DEFAULT_ATOL = {"bfloat16": 1e-3, "float16": 2e-4, "float32": 1e-6, "float64": 1e-12}
#: Relative Frobenius tolerance for float32 outputs.
FLOAT32_RTOL = 1e-5



def _where(index, shape):
    return tuple(int(n) for n in np.unravel_index(index, shape))


def assert_attention_close(out, ref, baseline=None, *, dtype=None, atol=None, rtol=FLOAT32_RTOL,
                           name="out"):
    """Assert the accuracy rule for an attention result.

    Parameters
    ----------
    out : array (NumPy, CuPy or ``__array__``)
        The result under test (``out`` or ``lse``).
    ref : array, same shape
        The float64 reference (:mod:`cuflash.reference`).
    baseline : array, same shape, optional
        :func:`baseline_attention` on the same inputs; required for float16/bfloat16.
    dtype : str or dtype, optional
        The dtype whose rule applies; defaults to ``out.dtype`` (give it for ``lse``, which
        is float32 whatever the inputs were).
    atol : float, optional
        Absolute slack; defaults to :data:`DEFAULT_ATOL` of the dtype (bfloat16 1e-3,
        float16 2e-4, float32 1e-6 as an RMS slack).
    rtol : float
        Relative Frobenius tolerance of the float32 rule (1e-5).
    name : str
        Used in the failure message.

    Raises
    ------
    AssertionError
        If shapes differ, NaN/Inf positions differ from the reference's, or the error is too
        large; the message gives the error, where it is largest and the allowance.
    ValueError
        If a half-precision check has no ``baseline``.

    Notes
    -----
    float16/bfloat16: ``max|out - ref| <= 2 * max|baseline - ref| + atol``.
    float32/float64: ``||out - ref||_F <= rtol * ||ref||_F + atol * sqrt(n)``.
    Both are taken over the elements where the reference is finite.

    Examples
    --------
    >>> import cupy as cp
    >>> import cuflash
    >>> from cuflash import reference, testing
    >>> q, k, v = testing.random_qkv(dict(B=1, Sq=200, Sk=300, Hq=4, Hk=2, D=64), "bfloat16", seed=1, xp=cp)
    >>> out = cuflash.attention(q, k, v, causal=True)
    >>> ref, _ = reference.attention_forward(q, k, v, causal=True)
    >>> testing.assert_attention_close(out, ref, testing.baseline_attention(q, k, v, causal=True))
    """
    dtype = _dtype(dtype) if dtype is not None else np.dtype(getattr(out, "dtype", np.float64))
    half = dtype in (np.dtype(np.float16), _dtype("bfloat16"))
    if atol is None:
        atol = DEFAULT_ATOL.get(dtype.name, DEFAULT_ATOL["float32"])
    o, r = _host64(out), _host64(ref)
    if o.shape != r.shape:
        raise AssertionError(f"{name}: shape {o.shape} differs from the reference's {r.shape}")

    finite = np.isfinite(r)
    bad = (np.isnan(o) != np.isnan(r)) | (np.isinf(r) & (o != r)) | (finite & ~np.isfinite(o))
    if bad.any():
        first = np.flatnonzero(bad)[0]
        raise AssertionError(
            f"{name}: {int(bad.sum())} of {bad.size} elements are NaN/Inf where the reference "
            f"is not, or the other way round; first at {_where(first, o.shape)}: "
            f"{name}={o.flat[first]:.6g}, reference={r.flat[first]:.6g}")
    if not finite.any():
        return

    # Compare finite elements only (inf - inf would warn and say nothing).
    r = np.where(finite, r, 0.0)
    err = np.abs(np.where(finite, o, 0.0) - r)
    worst = int(np.argmax(err))
    where = (f"largest at {_where(worst, o.shape)}: {name}={o.flat[worst]:.6g}, "
             f"reference={r.flat[worst]:.6g}")
    if half:
        if baseline is None:
            raise ValueError(f"the {dtype.name} accuracy rule needs baseline= "
                             "(cuflash.testing.baseline_attention)")
        bl = _host64(baseline)
        if bl.shape != r.shape:
            raise ValueError(f"baseline shape {bl.shape} differs from the reference's {r.shape}")
        # A non-finite baseline element (e.g. 0 * NaN from a masked key) says nothing of scale.
        berr = np.abs(np.where(finite & np.isfinite(bl), bl, r) - r)
        allowed = 2.0 * berr.max() + atol
        if err.max() > allowed:
            raise AssertionError(
                f"{name} ({dtype.name}): max|{name} - ref| = {err.max():.3e} > "
                f"2 * max|baseline - ref| + atol = 2 * {berr.max():.3e} + {atol:.1e} = "
                f"{allowed:.3e}; {where}; baseline worst at "
                f"{_where(int(np.argmax(berr)), o.shape)}")
    else:
        n = int(finite.sum())
        diff = float(np.sqrt(np.sum(err ** 2)))
        norm = float(np.sqrt(np.sum(r ** 2)))
        allowed = rtol * norm + atol * np.sqrt(n)
        if diff > allowed:
            raise AssertionError(
                f"{name} ({dtype.name}): ||{name} - ref||_F = {diff:.3e} > rtol * ||ref||_F + "
                f"atol * sqrt(n) = {rtol:.0e} * {norm:.3e} + {atol:.0e} * sqrt({n}) = "
                f"{allowed:.3e} (relative {diff / max(norm, 1e-300):.2e}); max abs error "
                f"{err.max():.3e}, {where}")

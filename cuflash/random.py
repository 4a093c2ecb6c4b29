"""Counter-based random numbers for dropout (Philox4x32-10), on the host.

Every kernel family draws its dropout decisions from ``cuda_src/philox.cuh``; this module is
the NumPy twin of that header, used by the float64 reference (:mod:`cuflash.reference`) and by
the tests, and it owns the :class:`Generator` whose ``(seed, offset)`` state is handed to the
kernels.

The keep/drop decision for score element ``(b, h, i, j)`` (``h`` the query head, ``i``/``j`` the
row/column inside the sequence) is a pure function of ``(seed, offset, b, h, i, j)``::

    key       = (seed & 0xFFFFFFFF, seed >> 32)
    counter   = (j // 4, i, b * num_heads + h, offset & 0xFFFFFFFF)     # each mod 2**32
    word      = philox4x32_10(counter, key)[j % 4]
    threshold = min(round(p * 2**32), 2**32 - 1)
    keep      = word >= threshold                 # kept values are scaled by 1 / (1 - p)

so it does not depend on tiling, kernel family or GPU, and a backward pass can regenerate it.
Each attention call with ``dropout_p > 0`` takes ``offset = generator.offset`` and advances the
generator's offset by one (:meth:`Generator.next_state`).
"""

from __future__ import annotations

import numbers
import os
import threading

import numpy as np

__all__ = [
    "Generator",
    "as_rng_state",
    "default_generator",
    "dropout_keep",
    "dropout_threshold",
    "dropout_words",
    "manual_seed",
    "philox4x32",
]

# Random123's Philox4x32 constants: round multipliers and the Weyl key increments.
PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
PHILOX_ROUNDS = 10

_MASK32 = np.uint64(0xFFFFFFFF)
_SHIFT32 = np.uint64(32)


def _as_uint32_words(x, name, last):
    """``x`` as a uint64 array of 32-bit words whose last axis has length ``last``."""
    arr = np.asarray(x)
    if arr.dtype == object:
        # Python ints too large for int64 arrive as object arrays; convert them one by one.
        if not all(isinstance(v, numbers.Integral) for v in arr.ravel()):
            raise TypeError(f"{name} must hold integers")
        if any(not 0 <= int(v) <= 0xFFFFFFFF for v in arr.ravel()):
            raise ValueError(f"{name} words must lie in [0, 2**32)")
        arr = arr.astype(np.uint64)
    elif arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an integer array, got dtype {arr.dtype}")
    elif arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
        raise ValueError(
            f"{name} words must lie in [0, 2**32), got values in [{arr.min()}, {arr.max()}]")
    if arr.ndim == 0 or arr.shape[-1] != last:
        raise ValueError(f"{name} must have shape (..., {last}), got {arr.shape}")
    return arr.astype(np.uint64)


def philox4x32(counter, key):
    """Philox4x32-10 block function (Random123), vectorised.

    Parameters
    ----------
    counter : array_like of int, shape (..., 4)
        Counter words, each in ``[0, 2**32)``.
    key : array_like of int, shape (..., 2)
        Key words, each in ``[0, 2**32)``. The leading axes of ``counter`` and ``key``
        broadcast against each other.

    Returns
    -------
    numpy.ndarray of uint32, shape (broadcast(...), 4)
        The four output words.

    Raises
    ------
    TypeError
        If ``counter`` or ``key`` is not integer.
    ValueError
        If a word is out of range or the last axis has the wrong length.

    Notes
    -----
    One round maps ``(c0, c1, c2, c3)`` with key ``(k0, k1)`` to
    ``(hi(M1*c2) ^ c1 ^ k0, lo(M1*c2), hi(M0*c0) ^ c3 ^ k1, lo(M0*c0))``; the key is bumped by
    ``(W0, W1)`` between rounds. The 32x32 -> 64 bit products are exact in uint64.
    """
    c = _as_uint32_words(counter, "counter", 4)
    k = _as_uint32_words(key, "key", 2)
    shape = np.broadcast_shapes(c.shape[:-1], k.shape[:-1])
    c0, c1, c2, c3 = (np.broadcast_to(c[..., n], shape) for n in range(4))
    k0, k1 = (np.broadcast_to(k[..., n], shape) for n in range(2))
    m0, m1 = np.uint64(PHILOX_M0), np.uint64(PHILOX_M1)
    w0, w1 = np.uint64(PHILOX_W0), np.uint64(PHILOX_W1)
    for r in range(PHILOX_ROUNDS):
        if r > 0:
            k0 = (k0 + w0) & _MASK32
            k1 = (k1 + w1) & _MASK32
        p0 = m0 * c0
        p1 = m1 * c2
        c0, c1, c2, c3 = ((p1 >> _SHIFT32) ^ c1 ^ k0, p1 & _MASK32,
                          (p0 >> _SHIFT32) ^ c3 ^ k1, p0 & _MASK32)
    return np.stack([c0, c1, c2, c3], axis=-1).astype(np.uint32)


def _check_seed(seed, name="seed"):
    """``seed`` as a Python int in ``[0, 2**64)``."""
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"{name} must be an integer in [0, 2**64), got {type(seed).__name__}")
    seed = int(seed)
    if not 0 <= seed < 2**64:
        raise ValueError(f"{name} must lie in [0, 2**64), got {seed}")
    return seed


def dropout_threshold(p):
    """The uint32 threshold below which a Philox word drops an element.

    Parameters
    ----------
    p : float
        Dropout probability in ``[0, 1)``.

    Returns
    -------
    int
        ``min(round(p * 2**32), 2**32 - 1)`` (Python's ``round``: half to even). The kernels
        receive this value from the host, so there is one definition of it.

    Raises
    ------
    TypeError, ValueError
        If ``p`` is not a real number in ``[0, 1)``.
    """
    if isinstance(p, (bool, np.bool_)) or not isinstance(p, numbers.Real):
        raise TypeError(f"dropout_p must be a float in [0, 1), got {type(p).__name__}")
    p = float(p)
    if not 0.0 <= p < 1.0:  # also rejects NaN
        raise ValueError(f"dropout_p must lie in [0, 1), got {p}")
    return min(round(p * 2.0**32), 2**32 - 1)


def dropout_words(seed, offset, b, h, i, j4, num_heads):
    """The four Philox words covering columns ``4*j4 .. 4*j4+3`` of row ``(b, h, i)``.

    Mirrors ``cuflash::dropout_words`` in ``cuda_src/philox.cuh``.

    Parameters
    ----------
    seed : int
        Generator seed in ``[0, 2**64)``.
    offset : int
        Generator offset (only its low 32 bits enter the counter).
    b, h, i, j4 : array_like of int
        Batch, query head, row and column-group indices; they broadcast together.
    num_heads : int
        Number of query heads ``Hq``.

    Returns
    -------
    numpy.ndarray of uint32, shape (broadcast(b, h, i, j4), 4)
    """
    seed = _check_seed(seed)
    offset = _check_seed(offset, "offset")
    b, h, i, j4 = (np.asarray(x, dtype=np.int64) for x in (b, h, i, j4))
    key = np.array([seed & 0xFFFFFFFF, seed >> 32], dtype=np.uint64)
    shape = np.broadcast_shapes(b.shape, h.shape, i.shape, j4.shape)
    # Counter words wrap mod 2**32, as the uint32 arithmetic does on the device.
    counter = np.empty(shape + (4,), dtype=np.uint64)
    counter[..., 0] = j4 & 0xFFFFFFFF
    counter[..., 1] = i & 0xFFFFFFFF
    counter[..., 2] = (b * int(num_heads) + h) & 0xFFFFFFFF
    counter[..., 3] = offset & 0xFFFFFFFF
    return philox4x32(counter, key)


def dropout_keep(seed, offset, p, b, h, i, j, num_heads):
    """Dropout keep mask for score elements ``(b, h, i, j)``.

    Parameters
    ----------
    seed, offset : int
        The ``rng_state`` of the call: ``(seed, offset)``.
    p : float
        Dropout probability in ``[0, 1)``.
    b, h, i, j : array_like of int
        Batch, query head, row and column indices (within the sequence); they broadcast.
    num_heads : int
        Number of query heads ``Hq``.

    Returns
    -------
    numpy.ndarray of bool, shape broadcast(b, h, i, j)
        True where the element is kept (to be scaled by ``1 / (1 - p)``).
    """
    threshold = dropout_threshold(p)
    j = np.asarray(j, dtype=np.int64)
    if np.any(j < 0):
        raise ValueError("column indices j must be non-negative")
    words = dropout_words(seed, offset, b, h, i, j // 4, num_heads)
    word = np.take_along_axis(words, np.broadcast_to(j % 4, words.shape[:-1])[..., None],
                              axis=-1)[..., 0]
    return word >= np.uint32(threshold)


class Generator:
    """State of the dropout random numbers: a 64-bit seed and a call offset.

    Parameters
    ----------
    seed : int, optional
        In ``[0, 2**64)``. ``None`` draws a fresh seed from ``os.urandom``.

    Attributes
    ----------
    seed : int
        The Philox key (read-only; use :meth:`manual_seed` or :meth:`set_state`).
    offset : int
        Number of dropout calls served so far; the next call uses this value.

    Notes
    -----
    The methods are thread-safe: two threads calling :meth:`next_state` get distinct offsets.
    """

    def __init__(self, seed=None):
        self._lock = threading.Lock()
        self._seed = 0
        self._offset = 0
        self.manual_seed(seed)

    def manual_seed(self, seed=None):
        """Reset to ``seed`` (``None``: a random seed) and offset 0; returns ``self``."""
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little")
        seed = _check_seed(seed)
        with self._lock:
            self._seed, self._offset = seed, 0
        return self

    @property
    def seed(self):
        return self._seed

    @property
    def offset(self):
        return self._offset

    def get_state(self):
        """The state as ``numpy.array([seed, offset], dtype=uint64)``, shape (2,)."""
        with self._lock:
            return np.array([self._seed, self._offset], dtype=np.uint64)

    def set_state(self, state):
        """Restore a state returned by :meth:`get_state` (or an ``rng_state``).

        Parameters
        ----------
        state : array_like of int, shape (2,)
            ``[seed, offset]``, each in ``[0, 2**64)``.

        Raises
        ------
        TypeError
            If ``state`` does not hold integers.
        ValueError
            If its shape is not (2,) or a value is out of range.
        """
        seed, offset = as_rng_state(state, "state")
        with self._lock:
            self._seed, self._offset = seed, offset

    def next_state(self):
        """The state for one dropout call, advancing the offset by one.

        Returns
        -------
        numpy.ndarray of uint64, shape (2,)
            ``[seed, offset]`` to use for this call.
        """
        with self._lock:
            state = np.array([self._seed, self._offset], dtype=np.uint64)
            self._offset = (self._offset + 1) % 2**64
        return state

    def __repr__(self):
        return f"cuflash.Generator(seed={self._seed}, offset={self._offset})"


def as_rng_state(state, name="rng_state"):
    """Validate an ``rng_state``-like ``[seed, offset]`` pair; returns two Python ints.

    Raises
    ------
    TypeError
        If ``state`` is None or does not hold integers.
    ValueError
        If it does not have exactly two entries or a value is outside ``[0, 2**64)``.
    """
    if state is None:
        raise TypeError(f"{name} must be a [seed, offset] pair of integers, got None")
    if hasattr(state, "get") and not isinstance(state, (np.ndarray, dict)):
        state = state.get()  # a CuPy array
    if isinstance(state, np.ndarray):
        if state.dtype.kind not in "iuO":
            raise TypeError(f"{name} must hold integers, got dtype {state.dtype}")
        values = list(state.ravel()) if state.shape == (2,) else None
        shape = state.shape
    else:
        try:
            values = list(state)
        except TypeError:
            raise TypeError(f"{name} must be a [seed, offset] pair of integers, "
                            f"got {type(state).__name__}") from None
        shape = (len(values),)
    if values is None or len(values) != 2:
        raise ValueError(f"{name} must have shape (2,) = [seed, offset], got shape {shape}")
    seed = _check_seed(values[0], f"{name}[0] (seed)")
    offset = _check_seed(values[1], f"{name}[1] (offset)")
    return seed, offset


_default_generator = None
_default_lock = threading.Lock()


def default_generator():
    """The process-wide :class:`Generator` used when ``generator=None``.

    Created on first use with a random seed; reseed it with :func:`manual_seed`.
    """
    global _default_generator
    with _default_lock:
        if _default_generator is None:
            _default_generator = Generator()
        return _default_generator


def manual_seed(seed):
    """Reseed the default generator (offset back to 0) and return it.

    Parameters
    ----------
    seed : int
        In ``[0, 2**64)``.
    """
    seed = _check_seed(seed)
    return default_generator().manual_seed(seed)


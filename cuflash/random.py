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

A call captured in a CUDA graph cannot take its offset on the host (the host runs once, at the
capture): it draws from the generator's *graph state* on the GPU instead (:meth:`Generator.graph_safe`),
a device word pair (seed, next offset) that a one-thread kernel at the head of the captured call
copies into the call's ``rng_state`` and advances, at every replay (``cuda_src/rng_state.cu``).
"""

from __future__ import annotations

import numbers
import os
import threading

import numpy as np

__all__ = [
    "GRAPH_OFFSET_START",
    "Generator",
    "as_rng_state",
    "default_generator",
    "dropout_keep",
    "dropout_threshold",
    "dropout_words",
    "graph_offsets",
    "manual_seed",
    "philox4x32",
]

# Random123's Philox4x32 constants: round multipliers and the Weyl key increments.
PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
PHILOX_ROUNDS = 10

#: A graph state starts this far above the host offset of the moment it is made (or the generator
#: reseeded), so that 2**31 host draws and a graph state's draws never meet (the counter takes the
#: offset mod 2**32). The GPUs share the other half: :func:`graph_offsets` each.
GRAPH_OFFSET_START = 2**31

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

    Calls captured in a CUDA graph draw on the GPU, from the generator's graph state on that GPU
    (:meth:`graph_safe`; made at the first capture of a call with dropout, by :func:`cuflash.plan`
    for such a call, or by calling :meth:`graph_safe`). The graph state of GPU ``d`` starts at offset
    ``offset + 2**31 + d * graph_offsets()``, ``offset`` the host offset when it is made, and each
    replay of a captured call takes the next one; the host offset is not moved. Host calls and
    replays thus never share an offset as long as there are fewer than ``2**31`` host calls, and
    fewer than :func:`graph_offsets` replays on each GPU (``2**31`` with one GPU, ``2**28`` with
    eight), since the state was made or the generator reseeded (the counter takes offsets mod
    ``2**32``). :meth:`manual_seed` restarts the graph states too (offset ``2**31 + d *
    graph_offsets()``, like the host's 0: the same draws again); :meth:`set_state` gives them the
    new seed and leaves their offsets where the replays took them (restoring a host state for a
    recomputation does not make later replays repeat earlier masks). :meth:`get_state` is the host
    state; read a graph state with ``graph_safe(device).get()``.

    Examples
    --------
    >>> import cuflash
    >>> g = cuflash.Generator(1234)
    >>> out, lse, rng_state = cuflash.attention_forward(q, k, v, dropout_p=0.1, generator=g)
    >>> rng_state                       # the state this call drew: (seed, offset)
    array([1234,    0], dtype=uint64)
    >>> g.offset                        # the next call draws offset 1
    1
    """

    def __init__(self, seed=None):
        self._lock = threading.Lock()
        self._seed = 0
        self._offset = 0
        self._graph = {}   # device id -> its graph state, a CuPy uint64 array (seed, next offset)
        self.manual_seed(seed)

    def manual_seed(self, seed=None):
        """Reset to ``seed`` and offset 0, and the graph states to their first offsets (see the class
        notes).

        Parameters
        ----------
        seed : int, optional
            In ``[0, 2**64)``; ``None`` draws a random seed from ``os.urandom``.

        Returns
        -------
        Generator
            ``self``.

        Raises
        ------
        TypeError
            If ``seed`` is not an integer.
        ValueError
            If ``seed`` is outside ``[0, 2**64)``.
        RuntimeError
            If the generator has graph states and CuPy's current stream is capturing.

        Examples
        --------
        >>> g = cuflash.Generator().manual_seed(7)
        >>> g.get_state()
        array([7, 0], dtype=uint64)
        """
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little")
        seed = _check_seed(seed)
        with self._lock:
            self._seed, self._offset = seed, 0
            for device_id, words in sorted(self._graph.items()):
                _write_graph_state(words, device_id, (seed, _graph_start(0, device_id)), wait=True)
        return self

    @property
    def seed(self):
        """The Philox key, an int in ``[0, 2**64)`` (read-only: :meth:`manual_seed`, :meth:`set_state`)."""
        return self._seed

    @property
    def offset(self):
        """The offset the next dropout call draws (the number of calls served since the seed was set)."""
        return self._offset

    def get_state(self):
        """The host state, ``[seed, offset]``: what the next dropout call will draw.

        Returns
        -------
        numpy.ndarray of uint64, shape (2,)
            A copy; pass it to :meth:`set_state` to replay the calls that follow.

        Examples
        --------
        >>> g = cuflash.Generator(3)
        >>> state = g.get_state()
        >>> out1 = cuflash.attention(q, k, v, dropout_p=0.2, generator=g)
        >>> g.set_state(state)
        >>> out2 = cuflash.attention(q, k, v, dropout_p=0.2, generator=g)   # the same mask again
        """
        with self._lock:
            return np.array([self._seed, self._offset], dtype=np.uint64)

    def set_state(self, state):
        """Restore a state returned by :meth:`get_state` (or an ``rng_state``).

        The next dropout call then draws ``state``'s offset. Graph states get the new seed and keep
        their offsets (see the class notes).

        Parameters
        ----------
        state : array_like of int, shape (2,)
            ``[seed, offset]``, each in ``[0, 2**64)`` (NumPy, a list, or a CuPy array, read back).

        Raises
        ------
        TypeError
            If ``state`` does not hold integers.
        ValueError
            If its shape is not (2,) or a value is out of range.

        Examples
        --------
        >>> g = cuflash.Generator(0)
        >>> g.set_state([42, 10])
        >>> g.next_state()
        array([42, 10], dtype=uint64)
        """
        seed, offset = as_rng_state(state, "state")
        with self._lock:
            if seed != self._seed:
                for device_id, words in sorted(self._graph.items()):
                    _write_graph_state(words, device_id, (seed,), wait=True)
            self._seed, self._offset = seed, offset

    def next_state(self):
        """The state for one dropout call, advancing the offset by one (what every entry point with
        ``dropout_p > 0`` calls; thread-safe).

        Returns
        -------
        numpy.ndarray of uint64, shape (2,)
            ``[seed, offset]`` to use for this call.

        Examples
        --------
        >>> g = cuflash.Generator(5)
        >>> g.next_state(), g.next_state()
        (array([5, 0], dtype=uint64), array([5, 1], dtype=uint64))
        """
        with self._lock:
            state = np.array([self._seed, self._offset], dtype=np.uint64)
            self._offset = (self._offset + 1) % 2**64
        return state

    def graph_safe(self, device=None):
        """This generator's graph state on a GPU, made at the first call for that GPU: what calls
        captured in a CUDA graph draw their ``(seed, offset)`` from, at every replay.

        A captured call with dropout makes it at its first capture (outside the graph, see
        :mod:`cuflash._runtime.now`); calling it first only moves that work before the capture.

        Parameters
        ----------
        device : int, optional
            The GPU; default: CuPy's current device.

        Returns
        -------
        cupy.ndarray of uint64, shape (2,)
            The live state ``[seed, next offset]`` (see the class notes for where the offsets start).
            Each replay of a captured call advances it on the GPU; ``.get()`` reads it. Writing into
            it (outside any replay) sets where the next replay starts.

        Examples
        --------
        >>> import cupy as cp
        >>> g = cuflash.Generator(0)
        >>> g.graph_safe()                  # the state on the current GPU (made now)
        array([         0, 2147483648], dtype=uint64)
        >>> stream = cp.cuda.Stream(non_blocking=True)
        >>> with stream:
        ...     stream.begin_capture()
        ...     out = cuflash.attention(q, k, v, dropout_p=0.1, generator=g)
        ...     graph = stream.end_capture()
        >>> graph.launch(stream)            # each replay draws a fresh (seed, offset) on the GPU
        """
        import cupy

        device_id = cupy.cuda.runtime.getDevice() if device is None else int(device)
        words = self._graph.get(device_id)
        if words is not None:
            return words
        from ._runtime import capture as _capture, now as _now

        with self._lock:
            words = self._graph.get(device_id)
            if words is None:
                # Made and written now, also when the calling stream is capturing (a captured
                # call with dropout makes it at its first capture).
                with _now.done_now(device_id):
                    words = cupy.empty(2, dtype=np.uint64)
                    _write_graph_state(words, device_id, (self._seed, _graph_start(self._offset, device_id)))
                    _capture.rng_step(device_id)   # its kernel loaded now, not inside a capture
                self._graph[device_id] = words
        return words

    def _graph_state(self, device_id: int):
        """The graph state on ``device_id``, or None when there is none (the launch path's lookup)."""
        return self._graph.get(device_id)

    def __repr__(self):
        return f"cuflash.Generator(seed={self._seed}, offset={self._offset})"


def graph_offsets(device_count: int | None = None) -> int:
    """Offsets each GPU's graph state owns: ``2**31`` shared by the GPUs of the process (``device_count``,
    default CuPy's count), rounded down to a power of two (``2**31`` for one GPU, ``2**28`` for eight)."""
    if device_count is None:
        import cupy

        device_count = cupy.cuda.runtime.getDeviceCount()
    slots = 1 << max(0, int(device_count) - 1).bit_length()
    return GRAPH_OFFSET_START // slots


def _graph_start(host_offset: int, device_id: int) -> int:
    """The first offset of GPU ``device_id``'s graph state made (or reset) at host offset ``host_offset``."""
    return (host_offset + GRAPH_OFFSET_START + device_id * graph_offsets()) % 2**64


def _write_graph_state(words, device_id: int, values, wait: bool = False) -> None:
    """Write ``values`` (the seed, and the offset if given) into a graph state from the host, and wait
    until they are there. ``wait``: first wait for the GPU's work, whose replays may be drawing from it."""
    import cupy

    with cupy.cuda.Device(device_id):
        stream = cupy.cuda.get_current_stream()
        if stream.is_capturing():
            raise RuntimeError("a generator's graph states cannot be written while CuPy's current stream is "
                               "capturing (reseed it before or after the capture)")
        if wait:
            cupy.cuda.runtime.deviceSynchronize()
        words[:len(values)].set(np.array(values, dtype=np.uint64))
        stream.synchronize()


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

    Returns
    -------
    Generator
        The same object at every call.

    Examples
    --------
    >>> import cuflash
    >>> cuflash.manual_seed(0)
    cuflash.Generator(seed=0, offset=0)
    >>> cuflash.default_generator().get_state()
    array([0, 0], dtype=uint64)
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

    Returns
    -------
    Generator
        :func:`default_generator`, reseeded.

    Raises
    ------
    TypeError
        If ``seed`` is not an integer.
    ValueError
        If ``seed`` is outside ``[0, 2**64)``.

    Examples
    --------
    >>> import cuflash
    >>> _ = cuflash.manual_seed(1234)
    >>> a = cuflash.attention(q, k, v, dropout_p=0.1)
    >>> _ = cuflash.manual_seed(1234)
    >>> b = cuflash.attention(q, k, v, dropout_p=0.1)     # the same dropout mask: a == b
    """
    seed = _check_seed(seed)
    return default_generator().manual_seed(seed)


"""A call's output handed out again once the caller has dropped it.

A call from CuPy without ``out=`` allocates its output. With CuPy's pool the allocation, the array
and the free once the caller drops it cost about 6 us of an H200 host's time, against 21 us for a
whole short decode call (``benchmarks/bench_host.py``). A loop that calls an entry point and drops
the previous result (``out = cuflash.decode(...)`` at every step) asks for the same sizes again
and again. So each stream keeps the last outputs of each small plan and hands one out again once
nothing but this module refers to it: not the array, not a view of it (a view holds its base), not
its memory pointer, not its memory (a DLPack export or a ``__cuda_array_interface__`` consumer holds
the array). That is when CuPy's pool would give its memory to the next allocation on the same
stream, and this module reuses it on that stream only. Only memory from CuPy's pool is kept (not a
framework's allocator, whose blocks a framework view may still use after CuPy's array is gone).
"""

from __future__ import annotations

import sys
from collections import deque

__all__ = ["MAX_BYTES", "output", "spares"]

MAX_BYTES = 1 << 20   # small outputs only: larger calls are GPU-bound, and what is kept grows with them
_KEPT = 2             # a loop still holds its previous result while it makes the next one

_getrefcount = sys.getrefcount
_pooled = None        # cupy.cuda.memory.PooledMemory, bound at the first output
_free = None          # the reference counts (_counts) of an output that only a local name holds


def _counts(x):
    pointer = x.data
    return _getrefcount(x), _getrefcount(pointer), _getrefcount(pointer.mem)


def spares():
    """A stream's spare outputs of one plan and output position."""
    return deque(maxlen=_KEPT)


def output(spare, cupy, shape, dtype, nbytes: int):
    """An output array of ``shape`` and ``dtype``: one of ``spare`` that nothing else refers to, or
    a new one of ``nbytes`` from CuPy's current allocator; kept in ``spare`` when it is the pool's."""
    global _free, _pooled
    try:
        x = spare.popleft()   # the oldest; atomic: two threads on one stream never take the same array
    except IndexError:
        x = None
    # The same code path as the calibration below: x is a local name only when nothing else holds it.
    if x is not None and _counts(x) != _free:
        spare.append(x)       # the caller's still: kept, to be asked again
        x = None
    elif x is not None and x.shape != shape:
        x = None              # reshaped in place (``x.shape = ...``) before it was dropped: let it go
    if x is None:
        x = cupy.ndarray(shape, dtype, cupy.cuda.alloc(nbytes))
        if _pooled is None:
            _pooled = cupy.cuda.memory.PooledMemory
        if type(x.data.mem) is not _pooled:
            return x
        if _free is None:
            _free = _counts(x)
    spare.append(x)
    return x

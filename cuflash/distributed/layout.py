"""The zigzag layout of a sequence over ``world`` ranks: which chunks a rank holds, and the
shards of an array (see :mod:`cuflash.distributed`)."""

from __future__ import annotations

import operator

from . import _comm


def _check_world(world) -> int:
    try:
        world = operator.index(world)
    except TypeError:
        raise TypeError(f"world must be an int, got {type(world).__name__}") from None
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    return world


def zigzag_chunks(rank, world):
    """The two chunk indices rank ``rank`` holds in the zigzag layout.

    Parameters
    ----------
    rank : int
        ``0 <= rank < world``.
    world : int
        Number of ranks (>= 1); the sequence is cut into ``2 * world`` chunks.

    Returns
    -------
    (int, int)
        ``(rank, 2 * world - 1 - rank)``, in the order they sit in the rank's shard.

    Raises
    ------
    ValueError
        If ``world < 1`` or ``rank`` is out of range.

    Examples
    --------
    >>> from cuflash import distributed as cd
    >>> cd.zigzag_chunks(1, 4)          # 8 chunks: rank 1 holds an early and a late one
    (1, 6)
    """
    world = _check_world(world)
    rank = operator.index(rank)
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}), got {rank}")
    return rank, 2 * world - 1 - rank


def shard(x, world, *, axis=1):
    """Cut a sequence into the zigzag layout: one slice per rank.

    Parameters
    ----------
    x : NumPy or CuPy array, e.g. (B, S, H, D) with ``axis=1`` or lse (B, H, S) with ``axis=2``
        ``x.shape[axis]`` must be divisible by ``2 * world``.
    world : int
        Number of ranks (>= 1).
    axis : int
        The sequence axis.

    Returns
    -------
    list of ``world`` arrays, each of ``x``'s shape with ``S / world`` along ``axis``
        Rank ``r``'s slice is chunk ``r`` followed by chunk ``2 * world - 1 - r`` (new arrays).

    Raises
    ------
    ValueError
        If ``world < 1`` or the sequence length is not divisible by ``2 * world``.

    Examples
    --------
    >>> import numpy as np
    >>> from cuflash import distributed as cd
    >>> [s.tolist() for s in cd.shard(np.arange(8).reshape(1, 8), 2)]
    [[[0, 1, 6, 7]], [[2, 3, 4, 5]]]
    """
    world = _check_world(world)
    xp = _comm.array_module(x)
    length = x.shape[axis]
    if length % (2 * world):
        raise ValueError(f"x.shape[{axis}] (the sequence length, {length}) must be divisible by "
                         f"2 * world = {2 * world}")
    chunks = xp.split(x, 2 * world, axis=axis)
    return [xp.concatenate([chunks[a], chunks[b]], axis=axis)
            for a, b in (zigzag_chunks(r, world) for r in range(world))]


def unshard(shards, *, axis=1):
    """Invert :func:`shard`: put the ranks' zigzag slices back in sequence order.

    Parameters
    ----------
    shards : sequence of ``world`` NumPy or CuPy arrays
        Rank ``r``'s slice (chunk ``r`` then chunk ``2 * world - 1 - r``), all of one shape with
        an even length along ``axis``.
    axis : int
        The sequence axis.

    Returns
    -------
    array, the shards' shape with ``world`` times the length along ``axis``

    Raises
    ------
    ValueError
        If ``shards`` is empty, or the shards differ in shape or have an odd length.

    Examples
    --------
    >>> import numpy as np
    >>> from cuflash import distributed as cd
    >>> x = np.arange(8).reshape(1, 8)
    >>> bool((cd.unshard(cd.shard(x, 2)) == x).all())
    True
    """
    shards = list(shards)
    if not shards:
        raise ValueError("shards must hold at least one array (one per rank)")
    shape = tuple(shards[0].shape)
    for r, s in enumerate(shards):
        if tuple(s.shape) != shape:
            raise ValueError(f"shards[{r}] has shape {tuple(s.shape)}, shards[0] has {shape}")
    if shape[axis] % 2:
        raise ValueError(f"shards must have an even length along axis {axis} (two equal chunks), "
                         f"got {shape[axis]}")
    world = len(shards)
    xp = _comm.array_module(shards[0])
    chunks = [None] * (2 * world)
    for r, s in enumerate(shards):
        first, second = xp.split(s, 2, axis=axis)
        a, b = zigzag_chunks(r, world)
        chunks[a], chunks[b] = first, second
    return xp.concatenate(chunks, axis=axis)



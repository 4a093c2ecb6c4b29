"""The ring's schedule: which (query chunk, key chunk) pairs each rank computes at each step, with
which mask, and the kernel calls a step takes. Pure Python, checked on the CPU."""

from __future__ import annotations

from typing import NamedTuple

from .layout import _check_world, zigzag_chunks

FULL, CAUSAL, SKIP = "full", "causal", "skip"


class RingPair(NamedTuple):
    """One (query chunk, key chunk) block of the attention matrix, as a rank meets it.

    ``rank`` computes it at ring ``step`` with the keys and values received from ``kv_rank``;
    ``mask`` is ``"full"`` (every key visible), ``"causal"`` (the diagonal chunk: causal within
    the chunk) or ``"skip"`` (no key visible: nothing to compute).

    Examples
    --------
    >>> from cuflash import distributed as cd
    >>> cd.ring_schedule(2, causal=True)[0][0][2]
    RingPair(rank=0, step=0, kv_rank=0, q_chunk=3, k_chunk=0, mask='full')
    """
    rank: int
    step: int
    kv_rank: int
    q_chunk: int
    k_chunk: int
    mask: str


def pair_mask(q_chunk, k_chunk, *, causal):
    """The mask a (query chunk, key chunk) block needs, from the chunks' positions.

    Parameters
    ----------
    q_chunk, k_chunk : int
        Positions of the query and the key chunk in the sequence.
    causal : bool
        Causal self-attention over the whole sequence.

    Returns
    -------
    {"full", "causal", "skip"}
        Without ``causal`` every block is ``"full"``. With it, keys wholly before the queries are
        ``"full"``, the same chunk is ``"causal"`` (equal chunk lengths, so the kernel's bottom-right
        causal alignment is the diagonal), and keys wholly after are ``"skip"``.

    Examples
    --------
    >>> from cuflash import distributed as cd
    >>> cd.pair_mask(3, 1, causal=True), cd.pair_mask(1, 1, causal=True), cd.pair_mask(1, 3, causal=True)
    ('full', 'causal', 'skip')
    """
    if not causal or k_chunk < q_chunk:
        return FULL
    return CAUSAL if k_chunk == q_chunk else SKIP


def ring_schedule(world, *, causal):
    """The ring's work in the zigzag layout: every rank's (query chunk, key chunk) pairs per step.

    At step ``s`` rank ``r`` holds the keys and values of rank ``(r - s) % world`` (they travel
    one rank further each step), and attends each of its two query chunks to each of the two
    key chunks in hand.

    Parameters
    ----------
    world : int
        Number of ranks (>= 1).
    causal : bool
        Causal self-attention over the whole sequence.

    Returns
    -------
    list (ranks) of lists (steps) of tuples of 4 :class:`RingPair`
        ``schedule[r][s]`` lists all four pairs of rank ``r`` at step ``s``, including those with
        ``mask == "skip"``, query chunks in shard order, then key chunks in shard order.

    Notes
    -----
    Over all ranks and steps every (query chunk, key chunk) pair appears exactly once. Under
    causal masking each rank does the work of ``2 * world`` full blocks (a diagonal block is half
    of one): at step 0 two diagonal blocks and one full, at each later step exactly two full.

    Examples
    --------
    >>> from cuflash import distributed as cd
    >>> [p.mask for p in cd.ring_schedule(2, causal=True)[0][0]]   # rank 0, step 0
    ['causal', 'skip', 'full', 'causal']
    """
    world = _check_world(world)
    schedule = []
    for rank in range(world):
        steps = []
        for step in range(world):
            kv_rank = (rank - step) % world
            steps.append(tuple(RingPair(rank, step, kv_rank, qc, kc, pair_mask(qc, kc, causal=causal))
                               for qc in zigzag_chunks(rank, world)
                               for kc in zigzag_chunks(kv_rank, world)))
        schedule.append(steps)
    return schedule


# ----------------------------------------------------------------------------- one step's calls

class RingCall(NamedTuple):
    """One kernel call of a ring step, in chunk slots: slot ``i`` is rows ``i * c .. (i + 1) * c``
    of a shard (``c`` the chunk length). The rank's query slots ``[q_slots[0], q_slots[1])`` attend
    to key slots ``[k_slots[0], k_slots[1])`` of the kv shard in hand, every key visible, or, with
    ``causal``, causal aligned to the bottom-right corner of that rectangle (as the kernels align it).

    Examples
    --------
    >>> from cuflash import distributed as cd
    >>> cd.step_calls(cd.ring_schedule(2, causal=True)[0][1], 2)   # rank 0, step 1
    (RingCall(q_slots=(1, 2), k_slots=(0, 2), causal=False, chunks=None),)
    """
    q_slots: tuple
    k_slots: tuple
    causal: bool
    chunks: tuple | None = None   # (query chunk, key chunk) of a one-pair call under dropout: its origin


def _call_mask(a, b, nq, nk, causal):
    """The mask a call of ``nq`` query and ``nk`` key chunks applies to its chunk pair (a, b).

    Bottom-right causal: query row ``a * c + x`` sees key ``b * c + y`` iff
    ``b * c + y <= a * c + x + (nk - nq) * c``, so whole chunks left of the shifted diagonal are
    full, the diagonal chunk is causal within itself, and chunks right of it are skipped.
    """
    if not causal:
        return FULL
    diagonal = a + nk - nq
    return FULL if b < diagonal else CAUSAL if b == diagonal else SKIP


def step_calls(pairs, world, *, per_pair=False):
    """The kernel calls that compute one rank's ring step.

    When the step's live (non-skipped) pairs fill a rectangle of chunk slots that one call masks
    exactly as the pairs ask, that one call (bigger calls run closer to the GPU's peak; in the
    zigzag layout every step is one call: the whole shard against itself, causal, at step 0, then
    ``c x 2c`` or ``2c x c`` unmasked); otherwise one call per live pair.

    Parameters
    ----------
    pairs : tuple of :class:`RingPair`
        ``ring_schedule(world, causal=...)[rank][step]``.
    world : int
        Number of ranks.
    per_pair : bool
        One call per live pair, each with its ``chunks`` (dropout: a call draws the mask of the
        global positions of one pair, whose rows and columns are contiguous).

    Returns
    -------
    tuple of :class:`RingCall`
        Empty when every pair is skipped.

    Examples
    --------
    >>> from cuflash import distributed as cd
    >>> cd.step_calls(cd.ring_schedule(2, causal=True)[0][0], 2)   # rank 0, step 0: one causal call
    (RingCall(q_slots=(0, 2), k_slots=(0, 2), causal=True, chunks=None),)
    """
    world = _check_world(world)

    def slots(p):
        return (zigzag_chunks(p.rank, world).index(p.q_chunk), zigzag_chunks(p.kv_rank, world).index(p.k_chunk))

    if per_pair:
        calls = []
        for p in pairs:
            if p.mask != SKIP:
                a, b = slots(p)
                calls.append(RingCall((a, a + 1), (b, b + 1), p.mask == CAUSAL, (p.q_chunk, p.k_chunk)))
        return tuple(calls)
    masks = {slots(p): p.mask for p in pairs}
    live = [slots(p) for p in pairs if p.mask != SKIP]
    if not live:
        return ()
    q_lo, q_hi = min(a for a, _ in live), max(a for a, _ in live) + 1
    k_lo, k_hi = min(b for _, b in live), max(b for _, b in live) + 1
    nq, nk = q_hi - q_lo, k_hi - k_lo
    for causal in (False, True):
        if all(masks.get((a, b), SKIP) == _call_mask(a - q_lo, b - k_lo, nq, nk, causal)
               for a in range(q_lo, q_hi) for b in range(k_lo, k_hi)):
            return (RingCall((q_lo, q_hi), (k_lo, k_hi), causal),)
    return tuple(RingCall((a, a + 1), (b, b + 1), masks[a, b] == CAUSAL) for a, b in live)


def _rank_calls(world, rank, causal, per_pair=False):
    """``step_calls`` of every step of ``rank``."""
    return [step_calls(pairs, world, per_pair=per_pair) for pairs in ring_schedule(world, causal=causal)[rank]]



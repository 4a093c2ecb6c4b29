"""``jax.vmap`` over cuflash's JAX functions.

Every callback of :mod:`cuflash.interop.jax` is made :func:`batchable`: a ``custom_vmap`` whose rule,
under ``jax.vmap``, either folds the mapped axis into the kernels' batch axis (one call over N x B
sequences) or makes one call per instance (``jax.lax.map``). Folding is taken only where each
sequence of the folded call computes what the instance's own call computes, with the same kernels:

- attention (forward and backward) and decode: the mapped axis joins B; a paged cache's mapped axis
  joins its pages, and each instance's block table is offset to its own pages;
- merge_states: the mapped axis joins B behind the parts' axis.

One call per instance where folding would change an instance's result or cost copies its own call
does not make: dropout (its mask is a function of the batch index), user modifiers (their
expression may read ``b``), mapped per-head arrays (sinks, ALiBi slopes in decode, fp8 scales), a
dbias or dsinks (sums over broadcast axes), varlen (packed rows between the sequences would fall
into the folded call's sequences) and a contiguous cache that the instances share.

The rules run when a function is traced, on abstract values: nothing here reads the GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap

__all__ = ["batchable", "fold", "fold_batch", "fold_broadcast", "leading", "unfold"]


def batchable(call, fold_rule=None):
    """``call`` (a function of arrays returning a tuple of arrays) that ``jax.vmap`` can map.

    ``fold_rule(n, batched, args)`` gives the mapped results (each with the mapped axis first) of
    one folded call, or None where it does not fold; the rule then makes one call per instance.
    ``batched[i]`` says whether ``args[i]`` is mapped (its mapped axis first, of size ``n``)."""

    @custom_vmap
    def mapped_call(*args):
        return tuple(call(*args))

    @mapped_call.def_vmap
    def rule(n, batched, *args):
        outs = fold_rule(n, batched, args) if fold_rule is not None else None
        if outs is None:
            outs = one_call_per_instance(mapped_call, batched, args)
        outs = tuple(outs)
        return outs, tuple(True for _ in outs)

    return mapped_call


def one_call_per_instance(call, batched, args):
    """``call`` once per instance of the mapped arguments, the others as they are (``jax.lax.map``: a
    loop in the program; the calls written out one by one ran no faster, docs/decisions.md#jax-vmap)."""
    mapped = tuple(x for x, is_mapped in zip(args, batched) if is_mapped)

    def instance(slices):
        slices = iter(slices)
        return call(*(next(slices) if is_mapped else x for x, is_mapped in zip(args, batched)))

    return jax.lax.map(instance, mapped)


def leading(x, is_mapped: bool, n: int):
    """``x`` with the mapped axis first: as it is when mapped, else broadcast to ``n`` instances."""
    return x if is_mapped else jnp.broadcast_to(x, (n, *x.shape))


def fold(x):
    """The first two axes as one: (n, B, ...) -> (n B, ...), instance-major."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def unfold(x, n: int):
    """The inverse of :func:`fold`: (n B, ...) -> (n, B, ...)."""
    return x.reshape(n, x.shape[0] // n, *x.shape[1:])


def fold_batch(x, is_mapped: bool, n: int):
    """An array whose first axis is the batch, folded with the mapped axis."""
    return fold(leading(x, is_mapped, n))


def fold_broadcast(x, is_mapped: bool, n: int, batch: int, rank: int):
    """An array that broadcasts to (batch, ...) of ``rank`` axes (a mask, a bias, a block mask, ALiBi's
    (B, Hq) slopes), for the folded batch of ``n`` x ``batch``.

    Left as it is when not mapped and without a batch axis of its own (it broadcasts over the folded
    batch as over the batch); otherwise given the batch axis and folded."""
    shape = tuple(x.shape[1:] if is_mapped else x.shape)
    padded = (1,) * (rank - len(shape)) + shape
    if not is_mapped and padded[0] == 1:
        return x
    x = x.reshape(((n,) if is_mapped else ()) + padded)
    return fold(jnp.broadcast_to(x, (n, batch, *padded[1:])))

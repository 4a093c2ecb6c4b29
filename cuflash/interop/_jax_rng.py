"""Dropout's (seed, offset) from a JAX PRNG key, drawn inside the traced program.

cuflash draws the keep/drop decision of score element (b, h, i, j) from a (seed, offset) pair
(Philox4x32-10, :mod:`cuflash.random`). Under ``jax.jit`` the key is device data that the host must
not read, so the pair is drawn on the GPU by ``jax.random.bits`` and handed to the kernels as device
words (``FwdParams.dropout_state``, read there as a uint64 pair). JAX without ``jax_enable_x64`` has
no uint64, so the pair is four uint32 words in the order a little-endian uint64 (2,) array has them:
``[seed_lo, seed_hi, offset, 0]``. The kernels use the offset's low 32 bits only (the Philox
counter's last word), so the high word is 0 and a host reading the pair gets cuflash's
``rng_state``: ``np.asarray(words).view(np.uint64)``.
"""

from __future__ import annotations

__all__ = ["state_words"]


def state_words(key):
    """The uint32 (4,) words ``[seed_lo, seed_hi, offset, 0]`` that ``key`` gives, a traced value."""
    import jax
    import jax.numpy as jnp

    bits = jax.random.bits(key, (3,), jnp.uint32)
    return jnp.concatenate([bits, jnp.zeros((1,), jnp.uint32)])

"""mask_blocks (cuda_src/mask_blocks.cu): the block mask a MaskMod implies, evaluated on the GPU over
every element of every block, so that the attention kernels skip the tiles it hides entirely
(:mod:`cuflash._mask_blocks` runs it and caches the result)."""

from __future__ import annotations

from .._build.variant import Variant

MASK_BLOCKS_THREADS = 256   # cuda_src/mask_blocks.cu __launch_bounds__
#: CTAs of one launch at most; each then strides over the remaining blocks.
MASK_BLOCKS_MAX_CTAS = 65535
#: The block (queries, keys) of the mask derived for a call without an explicit ``block_mask``: every
#: tile of the sm90 families with a user modifier is a multiple of it (fwd_sm90 64 x consumers rows x 64
#: keys, bwd_sm90's featured tiles 64 rows x 64/128 keys), and the kernels OR the blocks a larger tile
#: overlaps, so one mask serves the forward and the backward. Smaller tiles (sm80's backward, SIMT)
#: skip at this granularity: exact, a little less sparse than they could be.
DERIVED_BLOCK_SIZE = (64, 64)


def mask_blocks_variant(source: str) -> Variant:
    """The block-mask evaluation of one MaskMod: ``source`` is
    :func:`cuflash.modifiers.kernel_source` ``(None, mask_mod)`` (its ``user_mask_mod`` over the
    MaskMod's own argument slots); MASK_BLOCKS_THREADS threads per CTA, any grid."""
    if not source:
        raise ValueError("mask_blocks needs a MaskMod's generated source")
    return Variant("mask_blocks", (), source)

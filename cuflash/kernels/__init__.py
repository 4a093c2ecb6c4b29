"""Planning of every kernel family, one module facing each ``cuda_src/<family>.cu``: which calls it
runs, its tiles and compile-time defines (``-DCUFLASH_*``, generated here and read by the kernel's
config), and its shared memory, which the kernel ``static_assert``\\ s against its own count.

==================  ===================================================================
``fwd_sm90``        Hopper forward (wgmma, TMA, warp specialisation, persistent CTAs)
``fwd_sm80``        mma.sync forward for sm_80+ (and Hopper calls TMA cannot describe)
``fwd_simt``        float32 forward (FFMA)
``forward``         the forward's variant by family, its default family, precompile list
``bwd_sm90``        Hopper dK/dV pass with dQ (any order, or a fixed one)
``bwd_sm80``        mma.sync dK/dV and dQ passes
``bwd_simt``        float32 dK/dV and dQ passes
``bwd_common``      the backward's shared tiles and grid order, preprocess and convert
``backward``        the backward's variant by family, its default family, precompile list
``decode``          split-KV decode (tiles, split count)
``mla_sm90``        MLA decode on wgmma (Hopper), 64 packed query rows a CTA
``merge``           the merge of partial states
``check_indices``   the index check ahead of decode / varlen kernels
``append_kv``       new keys and values into a cache, ahead of fwd_sm90 reading it there
``rng_state``       a captured dropout call's (seed, offset) drawn on the GPU
``mask_blocks``     the block mask a MaskMod implies (which tiles it hides entirely)
``work_order``      the order of a block-masked call's tiles, longest walk first
``catalogue``       the variants to precompile, every reachable variant, what CI compiles
==================  ===================================================================

Everything here is a pure function of shapes, options and device properties (no GPU), tested on
the CPU. The entry points (cuflash/attention.py, backward.py, decode.py, merge.py) turn a plan into
launches.
"""

from . import (append_kv, backward, bwd_common, bwd_simt, bwd_sm80, bwd_sm90, catalogue, check_indices, common, decode,  # noqa: F401
               forward, fwd_simt, fwd_sm80, fwd_sm90, mask_blocks, merge, mla_sm90, rng_state, work_order)


def home(name: str):
    """The module of this package that defines ``name`` (a tuned constant, for the A/B scripts that
    override one: benchmarks/ab_forward.py, ab_backward.py), or None."""
    for module in (fwd_sm90, fwd_sm80, fwd_simt, forward, bwd_sm90, bwd_sm80, bwd_simt, bwd_common, backward, decode,
                   merge, mla_sm90, check_indices, append_kv, rng_state, mask_blocks, work_order, common):
        if name in vars(module):
            return module
    return None

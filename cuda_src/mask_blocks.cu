// Contract: cuflash_mask_blocks evaluates a call's MaskMod (user_mask_mod, written by
// cuflash/modifiers/cuda.py and compiled ahead of this file) over every element of every block of a
// block mask and writes the block mask: block_mask[t] = 3 where every element (i, j) of block t may
// attend, 1 where some but not all may, 0 where none may. Exact by construction: every element inside
// the sequences is evaluated with the same generated function the attention kernels call (a block is
// 0 only if all of them gave false, 3 only if all gave true), so passing the result as a block_mask
// changes no score; it lets the kernels skip the tiles that the MaskMod hides entirely, and fwd_sm90
// skip the MaskMod itself on tiles whose blocks are all 3 (cuflash/_mask_blocks.py, mask.cuh
// block_mask_tile_state). Both nonzero values read as True wherever a bool block mask is read.
//
// block_mask: C-contiguous (batch_m, heads_m, rows, cols) bool bytes, rows = ceil(seqlen_q /
// block_q), cols = ceil(seqlen_k / block_k); batch_m / heads_m are 1 when the expression does not
// read b / h (then b / h = 0 is evaluated: any value gives the same). Elements past seqlen_q or
// seqlen_k are not evaluated (they do not exist). args: the MaskMod's cuflash::user::Args, in device
// memory; the shape as plain scalars (CuPy's launcher packs them). Any grid: each CTA takes blocks t =
// blockIdx.x, + gridDim.x, ...; a CTA stops evaluating a block at the first chunk of blockDim.x
// elements after which it has seen one that may attend and one that may not. Compile-time: none (the
// expression is the variant's generated source).
#include "user_mod.cuh"

namespace cuflash {

struct MaskBlocksShape {
    long long blocks;       // batch_m * heads_m * rows * cols
    int heads_m, rows, cols;
    int block_q, block_k, seqlen_q, seqlen_k;
};

// Block (b, h, r, c)'s byte: 0 (no element may attend), 1 (some may) or 3 (all may); every thread
// of the CTA calls it.
__device__ __forceinline__ unsigned char block_byte(const user::Args& args, const MaskBlocksShape& s, long long b,
                                                    long long h, int r, int c) {
    const long long i0 = static_cast<long long>(r) * s.block_q, j0 = static_cast<long long>(c) * s.block_k;
    const long long rows = min(static_cast<long long>(s.block_q), s.seqlen_q - i0);
    const long long cols = min(static_cast<long long>(s.block_k), s.seqlen_k - j0);
    const long long count = rows * cols;
    bool any = false, all = true;
    for (long long e0 = 0; e0 < count; e0 += blockDim.x) {
        const long long e = e0 + threadIdx.x;
        const bool inside = e < count;
        const bool attends = inside && user_mask_mod(b, h, i0 + e / cols, j0 + e % cols, args);
        // The same answers in every thread: the exit is uniform.
        any = __syncthreads_or(attends) != 0 || any;
        all = __syncthreads_and(!inside || attends) != 0 && all;
        if (any && !all) break;
    }
    return any ? (all ? 3 : 1) : 0;
}

}  // namespace cuflash

extern "C" __global__ void __launch_bounds__(256) cuflash_mask_blocks(const cuflash::user::Args* args_gmem,
                                                                       unsigned char* block_mask, long long blocks,
                                                                       int heads_m, int rows, int cols, int block_q,
                                                                       int block_k, int seqlen_q, int seqlen_k) {
    const cuflash::MaskBlocksShape shape{blocks, heads_m, rows, cols, block_q, block_k, seqlen_q, seqlen_k};
    __shared__ cuflash::user::Args args;
    if (threadIdx.x == 0) args = *args_gmem;
    __syncthreads();
    for (long long t = blockIdx.x; t < shape.blocks; t += gridDim.x) {
        const int c = static_cast<int>(t % shape.cols);
        const int r = static_cast<int>((t / shape.cols) % shape.rows);
        const long long bh = t / (static_cast<long long>(shape.cols) * shape.rows);
        const unsigned char byte = cuflash::block_byte(args, shape, bh / shape.heads_m, bh % shape.heads_m, r, c);
        if (threadIdx.x == 0) block_mask[t] = byte;
    }
}

// Contract: cuflash_mask_blocks evaluates a call's MaskMod (user_mask_mod, written by
// cuflash/modifiers/cuda.py and compiled ahead of this file) over every element of every block of a
// block mask and writes the block mask: block_mask[t] = 1 where some element (i, j) of block t may
// attend, 0 where none may. Exact by construction: every element inside the sequences is evaluated
// with the same generated function the attention kernels call (a block is 0 only if all of them
// gave false), so passing the result as a block_mask changes no score, it only lets the kernels skip
// the tiles that the MaskMod hides entirely (cuflash/_mask_blocks.py).
//
// block_mask: C-contiguous (batch_m, heads_m, rows, cols) bool bytes, rows = ceil(seqlen_q /
// block_q), cols = ceil(seqlen_k / block_k); batch_m / heads_m are 1 when the expression does not
// read b / h (then b / h = 0 is evaluated: any value gives the same). Elements past seqlen_q or
// seqlen_k are not evaluated (they do not exist). args: the MaskMod's cuflash::user::Args, in device
// memory; the shape as plain scalars (CuPy's launcher packs them). Any grid: each CTA takes blocks t = blockIdx.x, + gridDim.x, ...; a CTA stops evaluating
// a block at the first chunk of blockDim.x elements in which one may attend. Compile-time: none
// (the expression is the variant's generated source).
#include "user_mod.cuh"

namespace cuflash {

struct MaskBlocksShape {
    long long blocks;       // batch_m * heads_m * rows * cols
    int heads_m, rows, cols;
    int block_q, block_k, seqlen_q, seqlen_k;
};

// Whether any element of block (b, h, r, c) may attend; every thread of the CTA calls it.
__device__ __forceinline__ bool block_may_attend(const user::Args& args, const MaskBlocksShape& s, long long b,
                                                 long long h, int r, int c) {
    const long long i0 = static_cast<long long>(r) * s.block_q, j0 = static_cast<long long>(c) * s.block_k;
    const long long rows = min(static_cast<long long>(s.block_q), s.seqlen_q - i0);
    const long long cols = min(static_cast<long long>(s.block_k), s.seqlen_k - j0);
    const long long count = rows * cols;
    for (long long e0 = 0; e0 < count; e0 += blockDim.x) {
        const long long e = e0 + threadIdx.x;
        const bool visible = e < count && user_mask_mod(b, h, i0 + e / cols, j0 + e % cols, args);
        if (__syncthreads_or(visible)) return true;   // the same answer in every thread: a uniform exit
    }
    return false;
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
        const bool any = cuflash::block_may_attend(args, shape, bh / shape.heads_m, bh % shape.heads_m, r, c);
        if (threadIdx.x == 0) block_mask[t] = any ? 1 : 0;
    }
}

// Contract: cuflash_mask_blocks evaluates a call's MaskMod (user_mask_mod, written by
// cuflash/modifiers/cuda.py and compiled ahead of this file) over every element of every block of a
// block mask and writes the block mask: block_mask[t] = 3 where every element (i, j) of block t may
// attend, 1 where some but not all may, 0 where none may. Exact by construction: every element inside
// the sequences is evaluated with the same generated function the attention kernels call (a block is
// 0 only if all of them gave false, 3 only if all gave true), so passing the result as a block_mask
// changes no score; it lets the kernels skip the tiles that the MaskMod hides entirely, and fwd_sm90
// skip the MaskMod itself on tiles whose blocks are all 3 (cuflash/_mask_blocks.py, mask.cuh
// block_mask_tile_state). Both nonzero values read as True wherever a bool block mask is read.
// With bits, every element's answer too, for the attention kernels to read on a tile's partly
// visible blocks instead of the expression (FwdParams::mask_bits_offset).
//
// block_mask: C-contiguous (batch_m, heads_m, rows, cols) bool bytes, rows = ceil(seqlen_q /
// block_q), cols = ceil(seqlen_k / block_k); batch_m / heads_m are 1 when the expression does not
// read b / h (then b / h = 0 is evaluated: any value gives the same). Elements past seqlen_q or
// seqlen_k are not evaluated (they do not exist). args: the MaskMod's cuflash::user::Args, in device
// memory; the shape as plain scalars (CuPy's launcher packs them). Any grid: each CTA takes blocks t =
// blockIdx.x, + gridDim.x, ...; without bits a CTA stops evaluating a block at the first chunk of
// blockDim.x elements after which it has seen one that may attend and one that may not. Compile-time:
// none (the expression is the variant's generated source).
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

// block_byte, and every element's answer into bits (block_k a multiple of 32): the block is walked
// row by row in 32-key words, a warp a word (its ballot), so that each word is written whole, zeros
// past the sequences' ends included; no early exit.
__device__ __forceinline__ unsigned char block_byte_and_bits(const user::Args& args, const MaskBlocksShape& s,
                                                             long long b, long long h, int r, int c, unsigned* bits,
                                                             long long row_words) {
    const long long i0 = static_cast<long long>(r) * s.block_q, j0 = static_cast<long long>(c) * s.block_k;
    const long long rows = min(static_cast<long long>(s.block_q), s.seqlen_q - i0);
    const long long cols = min(static_cast<long long>(s.block_k), s.seqlen_k - j0);
    const long long count = rows * s.block_k;   // whole rows of the block's words
    bool any = false, all = true;
    for (long long e0 = 0; e0 < count; e0 += blockDim.x) {
        const long long e = e0 + threadIdx.x;
        const long long i = e / s.block_k, j = e % s.block_k;
        const bool inside = e < count && j < cols;
        const bool attends = inside && user_mask_mod(b, h, i0 + i, j0 + j, args);
        const unsigned word = __ballot_sync(0xffffffffu, attends);
        if (e < count && threadIdx.x % 32 == 0) bits[(i0 + i) * row_words + (j0 + j) / 32] = word;
        any = __syncthreads_or(attends) != 0 || any;
        all = __syncthreads_and(!inside || attends) != 0 && all;
    }
    return any ? (all ? 3 : 1) : 0;
}

}  // namespace cuflash

// bits: nullptr, or (batch_m, heads_m, bits_rows, row_words) 32-bit words for every element's answer
// (FwdParams::mask_bits_offset), row_words = cols * block_k / 32; rows from seqlen_q on are padding,
// not written.
extern "C" __global__ void __launch_bounds__(256) cuflash_mask_blocks(const cuflash::user::Args* args_gmem,
                                                                       unsigned char* block_mask, unsigned* bits,
                                                                       long long blocks, int heads_m, int rows,
                                                                       int cols, int block_q, int block_k,
                                                                       int seqlen_q, int seqlen_k, int bits_rows) {
    const cuflash::MaskBlocksShape shape{blocks, heads_m, rows, cols, block_q, block_k, seqlen_q, seqlen_k};
    __shared__ cuflash::user::Args args;
    if (threadIdx.x == 0) args = *args_gmem;
    __syncthreads();
    const long long row_words = static_cast<long long>(cols) * block_k / 32;
    for (long long t = blockIdx.x; t < shape.blocks; t += gridDim.x) {
        const int c = static_cast<int>(t % shape.cols);
        const int r = static_cast<int>((t / shape.cols) % shape.rows);
        const long long bh = t / (static_cast<long long>(shape.cols) * shape.rows);
        const long long b = bh / shape.heads_m, h = bh % shape.heads_m;
        const unsigned char byte =
            bits == nullptr ? cuflash::block_byte(args, shape, b, h, r, c)
                            : cuflash::block_byte_and_bits(args, shape, b, h, r, c, bits + bh * bits_rows * row_words,
                                                           row_words);
        if (threadIdx.x == 0) block_mask[t] = byte;
    }
}

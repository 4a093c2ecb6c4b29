// Contract: the work order of a call's block mask, for each (b, h) slice of it: the order in which an
// attention kernel takes that slice's tiles, the longest walk first. fwd_sm90 (by_keys 0) takes
// m-blocks of `tile` query rows, each walking key tiles of `step` keys; bwd_sm90 (by_keys 1) takes key
// blocks of `tile` keys, each walking query steps of `step` rows. A tile's walk is the number of its
// steps inside the window that some True block of the mask touches: the tiles the kernels load.
// Among equal walks, the order the kernels have without one (the last m-block first, the first key
// block first). order[slice * tiles + r] is the tile taken r-th (FwdParams::work_order).
//
// Why: a persistent kernel takes its work in a fixed order, and the last CTAs to finish set the call's
// time. Under a causal mask alone that order is longest first already; under a document mask the walks
// rise and fall with each document, and a long walk taken last leaves the other SMs idle
// (docs/decisions.md#modifiers-work-order-from-the-block-mask). Which CTA computes a tile changes
// nothing in what it computes.
//
// Two launches (CUFLASH_WORK_ORDER_PHASE): 0 counts the walks, a CTA of kWalkThreads a tile (grid:
// tiles x slices, b major), into walks[slice * tiles + t], and the tile's bounds there: (first, end) of
// the steps that a True block touches, the window aside (FwdParams::work_bounds); 1 ranks the walks, a
// CTA of kRankThreads a slice (tiles <= kWorkOrderMaxTiles: the host orders no more). One CTA a slice
// doing both took 33-39 us at 16k tokens, its threads' loads of the mask one after the other; the two
// launches take ~19 us together. Compile-time: the phase (CUFLASH_WORK_ORDER_PARAMS_SIZE checks the
// layout).
#include "common.cuh"

namespace cuflash {

// An enum, not constexpr ints (those become globals of the module).
enum WorkOrderShape : int { kWalkThreads = 128, kRankThreads = 1024, kWorkOrderMaxTiles = 4096 };

// cuflash/_runtime/params.py mirrors it (WORK_ORDER_PARAMS).
struct WorkOrderParams {
    const unsigned char* block_mask;   // bool (batch_m, heads_m, rows, cols) blocks of block_q x block_k
    int* order;                        // (batch_m * heads_m, tiles)
    int* walks;                        // (batch_m * heads_m, tiles): phase 0's walks
    int2* bounds;                      // (batch_m * heads_m, tiles): phase 0's (first, end) steps with True blocks
    long long block_mask_batch_stride, block_mask_head_stride, block_mask_row_stride, block_mask_col_stride;
    int heads_m, tiles, by_keys, tile, step, block_q, block_k, seqlen_q, seqlen_k;
    int window_left, window_right;     // -1: unbounded; causal is window_right = 0
};

// Whether a True block of the slice touches query rows [i0, i1) x keys [j0, j1) (both non-empty): a step
// of a tile spans a block or two each way.
__device__ __forceinline__ bool any_block(const WorkOrderParams& p, const unsigned char* mask, int i0, int i1,
                                          int j0, int j1) {
    unsigned any = 0;
    for (int r = i0 / p.block_q; r <= (i1 - 1) / p.block_q; ++r)
        for (int c = j0 / p.block_k; c <= (j1 - 1) / p.block_k; ++c)
            any |= mask[r * p.block_mask_row_stride + c * p.block_mask_col_stride];
    return any != 0;
}

// Whether a True block touches step s of tile t (its rows x keys, clipped to the sequences), the window
// aside: the kernels' test of a tile (block_mask_tile_state, query_tiles_from).
__device__ __forceinline__ bool step_blocks(const WorkOrderParams& p, const unsigned char* mask, int t, int s) {
    const int lo = t * p.tile, hi = min(lo + p.tile, p.by_keys ? p.seqlen_k : p.seqlen_q);
    const int o0 = s * p.step, o1 = min(o0 + p.step, p.by_keys ? p.seqlen_q : p.seqlen_k);
    return p.by_keys ? any_block(p, mask, o0, o1, lo, hi) : any_block(p, mask, lo, hi, o0, o1);
}

// Whether step s of tile t lies inside the window.
__device__ __forceinline__ bool step_in_window(const WorkOrderParams& p, int t, int s) {
    const int diag = p.seqlen_k - p.seqlen_q, left = p.window_left, right = p.window_right;
    const int lo = t * p.tile, hi = min(lo + p.tile, p.by_keys ? p.seqlen_k : p.seqlen_q);
    int first, last;   // the other axis' rows or keys that the window leaves the tile, [first, last)
    if (!p.by_keys) {   // query rows i in [lo, hi) see keys i + diag - left .. i + diag + right
        first = left < 0 ? 0 : max(0, lo + diag - left);
        last = right < 0 ? p.seqlen_k : min(p.seqlen_k, hi + diag + right);
    } else {            // keys j in [lo, hi) are seen by rows j - diag - right .. j - diag + left
        first = right < 0 ? 0 : max(0, lo - diag - right);
        last = left < 0 ? p.seqlen_q : min(p.seqlen_q, hi - diag + left);
    }
    return max(s * p.step, first) < min((s + 1) * p.step, last);
}

}  // namespace cuflash

#ifndef CUFLASH_WORK_ORDER_PHASE
#define CUFLASH_WORK_ORDER_PHASE 0
#endif
#ifdef CUFLASH_WORK_ORDER_PARAMS_SIZE
static_assert(sizeof(cuflash::WorkOrderParams) == CUFLASH_WORK_ORDER_PARAMS_SIZE,
              "WorkOrderParams differs from cuflash/_runtime/params.py");
#endif

#if CUFLASH_WORK_ORDER_PHASE == 0
extern "C" __global__ void __launch_bounds__(cuflash::kWalkThreads) cuflash_work_order(const cuflash::WorkOrderParams p) {
    using namespace cuflash;
    const int t = blockIdx.x, slice = blockIdx.y;
    const unsigned char* mask = p.block_mask + (slice / p.heads_m) * p.block_mask_batch_stride +
                                (slice % p.heads_m) * p.block_mask_head_stride;
    const int steps = ceil_div(p.by_keys ? p.seqlen_q : p.seqlen_k, p.step);
    int walk = 0, first = steps, end = 0;
    for (int s = threadIdx.x; s < steps; s += blockDim.x) {
        if (!step_blocks(p, mask, t, s)) continue;
        first = min(first, s);
        end = s + 1;
        walk += step_in_window(p, t, s);
    }
    __shared__ int3 warp_parts[kWalkThreads / 32];
    for (int offset = 16; offset > 0; offset /= 2) {
        walk += __shfl_xor_sync(0xffffffffu, walk, offset);
        first = min(first, __shfl_xor_sync(0xffffffffu, first, offset));
        end = max(end, __shfl_xor_sync(0xffffffffu, end, offset));
    }
    if (threadIdx.x % 32 == 0) warp_parts[threadIdx.x / 32] = make_int3(walk, first, end);
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < kWalkThreads / 32; ++w) {
            walk += warp_parts[w].x;
            first = min(first, warp_parts[w].y);
            end = max(end, warp_parts[w].z);
        }
        p.walks[slice * p.tiles + t] = walk;
        p.bounds[slice * p.tiles + t] = make_int2(min(first, end), end);   // no step: (0, 0)
    }
}
#else
extern "C" __global__ void __launch_bounds__(cuflash::kRankThreads) cuflash_work_order(const cuflash::WorkOrderParams p) {
    using namespace cuflash;
    __shared__ int walks[kWorkOrderMaxTiles];
    const int slice = blockIdx.x;
    for (int t = threadIdx.x; t < p.tiles; t += blockDim.x) walks[t] = p.walks[slice * p.tiles + t];
    __syncthreads();
    // A tile's place: the tiles with longer walks, and those with equal walks that the kernels take
    // first without an order (fwd: higher m-blocks; bwd: lower key blocks). O(tiles^2) comparisons in
    // shared memory: 16k at 16k tokens.
    for (int tile = threadIdx.x; tile < p.tiles; tile += blockDim.x) {
        const int walk = walks[tile];
        int rank = 0;
        for (int u = 0; u < p.tiles; ++u) {
            const int w = walks[u];
            rank += w > walk || (w == walk && (p.by_keys ? u < tile : u > tile));
        }
        p.order[slice * p.tiles + rank] = tile;
    }
}
#endif

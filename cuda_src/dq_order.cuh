// Deterministic dQ in bwd_sm90: the fixed order in which the key blocks of one (sequence, query
// head) add into each query tile of dq_accum, and the counters that keep it.
//
// Key block x (one CTA) visits the query tiles [c_begin, c_end) that see its keys, upwards, and
// adds its share of dQ into each (a float32 bulk reduction). A sum of floats depends on its order,
// so for bitwise stable gradients every tile takes its additions in one fixed order: the CTA of
// rank r at a tile waits until r others have added there (a counter per tile and consumer share,
// bp.dq_semaphore), adds, and counts itself once its reduction has landed.
//
// The order is from the highest key block that sees the tile downwards: rank x_hi(c) - x. The
// CTAs are dispatched highest key block first, so a CTA only ever waits for CTAs that already run
// (no deadlock, whatever the grid and however few CTAs fit at once). Under a causal or sliding
// window a higher key block starts its walk higher and reaches each tile first, so in the steady
// state nobody waits; without a window all walks start at the first tile, and CTAs started at the
// same time take turns (a staircase); CTAs started as others finish arrive staggered already.
// (Starting each walk at its own tile and ordering each tile cyclically, which needs every CTA of a
// head resident at once, ran 0.80x the default mode's speed against 0.90x for this order at 8k:
// docs/decisions.md#bwd-sm90-ordered-dq.)
#pragma once

#include "common.cuh"
#include "params.cuh"
#include "bwd_params.cuh"
#include "mask.cuh"
#include "tma_sm90.cuh"

namespace cuflash {

// How many key blocks add into tile c before key block x does: those above x that see the tile.
template <int kBlockM, int kBlockN>
__device__ __forceinline__ int dq_rank(const FwdParams& p, const SeqInfo& s, int x, int c) {
    int first, last;
    visible_keys(p, s, c * kBlockM, min((c + 1) * kBlockM, s.seqlen_q), &first, &last);
    return (last - 1) / kBlockN - x;
}

// Waits until `rank` additions have landed in the share `counter` guards. The reduction that
// follows is issued by the async proxy, hence the proxy fence after the acquire. (The loop is
// PTX's: written in C++, it made ptxas spill around it in the consumers' walk.)
__device__ __forceinline__ void dq_wait_turn(const int* counter, int rank) {
    asm volatile(
        "{\n.reg .pred waiting;\n.reg .s32 seen;\n"
        "WAIT_%=:\n"
        "ld.acquire.gpu.global.s32 seen, [%0];\n"
        "setp.lt.s32 waiting, seen, %1;\n"
        "@waiting bra WAIT_%=;\n}\n"
        "fence.proxy.async.global;\n" ::"l"(counter),
        "r"(rank)
        : "memory");
}

// Counts this CTA's addition, once the thread that issued it has waited for it to complete
// (bulk_wait): the next in order then adds onto a sum that includes it.
__device__ __forceinline__ void dq_pass_turn(int* counter) { release_count(counter, 1); }

}  // namespace cuflash

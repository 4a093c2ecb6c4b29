// The parameter struct of the backward kernels (bwd_preprocess, bwd_sm80, bwd_simt, bwd_convert),
// passed by value.
//
// It starts with the forward's FwdParams, so that the score pipeline of mask.cuh (and SeqInfo)
// serves the backward unchanged: q, k, v, o (= the forward's out), lse, the score operands, the
// window, the scale and the dropout state mean there exactly what they meant in the forward.
//
// cuflash/_launch.py mirrors this layout as BWD_PARAMS_DTYPE (align=True); the size it computes
// arrives as CUFLASH_BWD_PARAMS_SIZE and is checked below. Order after `fwd`: 8-byte fields, then
// 4-byte fields, so that C and NumPy pad alike.
#pragma once
#include "params.cuh"

namespace cuflash {

struct BwdParams {
    FwdParams fwd;

    const void* dout;        // dO, the layout of o (strides below)
    float* dq_accum;         // float32 dQ / scale, accumulated with atomics (bwd_sm90: bulk reductions into
                             // tiles, dqa_tile_rows); nullptr: deterministic dQ pass
    void* dq;                // elem_t dQ, written by the dQ pass (deterministic mode)
    void* dk;                // elem_t dK (dkv_partial = 0) or float32 partial sums (dkv_partial = 1)
    void* dv;
    float* lse2;             // (B, Hq, seqlen_q_pad): lse * log2(e); +inf for rows with no key and pad rows
    float* dsum;             // (B, Hq, seqlen_q_pad): D = rowsum(dO * O); 0 for pad rows
    float* dbias;            // float32 dL/ds (B, Hq, Sq, Sk) when the caller wants dbias, else nullptr
    int* dq_semaphore;       // bwd_sm90, deterministic: a counter per dq_accum tile and consumer share,
                             // zeroed per call (cuda_src/dq_order.cuh); else nullptr
    int* dq_done;            // bwd_sm90 with its dQ conversion launched behind it: per (sequence, slot) the
                             // consumers whose dQ reductions have landed, zeroed by bwd_preprocess
                             // (ConvertParams::done); else nullptr
    float* dsink_part;       // return_dsinks: per (b, h, 16-row block of bwd_preprocess) the block's sum of
                             // -exp(sinks[h] - lse_i) D_i, (B, Hq, seqlen_q_pad / 16); else nullptr
    float* dsinks;           // return_dsinks: float32 (Hq,), dsink_part summed by bwd_dsinks.cu; else nullptr
    int* work_counter;       // bwd_sm90 with persistent CTAs: the next key block's linear index (its grid's
                             // order, bwd_grid_place_of), zeroed by bwd_preprocess; else nullptr
    const float* dlse;       // dL/dlse in lse's layout (FwdParams::lse strides) when the loss reads lse, else
                             // nullptr: bwd_preprocess takes it out of D (dS = P (dP - D + dlse))
    long long do_batch_stride, do_row_stride, do_head_stride;
    long long dqa_batch_stride, dqa_row_stride, dqa_head_stride;
    long long dq_batch_stride, dq_row_stride, dq_head_stride;
    long long dk_batch_stride, dk_row_stride, dk_head_stride;
    long long dv_batch_stride, dv_row_stride, dv_head_stride;
    long long dbias_batch_stride, dbias_head_stride, dbias_row_stride;   // columns are contiguous

    int seqlen_q_pad;        // rows per (b, h) of lse2/dsum: a multiple of every backward block size
    int heads_per_cta;       // query heads whose dK/dV one CTA sums (divides Hq / Hk)
    int dkv_partial;         // 1: dk/dv hold float32 partial sums, head index = query head / heads_per_cta
    int dqa_tile_rows;       // 0: dq_accum rows are dQ's rows; else bwd_sm90's tiles (bwd_common.cuh)
    int tail_pairs;          // the last (slot, sequence) pairs of bwd_sm90's grid, taken block by block rather
                             // than head by head (bwd_grid_place, bwd_common.cuh); 0: none
    int dq_tail_pairs;       // the same for the dQ pass's grid (deterministic mode, bwd_sm80 / bwd_simt)
};

// Elementwise float32 -> element type conversion with a scale and a fixed-order sum over partial
// buffers: dQ from dq_accum, and dK/dV from per-head-chunk partials (GQA split over CTAs).
//   dst[r, h, d] = scale * sum_{s < num_partials} src[s * partial_stride + r * src_row_stride
//                                                     + h * src_head_stride + d]
// or, with tile_rows > 0, dQ from bwd_sm90's tiled dq_accum (bwd_common.cuh): dst row i of sequence
// b from element (i, d) of b's tiles, src_batch_stride / dst_batch_stride apart per sequence (0
// under varlen, whose rows start at cu_seqlens[b]).
struct ConvertParams {
    const float* src;
    void* dst;
    const int* error;        // the call's check_indices verdict (see FwdParams::error); nullptr: no check
    const int* cu_seqlens;   // tiled source under varlen; else nullptr
    const int* done;         // tiled source: BwdParams::dq_done when the conversion runs as bwd_sm90's
                             // programmatic dependent; a tile of head h of sequence b is read once
                             // done[b * (heads / heads_per_slot) + h / heads_per_slot] reaches
                             // done_expected. nullptr: bwd_sm90 has ended (stream order)
    long long partial_stride;
    long long src_row_stride, src_head_stride, src_batch_stride;
    long long dst_row_stride, dst_head_stride, dst_batch_stride;
    int rows, heads, head_dim, num_partials;   // tiled: rows per sequence (varlen: the longest)
    float scale;
    int tile_rows;           // 0: rows as above; else the tiles' rows (their columns: src_row_stride)
    int done_expected, heads_per_slot;
};

#ifdef CUFLASH_BWD_PARAMS_SIZE
static_assert(sizeof(BwdParams) == CUFLASH_BWD_PARAMS_SIZE, "BwdParams differs from cuflash/_launch.py");
#endif
#ifdef CUFLASH_CONVERT_PARAMS_SIZE
static_assert(sizeof(ConvertParams) == CUFLASH_CONVERT_PARAMS_SIZE, "ConvertParams differs from cuflash/_launch.py");
#endif

}  // namespace cuflash

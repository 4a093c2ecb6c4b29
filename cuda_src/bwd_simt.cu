// Backward attention in float32 on the CUDA cores (FFMA), for float32 inputs on any GPU sm_80+.
//
// The algorithm of bwd_sm80.cu (same passes, tile walk, score_grad and outputs) with the products
// written as register micro-tiles:
//   pass 0 (dK/dV): a CTA keeps kBlockR keys (K, V) and walks over the query tiles that see them, for each
//     query head of its GQA group: S^T = K Q^T, dP^T = V dO^T -> P, dS -> dV += P^T dO, dK += dS^T Q,
//     and (unless deterministic) dQ += dS K with float32 atomics into dq_accum;
//   pass 1 (dQ, deterministic mode): a CTA keeps kBlockR query rows (Q, dO) and walks over the key tiles:
//     S = Q K^T, dP = dO V^T -> dS -> dQ += dS K.
// P^T and dS go through shared memory between the score products and the accumulations, because a
// thread needs a whole row of them but computed only 8 elements.
//
// Thread tiling (128 threads, kBlockR = 16 kRows kept rows, 32 streamed rows per step): in the score
// products thread t owns kept rows t/8 + 16 x and streamed rows t%8 + {0, 8, 16, 24}; in the
// accumulations it owns kept rows kRows*(t/8) + x and the float4 columns t%8 + 8*k of the head dim
// (x < kRows; large head dims keep 16 rows so that the accumulators fit in registers). Tiles of
// head-dim rows are padded by 4 floats so that both access patterns are free of bank conflicts.
//
// v's head dim may differ (CUFLASH_HEAD_DIM_V): V, dO and dV have kHeadDimV columns (the a2/b2 tiles,
// the dV accumulator), Q, K, dQ, dK kHeadDim; with equal head dims S and dP share one loop.
//
// Compile-time configuration (cuflash/kernels/bwd_simt.py): CUFLASH_DTYPE 2, CUFLASH_HEAD_DIM
// (multiple of 32), CUFLASH_HEAD_DIM_V (multiple of 32, default CUFLASH_HEAD_DIM), CUFLASH_BLOCK_R (16 or 32), CUFLASH_BWD_PASS, CUFLASH_SCORE_MODS (bit mask, mask.cuh), CUFLASH_DROPOUT,
// CUFLASH_MIN_BLOCKS.
#include "common.cuh"
#include "params.cuh"
#include "bwd_params.cuh"
#include "fault.cuh"
#include "mask.cuh"
#include "mma_sm80.cuh"   // only its cp.async wrappers: 16-byte copies with zero fill
#include "philox.cuh"
#include "bwd_common.cuh"

#if CUFLASH_DTYPE != 2
#error "bwd_simt computes float32 (CUFLASH_DTYPE=2)"
#endif
#ifndef CUFLASH_HEAD_DIM_V
#define CUFLASH_HEAD_DIM_V CUFLASH_HEAD_DIM
#endif

namespace cuflash {

template <int kHeadDim_, int kHeadDimV_, int kBlockR_, bool kPassDq_, int kMods_, bool kDropout_>
struct BwdSimtConfig {
    static constexpr int kHeadDim = kHeadDim_, kHeadDimV = kHeadDimV_, kBlockR = kBlockR_;
    static constexpr int kMods = kMods_;   // score modifiers compiled in (mask.cuh)
    static constexpr bool kPassDq = kPassDq_, kScoreMods = kMods != 0, kDropout = kDropout_;
    static constexpr int kBlockC = 32, kNThreads = 128;
    static constexpr int kRows = kBlockR / 16;      // kept rows per thread (the accumulators' registers)
    static constexpr int kStride = kHeadDim + 4;    // floats per row of the head-dim tiles (Q, K)
    static constexpr int kStrideV = kHeadDimV + 4;  // (V, dO)
    static constexpr int kWStride = kBlockC + 1;    // floats per row of the P^T / dS^T tiles
    static constexpr int kChunks = kHeadDim / 32;   // float4 columns per thread in the accumulations
    static constexpr int kChunksV = kHeadDimV / 32; // (dV)
    static constexpr int kChunksMax = kChunks > kChunksV ? kChunks : kChunksV;
    static constexpr int kSmemFloats = kBlockR * (kStride + kStrideV) + kBlockC * (kStride + kStrideV) +
                                       (kPassDq ? 1 : 2) * kBlockR * kWStride + (kPassDq ? 0 : 2 * kBlockC);
    static constexpr int kSmemBytes = 4 * kSmemFloats;
    static_assert(kHeadDim % 32 == 0 && kHeadDimV % 32 == 0, "head dims in whole groups of 8 float4 columns");
    static_assert(kBlockR == 16 || kBlockR == 32, "16 groups of 8 threads own one or two kept rows each");
};

// Copies kRows rows x kHeadDim floats into a padded tile; rows past `rows` and columns past
// `head_dim` are zero-filled, not read.
template <int kRows, int kHeadDim, int kStride, int kNThreads>
__device__ __forceinline__ void load_rows_f32(float* tile_smem, const float* gmem, long long row_stride, int row0,
                                              int rows, int head_dim) {
    constexpr int kChunksPerRow = kHeadDim / 4;
    static_assert(kRows * kChunksPerRow % kNThreads == 0, "every thread copies the same number of chunks");
#pragma unroll
    for (int it = 0; it < kRows * kChunksPerRow / kNThreads; ++it) {
        const int chunk = threadIdx.x + it * kNThreads;
        const int r = chunk / kChunksPerRow, c = chunk % kChunksPerRow;
        const bool valid = row0 + r < rows && 4 * c < head_dim;
        cp_async_16(tile_smem + r * kStride + 4 * c, valid ? gmem + (row0 + r) * row_stride + 4 * c : gmem, valid);
    }
}

// acc[x][y] += a row (sr0 + 16 x) . b row (sc0 + 8 y) over kDim columns of two padded tiles.
template <int kRows, int kDim, int kStride>
__device__ __forceinline__ void dot_rows(float (&acc)[kRows][4], const float* a_smem, const float* b_smem, int sr0,
                                         int sc0) {
#pragma unroll 2
    for (int kc = 0; kc < kDim / 4; ++kc) {
        float4 a[kRows];
#pragma unroll
        for (int x = 0; x < kRows; ++x) a[x] = *reinterpret_cast<const float4*>(a_smem + (sr0 + 16 * x) * kStride + 4 * kc);
#pragma unroll
        for (int y = 0; y < 4; ++y) {
            const float4 bb = *reinterpret_cast<const float4*>(b_smem + (sc0 + 8 * y) * kStride + 4 * kc);
#pragma unroll
            for (int x = 0; x < kRows; ++x) {
                float v = acc[x][y];
                v = fmaf(a[x].x, bb.x, v);
                v = fmaf(a[x].y, bb.y, v);
                v = fmaf(a[x].z, bb.z, v);
                acc[x][y] = fmaf(a[x].w, bb.w, v);
            }
        }
    }
}

template <class C>
__device__ __forceinline__ void bwd_simt(const BwdParams& bp) {
    const FwdParams& p = bp.fwd;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    float* a1_smem = reinterpret_cast<float*>(smem_raw);     // [kBlockR][kStride]: K (pass 0) / Q (pass 1)
    float* a2_smem = a1_smem + C::kBlockR * C::kStride;      // [kBlockR][kStrideV]: V / dO
    float* b1_smem = a2_smem + C::kBlockR * C::kStrideV;     // [kBlockC][kStride]: Q / K
    float* b2_smem = b1_smem + C::kBlockC * C::kStride;      // [kBlockC][kStrideV]: dO / V
    float* ds_smem = b2_smem + C::kBlockC * C::kStrideV;     // [kBlockR][kWStride]: dS^T (pass 0) / dS (pass 1)
    float* p_smem = ds_smem + C::kBlockR * C::kWStride;      // [kBlockR][kWStride]: P^T (pass 0)
    float* lse2_smem = p_smem + (C::kPassDq ? 0 : C::kBlockR * C::kWStride);   // [kBlockC] (pass 0)
    float* dsum_smem = lse2_smem + C::kBlockC;

    // Pass 1 reads its grid's last pairs block by block (bwd_grid_place, bwd_common.cuh); pass 0 keeps
    // the grid's order (the computed place is held through the walk where blockIdx is read again: at
    // D = 128 that cost bwd_sm80 20-28 B of spills).
    const int4 place = C::kPassDq ? bwd_grid_place(bp.dq_tail_pairs)
                                  : make_int4(blockIdx.x, blockIdx.y, blockIdx.z, 0);
    const int b = place.z;
    int h0, heads;
    if constexpr (C::kPassDq) {
        h0 = place.y;
        heads = 1;
    } else {
        const int group = p.heads_q / p.heads_k;
        const int splits = group / bp.heads_per_cta;
        h0 = (place.y / splits) * group + (place.y % splits) * bp.heads_per_cta;
        heads = bp.heads_per_cta;
    }
    SeqInfo s = make_seq_info(p, b, h0);
    const int r_block = C::kPassDq ? gridDim.x - 1 - place.x : place.x;
    const int r_len = C::kPassDq ? s.seqlen_q : s.seqlen_k;
    const int c_len = C::kPassDq ? s.seqlen_k : s.seqlen_q;
    const int r_lo = r_block * C::kBlockR;
    if (r_lo >= r_len) return;
    const int r_hi = min(r_lo + C::kBlockR, r_len);
    int c_first, c_last;
    if constexpr (C::kPassDq) {
        visible_keys(p, s, r_lo, r_hi, &c_first, &c_last);
    } else {
        visible_queries(p, s, r_lo, r_hi, &c_first, &c_last);
    }
    const int c_begin = c_first / C::kBlockC, c_end = ceil_div(c_last, C::kBlockC);

    const float* q_gmem = static_cast<const float*>(p.q) + b * p.q_batch_stride + s.q_row0 * p.q_row_stride;
    const float* do_gmem = static_cast<const float*>(bp.dout) + b * bp.do_batch_stride + s.q_row0 * bp.do_row_stride;
    const float* k_gmem = static_cast<const float*>(p.k) + b * p.k_batch_stride + s.h_kv * p.k_head_stride +
                          s.k_row0 * p.k_row_stride;
    const float* v_gmem = static_cast<const float*>(p.v) + b * p.v_batch_stride + s.h_kv * p.v_head_stride +
                          s.k_row0 * p.v_row_stride;

    constexpr int kStride = C::kStride, kStrideV = C::kStrideV, kWStride = C::kWStride;
    constexpr int kRows = C::kRows;
    // Score products: kept rows sr0 + 16 x (x < kRows), streamed rows sc0 + {0, 8, 16, 24}.
    const int sr0 = threadIdx.x / 8, sc0 = threadIdx.x % 8;
    // Accumulations: kept rows ar0 + x (x < kRows), float4 columns col4 + 8 k; the atomic dQ
    // product: streamed rows dr0 + {0, 1}.
    const int ar0 = kRows * (threadIdx.x / 8), dr0 = 2 * (threadIdx.x / 8), col4 = threadIdx.x % 8;

    if constexpr (C::kPassDq) {
        load_rows_f32<C::kBlockR, C::kHeadDim, kStride, C::kNThreads>(a1_smem, q_gmem + h0 * p.q_head_stride,
                                                                      p.q_row_stride, r_lo, r_len, p.head_dim);
        load_rows_f32<C::kBlockR, C::kHeadDimV, kStrideV, C::kNThreads>(a2_smem, do_gmem + h0 * bp.do_head_stride,
                                                                        bp.do_row_stride, r_lo, r_len, p.head_dim_v);
    } else {
        load_rows_f32<C::kBlockR, C::kHeadDim, kStride, C::kNThreads>(a1_smem, k_gmem, p.k_row_stride, r_lo, r_len,
                                                                      p.head_dim);
        load_rows_f32<C::kBlockR, C::kHeadDimV, kStrideV, C::kNThreads>(a2_smem, v_gmem, p.v_row_stride, r_lo, r_len,
                                                                        p.head_dim_v);
    }
    cp_async_commit();

    float row_lse2[kRows], row_dsum[kRows];
    if constexpr (C::kPassDq) {
#pragma unroll
        for (int x = 0; x < kRows; ++x) {
            const long long idx = bwd_row_index(bp, b, h0, r_lo + sr0 + 16 * x);
            row_lse2[x] = bp.lse2[idx];
            row_dsum[x] = bp.dsum[idx];
        }
    }

    float acc_1[kRows][C::kChunks][4];                      // dK (pass 0) / dQ (pass 1)
    float acc_2[C::kPassDq ? 1 : kRows][C::kChunksV][4];    // dV (pass 0)
#pragma unroll
    for (int x = 0; x < kRows; ++x)
#pragma unroll
        for (int k = 0; k < C::kChunksMax; ++k)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                if (k < C::kChunks) acc_1[x][k][e] = 0.f;
                if (!C::kPassDq && k < C::kChunksV) acc_2[C::kPassDq ? 0 : x][k][e] = 0.f;
            }

    int hh = 0, c = c_begin - 1;
    bool have = next_tile<C::kBlockC, C::kMods, !C::kPassDq>(p, s, h0, heads, r_lo, r_hi, c_begin, c_end, hh, c);
    while (have) {
        s.h = h0 + hh;
        const int c_lo = c * C::kBlockC;
        if constexpr (C::kPassDq) {
            load_rows_f32<C::kBlockC, C::kHeadDim, kStride, C::kNThreads>(b1_smem, k_gmem, p.k_row_stride, c_lo,
                                                                          c_len, p.head_dim);
            load_rows_f32<C::kBlockC, C::kHeadDimV, kStrideV, C::kNThreads>(b2_smem, v_gmem, p.v_row_stride, c_lo,
                                                                            c_len, p.head_dim_v);
        } else {
            load_rows_f32<C::kBlockC, C::kHeadDim, kStride, C::kNThreads>(b1_smem, q_gmem + s.h * p.q_head_stride,
                                                                          p.q_row_stride, c_lo, c_len, p.head_dim);
            load_rows_f32<C::kBlockC, C::kHeadDimV, kStrideV, C::kNThreads>(b2_smem, do_gmem + s.h * bp.do_head_stride,
                                                                            bp.do_row_stride, c_lo, c_len, p.head_dim_v);
            if (threadIdx.x < C::kBlockC / 2) {   // lse2 and D: padded buffers, whole chunks
                const bool is_lse = threadIdx.x < C::kBlockC / 4;
                const int chunk = is_lse ? threadIdx.x : threadIdx.x - C::kBlockC / 4;
                const long long row = bwd_row_index(bp, b, s.h, c_lo);
                cp_async_16((is_lse ? lse2_smem : dsum_smem) + chunk * 4,
                            (is_lse ? bp.lse2 : bp.dsum) + row + chunk * 4, true);
            }
        }
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();

        // S and dP for the thread's kRows x 4 elements.
        float acc_s[kRows][4], acc_dp[kRows][4];
#pragma unroll
        for (int x = 0; x < kRows; ++x)
#pragma unroll
            for (int y = 0; y < 4; ++y) acc_s[x][y] = acc_dp[x][y] = 0.f;
        if constexpr (C::kHeadDim == C::kHeadDimV) {
#pragma unroll 2
        for (int kc = 0; kc < C::kHeadDim / 4; ++kc) {
            float4 a1[kRows], a2[kRows];
#pragma unroll
            for (int x = 0; x < kRows; ++x) {
                a1[x] = *reinterpret_cast<const float4*>(a1_smem + (sr0 + 16 * x) * kStride + 4 * kc);
                a2[x] = *reinterpret_cast<const float4*>(a2_smem + (sr0 + 16 * x) * kStride + 4 * kc);
            }
#pragma unroll
            for (int y = 0; y < 4; ++y) {
                const float4 b1 = *reinterpret_cast<const float4*>(b1_smem + (sc0 + 8 * y) * kStride + 4 * kc);
                const float4 b2 = *reinterpret_cast<const float4*>(b2_smem + (sc0 + 8 * y) * kStride + 4 * kc);
#pragma unroll
                for (int x = 0; x < kRows; ++x) {
                    float s_xy = acc_s[x][y], dp_xy = acc_dp[x][y];
                    s_xy = fmaf(a1[x].x, b1.x, s_xy);
                    s_xy = fmaf(a1[x].y, b1.y, s_xy);
                    s_xy = fmaf(a1[x].z, b1.z, s_xy);
                    acc_s[x][y] = fmaf(a1[x].w, b1.w, s_xy);
                    dp_xy = fmaf(a2[x].x, b2.x, dp_xy);
                    dp_xy = fmaf(a2[x].y, b2.y, dp_xy);
                    dp_xy = fmaf(a2[x].z, b2.z, dp_xy);
                    acc_dp[x][y] = fmaf(a2[x].w, b2.w, dp_xy);
                }
            }
        }
        } else {   // S over kHeadDim columns, then dP over kHeadDimV
            dot_rows<kRows, C::kHeadDim, kStride>(acc_s, a1_smem, b1_smem, sr0, sc0);
            dot_rows<kRows, C::kHeadDimV, kStrideV>(acc_dp, a2_smem, b2_smem, sr0, sc0);
        }

        // With score modifiers, the scores in log2 units (modify_scores; acc_s keeps the raw q.k for
        // the softcap's derivative, or takes the chain factor of a user ScoreMod); the queries are the kept rows in pass 1, the streamed ones in pass 0.
        float score2[kRows][4];
        if constexpr (C::kScoreMods) {
            int kept[kRows], streamed[4];
#pragma unroll
            for (int x = 0; x < kRows; ++x) kept[x] = r_lo + sr0 + 16 * x;
#pragma unroll
            for (int y = 0; y < 4; ++y) streamed[y] = c_lo + sc0 + 8 * y;
#pragma unroll
            for (int x = 0; x < kRows; ++x)
#pragma unroll
                for (int y = 0; y < 4; ++y) score2[x][y] = acc_s[x][y];
            if constexpr (C::kPassDq) {
                modify_scores<C::kMods>(p, s, kept, streamed, [&](int x, int y) -> float& { return score2[x][y]; },
                                        [&](int x, int y) -> float& { return acc_s[x][y]; });
            } else {
                modify_scores<C::kMods>(p, s, streamed, kept, [&](int y, int x) -> float& { return score2[x][y]; },
                                        [&](int y, int x) -> float& { return acc_s[x][y]; });
            }
        }
        // P and dS into shared memory (row = kept row, column = streamed row).
        bool check_window = false;
        if constexpr (!C::kScoreMods) {
            check_window = C::kPassDq ? !tile_inside_window(p, s, r_lo, r_hi, c_lo, c_lo + C::kBlockC)
                                      : !tile_inside_window(p, s, c_lo, min(c_lo + C::kBlockC, s.seqlen_q), r_lo,
                                                            r_lo + C::kBlockR);
        }
        if (check_window) {   // only tiles on a window edge or the key tail
#pragma unroll
            for (int x = 0; x < kRows; ++x)
#pragma unroll
                for (int y = 0; y < 4; ++y) {
                    const int rr = sr0 + 16 * x, cc = sc0 + 8 * y;
                    const int i = C::kPassDq ? r_lo + rr : c_lo + cc;
                    const int j = C::kPassDq ? c_lo + cc : r_lo + rr;
                    if (!in_window(p, s, i, j)) acc_s[x][y] = -CUFLASH_INF;
                }
        }
#pragma unroll
        for (int x = 0; x < kRows; ++x)
#pragma unroll
            for (int y = 0; y < 4; ++y) {
                const int rr = sr0 + 16 * x, cc = sc0 + 8 * y;
                const int i = C::kPassDq ? r_lo + rr : c_lo + cc;
                const int j = C::kPassDq ? c_lo + cc : r_lo + rr;
                const float lse2 = C::kPassDq ? row_lse2[x] : lse2_smem[cc];
                const float dsum = C::kPassDq ? row_dsum[x] : dsum_smem[cc];
                float pd, ds, dx;
                const unsigned word = C::kDropout ? dropout_word(p, s, i, j) : 0u;
                score_grad<C::kMods, C::kDropout>(p, acc_s[x][y], C::kScoreMods ? score2[x][y] : 0.f, acc_dp[x][y],
                                                  lse2, dsum, word, &pd, &ds, &dx);
                if constexpr ((C::kMods & kModBias) && !C::kPassDq) {
                    store_dbias(bp, s, i, j, ds);
                }
                ds_smem[rr * kWStride + cc] = dx;
                if constexpr (!C::kPassDq) p_smem[rr * kWStride + cc] = pd;
            }
        __syncthreads();

        // dK += dS^T Q and dV += P^T dO (pass 0) / dQ += dS K (pass 1). Not unrolled further: with
        // the accumulators of large head dims, hoisted loads would not fit in registers.
#pragma unroll 1
        for (int cc = 0; cc < C::kBlockC; ++cc) {
            float w1[kRows], w2[kRows];
#pragma unroll
            for (int x = 0; x < kRows; ++x) {
                w1[x] = ds_smem[(ar0 + x) * kWStride + cc];
                w2[x] = C::kPassDq ? 0.f : p_smem[(ar0 + x) * kWStride + cc];
            }
#pragma unroll
            for (int k = 0; k < C::kChunksMax; ++k) {
                if (k < C::kChunks) {
                const float4 b1 = *reinterpret_cast<const float4*>(b1_smem + cc * kStride + 4 * (col4 + 8 * k));
#pragma unroll
                for (int x = 0; x < kRows; ++x) {
                    acc_1[x][k][0] = fmaf(w1[x], b1.x, acc_1[x][k][0]);
                    acc_1[x][k][1] = fmaf(w1[x], b1.y, acc_1[x][k][1]);
                    acc_1[x][k][2] = fmaf(w1[x], b1.z, acc_1[x][k][2]);
                    acc_1[x][k][3] = fmaf(w1[x], b1.w, acc_1[x][k][3]);
                }
                }
                if (!C::kPassDq && k < C::kChunksV) {
                    const float4 b2 = *reinterpret_cast<const float4*>(b2_smem + cc * kStrideV + 4 * (col4 + 8 * k));
#pragma unroll
                    for (int x = 0; x < kRows; ++x) {
                        acc_2[x][k][0] = fmaf(w2[x], b2.x, acc_2[x][k][0]);
                        acc_2[x][k][1] = fmaf(w2[x], b2.y, acc_2[x][k][1]);
                        acc_2[x][k][2] = fmaf(w2[x], b2.z, acc_2[x][k][2]);
                        acc_2[x][k][3] = fmaf(w2[x], b2.w, acc_2[x][k][3]);
                    }
                }
            }
        }

        if constexpr (!C::kPassDq) {
            if (bp.dq_accum != nullptr) {
                // dQ (queries dr0 + {0, 1} of the tile) += dS K over the kept keys, one float4
                // column at a time, added to dq_accum.
                float* dqa = bp.dq_accum + b * bp.dqa_batch_stride + s.h * bp.dqa_head_stride +
                             s.q_row0 * bp.dqa_row_stride;
#pragma unroll 1
                for (int k = 0; k < C::kChunks; ++k) {
                    float acc_dq[2][4] = {};
#pragma unroll 2
                    for (int rr = 0; rr < C::kBlockR; ++rr) {
                        const float4 kv = *reinterpret_cast<const float4*>(a1_smem + rr * kStride + 4 * (col4 + 8 * k));
#pragma unroll
                        for (int x = 0; x < 2; ++x) {
                            const float w = ds_smem[rr * kWStride + dr0 + x];
                            acc_dq[x][0] = fmaf(w, kv.x, acc_dq[x][0]);
                            acc_dq[x][1] = fmaf(w, kv.y, acc_dq[x][1]);
                            acc_dq[x][2] = fmaf(w, kv.z, acc_dq[x][2]);
                            acc_dq[x][3] = fmaf(w, kv.w, acc_dq[x][3]);
                        }
                    }
                    const int col = 4 * (col4 + 8 * k);
#pragma unroll
                    for (int x = 0; x < 2; ++x) {
                        const int i = c_lo + dr0 + x;
                        if (i >= s.seqlen_q || col >= p.head_dim) continue;
                        atomic_add4(dqa + i * bp.dqa_row_stride + col,
                                    make_float4(acc_dq[x][0], acc_dq[x][1], acc_dq[x][2], acc_dq[x][3]));
                    }
                }
            }
        }
        // Every thread is done with this step's tiles before the next step overwrites them.
        have = next_tile<C::kBlockC, C::kMods, !C::kPassDq>(p, s, h0, heads, r_lo, r_hi, c_begin, c_end, hh, c);
        __syncthreads();
    }
    cp_async_wait<0>();   // with no visible tile, the kept tiles' copies are still outstanding

#pragma unroll
    for (int x = 0; x < kRows; ++x) {
        const int r = r_lo + ar0 + x;
        if (r >= r_len) continue;
#pragma unroll
        for (int k = 0; k < C::kChunksMax; ++k) {
            const int col = 4 * (col4 + 8 * k);
            if constexpr (!C::kPassDq && C::kHeadDimV != C::kHeadDim) {   // dV's columns alone, then dK's
                if (k < C::kChunksV && col < p.head_dim_v) {
                    const int head = bp.dkv_partial ? h0 / bp.heads_per_cta : s.h_kv;
                    float* dv = static_cast<float*>(bp.dv) + b * bp.dv_batch_stride + head * bp.dv_head_stride +
                                (s.k_row0 + r) * bp.dv_row_stride + col;
                    *reinterpret_cast<float4*>(dv) =
                        make_float4(acc_2[x][k][0], acc_2[x][k][1], acc_2[x][k][2], acc_2[x][k][3]);
                }
            }
            if (k >= C::kChunks || col >= p.head_dim) continue;
            const float4 a = make_float4(acc_1[x][k][0] * p.scale, acc_1[x][k][1] * p.scale, acc_1[x][k][2] * p.scale,
                                         acc_1[x][k][3] * p.scale);
            if constexpr (C::kPassDq) {
                float* dq = static_cast<float*>(bp.dq) + b * bp.dq_batch_stride + s.h * bp.dq_head_stride +
                            (s.q_row0 + r) * bp.dq_row_stride + col;
                *reinterpret_cast<float4*>(dq) = a;
            } else {
                // dkv_partial: float32 partials of this head chunk; else the kv head's dK/dV (float32 too).
                const int head = bp.dkv_partial ? h0 / bp.heads_per_cta : s.h_kv;
                float* dk = static_cast<float*>(bp.dk) + b * bp.dk_batch_stride + head * bp.dk_head_stride +
                            (s.k_row0 + r) * bp.dk_row_stride + col;
                float* dv = static_cast<float*>(bp.dv) + b * bp.dv_batch_stride + head * bp.dv_head_stride +
                            (s.k_row0 + r) * bp.dv_row_stride + col;
                *reinterpret_cast<float4*>(dk) = a;
                if constexpr (C::kHeadDimV == C::kHeadDim)
                    *reinterpret_cast<float4*>(dv) =
                        make_float4(acc_2[x][k][0], acc_2[x][k][1], acc_2[x][k][2], acc_2[x][k][3]);
            }
        }
    }
}

}  // namespace cuflash

using Config = cuflash::BwdSimtConfig<CUFLASH_HEAD_DIM, CUFLASH_HEAD_DIM_V, CUFLASH_BLOCK_R, CUFLASH_BWD_PASS == 1, CUFLASH_SCORE_MODS,
                                      CUFLASH_DROPOUT != 0>;
#ifdef CUFLASH_SMEM_BYTES
static_assert(CUFLASH_SMEM_BYTES == Config::kSmemBytes, "shared memory size differs from cuflash/_heuristics.py");
#endif

extern "C" __global__ void __launch_bounds__(Config::kNThreads, CUFLASH_MIN_BLOCKS)
    cuflash_bwd_simt(const cuflash::BwdParams p) {
    if (cuflash::call_faulted(p.fwd.error)) return;
    cuflash::bwd_simt<Config>(p);
}

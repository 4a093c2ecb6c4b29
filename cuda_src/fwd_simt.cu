// Forward attention in float32 on the CUDA cores (FFMA), for float32 inputs on any GPU sm_80+.
//
// The same algorithm, score pipeline, tile order and dropout as fwd_sm80.cu, with the two matrix
// products written as register micro-tiles instead of mma fragments. One CTA computes kBlockM query
// rows of one (sequence, head); Q stays in shared memory, K and V tiles of kBlockN keys stream through
// one buffer each. Per key tile:  S = Q K^T  ->  score pipeline / masks  ->  online softmax (base 2)
// ->  P to shared memory  ->  O += P V.
//
// Thread tiling: the kBlockN / 4 threads that share a group of kThreadRows rows are adjacent lanes of
// one warp (row maxima and sums are warp shuffles). Thread t owns rows kThreadRows * (t / kThreadsPerRow)
// + r of the tile, keys 4 * (t % kThreadsPerRow) + c of each key tile (one float4 of P, one Philox
// block), and for its rows the float4 columns t % kThreadsPerRow + kThreadsPerRow * c of O. P goes
// through shared memory because a thread needs all kBlockN probabilities of its rows for O += P V but
// computed only 4 of them. With 64 x 32 tiles: 4 warps give 4 x 4 micro-tiles, 8 warps 2 x 4.
//
// Pipeline with one K and one V buffer: K of the next tile is fetched (cp.async) while this tile's
// softmax and P V run, V of the next tile while the next S = Q K^T runs.
//
// Compile-time configuration (set by cuflash/_heuristics.py, one module per combination):
//   CUFLASH_DTYPE 2 (float32), CUFLASH_HEAD_DIM (multiple of 32), CUFLASH_HEAD_DIM_V (v's and out's,
//   multiple of 32; default CUFLASH_HEAD_DIM), CUFLASH_BLOCK_M, CUFLASH_BLOCK_N,
//   CUFLASH_WARPS, CUFLASH_MIN_BLOCKS, CUFLASH_SCORE_MODS (bit mask, mask.cuh), CUFLASH_DROPOUT.
#include "common.cuh"
#include "params.cuh"
#include "fault.cuh"
#include "mask.cuh"
#include "mma_sm80.cuh"   // only its cp.async wrappers: 16-byte copies with zero fill
#include "philox.cuh"

#if CUFLASH_DTYPE != 2
#error "fwd_simt computes float32 (CUFLASH_DTYPE=2)"
#endif
#ifndef CUFLASH_HEAD_DIM_V
#define CUFLASH_HEAD_DIM_V CUFLASH_HEAD_DIM
#endif

namespace cuflash {

template <int kHeadDim_, int kHeadDimV_, int kBlockM_, int kBlockN_, int kNWarps_, int kMods_, bool kDropout_>
struct FwdSimtConfig {
    static constexpr int kHeadDim = kHeadDim_, kBlockM = kBlockM_, kBlockN = kBlockN_, kNWarps = kNWarps_;
    static constexpr int kHeadDimV = kHeadDimV_;   // columns of V and O
    static constexpr int kMods = kMods_;   // score modifiers compiled in (mask.cuh)
    static constexpr bool kScoreMods = kMods != 0, kDropout = kDropout_;
    static constexpr int kNThreads = 32 * kNWarps;
    static constexpr int kThreadKeys = 4;                       // keys of S per thread: one float4, one Philox block
    static constexpr int kThreadsPerRow = kBlockN / kThreadKeys;
    static constexpr int kRowGroups = kNThreads / kThreadsPerRow;
    static constexpr int kThreadRows = kBlockM / kRowGroups;    // rows of S and O per thread
    static constexpr int kOChunks = kHeadDimV / 4 / kThreadsPerRow;   // float4 columns of O per thread
    static constexpr int kSmemFloats = kBlockM * kHeadDim + kBlockN * kHeadDim + kBlockN * kHeadDimV + kBlockM * kBlockN;
    static_assert(kThreadsPerRow <= 32 && (kThreadsPerRow & (kThreadsPerRow - 1)) == 0,
                  "the threads of a row are a power-of-two group of lanes in one warp");
    static_assert(kRowGroups * kThreadRows == kBlockM && kThreadRows >= 1, "whole rows per thread");
    static_assert(kHeadDimV % (4 * kThreadsPerRow) == 0 && kHeadDim % 16 == 0 && kHeadDimV % 16 == 0,
                  "O columns split evenly");
    static_assert(kBlockM % (8 * kThreadRows) == 0 && kBlockN % 32 == 0, "copy patches of 8 rows");
};

// Q, K and P tiles are stored chunk-major: the float4 chunk kc of tile row R sits at chunk index
//   kc * kRows + (R % kGroup) * (kRows / kGroup) + R / kGroup,
// with kGroup the rows (keys) one thread owns. The threads that read one chunk of their rows in one
// instruction then touch consecutive chunks (no bank conflicts), and every address a thread reads is
// one per-thread base plus a compile-time offset. (An XOR swizzle would do the first, but its
// per-step offsets cost a register each once the compiler hoists them out of the key loop.)
template <int kRows, int kGroup>
__device__ __forceinline__ int chunk_major(int row, int chunk) {
    return chunk * kRows + (row % kGroup) * (kRows / kGroup) + row / kGroup;
}

__device__ __forceinline__ float4 load_float4(const float* smem) { return *reinterpret_cast<const float4*>(smem); }

// Copies a tile of kRows rows x kHeadDim floats from global to shared memory (cp.async), chunk-major
// (Q, K) or row-major (V); rows past `rows` and columns past `head_dim` (a multiple of 8) are
// zero-filled, not read. Per instruction a warp copies a patch of storage rows x chunks chosen so that
// it reads at least 64 contiguous bytes of each global row and its 32 shared-memory chunks cover the 8
// bank groups 4 times each. Warps form a grid over the patches, so a thread touches the same one or
// two rows at every step and its addresses are a row pointer plus compile-time column offsets.
template <int kRows, int kHeadDim, int kNWarps, bool kChunkMajor, int kGroup = 1>
__device__ __forceinline__ void load_tile(float* tile_smem, const float* gmem, long long row_stride, int row0,
                                          int rows, int head_dim) {
    constexpr int kPatchRows = kChunkMajor ? 8 : 4, kPatchChunks = 32 / kPatchRows;
    constexpr int kRowBlocks = kRows / kPatchRows, kColBlocks = kHeadDim / 4 / kPatchChunks;
    constexpr int kWarpRows = kNWarps < kRowBlocks ? kNWarps : kRowBlocks, kWarpCols = kNWarps / kWarpRows;
    static_assert(kRows % kPatchRows == 0 && (kHeadDim / 4) % kPatchChunks == 0, "whole patches");
    static_assert(kRowBlocks % kWarpRows == 0 && kNWarps % kWarpRows == 0, "power-of-two warps and row blocks");
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int warp_row = warp % kWarpRows, warp_col = warp / kWarpRows;
#pragma unroll
    for (int i = 0; i < kRowBlocks / kWarpRows; ++i) {
        const int slot = (warp_row + i * kWarpRows) * kPatchRows + lane / kPatchChunks;   // storage row
        const int r = kChunkMajor ? kGroup * (slot % (kRows / kGroup)) + slot / (kRows / kGroup) : slot;
        const bool row_valid = row0 + r < rows;
        const float* src_row = gmem + (row_valid ? (row0 + r) * row_stride : 0);
#pragma unroll
        for (int j = 0; j < ceil_div(kColBlocks, kWarpCols); ++j) {
            const int c = (warp_col + j * kWarpCols) * kPatchChunks + lane % kPatchChunks;
            if (kColBlocks % kWarpCols != 0 && c >= kHeadDim / 4) break;
            const bool valid = row_valid && 4 * c < head_dim;
            const int index = kChunkMajor ? c * kRows + slot : slot * (kHeadDim / 4) + c;
            cp_async_16(tile_smem + 4 * index, valid ? src_row + 4 * c : gmem, valid);
        }
    }
}

// The last key tile at or before n that block_mask leaves visible (n_first - 1 if none).
template <class C>
__device__ __forceinline__ int previous_visible_tile(const FwdParams& p, const SeqInfo& s, int n, int n_first,
                                                     int m_lo, int m_hi) {
    if constexpr ((C::kMods & kModBlockMask) != 0) {
        while (n >= n_first &&
               !block_mask_tile_visible(p, s, m_lo, m_hi, n * C::kBlockN, min((n + 1) * C::kBlockN, s.seqlen_k)))
            --n;
    }
    return n;
}

// Reductions over the kGroup adjacent lanes that share a row.
template <int kGroup>
__device__ __forceinline__ float group_max(float x) {
#pragma unroll
    for (int offset = 1; offset < kGroup; offset *= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
    return x;
}
template <int kGroup>
__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
    for (int offset = 1; offset < kGroup; offset *= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
    return x;
}

// Online softmax in base 2 over a thread's kRows x kCols slice of S; the same arithmetic as
// online_softmax.cuh (whose quad layout is the mma accumulator's), for rows shared by kGroup lanes.
template <int kRows, int kCols, int kGroup>
struct RowSoftmax {
    float m[kRows];   // running row maximum of s (log2 units)
    float l[kRows];   // running row sum of 2^(s - m), this thread's keys only

    __device__ __forceinline__ void init() {
#pragma unroll
        for (int r = 0; r < kRows; ++r) { m[r] = -CUFLASH_INF; l[r] = 0.f; }
    }

    // s holds scores in log2 units (-inf where masked); on return it holds p = 2^(s - m_new) and
    // correction[r] = 2^(m_old - m_new), by which the caller rescales its output accumulator.
    __device__ __forceinline__ void update(float (&s)[kRows][kCols], float (&correction)[kRows]) {
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
            float m_new = m[r];
#pragma unroll
            for (int c = 0; c < kCols; ++c) m_new = fmaxf(m_new, s[r][c]);
            m_new = group_max<kGroup>(m_new);
            // A row that has seen only masked keys keeps m = -inf; subtracting 0 instead makes its
            // p exactly 0 rather than NaN from (-inf) - (-inf).
            const float m_safe = m_new == -CUFLASH_INF ? 0.f : m_new;
            correction[r] = fast_exp2(m[r] - m_safe);
            m[r] = m_new;
            float sum = 0.f;
#pragma unroll
            for (int c = 0; c < kCols; ++c) {
                s[r][c] = fast_exp2(s[r][c] - m_safe);
                sum += s[r][c];
            }
            l[r] = l[r] * correction[r] + sum;
        }
    }

    // After the last tile: 1/l for normalising (0 for rows with no visible key, so they come out as 0)
    // and lse = ln(sum exp(s_natural)) (-inf for those rows). Every lane must call it (shuffles).
    // sink (natural units, -inf: none) joins the denominator as in OnlineSoftmax::finish
    // (online_softmax.cuh), against the larger of m and the sink; a row with no key gets lse = sink.
    __device__ __forceinline__ void finish(float (&inv_l)[kRows], float (&lse)[kRows], float sink) {
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
            const float row_sum = group_sum<kGroup>(l[r]);
            if (sink == -CUFLASH_INF) {
                inv_l[r] = row_sum == 0.f ? 0.f : 1.f / row_sum;
                lse[r] = row_sum == 0.f ? -CUFLASH_INF : (m[r] + log2f(row_sum)) * kLn2;
            } else {
                const float sink2 = sink * kLog2e, top = fmaxf(m[r], sink2);
                const float keys_part = exp2f(m[r] - top);   // 0 for a row with no key (m = -inf)
                const float total = fmaf(row_sum, keys_part, exp2f(sink2 - top));
                inv_l[r] = row_sum == 0.f ? 0.f : keys_part / total;
                lse[r] = row_sum == 0.f ? sink : (top + log2f(total)) * kLn2;
            }
        }
    }
};

template <class C>
__device__ __forceinline__ void fwd_simt(const FwdParams& p) {
    constexpr int kRows = C::kThreadRows, kKeys = C::kThreadKeys, kGroup = C::kThreadsPerRow;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    float* q_smem = reinterpret_cast<float*>(smem_raw);   // chunk-major, kBlockM rows x kHeadDim
    float* k_smem = q_smem + C::kBlockM * C::kHeadDim;     // chunk-major, kBlockN keys x kHeadDim
    float* v_smem = k_smem + C::kBlockN * C::kHeadDim;     // row-major [kBlockN][kHeadDimV]
    float* p_smem = v_smem + C::kBlockN * C::kHeadDimV;    // chunk-major, kBlockM rows x kBlockN

    const int m_block = gridDim.x - 1 - blockIdx.x;   // longest causal rows first
    const SeqInfo s = make_seq_info(p, blockIdx.z, blockIdx.y);
    const int m_lo = m_block * C::kBlockM;
    if (m_lo >= s.seqlen_q) return;                   // a short sequence of a varlen batch
    const int m_hi = min(m_lo + C::kBlockM, s.seqlen_q);

    int key_first, key_last;
    visible_keys(p, s, m_lo, m_hi, &key_first, &key_last);
    const int n_first = key_first / C::kBlockN;
    const int n_end = ceil_div(key_last, C::kBlockN);

    const float* q_gmem = static_cast<const float*>(p.q) + s.b * p.q_batch_stride + s.h * p.q_head_stride +
                          s.q_row0 * p.q_row_stride;
    const float* k_gmem = static_cast<const float*>(p.k) + s.b * p.k_batch_stride + s.h_kv * p.k_head_stride +
                          s.k_row0 * p.k_row_stride;
    const float* v_gmem = static_cast<const float*>(p.v) + s.b * p.v_batch_stride + s.h_kv * p.v_head_stride +
                          s.k_row0 * p.v_row_stride;

    // This thread's micro-tile: rows kRows * tg + r of the CTA's tile, keys kKeys * tc + c of each key
    // tile, and float4 columns tc + kGroup * c of O.
    const int tg = threadIdx.x / kGroup, tc = threadIdx.x % kGroup;
    const int row0 = kRows * tg, key0 = kKeys * tc;
    // Its operands in shared memory (chunk_major with the group sizes that make these offsets linear).
    auto q_chunk = [&](int r, int kc) { return q_smem + 4 * (kc * C::kBlockM + r * (C::kBlockM / kRows) + tg); };
    auto k_chunk = [&](int c, int kc) { return k_smem + 4 * (kc * C::kBlockN + c * (C::kBlockN / kKeys) + tc); };
    auto p_chunk = [&](int r, int jc) { return p_smem + 4 * (jc * C::kBlockM + r * (C::kBlockM / kRows) + tg); };
    auto v_chunk = [&](int j, int c) { return v_smem + 4 * (j * (C::kHeadDimV / 4) + tc + kGroup * c); };

    auto load_k = [&](int tile) {
        load_tile<C::kBlockN, C::kHeadDim, C::kNWarps, true, kKeys>(k_smem, k_gmem, p.k_row_stride,
                                                                    tile * C::kBlockN, s.seqlen_k, p.head_dim);
    };
    auto load_v = [&](int tile) {
        load_tile<C::kBlockN, C::kHeadDimV, C::kNWarps, false>(v_smem, v_gmem, p.v_row_stride, tile * C::kBlockN,
                                                               s.seqlen_k, p.head_dim_v);
    };

    // cp.async groups, always committed in pairs so that wait_group<1> means "all but the newest":
    // {Q, K(n)} {V(n)} before the loop, then {K(next)} and {V(next)} inside it (empty at the end).
    load_tile<C::kBlockM, C::kHeadDim, C::kNWarps, true, kRows>(q_smem, q_gmem, p.q_row_stride, m_lo, s.seqlen_q,
                                                                p.head_dim);
    int n = previous_visible_tile<C>(p, s, n_end - 1, n_first, m_lo, m_hi);
    if (n >= n_first) load_k(n);
    cp_async_commit();
    if (n >= n_first) load_v(n);
    cp_async_commit();

    float acc_o[kRows][C::kOChunks][4];
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
        for (int c = 0; c < C::kOChunks; ++c)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_o[r][c][e] = 0.f;
    RowSoftmax<kRows, kKeys, kGroup> softmax;
    softmax.init();

    while (n >= n_first) {
        const int n_next = previous_visible_tile<C>(p, s, n - 1, n_first, m_lo, m_hi);
        cp_async_wait<1>();
        __syncthreads();   // Q and K(n) have landed (V(n) may still be in flight)

        // S = Q K^T: kRows x 4 scores per thread, 4 head-dim columns per step.
        float acc_s[kRows][kKeys];
#pragma unroll
        for (int r = 0; r < kRows; ++r)
#pragma unroll
            for (int c = 0; c < kKeys; ++c) acc_s[r][c] = 0.f;
#pragma unroll
        for (int kc = 0; kc < C::kHeadDim / 4; ++kc) {
            float4 q[kRows], k[kKeys];
#pragma unroll
            for (int r = 0; r < kRows; ++r) q[r] = load_float4(q_chunk(r, kc));
#pragma unroll
            for (int c = 0; c < kKeys; ++c) k[c] = load_float4(k_chunk(c, kc));
#pragma unroll
            for (int r = 0; r < kRows; ++r)
#pragma unroll
                for (int c = 0; c < kKeys; ++c) {
                    acc_s[r][c] = fmaf(q[r].x, k[c].x, acc_s[r][c]);
                    acc_s[r][c] = fmaf(q[r].y, k[c].y, acc_s[r][c]);
                    acc_s[r][c] = fmaf(q[r].z, k[c].z, acc_s[r][c]);
                    acc_s[r][c] = fmaf(q[r].w, k[c].w, acc_s[r][c]);
                }
        }
        __syncthreads();   // every thread is done with K(n): fetch K(next) under the rest of this tile
        if (n_next >= n_first) load_k(n_next);
        cp_async_commit();

        // Scores in log2 units, -inf where hidden.
        const int n_lo = n * C::kBlockN;
        const bool need_mask = !tile_inside_window(p, s, m_lo, m_hi, n_lo, n_lo + C::kBlockN);
        if constexpr (C::kScoreMods) {
            int rows[kRows], cols[kKeys];
#pragma unroll
            for (int r = 0; r < kRows; ++r) rows[r] = m_lo + row0 + r;
#pragma unroll
            for (int c = 0; c < kKeys; ++c) cols[c] = n_lo + key0 + c;
            modify_scores<C::kMods>(p, s, rows, cols, [&](int r, int c) -> float& { return acc_s[r][c]; });
        } else {
#pragma unroll
            for (int r = 0; r < kRows; ++r)
#pragma unroll
                for (int c = 0; c < kKeys; ++c) {
                    const int i = m_lo + row0 + r;
                    const int j = n_lo + key0 + c;
                    float& x = acc_s[r][c];
                    x = (need_mask && !in_window(p, s, i, j)) ? -CUFLASH_INF : x * p.scale_log2;
                }
        }

        float correction[kRows];
        softmax.update(acc_s, correction);
#pragma unroll
        for (int r = 0; r < kRows; ++r)
#pragma unroll
            for (int c = 0; c < C::kOChunks; ++c)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc_o[r][c][e] *= correction[r];

        if (C::kDropout) {
            // The row sums above saw every p; only O loses the dropped ones (lse is pre-dropout).
            // The thread's keys n_lo + key0 + 0..3 are exactly one Philox block (key0 % 4 == 0).
#pragma unroll
            for (int r = 0; r < kRows; ++r) {
                const int i = m_lo + row0 + r;
                const uint4 w = dropout_words(dropout_key(p), s.b, s.h, i, (n_lo + key0) / 4, p.heads_q);
                if (w.x < p.dropout_threshold) acc_s[r][0] = 0.f;
                if (w.y < p.dropout_threshold) acc_s[r][1] = 0.f;
                if (w.z < p.dropout_threshold) acc_s[r][2] = 0.f;
                if (w.w < p.dropout_threshold) acc_s[r][3] = 0.f;
            }
        }

        // P to shared memory: the thread's 4 keys of a row are that row's chunk tc.
#pragma unroll
        for (int r = 0; r < kRows; ++r)
            *reinterpret_cast<float4*>(p_chunk(r, tc)) =
                make_float4(acc_s[r][0], acc_s[r][1], acc_s[r][2], acc_s[r][3]);
        cp_async_wait<1>();
        __syncthreads();   // V(n) has landed (K(next) may still be in flight) and all of P is written

        // O += P V: 4 keys per step; for each key, the thread's float4 columns of V.
#pragma unroll
        for (int jc = 0; jc < C::kBlockN / 4; ++jc) {
            float p_reg[kRows][4];
#pragma unroll
            for (int r = 0; r < kRows; ++r) {
                const float4 x = load_float4(p_chunk(r, jc));
                p_reg[r][0] = x.x; p_reg[r][1] = x.y; p_reg[r][2] = x.z; p_reg[r][3] = x.w;
            }
#pragma unroll
            for (int jj = 0; jj < 4; ++jj)
#pragma unroll
                for (int c = 0; c < C::kOChunks; ++c) {
                    const float4 v = load_float4(v_chunk(4 * jc + jj, c));
#pragma unroll
                    for (int r = 0; r < kRows; ++r) {
                        acc_o[r][c][0] = fmaf(p_reg[r][jj], v.x, acc_o[r][c][0]);
                        acc_o[r][c][1] = fmaf(p_reg[r][jj], v.y, acc_o[r][c][1]);
                        acc_o[r][c][2] = fmaf(p_reg[r][jj], v.z, acc_o[r][c][2]);
                        acc_o[r][c][3] = fmaf(p_reg[r][jj], v.w, acc_o[r][c][3]);
                    }
                }
        }
        __syncthreads();   // every thread is done with V(n) and P: fetch V(next)
        if (n_next >= n_first) load_v(n_next);
        cp_async_commit();
        n = n_next;
    }
    cp_async_wait<0>();   // with no visible tile, Q's copy is still outstanding; never exit under it

    // out = O / l (times 1/(1-p) under dropout), l with the head's sink; lse per row.
    float inv_l[kRows], lse[kRows];
    softmax.finish(inv_l, lse, p.sinks != nullptr ? p.sinks[s.h] : -CUFLASH_INF);
    float* o_gmem = static_cast<float*>(p.o) + s.b * p.o_batch_stride + s.h * p.o_head_stride +
                    s.q_row0 * p.o_row_stride;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
        const int i = m_lo + row0 + r;
        if (i >= s.seqlen_q) continue;
        // A row that saw no key is exactly 0 (0 * NaN from masked values must not reach it).
        const float factor = C::kDropout ? inv_l[r] * p.dropout_rescale : inv_l[r];
        const bool no_keys = inv_l[r] == 0.f;
        float* row = o_gmem + i * p.o_row_stride;
#pragma unroll
        for (int c = 0; c < C::kOChunks; ++c) {
            const int col = 4 * (tc + kGroup * c);
            if (col < p.head_dim_v)
                *reinterpret_cast<float4*>(row + col) =
                    no_keys ? make_float4(0.f, 0.f, 0.f, 0.f)
                            : make_float4(acc_o[r][c][0] * factor, acc_o[r][c][1] * factor, acc_o[r][c][2] * factor,
                                          acc_o[r][c][3] * factor);
        }
        if (tc == 0) p.lse[s.b * p.lse_batch_stride + s.h * p.lse_head_stride + s.q_row0 + i] = lse[r];
    }
}

}  // namespace cuflash

using Config = cuflash::FwdSimtConfig<CUFLASH_HEAD_DIM, CUFLASH_HEAD_DIM_V, CUFLASH_BLOCK_M, CUFLASH_BLOCK_N, CUFLASH_WARPS,
                                      CUFLASH_SCORE_MODS, CUFLASH_DROPOUT != 0>;
#ifdef CUFLASH_SMEM_BYTES
static_assert(CUFLASH_SMEM_BYTES == Config::kSmemFloats * sizeof(float),
              "shared memory size differs from cuflash/_heuristics.py");
#endif

extern "C" __global__ void __launch_bounds__(Config::kNThreads, CUFLASH_MIN_BLOCKS)
    cuflash_fwd_simt(const cuflash::FwdParams p) {
    if (cuflash::call_faulted(p.error)) return;
    cuflash::fwd_simt<Config>(p);
}

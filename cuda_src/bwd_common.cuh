// What every backward kernel family shares: the gradient of one score element and the walk over
// the tiles a CTA visits.
//
// Per row i and key j, with s the final score in natural units and P = exp(s - lse):
//   dV_j  += Pdrop_ij dO_i                       Pdrop = P * keep / (1 - p)   (P without dropout)
//   dP_ij  = dO_i . V_j  (* keep / (1 - p))
//   dS_ij  = P_ij (dP_ij - D_i)                  D_i = rowsum(dO_i * O_i)  (bwd_preprocess.cu)
//   dX_ij  = dS_ij * ds/dx                       x = scale * q.k; only the softcap bends s(x)
//   dQ_i  += scale * dX_ij K_j,   dK_j += scale * dX_ij Q_i,   dbias_ij = dS_ij
// Masked elements (and rows that see no key, whose lse2 is +inf) get P = 0 and dS = 0 exactly,
// whatever dP is there, so a NaN or Inf that the forward never saw cannot reach a gradient
// through 0 * NaN in this step.
#pragma once
#include "common.cuh"
#include "params.cuh"
#include "bwd_params.cuh"
#include "mask.cuh"
#include "philox.cuh"

namespace cuflash {

// Index of row i of (sequence b, query head h) in the lse2 / dsum buffers (padded rows per head).
__device__ __forceinline__ long long bwd_row_index(const BwdParams& bp, int b, int h, int i) {
    return (static_cast<long long>(b) * bp.fwd.heads_q + h) * bp.seqlen_q_pad + i;
}

// The Philox word of element (i, j) of the sequence/head in s (cuda_src/philox.cuh's formula).
__device__ __forceinline__ unsigned dropout_word(const FwdParams& p, const SeqInfo& s, int i, int j) {
    const uint4 w = dropout_words(p.dropout_seed, p.dropout_offset, s.b, s.h, i, j >> 2, p.heads_q);
    const int r = j & 3;
    return r == 0 ? w.x : r == 1 ? w.y : r == 2 ? w.z : w.w;
}

// One element's share of the backward.
//   qk      raw q_i . k_j; without score modifiers (kMods == 0) already -inf where the window or the
//           key tail hides (i, j);
//   score2  with them, the element's score in log2 units from modify_scores (mask.cuh), -inf where
//           hidden (qk is then raw: the softcap's derivative needs it); ignored without;
//   dp      raw dO_i . v_j;   lse2 / dsum  the row's lse * log2(e) and D_i
//   word    the element's Philox word (dropout_word), used only when kDropout
// Outputs: pd = Pdrop (what multiplied v_j in the forward), ds = dL/ds (for dbias), dx = dL/dx.
template <int kMods, bool kDropout>
__device__ __forceinline__ void score_grad(const FwdParams& p, float qk, float score2, float dp, float lse2,
                                           float dsum, unsigned word, float* pd, float* ds, float* dx) {
    float prob;
    if constexpr (kMods != 0) {
        prob = fast_exp2(score2 - lse2);
    } else {
        prob = fast_exp2(fmaf(qk, p.scale_log2, -lse2));   // -inf (masked) -> 0
    }
    float dp_kept = dp, p_kept = prob;
    if constexpr (kDropout) {
        const bool keep = dropout_keeps(word, p.dropout_threshold);
        dp_kept = keep ? dp * p.dropout_rescale : 0.f;
        p_kept = keep ? prob * p.dropout_rescale : 0.f;
    }
    const float grad = prob == 0.f ? 0.f : prob * (dp_kept - dsum);
    *pd = p_kept;
    *ds = grad;
    *dx = (kMods & kModSoftcap) ? grad * softcap_grad(p, qk) : grad;
}

// dst[0..1] += (a, b) and dst[0..3] += v with float32 atomics: one vector reduction on sm_90 (dst
// 8- / 16-byte aligned), scalar atomics before.
__device__ __forceinline__ void atomic_add2(float* dst, float a, float b) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(dst), "f"(a), "f"(b) : "memory");
#else
    atomicAdd(dst, a);
    atomicAdd(dst + 1, b);
#endif
}
__device__ __forceinline__ void atomic_add4(float* dst, float4 v) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w)
                 : "memory");
#else
    atomicAdd(dst, v.x);
    atomicAdd(dst + 1, v.y);
    atomicAdd(dst + 2, v.z);
    atomicAdd(dst + 3, v.w);
#endif
}

// Dropout words of the 4 elements of one 16x8 accumulator tile, element e at row g + 8 (e / 2) and
// column 2t + e % 2 (mma C layout).
//
// Pass 1 (rows = queries i0 + {0, 8}, columns = keys j0 + {0, 1}, j0 even): both columns of a row
// lie in one Philox block, so two blocks per tile.
__device__ __forceinline__ void dropout_words_rows(const FwdParams& p, const SeqInfo& s, int i0, int j0,
                                                   unsigned (&word)[4]) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const uint4 w = dropout_words(p.dropout_seed, p.dropout_offset, s.b, s.h, i0 + 8 * half, j0 >> 2, p.heads_q);
        word[2 * half] = (j0 & 2) ? w.z : w.x;
        word[2 * half + 1] = (j0 & 2) ? w.w : w.y;
    }
}

// Pass 0 (rows = keys j0 + {0, 8}, columns = queries i0 + {0, 1}; j0 = first key + g): the four
// elements lie in four Philox blocks (query, keys / 4), each needing word g % 4 of it. The four lanes
// that share t and g / 4 need the same four blocks, so each computes one (block r = g % 4: query
// i0 + r % 2, keys + 8 (r / 2)) and in round x sends word r ^ x to the lane r ^ x: Philox runs once
// per tile and thread instead of four times.
__device__ __forceinline__ void dropout_words_cols(const FwdParams& p, const SeqInfo& s, int i0, int j0, int lane,
                                                   unsigned (&word)[4]) {
    const int r = (lane >> 2) & 3;
    const int block_key = j0 - r + 8 * (r >> 1);   // first key of this lane's block (a multiple of 4)
    const uint4 w = dropout_words(p.dropout_seed, p.dropout_offset, s.b, s.h, i0 + (r & 1), block_key >> 2,
                                  p.heads_q);
    unsigned got[4];   // got[x]: word r of block r ^ x
#pragma unroll
    for (int x = 0; x < 4; ++x) {
        const int index = r ^ x;
        const unsigned send = (index & 2) ? ((index & 1) ? w.w : w.z) : ((index & 1) ? w.y : w.x);
        got[x] = x == 0 ? send : __shfl_xor_sync(0xffffffffu, send, x << 2);
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {   // element e lies in block e (query + e % 2, keys + 8 (e / 2))
        const int x = r ^ e;
        word[e] = (x & 2) ? ((x & 1) ? got[3] : got[2]) : ((x & 1) ? got[1] : got[0]);
    }
}

// Where dK (already scaled) and dV of key row r (inside the sequence) of the kv head of s go: dk/dv
// in the element type Elem (16-bit), or, when the host split the GQA group over CTAs (dkv_partial),
// the float32 partial sums of the CTA's head chunk (chunk = first query head / heads_per_cta, which is
// the dK/dV pass's blockIdx.y). The row's addresses are computed once; store() writes columns col and
// col + 1.
template <class Elem>
struct DkDvRow {
    char* dk;
    char* dv;
    bool partial;

    __device__ __forceinline__ DkDvRow(const BwdParams& bp, const SeqInfo& s, int chunk, int r) {
        partial = bp.dkv_partial != 0;
        const int head = partial ? chunk : s.h_kv;
        const int bytes = partial ? 4 : 2;
        dk = static_cast<char*>(bp.dk) +
             bytes * (s.b * bp.dk_batch_stride + head * bp.dk_head_stride + (s.k_row0 + r) * bp.dk_row_stride);
        dv = static_cast<char*>(bp.dv) +
             bytes * (s.b * bp.dv_batch_stride + head * bp.dv_head_stride + (s.k_row0 + r) * bp.dv_row_stride);
    }
    __device__ __forceinline__ void store(int col, float dk0, float dk1, float dv0, float dv1) const {
        if (partial) {
            *reinterpret_cast<float2*>(dk + 4 * col) = make_float2(dk0, dk1);
            *reinterpret_cast<float2*>(dv + 4 * col) = make_float2(dv0, dv1);
        } else {
            *reinterpret_cast<unsigned*>(dk + 2 * col) = pack2<Elem>(dk0, dk1);
            *reinterpret_cast<unsigned*>(dv + 2 * col) = pack2<Elem>(dv0, dv1);
        }
    }
};

// Advances (hh, c) to the next tile of a CTA's walk: C tiles c_begin .. c_end - 1 for each of the
// query heads h0 .. h0 + heads - 1 in turn, skipping tiles that block_mask hides. Rows (the tile
// the CTA keeps) are keys when kKeysAreRows (the dK/dV pass), else queries. Returns false past the
// end. Every thread of the CTA must call it: block_mask_tile_visible ends in a barrier.
template <int kBlockC, int kMods, bool kKeysAreRows>
__device__ __forceinline__ bool next_tile(const FwdParams& p, SeqInfo s, int h0, int heads, int r_lo, int r_hi,
                                          int c_begin, int c_end, int& hh, int& c) {
    if (c_begin >= c_end) return false;
    while (true) {
        if (++c >= c_end) {
            c = c_begin;
            if (++hh >= heads) return false;
        }
        if constexpr ((kMods & kModBlockMask) == 0) return true;
        s.h = h0 + hh;
        const int c_lo = c * kBlockC;
        const int c_hi = min(c_lo + kBlockC, kKeysAreRows ? s.seqlen_q : s.seqlen_k);
        const bool visible = kKeysAreRows ? block_mask_tile_visible(p, s, c_lo, c_hi, r_lo, r_hi)
                                          : block_mask_tile_visible(p, s, r_lo, r_hi, c_lo, c_hi);
        if (visible) return true;
    }
}

}  // namespace cuflash

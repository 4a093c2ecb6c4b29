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

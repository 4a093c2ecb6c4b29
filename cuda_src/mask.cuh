// Which scores exist and what they are: the score pipeline of docs/design.md §2, shared by every kernel
// family so that the semantics cannot drift between them.
//
//   s = scale * q.k;  softcap c > 0: s = c * tanh(s / c);  s -= slope * |i + Sk - Sq - j|;  s += bias;
//   s = score_mod(s, b, h, i, j) (a user ScoreMod);
//   then s = -inf where a mask hides (i, j): window (causal is window_right = 0), tails, mask, block_mask,
//   a user MaskMod.
//
// Rows i and keys j are positions inside one sequence (varlen: relative to cu_seqlens[b]).
//
// Which modifiers a kernel variant compiles is the bit mask CUFLASH_SCORE_MODS (kMods below): the
// code of a modifier whose bit is clear is left out and its run-time argument never read, so that a
// softcap-only call does not compile (nor wait for) the bias, mask and block-mask paths. A variant
// with several bits set still tests each argument at run time (nullptr / softcap 0: not applied).
#pragma once
#include "common.cuh"
#include "params.cuh"

namespace cuflash {

// One (sequence, query head) problem as a CTA sees it.
struct SeqInfo {
    int b, h, h_kv;
    int seqlen_q, seqlen_k;
    int q_row0, k_row0;   // first row of this sequence in q / k (varlen), else 0
    int diag;             // Sk - Sq: query i lines up with key i + diag (bottom-right alignment)
};

__device__ __forceinline__ SeqInfo make_seq_info(const FwdParams& p, int b, int h) {
    SeqInfo s;
    s.b = b;
    s.h = h;
    s.h_kv = h / (p.heads_q / p.heads_k);
    if (p.cu_seqlens_q != nullptr) {
        s.q_row0 = p.cu_seqlens_q[b];
        s.k_row0 = p.cu_seqlens_k[b];
        s.seqlen_q = p.cu_seqlens_q[b + 1] - s.q_row0;
        s.seqlen_k = p.cu_seqlens_k[b + 1] - s.k_row0;
    } else {
        s.q_row0 = s.k_row0 = 0;
        s.seqlen_q = p.seqlen_q;
        s.seqlen_k = p.seqlen_k;
    }
    s.diag = s.seqlen_k - s.seqlen_q;
    return s;
}

// Keys [first, last) that the window and the sequence end leave visible to query rows [m_lo, m_hi).
__device__ __forceinline__ void visible_keys(const FwdParams& p, const SeqInfo& s, int m_lo, int m_hi,
                                             int* first, int* last) {
    int lo = 0, hi = s.seqlen_k;
    if (p.window_left >= 0) lo = max(lo, m_lo + s.diag - p.window_left);
    if (p.window_right >= 0) hi = min(hi, m_hi - 1 + s.diag + p.window_right + 1);
    *first = lo;
    *last = max(hi, lo);
}

// Query rows [first, last) that the window leaves some key of [n_lo, n_hi) visible to: the
// mirror of visible_keys, for a CTA that owns keys and walks over queries.
__device__ __forceinline__ void visible_queries(const FwdParams& p, const SeqInfo& s, int n_lo, int n_hi,
                                                int* first, int* last) {
    int lo = 0, hi = s.seqlen_q;
    // j <= i + diag + right  <=>  i >= j - diag - right;  j >= i + diag - left  <=>  i <= j - diag + left.
    if (p.window_right >= 0) lo = max(lo, n_lo - s.diag - p.window_right);
    if (p.window_left >= 0) hi = min(hi, n_hi - 1 - s.diag + p.window_left + 1);
    *first = lo;
    *last = max(hi, lo);
}

__device__ __forceinline__ bool in_window(const FwdParams& p, const SeqInfo& s, int i, int j) {
    const int center = i + s.diag;
    return j < s.seqlen_k && (p.window_left < 0 || j >= center - p.window_left) &&
           (p.window_right < 0 || j <= center + p.window_right);
}

// True when no element of the tile [m_lo, m_hi) x [n_lo, n_hi) is hidden by the window or the key
// tail, so the kernel can skip per-element masking there (most tiles of a long causal problem).
__device__ __forceinline__ bool tile_inside_window(const FwdParams& p, const SeqInfo& s, int m_lo, int m_hi,
                                                   int n_lo, int n_hi) {
    if (n_hi > s.seqlen_k) return false;
    if (p.window_right >= 0 && n_hi - 1 > m_lo + s.diag + p.window_right) return false;
    if (p.window_left >= 0 && n_lo < m_hi - 1 + s.diag - p.window_left) return false;
    return true;
}

// Score-modifier bits of CUFLASH_SCORE_MODS (cuflash/_heuristics.py SCORE_MODS has the same order).
// An enum, not constexpr ints: those became globals of every module (symbols, constant bank entries).
// kModUserScore / kModUserMask: the call's ScoreMod / MaskMod, whose functions the variant's source
// defines (user_mod.cuh); not among kAllMods, the built-in ones a variant may compile without a call.
enum ScoreMod : int { kModSoftcap = 1, kModAlibi = 2, kModBias = 4, kModMask = 8, kModBlockMask = 16,
                      kAllMods = kModSoftcap | kModAlibi | kModBias | kModMask | kModBlockMask,
                      kModUserScore = 32, kModUserMask = 64 };

// 2 log2(e) / c: what softcap_tanh multiplies its argument by (one division per tile, not per element).
__device__ __forceinline__ float softcap_rate(const FwdParams& p) { return 2.f * kLog2e / p.softcap; }

// (1 - tanh(x / c)) / 2 = 1 / (2^(x rate) + 1), rate = softcap_rate: softcap_tanh's ex2 and rcp, for a
// caller that scales the tanh anyway (fwd_sm90's cap_scores_log2: c tanh in one FFMA from it).
__device__ __forceinline__ float softcap_tanh_rest(float x, float rate) {
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(fast_exp2(x * rate) + 1.f));
    return r;
}

// tanh(x / c) as 1 - 2 / (2^(x rate) + 1), rate = softcap_rate: a multiply, two MUFU operations (ex2,
// rcp) and an FMA, where tanhf(x / c) took a division and ~20 instructions, at every element of a
// softcapped tile, forward and backward (docs/decisions.md#softcap-tanh-from-ex2). Its absolute error
// is a few 1e-7 (ex2.approx and rcp.approx are within about an ulp, then one rounding), so the score
// c tanh is off by c times that at most; near 0 its relative error grows (1 - 2 / (2 + 2y) cancels),
// which a score beside the others in a softmax does not feel. Infinities give +-1, NaN stays NaN.
__device__ __forceinline__ float softcap_tanh(float x, float rate) {
    return fmaf(-2.f, softcap_tanh_rest(x, rate), 1.f);
}

// d s / d x of the softcap at x = scale * qk (s = c tanh(x / c) gives 1 - tanh^2(x / c)); ALiBi and bias
// are additive constants. The tanh is the same expression as in modified_score, so the two agree bit for bit.
__device__ __forceinline__ float softcap_grad(const FwdParams& p, float qk) {
    if (p.softcap <= 0.f) return 1.f;
    const float t = softcap_tanh(qk * p.scale, softcap_rate(p));
    return 1.f - t * t;
}

// The same factor from the element's P and its row's lse2 (log2 units), for a backward that keeps P in
// place of the raw score (bwd_sm90's softcap alone): P = 2^(c tanh log2(e) - lse2), so tanh = (log2(P) +
// lse2) ln(2) / c, clamped to [-1, 1] (P = 0 gives -1 and a factor of 0). The score's error in log2
// units is that of ex2 and lg2 plus a rounding of lse2's size (~1e-6), so the factor's is ~1e-6 / c
// beside softcap_grad's few 1e-7.
__device__ __forceinline__ float softcap_grad_from_prob(const FwdParams& p, float prob, float lse2) {
    const float t = fminf(fmaxf((fast_log2(prob) + lse2) * (kLn2 / p.softcap), -1.f), 1.f);
    return fmaf(-t, t, 1.f);
}

// The full pipeline for one element in natural units; qk is the raw dot product q_i . k_j. Only the
// modifiers of kMods are compiled.
template <int kMods = kAllMods>
__device__ __forceinline__ float modified_score(const FwdParams& p, const SeqInfo& s, float qk, int i, int j) {
    if (!in_window(p, s, i, j)) return -CUFLASH_INF;
    float x = qk * p.scale;
    if ((kMods & kModSoftcap) && p.softcap > 0.f) x = p.softcap * softcap_tanh(x, softcap_rate(p));
    if ((kMods & kModAlibi) && p.alibi_slopes != nullptr)
        x -= p.alibi_slopes[s.b * p.alibi_batch_stride + s.h] * fabsf(float(i + s.diag - j));
    if ((kMods & kModBias) && p.bias != nullptr)
        x += load_as_float(p.bias, s.b * p.bias_batch_stride + s.h * p.bias_head_stride +
                                       i * p.bias_row_stride + j * p.bias_col_stride, p.bias_dtype);
    if constexpr ((kMods & kModUserScore) != 0) x = user_score_mod(x, s.b, s.h, i, j, p.user);
    if constexpr ((kMods & kModUserMask) != 0)
        if (!user_mask_mod(s.b, s.h, i, j, p.user)) return -CUFLASH_INF;
    if ((kMods & kModMask) && p.mask != nullptr &&
        !p.mask[s.b * p.mask_batch_stride + s.h * p.mask_head_stride + i * p.mask_row_stride +
                j * p.mask_col_stride])
        return -CUFLASH_INF;
    if ((kMods & kModBlockMask) && p.block_mask != nullptr &&
        !p.block_mask[s.b * p.block_mask_batch_stride + s.h * p.block_mask_head_stride +
                      (i / p.block_q) * p.block_mask_row_stride + (j / p.block_k) * p.block_mask_col_stride])
        return -CUFLASH_INF;
    return x;
}

// The answers of the MaskMod a block mask was derived from, from the bits beside it
// (FwdParams::mask_bits_offset): x(r, c) = -inf where visible(r, c) and the element's bit is 0. Each
// element's word is read at clamped positions, so that rows past the queries' end and keys past the
// keys' end read inside the bits (their answer is not taken), and the reads go out together.
template <bool kKeysAreRows, int kRows, int kCols, class At, class Visible>
__device__ __forceinline__ void hide_by_mask_bits(const FwdParams& p, const SeqInfo& s, const int (&rows)[kRows],
                                                  const int (&cols)[kCols], At&& x, Visible&& visible) {
    const unsigned* bits = reinterpret_cast<const unsigned*>(p.block_mask + p.mask_bits_offset) +
                           s.b * p.mask_bits_batch_stride + s.h * p.mask_bits_head_stride;
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
        for (int c = 0; c < kCols; ++c) {
            const int i = kKeysAreRows ? cols[c] : rows[r], j = kKeysAreRows ? rows[r] : cols[c];
            const unsigned word =
                __ldg(bits + min(i, s.seqlen_q - 1) * p.mask_bits_row_stride + (min(j, s.seqlen_k - 1) >> 5));
            if (visible(r, c) && ((word >> (j & 31)) & 1u) == 0u) x(r, c) = -CUFLASH_INF;
        }
}

// The masks of kMods (a user MaskMod, mask, block_mask) on a thread's grid of elements, as in
// modify_scores: x(r, c) = -inf where one hides the element; elements where visible(r, c) is false are
// neither read nor changed (their indices may lie past the arrays' ends). blocks_whole: the tile's
// blocks of block_mask say that neither it nor the MaskMod hides any element of the tile
// (block_mask_tile_state), so neither is read. kMaskEverywhere: the MaskMod is evaluated at every
// element, visible or not (its reads give 0 outside their arrays), so that a row's and a column's
// reads are shared by the elements that make them and go out together; guarded by visibility, each
// element waits for its own. The shared reads take registers: fwd_sm90's mask-only tiles and
// bwd_sm90's featured ones have them; fwd_sm90 with a ScoreMod beside and the sm80 families spilled
// 20-76 B (NVRTC 13, the CI's document MaskMod). kBitsHere false: the caller reads a MaskMod's bits
// beside a derived block mask itself, from its own layout of the elements (fwd_sm90, bwd_sm90).
template <int kMods, int kRows, int kCols, bool kKeysAreRows, bool kMaskEverywhere = false, bool kBitsHere = true,
          class At, class Visible>
__device__ __forceinline__ void hide_scores(const FwdParams& p, const SeqInfo& s, const int (&rows)[kRows],
                                            const int (&cols)[kCols], At&& x, Visible&& visible,
                                            bool blocks_whole = false) {
    auto strides = [](long long query_stride, long long key_stride) {
        return kKeysAreRows ? make_longlong2(key_stride, query_stride) : make_longlong2(query_stride, key_stride);
    };
    if constexpr ((kMods & kModUserMask) != 0) {
        if (!blocks_whole) {
#pragma unroll
            for (int r = 0; r < kRows; ++r)
#pragma unroll
                for (int c = 0; c < kCols; ++c) {
                    const int i = kKeysAreRows ? cols[c] : rows[r], j = kKeysAreRows ? rows[r] : cols[c];
                    if constexpr (kMaskEverywhere) {
                        const bool attends = user_mask_mod(s.b, s.h, i, j, p.user);
                        if (visible(r, c) && !attends) x(r, c) = -CUFLASH_INF;
                    } else {
                        if (visible(r, c) && !user_mask_mod(s.b, s.h, i, j, p.user)) x(r, c) = -CUFLASH_INF;
                    }
                }
        }
    }
    if constexpr ((kMods & kModMask) != 0) {
        if (p.mask != nullptr) {
            const longlong2 stride = strides(p.mask_row_stride, p.mask_col_stride);
            long long row_off[kRows];
#pragma unroll
            for (int r = 0; r < kRows; ++r)
                row_off[r] = s.b * p.mask_batch_stride + s.h * p.mask_head_stride + rows[r] * stride.x;
#pragma unroll
            for (int c = 0; c < kCols; ++c) {
                const long long col_off = cols[c] * stride.y;
#pragma unroll
                for (int r = 0; r < kRows; ++r)
                    if (visible(r, c) && !p.mask[row_off[r] + col_off]) x(r, c) = -CUFLASH_INF;
            }
        }
    }
    if constexpr ((kMods & kModBlockMask) != 0) {
        // The MaskMod's bits come with a derived block mask alone (cuflash/_mask_blocks.py): beside
        // other modifiers the block mask variants' registers have no room for their reads.
        if (kMods == kModBlockMask && kBitsHere && p.block_mask != nullptr && !blocks_whole &&
            p.mask_bits_offset != 0) {
            hide_by_mask_bits<kKeysAreRows>(p, s, rows, cols, x, visible);
        } else if (p.block_mask != nullptr && !blocks_whole) {
            const longlong2 stride = strides(p.block_mask_row_stride, p.block_mask_col_stride);
            const int row_block = kKeysAreRows ? p.block_k : p.block_q, col_block = kKeysAreRows ? p.block_q : p.block_k;
            long long row_off[kRows];
#pragma unroll
            for (int r = 0; r < kRows; ++r)
                row_off[r] = s.b * p.block_mask_batch_stride + s.h * p.block_mask_head_stride +
                             (rows[r] / row_block) * stride.x;
#pragma unroll
            for (int c = 0; c < kCols; ++c) {
                const long long col_off = (cols[c] / col_block) * stride.y;
#pragma unroll
                for (int r = 0; r < kRows; ++r)
                    if (visible(r, c) && !p.block_mask[row_off[r] + col_off]) x(r, c) = -CUFLASH_INF;
            }
        }
    }
}

// modified_score for a thread's grid of kRows rows x kCols columns at once (rows[r], cols[c]; x(r, c)
// is the element's raw q.k in, its score in log2 units out, -inf where hidden, positions past the
// sequence's end included). The rows are queries and the columns keys, or the other way round when
// kKeysAreRows (a backward CTA that keeps keys: each row's bounds are then the queries that see its
// key). Same arithmetic as modified_score, element for element, but one modifier at a time over the
// whole grid: each run-time test (softcap > 0, a pointer) is one branch per tile rather than one per
// element, the bias dtype two passes rather than a switch per element, the row part of every index
// is computed once per row, and the loads are predicated on visibility instead of branched around.
// Fully unrolled, the per-element form was a maze of branches that took ptxas 30-45 s per fwd_sm90
// variant (and spilled at D = 128 and 256).
//
// The backward passes ``chain`` too: chain(r, c) holds the element's raw q.k on entry and, in a variant
// with a user ScoreMod, d s / d (scale q.k) on return (the softcap's derivative times the ScoreMod's
// grad at its input, 0 where not visible): the raw q.k served only the softcap's derivative, and the
// ScoreMod's input (after softcap, ALiBi and bias) is gone once it has run, so its grad is taken here.
// Without a user ScoreMod, chain is left alone. The forward passes none (kChain false).
// kMaskEverywhere, kBitsHere: as in hide_scores.
template <int kMods, int kRows, int kCols, bool kKeysAreRows = false, bool kChain = true,
          bool kMaskEverywhere = false, bool kBitsHere = true, class At, class Chain>
__device__ __forceinline__ void modify_scores(const FwdParams& p, const SeqInfo& s, const int (&rows)[kRows],
                                              const int (&cols)[kCols], At&& x, Chain&& chain,
                                              bool blocks_whole = false) {
    // Visible columns of each row: [first, last) (window and sequence ends), none past the last row.
    int first[kRows], last[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
        if constexpr (kKeysAreRows) {
            visible_queries(p, s, rows[r], rows[r] + 1, &first[r], &last[r]);
            if (rows[r] >= s.seqlen_k) last[r] = first[r];
        } else {
            visible_keys(p, s, rows[r], rows[r] + 1, &first[r], &last[r]);
            if (rows[r] >= s.seqlen_q) last[r] = first[r];
        }
    }
    // Index strides of a row and of a column in a [query][key] argument (bias, mask, block_mask).
    auto strides = [](long long query_stride, long long key_stride) {
        return kKeysAreRows ? make_longlong2(key_stride, query_stride) : make_longlong2(query_stride, key_stride);
    };
    auto visible = [&](int r, int c) { return cols[c] >= first[r] && cols[c] < last[r]; };
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
        for (int c = 0; c < kCols; ++c) x(r, c) *= p.scale;
    if constexpr ((kMods & kModSoftcap) != 0) {
        if (p.softcap > 0.f) {
            const float rate = softcap_rate(p);
#pragma unroll
            for (int r = 0; r < kRows; ++r)
#pragma unroll
                for (int c = 0; c < kCols; ++c) x(r, c) = p.softcap * softcap_tanh(x(r, c), rate);
        }
    }
    if constexpr ((kMods & kModAlibi) != 0) {
        if (p.alibi_slopes != nullptr) {
            const float slope = p.alibi_slopes[s.b * p.alibi_batch_stride + s.h];
#pragma unroll
            for (int r = 0; r < kRows; ++r)
#pragma unroll
                for (int c = 0; c < kCols; ++c) {
                    const int i = kKeysAreRows ? cols[c] : rows[r], j = kKeysAreRows ? rows[r] : cols[c];
                    x(r, c) -= slope * fabsf(float(i + s.diag - j));
                }
        }
    }
    if constexpr ((kMods & kModBias) != 0) {
        if (p.bias != nullptr) {
            const longlong2 stride = strides(p.bias_row_stride, p.bias_col_stride);
            long long row_off[kRows];
#pragma unroll
            for (int r = 0; r < kRows; ++r)
                row_off[r] = s.b * p.bias_batch_stride + s.h * p.bias_head_stride + rows[r] * stride.x;
            // float32 in one pass, float16 and bfloat16 in another (one 16-bit load, two conversions).
            if (p.bias_dtype == kFloat32) {
                const float* bias = static_cast<const float*>(p.bias);
#pragma unroll
                for (int c = 0; c < kCols; ++c) {
                    const long long col_off = cols[c] * stride.y;
#pragma unroll
                    for (int r = 0; r < kRows; ++r)
                        if (visible(r, c)) x(r, c) += bias[row_off[r] + col_off];
                }
            } else {
                const unsigned short* bias = static_cast<const unsigned short*>(p.bias);
                const bool is_half = p.bias_dtype == kFloat16;
#pragma unroll
                for (int c = 0; c < kCols; ++c) {
                    const long long col_off = cols[c] * stride.y;
#pragma unroll
                    for (int r = 0; r < kRows; ++r)
                        if (visible(r, c)) {
                            const unsigned short bits = bias[row_off[r] + col_off];
                            x(r, c) += is_half ? to_float(half_t{bits}) : to_float(bfloat16_t{bits});
                        }
                }
            }
        }
    }
    // The user ScoreMod, on the score after softcap, ALiBi and bias (docs/design.md §2b), every element
    // (its array reads are bounds-checked; what it gives where not visible is replaced by -inf below).
    if constexpr ((kMods & kModUserScore) != 0) {
#pragma unroll
        for (int r = 0; r < kRows; ++r)
#pragma unroll
            for (int c = 0; c < kCols; ++c) {
                const int i = kKeysAreRows ? cols[c] : rows[r], j = kKeysAreRows ? rows[r] : cols[c];
                const float input = x(r, c);
                if constexpr (kChain) {
                    const float cap = (kMods & kModSoftcap) ? softcap_grad(p, chain(r, c)) : 1.f;
                    chain(r, c) = visible(r, c) ? cap * user_score_mod_grad(input, s.b, s.h, i, j, p.user) : 0.f;
                }
                x(r, c) = user_score_mod(input, s.b, s.h, i, j, p.user);
            }
    }
    // The masks (read only where visible) set -inf; so do the window and the sequence ends.
    hide_scores<kMods, kRows, kCols, kKeysAreRows, kMaskEverywhere, kBitsHere>(p, s, rows, cols, x, visible,
                                                                             blocks_whole);
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
        for (int c = 0; c < kCols; ++c) x(r, c) = visible(r, c) ? x(r, c) * kLog2e : -CUFLASH_INF;
}

// The forward's form: no chain.
template <int kMods, int kRows, int kCols, bool kKeysAreRows = false, class At>
__device__ __forceinline__ void modify_scores(const FwdParams& p, const SeqInfo& s, const int (&rows)[kRows],
                                              const int (&cols)[kCols], At&& x) {
    modify_scores<kMods, kRows, kCols, kKeysAreRows, false>(p, s, rows, cols, x, x);
}

// Whether any of this thread's share (blocks first, first + step, ...) of the user blocks that
// overlap the tile [m_lo, m_hi) x [n_lo, n_hi) is True; the callers below combine the shares.
__device__ __forceinline__ bool block_mask_share_visible(const FwdParams& p, const SeqInfo& s, int m_lo, int m_hi,
                                                         int n_lo, int n_hi, int first, int step) {
    const int bq0 = m_lo / p.block_q, bq1 = (m_hi - 1) / p.block_q;
    const int bk0 = n_lo / p.block_k, bk1 = (n_hi - 1) / p.block_k;
    const int cols = bk1 - bk0 + 1, count = (bq1 - bq0 + 1) * cols;
    bool any = false;
    for (int t = first; t < count; t += step) {
        const int bi = bq0 + t / cols, bj = bk0 + t % cols;
        any |= p.block_mask[s.b * p.block_mask_batch_stride + s.h * p.block_mask_head_stride +
                            bi * p.block_mask_row_stride + bj * p.block_mask_col_stride] != 0;
    }
    return any;
}

// What the blocks of block_mask that overlap the tile [m_lo, m_hi) x [n_lo, n_hi) say of it, as bits:
// kBlocksAny, some block may attend (the tile is visited); kBlocksAll, every block may (no element of
// the tile needs the block mask); kBlocksFull, every block is one whose elements all attend under the
// MaskMod the mask was derived from (no element needs the MaskMod either). A user's bool block mask
// holds bytes 0 and 1; a derived one 0, 1 (some element attends) and 3 (all do: cuda_src/mask_blocks.cu),
// so the AND of the bytes has bit 0 where all are nonzero and bit 1 where all are full. One thread
// tests every block (fwd_sm90's producer: a lane a tile; bwd_sm90's walks them its own way,
// query_tiles_from), in one loop: with two nested loops and a flag each, the producer's 40 registers
// spilled 8-20 bytes.
enum BlockState : int { kBlocksAny = 1, kBlocksAll = 2, kBlocksFull = 4 };
// Whether a tile whose blocks are in `state` needs neither the block mask nor the MaskMod (of kMods, or
// its bits beside a derived block mask) element by element.
template <int kMods>
__device__ __forceinline__ bool tile_blocks_whole(int state, const FwdParams& p) {
    const bool answers = (kMods & kModUserMask) != 0 || p.mask_bits_offset != 0;
    return (state & kBlocksAll) != 0 && (!answers || (state & kBlocksFull) != 0);
}
// The BlockState of blocks whose bytes OR to `any` and AND to `all`.
__device__ __forceinline__ int block_state(unsigned any, unsigned all) {
    return (any != 0u ? kBlocksAny : 0) | ((all & 1u) != 0u ? kBlocksAll : 0) | ((all & 2u) != 0u ? kBlocksFull : 0);
}
// The OR and the AND of block_mask's bytes over blocks [bq0, bq1] x [bk0, bk1] of one (batch, head),
// read kAtOnce at a time: each read waits on L2, and one at a time (a loop whose OR waits for its byte
// before the next read issues) a 128 x 128 tile over 2 x 2 derived blocks of 64 waited four times.
template <int kAtOnce = 4>
__device__ __forceinline__ void block_bytes(const unsigned char* mask, long long row_stride, long long col_stride,
                                            int bq0, int bq1, int bk0, int bk1, unsigned& any, unsigned& all) {
    any = 0u;
    all = 0xffu;
    for (int bi = bq0, bj = bk0; bi <= bq1;) {
        unsigned byte[kAtOnce];   // past the last block 0xff00: nothing to the OR's low byte, all ones to the AND's
#pragma unroll
        for (int u = 0; u < kAtOnce; ++u) {
            byte[u] = bi <= bq1 ? mask[bi * row_stride + bj * col_stride] : 0xff00u;
            if (++bj > bk1) {
                bj = bk0;
                ++bi;
            }
        }
#pragma unroll
        for (int u = 0; u < kAtOnce; ++u) {
            any |= byte[u] & 0xffu;
            all &= byte[u] | (byte[u] >> 8);
        }
    }
}
// kAtOnce: block_bytes', or 1: one block at a time in a loop of its own (fwd_sm90 with score
// modifiers besides the masks, whose producer spilled 4 B at D = 64 with block_bytes).
template <int kAtOnce = 4>
__device__ __forceinline__ int block_mask_tile_state(const FwdParams& p, const SeqInfo& s, int m_lo, int m_hi,
                                                     int n_lo, int n_hi) {
    const int bq0 = m_lo / p.block_q, bq1 = (m_hi - 1) / p.block_q;
    const int bk0 = n_lo / p.block_k, bk1 = (n_hi - 1) / p.block_k;
    const unsigned char* mask = p.block_mask + s.b * p.block_mask_batch_stride + s.h * p.block_mask_head_stride;
    unsigned any = 0u, all = 0xffu;
    // One block (a user's mask at the tile's size): read alone, not in block_bytes' four slots, which
    // took 1.7% more instructions in fwd_sm90 with a 128 x 128 block mask (Nsight Compute, H200).
    if (kAtOnce > 1 && bq0 == bq1 && bk0 == bk1) {
        any = all = mask[bq0 * p.block_mask_row_stride + bk0 * p.block_mask_col_stride];
    } else if constexpr (kAtOnce == 1) {
        const int cols = bk1 - bk0 + 1, count = (bq1 - bq0 + 1) * cols;
        for (int t = 0; t < count; ++t) {
            const unsigned byte = mask[(bq0 + t / cols) * p.block_mask_row_stride +
                                       (bk0 + t % cols) * p.block_mask_col_stride];
            any |= byte;
            all &= byte;
        }
    } else {
        block_bytes<kAtOnce>(mask, p.block_mask_row_stride, p.block_mask_col_stride, bq0, bq1, bk0, bk1, any, all);
    }
    return block_state(any, all);
}

// Whether any user block that overlaps the tile is True. Every thread of the CTA must call it (it
// ends in a barrier); tiles it rejects are neither loaded nor computed.
__device__ __forceinline__ bool block_mask_tile_visible(const FwdParams& p, const SeqInfo& s, int m_lo,
                                                        int m_hi, int n_lo, int n_hi) {
    if (p.block_mask == nullptr) return true;
    return __syncthreads_or(block_mask_share_visible(p, s, m_lo, m_hi, n_lo, n_hi, threadIdx.x, blockDim.x)) != 0;
}

}  // namespace cuflash

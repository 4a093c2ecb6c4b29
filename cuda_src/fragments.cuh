// What the tensor-core forward kernels do to their accumulator fragments between and after the two
// GEMMs: scores and masks, dropout, rescaling, packing P, and writing O and lse.
//
// Layout (mma.sync m16n8 C fragments, and wgmma's accumulators alike): a warp holds kMTiles
// 16-row m-tiles of kNTiles 8-column n-tiles; element e of tile (mi, ni) of lane (g = lane/4,
// t = lane%4) sits at row row0 + 16 mi + g + 8 (e / 2), column 8 ni + 2 t + (e % 2), where row0 is
// the warp's first query row (absolute, inside the sequence).
#pragma once
#include "common.cuh"
#include "params.cuh"
#include "mask.cuh"
#include "philox.cuh"

namespace cuflash {

// Row `half` of a thread's fragments (columns 8 ni + c relative to its first) outside [lo, hi) -> -inf.
template <bool kLeftEdge, int kNTiles>
__device__ __forceinline__ void mask_row(float (&acc_s_mi)[kNTiles][4], int half, int lo, int hi) {
#pragma unroll
    for (int ni = 0; ni < kNTiles; ++ni)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            const int col = ni * 8 + c;
            if (col >= hi || (kLeftEdge && col < lo)) acc_s_mi[ni][2 * half + c] = -CUFLASH_INF;
        }
}

// S tile -> scores, -inf where hidden. Without score modifiers (kMods == 0) S stays raw q.k (the
// softmax folds in scale * log2 e) and only tiles on a window edge or the key tail pay for per-element
// masking; with them, every element goes through modified_score<kMods> and comes out in log2 units.
template <int kMods, int kMTiles, int kNTiles>
__device__ __forceinline__ void mask_scores(float (&acc_s)[kMTiles][kNTiles][4], const FwdParams& p,
                                            const SeqInfo& s, int m_lo, int m_hi, int n_lo, int row0, int g,
                                            int t) {
    if constexpr (kMods != 0) {
        // Thread rows r = 2 mi + half, columns c = 2 ni + (e % 2).
        int rows[2 * kMTiles], cols[2 * kNTiles];
#pragma unroll
        for (int r = 0; r < 2 * kMTiles; ++r) rows[r] = row0 + (r / 2) * 16 + g + (r % 2) * 8;
#pragma unroll
        for (int c = 0; c < 2 * kNTiles; ++c) cols[c] = n_lo + (c / 2) * 8 + 2 * t + c % 2;
        modify_scores<kMods>(p, s, rows, cols, [&](int r, int c) -> float& {
            return acc_s[r / 2][c / 2][2 * (r % 2) + c % 2];
        });
    } else if (!tile_inside_window(p, s, m_lo, m_hi, n_lo, n_lo + kNTiles * 8)) {
        // Each row sees one interval of keys [first, last) (in_window for a single row). Its bounds
        // are taken relative to the thread's first column, so that an element compares its
        // compile-time column offset with them; only a row whose interval starts inside the tile
        // (a sliding window's left edge) tests both, so causal and tail tiles pay one comparison.
#pragma unroll
        for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int i = row0 + mi * 16 + g + half * 8;
                int first, last;
                visible_keys(p, s, i, i + 1, &first, &last);
                const int col0 = n_lo + 2 * t;
                if (first <= col0) mask_row<false>(acc_s[mi], half, first - col0, last - col0);
                else mask_row<true>(acc_s[mi], half, first - col0, last - col0);
            }
    }
}

// The bits of the MaskMod a block mask was derived from (FwdParams::mask_bits_offset) for a thread's
// accumulator elements of the tile whose keys start at n_lo (a multiple of 32): row r's keys n_lo +
// 8 ni + 2 t + e lie in word ni / 4 of the row's words from n_lo, so a row reads kNTiles / 4 words
// (two a row at 64 keys, four at 128) rather than one an element. The bits have rows up to the next
// multiple of 128 queries and one more (cuflash/_mask_blocks.py), so rows past the queries' end and
// keys past the keys' end read inside them without a bound (their scores are not used, or -inf
// already), and no element needs a visibility test. Loading (load_mask_bits_rows) and applying
// (hide_by_mask_words) are apart so that a caller loads as the tile comes and applies once its S has
// retired: the loads are L2 reads. In front of the softmax they took fwd_sm90's long-scoreboard stalls
// from 0.65 (the same documents as a 128 x 128 block mask) to 0.94 per issue; loaded as the tile comes,
// 0.66 (Nsight Compute, H200, docs/decisions.md#modifiers-a-maskmods-bits-read-under-the-gemms).
template <int kMTiles, int kNTiles>
__device__ __forceinline__ void load_mask_bits_rows(unsigned (&words)[2 * kMTiles][kNTiles / 4], const FwdParams& p,
                                                    const SeqInfo& s, int n_lo, int row0, int g) {
    static_assert(kNTiles % 4 == 0, "whole 32-key words");
    const unsigned* bits = reinterpret_cast<const unsigned*>(p.block_mask + p.mask_bits_offset) +
                           s.b * p.mask_bits_batch_stride + s.h * p.mask_bits_head_stride;
#pragma unroll
    for (int r = 0; r < 2 * kMTiles; ++r) {
        const int i = row0 + (r / 2) * 16 + g + (r % 2) * 8;
        const unsigned* row = bits + i * static_cast<int>(p.mask_bits_row_stride) + (n_lo >> 5);
#pragma unroll
        for (int w = 0; w < kNTiles / 4; ++w) words[r][w] = __ldg(row + w);
    }
}
template <int kMTiles, int kNTiles>
__device__ __forceinline__ void hide_by_mask_words(float (&acc_s)[kMTiles][kNTiles][4],
                                                   const unsigned (&words)[2 * kMTiles][kNTiles / 4], int t) {
#pragma unroll
    for (int r = 0; r < 2 * kMTiles; ++r)
#pragma unroll
        for (int w = 0; w < kNTiles / 4; ++w)
#pragma unroll
            for (int ni = 0; ni < 4; ++ni)
#pragma unroll
                for (int e = 0; e < 2; ++e)
                    if (((words[r][w] >> (ni * 8 + 2 * t + e)) & 1u) == 0u)
                        acc_s[r / 2][w * 4 + ni][2 * (r % 2) + e] = -CUFLASH_INF;
}

// The masks of kMods (block_mask, a user MaskMod: a mask-only variant, fwd_sm90's kMaskOnly) on raw
// scores that mask_scores<0> has taken through the window: -inf where one hides the element, the rest
// left raw for the softmax to scale. Only for tiles whose blocks leave some element hidden. The block
// mask is read only where the window left the element visible (not -inf) and never on rows past the
// queries' end or keys past the keys' end; the MaskMod at every element (hide_scores' kMaskEverywhere),
// its result taken only there. (A MaskMod's bits beside the block mask: hide_by_mask_words.)
template <int kMods, int kMTiles, int kNTiles>
__device__ __forceinline__ void hide_masked_scores(float (&acc_s)[kMTiles][kNTiles][4], const FwdParams& p,
                                                   const SeqInfo& s, int n_lo, int row0, int g, int t) {
    int rows[2 * kMTiles], cols[2 * kNTiles];
#pragma unroll
    for (int r = 0; r < 2 * kMTiles; ++r) rows[r] = row0 + (r / 2) * 16 + g + (r % 2) * 8;
#pragma unroll
    for (int c = 0; c < 2 * kNTiles; ++c) cols[c] = n_lo + (c / 2) * 8 + 2 * t + c % 2;
    hide_scores<kMods, 2 * kMTiles, 2 * kNTiles, false, true, false>(
        p, s, rows, cols, [&](int r, int c) -> float& { return acc_s[r / 2][c / 2][2 * (r % 2) + c % 2]; },
        [&](int r, int c) {
            return rows[r] < s.seqlen_q && cols[c] < s.seqlen_k &&
                   acc_s[r / 2][c / 2][2 * (r % 2) + c % 2] != -CUFLASH_INF;
        });
}

// Whether any row of the warp has a correction other than 1 (its maximum moved). Called by whole warps.
template <int kRows>
__device__ __forceinline__ bool rows_moved(const float (&correction)[kRows]) {
    bool moved = false;
#pragma unroll
    for (int r = 0; r < kRows; ++r) moved |= correction[r] != 1.f;
    return __any_sync(0xffffffffu, moved);
}

// O rows times the online-softmax correction of their row.
template <int kMTiles, int kDTiles>
__device__ __forceinline__ void scale_rows(float (&acc_o)[kMTiles][kDTiles][4], const float (&correction)[2 * kMTiles]) {
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
        for (int di = 0; di < kDTiles; ++di)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_o[mi][di][e] *= correction[2 * mi + e / 2];
}

// scale_rows, skipped by a warp whose corrections are all 1 (the row maxima did not move): a
// multiply by 1 changes nothing, and at large head dims the rescale costs more instructions than
// the softmax itself. Called by whole warps.
template <int kMTiles, int kDTiles>
__device__ __forceinline__ void rescale_rows(float (&acc_o)[kMTiles][kDTiles][4],
                                             const float (&correction)[2 * kMTiles]) {
    if (rows_moved(correction)) scale_rows(acc_o, correction);
}

// Zeroes the dropped probabilities (philox.cuh). The row sums already saw every p, so only O loses
// them: lse is pre-dropout and O is rescaled by 1 / (1 - p) at the end. The Philox draws of a row
// are gathered into a bit mask first, in a loop that is only partly unrolled: fully unrolled, all
// of a row's draws would be in flight at once and push a large tile's registers into spills. The
// (seed, offset) is read once (philox.cuh, dropout_key): read per draw, it spilled fwd_sm90 at D=128.
template <int kMTiles, int kNTiles>
__device__ __forceinline__ void drop_probabilities(float (&acc_s)[kMTiles][kNTiles][4], const FwdParams& p,
                                                   const SeqInfo& s, int row0, int n_lo, int g, int t) {
    static_assert(kNTiles <= 32, "two bits per n-tile in one 64-bit mask");
    const DropoutKey key = dropout_key(p);
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int i = row0 + mi * 16 + g + half * 8;
            unsigned long long dropped = 0;   // bit 2 ni + c: column 8 ni + 2 t + c is dropped
#pragma unroll 2
            for (int ni = 0; ni < kNTiles; ++ni) {
                const int j = n_lo + ni * 8 + 2 * t;   // even: the pair sits in one Philox block
                const uint4 w = dropout_words(key, s.b, s.h, i, j / 4, p.heads_q);
                const unsigned w0 = (j & 2) ? w.z : w.x, w1 = (j & 2) ? w.w : w.y;
                dropped |= (unsigned long long)(unsigned(w0 < p.dropout_threshold) | unsigned(w1 < p.dropout_threshold) << 1)
                           << (2 * ni);
            }
#pragma unroll
            for (int ni = 0; ni < kNTiles; ++ni) {
                if (dropped >> (2 * ni) & 1ull) acc_s[mi][ni][2 * half] = 0.f;
                if (dropped >> (2 * ni + 1) & 1ull) acc_s[mi][ni][2 * half + 1] = 0.f;
            }
        }
}

// P for keys 16 kk .. 16 kk + 15 as an m16k16 A fragment: two adjacent n-tiles of S, packed pairwise.
template <typename T, int kNTiles>
__device__ __forceinline__ void pack_p(unsigned (&a)[4], const float (&acc_s_mi)[kNTiles][4], int kk) {
    a[0] = pack2<T>(acc_s_mi[2 * kk][0], acc_s_mi[2 * kk][1]);
    a[1] = pack2<T>(acc_s_mi[2 * kk][2], acc_s_mi[2 * kk][3]);
    a[2] = pack2<T>(acc_s_mi[2 * kk + 1][0], acc_s_mi[2 * kk + 1][1]);
    a[3] = pack2<T>(acc_s_mi[2 * kk + 1][2], acc_s_mi[2 * kk + 1][3]);
}

// out = O / l (times 1/(1-p) under dropout) and lse, straight from registers. A row that saw no key
// is exactly 0, even if its masked tiles held NaN values (0 * NaN in P V would otherwise reach it).
template <bool kDropout, int kMTiles, int kDTiles>
__device__ __forceinline__ void store_output(const float (&acc_o)[kMTiles][kDTiles][4],
                                             const float (&inv_l)[2 * kMTiles], const float (&lse)[2 * kMTiles],
                                             const FwdParams& p, const SeqInfo& s, int row0, int g, int t) {
    elem_t* o_gmem = static_cast<elem_t*>(p.o) + s.b * p.o_batch_stride + s.h * p.o_head_stride +
                     s.q_row0 * p.o_row_stride;
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int r = 2 * mi + half;
            const int i = row0 + mi * 16 + g + half * 8;
            if (i >= s.seqlen_q) continue;
            const float factor = kDropout ? inv_l[r] * p.dropout_rescale : inv_l[r];
            const bool no_keys = inv_l[r] == 0.f;
            elem_t* row = o_gmem + i * p.o_row_stride;
#pragma unroll
            for (int di = 0; di < kDTiles; ++di) {
                const int col = di * 8 + 2 * t;
                if (col < p.head_dim_v)
                    *reinterpret_cast<unsigned*>(row + col) =
                        no_keys ? 0u
                                : pack2<elem_t>(acc_o[mi][di][2 * half] * factor, acc_o[mi][di][2 * half + 1] * factor);
            }
            if (t == 0) p.lse[s.b * p.lse_batch_stride + s.h * p.lse_head_stride + s.q_row0 + i] = lse[r];
        }
}

}  // namespace cuflash

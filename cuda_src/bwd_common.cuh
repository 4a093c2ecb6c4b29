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

// bwd_sm90's dq_accum (BwdParams::dqa_tile_rows > 0): per (b, h) a row space of whole tiles of
// tile_rows query rows x the compiled head dim (dqa_row_stride floats), each tile one contiguous
// block of two shares: 64 x 64 (split by rows when a tile has 128 rows, by columns when 64), or with
// 80 rows the 64 columns x 80 rows of dQ^T that each consumer computes. A share is stored in the
// order a warpgroup's wgmma accumulators leave registers: float4 number n-tile * 128 + thread,
// element e of the m64nN accumulator fragment (wgmma_sm90.cuh). That order
// lets bwd_sm90 write it to shared memory with conflict-free 16-byte stores and add it in one bulk
// reduction; bwd_convert and bwd_preprocess read it back through these two functions.
//
// Where sequence b's tiles start: row 0, or under varlen (every sequence in one row space per head)
// its first row plus b tiles, rounded down to a tile, so that its tiles are whole and apart from
// its neighbours'.
__device__ __forceinline__ int dq_tile_row0(int q_row0, int b, int tile_rows, bool varlen) {
    return varlen ? (q_row0 + b * tile_rows) / tile_rows * tile_rows : 0;
}
// Offset of element (r, c) inside its tile.
__device__ __forceinline__ int dq_tile_offset(int r, int c, int tile_rows) {
    if (tile_rows == 80) {   // transposed: accumulator row c % 64, column r
        const int m = c % 64, thread = (m / 16) * 32 + (m % 8) * 4 + (r % 8) / 2, e = ((m % 16) / 8) * 2 + r % 2;
        return (c / 64) * 5120 + ((r / 8) * 128 + thread) * 4 + e;
    }
    const bool by_rows = tile_rows == 128;
    const int share = by_rows ? r / 64 : c / 64, rr = by_rows ? r % 64 : r, cc = by_rows ? c : c % 64;
    const int thread = (rr / 16) * 32 + (rr % 8) * 4 + (cc % 8) / 2, e = ((rr % 16) / 8) * 2 + cc % 2;
    return share * 4096 + ((cc / 8) * 128 + thread) * 4 + e;
}

// bwd_sm90's dq_done counter of query head h of sequence b (BwdParams::dq_done): one per (sequence,
// slot), a slot being heads_per_slot consecutive query heads of `heads` (BwdParams::heads_per_cta,
// bwd_sm90's grid y). bwd_preprocess zeroes it, bwd_sm90 counts into it, bwd_convert waits on it.
__device__ __forceinline__ int dq_done_index(int b, int h, int heads, int heads_per_slot) {
    return b * (heads / heads_per_slot) + h / heads_per_slot;
}

// Where a CTA's work lies on a backward pass's grid (row blocks, head slots, sequences): (x, y, z).
// CTAs start in the order of their linear index, x fastest, i.e. head slot by head slot; each pass
// numbers its row blocks so that x = 0 is the heaviest under a causal mask (the dK/dV pass: the
// first keys, which the most queries see; the dQ pass: the last queries). Taken head by head, the
// slots started last would then leave their heaviest blocks running alone at the end of the call,
// so the last `tail_pairs` (slot, sequence) pairs of the grid are read block-major instead (all
// their blocks x = 0, then all their blocks x = 1, ...), their light blocks last. Only those few:
// CTAs of ~130 different heads at once each read their own head's rows, which L2 then cannot hold
// (the whole grid block-major ran 0.6x as fast; docs/decisions.md#bwd-causal-tail-pairs).
__device__ __forceinline__ int4 bwd_grid_place_of(int linear, int nx, int ny, int nz, int tail_pairs) {
    const int head_major = ny * nz - tail_pairs;   // pairs taken slot by slot
    if (linear < nx * head_major) return make_int4(linear % nx, (linear / nx) % ny, linear / (nx * ny), 0);
    const int r = linear - nx * head_major, pair = head_major + r % tail_pairs;
    return make_int4(r / tail_pairs, pair % ny, pair / ny, 0);
}

// The launched CTA's place (bwd_grid_place_of also serves bwd_sm90's persistent CTAs, which take the
// linear indices of a grid they are not launched as from a counter).
__device__ __forceinline__ int4 bwd_grid_place(int tail_pairs) {
    const int nx = gridDim.x, ny = gridDim.y;
    const int linear = blockIdx.x + nx * (blockIdx.y + ny * blockIdx.z);
    if (linear < nx * (ny * gridDim.z - tail_pairs)) return make_int4(blockIdx.x, blockIdx.y, blockIdx.z, 0);
    return bwd_grid_place_of(linear, nx, ny, gridDim.z, tail_pairs);
}

// dbias[b, h, i, j] = ds for element (i, j) of the sequence/head in s, when the call asked for dbias
// and (i, j) lies inside the sequence.
__device__ __forceinline__ void store_dbias(const BwdParams& bp, const SeqInfo& s, int i, int j, float ds) {
    if (bp.dbias != nullptr && i < s.seqlen_q && j < s.seqlen_k)
        bp.dbias[s.b * bp.dbias_batch_stride + s.h * bp.dbias_head_stride + i * bp.dbias_row_stride + j] = ds;
}

// The Philox word of element (i, j) of the sequence/head in s (cuda_src/philox.cuh's formula).
__device__ __forceinline__ unsigned dropout_word(const FwdParams& p, const SeqInfo& s, int i, int j) {
    const uint4 w = dropout_words(dropout_key(p), s.b, s.h, i, j >> 2, p.heads_q);
    const int r = j & 3;
    return r == 0 ? w.x : r == 1 ? w.y : r == 2 ? w.z : w.w;
}

// One element's share of the backward, in two halves so that a kernel can take P as soon as the
// scores are in and dS once dP is (bwd_sm90 overlaps each half with a product).
//   qk      raw q_i . k_j; without score modifiers (kMods == 0) already -inf where the window or the
//           key tail hides (i, j); with a user ScoreMod, d s / d (scale q.k) instead (modify_scores' chain);
//   score2  with them, the element's score in log2 units from modify_scores (mask.cuh), -inf where
//           hidden (qk is then raw: the softcap's derivative needs it); ignored without;
//   dp      raw dO_i . v_j;   lse2 / dsum  the row's lse * log2(e) and D_i
//   word    the element's Philox word (dropout_word), used only when kDropout
//
// element_prob: P_ij; with dropout its sign carries the keep bit (-P: dropped), so that the second
// half needs no Philox word. element_prob_kept takes the keep bit itself (dropout_keep_bits).
template <int kMods, bool kDropout>
__device__ __forceinline__ float element_prob_kept(const FwdParams& p, float qk, float score2, float lse2, bool kept) {
    const float prob = kMods != 0 ? fast_exp2(score2 - lse2)
                                  : fast_exp2(fmaf(qk, p.scale_log2, -lse2));   // -inf (masked) -> 0
    if constexpr (kDropout) return kept ? prob : -prob;
    return prob;
}
template <int kMods, bool kDropout>
__device__ __forceinline__ float element_prob(const FwdParams& p, float qk, float score2, float lse2, unsigned word) {
    return element_prob_kept<kMods, kDropout>(p, qk, score2, lse2, kDropout && dropout_keeps(word, p.dropout_threshold));
}

// Pdrop, what multiplied v_j in the forward, from element_prob's value.
template <bool kDropout>
__device__ __forceinline__ float element_pdrop(const FwdParams& p, float prob) {
    if constexpr (kDropout) return fmaxf(prob, 0.f) * p.dropout_rescale;
    return prob;
}

// dx = dL/dx from element_prob's value; ds = dL/ds (for dbias). kGuard: an element with P = 0 gets
// dS = 0 even where dP is not finite (a key the row does not see may hold NaN or inf in V, dO); a
// call whose rows see every key of the tiles they meet (kGuard false) lets it through as the product
// would.
template <int kMods, bool kDropout, bool kGuard = true>
__device__ __forceinline__ float element_grad(const FwdParams& p, float prob, float qk, float dp, float dsum,
                                              float* ds) {
    float dp_kept = dp;
    if constexpr (kDropout) {
        dp_kept = prob > 0.f ? dp * p.dropout_rescale : 0.f;
        prob = fabsf(prob);
    }
    const float grad = kGuard && prob == 0.f ? 0.f : prob * (dp_kept - dsum);
    *ds = grad;   // dL/ds of the final score: dbias (bias is added before a user ScoreMod: see below)
    if constexpr ((kMods & kModUserScore) != 0) {
        // A user ScoreMod's chain factor may be anything where P = 0 (its grad at a hidden element): 0
        // there. The product is dL/dy at the ScoreMod's input y, where bias was added: dbias too. (The
        // chain holds the softcap's factor as well, so the host refuses dbias beside both.)
        const float dx = prob == 0.f ? 0.f : grad * qk;
        *ds = dx;
        return dx;
    }
    return (kMods & kModSoftcap) ? grad * softcap_grad(p, qk) : grad;
}

// Both halves at once. Outputs: pd = Pdrop, ds = dL/ds, dx = dL/dx.
template <int kMods, bool kDropout>
__device__ __forceinline__ void score_grad(const FwdParams& p, float qk, float score2, float dp, float lse2,
                                           float dsum, unsigned word, float* pd, float* ds, float* dx) {
    const float prob = element_prob<kMods, kDropout>(p, qk, score2, lse2, word);
    *pd = element_pdrop<kDropout>(p, prob);
    *dx = element_grad<kMods, kDropout>(p, prob, qk, dp, dsum, ds);
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
        const uint4 w = dropout_words(dropout_key(p), s.b, s.h, i0 + 8 * half, j0 >> 2, p.heads_q);
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
    const uint4 w = dropout_words(dropout_key(p), s.b, s.h, i0 + (r & 1), block_key >> 2, p.heads_q);
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

// The keep bits of a thread's kTiles accumulator tiles in pass 0's layout (dropout_words_cols; tile
// mi at queries i0 + 8 mi): element e of tile mi is bit 4 (mi % 8) + e of keep[mi / 8]. One
// register per 8 tiles instead of a Philox word per element, so that the words can be drawn early
// (while a product runs) and used late.
template <int kTiles>
__device__ __forceinline__ void dropout_keep_bits_cols(const FwdParams& p, const SeqInfo& s, int i0, int j0, int lane,
                                                       unsigned (&keep)[(kTiles + 7) / 8]) {
#pragma unroll
    for (int w = 0; w < (kTiles + 7) / 8; ++w) keep[w] = 0u;
#pragma unroll
    for (int mi = 0; mi < kTiles; ++mi) {
        unsigned word[4];
        dropout_words_cols(p, s, i0 + 8 * mi, j0, lane, word);
#pragma unroll
        for (int e = 0; e < 4; ++e)
            keep[mi / 8] |= static_cast<unsigned>(dropout_keeps(word[e], p.dropout_threshold)) << (4 * (mi % 8) + e);
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
        store_one(dk, col, dk0, dk1);
        store_one(dv, col, dv0, dv1);
    }
    // dK and dV alone: their columns differ when v has a head dim of its own.
    __device__ __forceinline__ void store_dk(int col, float x0, float x1) const { store_one(dk, col, x0, x1); }
    __device__ __forceinline__ void store_dv(int col, float x0, float x1) const { store_one(dv, col, x0, x1); }
    __device__ __forceinline__ void store_one(char* row, int col, float x0, float x1) const {
        if (partial) *reinterpret_cast<float2*>(row + 4 * col) = make_float2(x0, x1);
        else *reinterpret_cast<unsigned*>(row + 2 * col) = pack2<Elem>(x0, x1);
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

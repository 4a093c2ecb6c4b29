// Decode attention: a few new query tokens against a long KV cache (contiguous or paged), split-KV.
//
// One CTA handles one (sequence b, kv head, row block, split). Its rows are the packed query rows
// r = i * group + (h % group) of the query heads that share kv head h / group (GQA: each K/V byte is
// read once per group, not once per query head), kBlockM of them per row block; its keys are the
// split's share of the keys those rows may see. K/V tiles of kBlockN keys stream through a
// kStages-deep cp.async pipeline (paged caches translate each key to its page through block_table,
// one tile ahead of the copies: see PagedRowFetch).
// Every warp takes its own kKeysPerWarp keys of a tile and keeps its own online softmax (base 2, as
// online_softmax.cuh), so the warps never wait on each other inside the loop; their states are
// combined through shared memory at the end. Per warp and tile:
//     S = Q K^T  ->  score pipeline / masks (mask.cuh)  ->  online softmax  ->  O += P V.
// The result is the final output and lse (num_splits == 1) or a float32 partial (o, lse) per split;
// the last split of a (sequence, kv head, row block) to finish combines the partials into the
// output (merge.cu's formula), so a call is one launch. Attention sinks (p.score.sinks, per query
// head) join each row's denominator once: where the CTA finishes the row itself (one split), or in
// that combine (the partials have no sink).
//
// Appended tokens (k_new / v_new) are keys cache_len .. cache_len + seqlen_new - 1 of the sequence.
// Every CTA reads them from k_new / v_new, and the CTAs of split 0, row block 0 also write them into
// the cache (after their loop); no CTA reads the cache at those positions (the caller guarantees
// that no sequence's visible cache slots are append targets; cuflash/decode.py checks it when the
// tables are on the host), so writing and reading in one launch is race free.
//
// Bad indices: cuda_src/check_indices.cu validates cache_seqlens and block_table on the device and
// the launch writes nothing on its verdict (p.error), which it reads after its loop: on sm_90 it is
// launched as a programmatic dependent of the check and overlaps it (fault.cuh). Without a check
// nothing is out of bounds either: a sequence that does not fit its cache is skipped, and a cached
// key on a block_table entry that is not a page reads as zeros (and receives no append).
//
// Two code paths share everything but the tile arithmetic:
//   fp16/bf16: mma.sync m16n8k16 (mma_sm80.cuh), kBlockM = 16 rows (padded), 16 keys per warp step;
//   float32:   FFMA, kBlockM = 8 rows, kKeysPerWarp keys per warp step with 32 / kKeysPerWarp lanes
//              per key for S = Q K^T and float4 columns of O per lane for O += P V.
//
// fp8 caches (CUFLASH_KV_FP8 = 1, fp16/bf16 q only): the cache holds float8_e4m3fn bytes standing for
// value * k_scale (v_scale), a scale per tensor or per kv head (p.k_scale / p.v_scale, or the values
// p.k_scale_value / p.v_scale_value). The stages hold the bytes (half the bytes of a 16-bit cache in
// flight) and the mma reads them through ldmatrix as they are: each lane's bytes become fp16 mma
// operands in registers (exactly: every e4m3 value is an fp16 value; e4m3x2_to_f16x2 below), taken in
// the order the bytes land: q's columns permuted alike in S = Q K^T (the contraction runs over them),
// O's columns in P V, restored when O is stored (mma_scores_fp8, mma_pv_fp8). The products run in
// fp16 whatever q's type: bf16 q rows are scaled by a power of two into fp16's range
// (load_q_tile_fp8), which the scores undo. The scales stay out of the 16-bit values, so nothing is
// rounded twice: k_scale multiplies the float32 scores S = Q K^T, v_scale the float32 output rows
// (before the splits' partials are written). Appended rows are quantised as cuflash.reference does,
// e4m3(x / scale) rounded to nearest even and saturated at 448 (quantize_e4m3), both into the cache
// and into the tile that attends them.
//
// MLA (CUFLASH_MLA = 1, fp16/bf16, DeepSeek's latent cache): one cache whose rows are the keys and
// whose first out_dim columns are the values (v_cache and v_new are the host's aliases of k_cache and
// k_new). A stage holds the K tile only and P V reads its first columns. O's 512 columns would not fit
// a warp's registers beside the rest, so a CTA holds kVCols (256) of them: the CTAs of a (row block,
// split) come in value halves (blockIdx.x's slowest part), each computing S over every column of the
// row and O over its own; the two read the same tiles at about the same time, the second mostly from L2.
//
// Compile-time configuration (set by cuflash/_heuristics.py): CUFLASH_DTYPE (0 fp16, 1 bf16, 2 fp32),
// CUFLASH_HEAD_DIM, CUFLASH_WARPS, CUFLASH_KEYS_PER_WARP, CUFLASH_STAGES, CUFLASH_PAGED, CUFLASH_KV_FP8, CUFLASH_MLA,
// CUFLASH_SCORE_MODS (bit mask of softcap / ALiBi / mask / user ScoreMod / user MaskMod: mask.cuh),
// CUFLASH_MIN_BLOCKS (CTAs per SM the shared memory allows; the register budget aims at it). Lengths,
// splits, page size and the user modifiers' arguments are run-time.
#include "common.cuh"
#include "params.cuh"
#include "decode_params.cuh"
#include "fault.cuh"
#include "mask.cuh"
#include "online_softmax.cuh"
#include "mma_sm80.cuh"

namespace cuflash {

// The type of one of two paths (no <type_traits> under NVRTC); the other is never instantiated.
template <bool kFirst, class A, class B> struct Select { using type = A; };
template <class A, class B> struct Select<false, A, B> { using type = B; };
template <class A, class B> struct Same { static constexpr bool value = false; };
template <class A> struct Same<A, A> { static constexpr bool value = true; };

// ---- float8_e4m3fn (fp8 caches)
//
// Two e4m3 bytes (x's low byte to the low half) to an fp16 pair, exactly. sm_89 and later convert
// them in one instruction. Before that: each byte is moved into the high byte of a 16-bit half, its 7
// magnitude bits eeeemmm shifted into the half's exponent and mantissa fields, which reads as the
// value times 2^-8 (exponent bias 15 = 7 + 8), e4m3 subnormals (e = 0) as fp16 subnormals; one packed
// fma by 2^8 restores the value (no .ftz: subnormals are kept). 0x7f (NaN) gets an all-ones exponent
// first, so it stays NaN. No lookup table and no CUDA header (cuda_fp8.h).
__device__ __forceinline__ unsigned e4m3x2_to_f16x2(unsigned short x) {
    unsigned r;
#if __CUDA_ARCH__ >= 890
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(x));
#else
    const unsigned t = __byte_perm(unsigned(x), 0u, 0x1404);   // byte 0 -> bits 8..15, byte 1 -> 24..31
    const unsigned mag = t & 0x7f007f00u;
    const unsigned nan = ((mag + 0x01000100u) & 0x80008000u) >> 15;   // 1 in each half that held 0x7f
    const unsigned h = (t & 0x80008000u) | (mag >> 1) | nan * 0x7c00u;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(h), "r"(0x5c005c00u), "r"(0x80008000u));   // x 256, + -0
#endif
    return r;
}
__device__ __forceinline__ unsigned e4m3_low_pair(unsigned w) { return e4m3x2_to_f16x2(w & 0xffffu); }
__device__ __forceinline__ unsigned e4m3_high_pair(unsigned w) { return e4m3x2_to_f16x2(w >> 16); }

// The e4m3 byte of x / scale, as cuflash.reference quantises (ml_dtypes): the quotient rounded to
// float32 (div.rn: the same float as rounding the float64 quotient, 53 >= 2 * 24 + 2), NaN stays NaN
// (0x7f with x's sign), |v| saturated at 448 (e4m3fn has no infinity), then rounded to nearest even
// on e4m3's grid: 2^(e - 3) in the binade [2^e, 2^(e+1)), 2^-9 below 2^-6 (subnormals). The count n of
// grid steps is 8..16 (16 = the next binade's first value) or 0..8 below 2^-6, so the byte is
// ((e + 6) << 3) + n in both cases. IEEE operations without .ftz: tiny quotients round, not flush.
__device__ __forceinline__ unsigned quantize_e4m3(float x, float scale) {
    float v;
    asm("div.rn.f32 %0, %1, %2;" : "=f"(v) : "f"(x), "f"(scale));
    const unsigned sign = (__float_as_uint(v) >> 24) & 0x80u;
    if (v != v) return sign | 0x7fu;
    const float a = fminf(fabsf(v), 448.f);
    const int e = max(int((__float_as_uint(a) >> 23) & 0xffu) - 127, -6);
    float steps, n;
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(steps) : "f"(a), "f"(__uint_as_float(static_cast<unsigned>(130 - e) << 23)));
    asm("cvt.rni.f32.f32 %0, %1;" : "=f"(n) : "f"(steps));
    return sign | static_cast<unsigned>(((e + 6) << 3) + static_cast<int>(n));
}

// The e4m3 byte of one 16-bit value under `scale`. A NaN's byte is taken from its bits: the
// conversion to float32 and the division return the canonical NaN, whose sign is not the value's
// (ml_dtypes keeps it: -NaN is 0xff).
__device__ __forceinline__ unsigned infinity_bits(half_t) { return 0x7c00u; }
__device__ __forceinline__ unsigned infinity_bits(bfloat16_t) { return 0x7f80u; }
template <typename T>
__device__ __forceinline__ unsigned quantize_e4m3_bits(unsigned short bits, float scale) {
    if ((bits & 0x7fffu) > infinity_bits(T{})) return ((bits >> 8) & 0x80u) | 0x7fu;
    return quantize_e4m3(to_float(T{bits}), scale);
}

// Sixteen elem_t values (two 16-byte chunks from src) quantised under `scale` into one 16-byte chunk.
template <typename T>
__device__ __forceinline__ uint4 quantize_e4m3x16(const T* src, float scale) {
    const uint4 lo = *reinterpret_cast<const uint4*>(src), hi = *reinterpret_cast<const uint4*>(src + 8);
    const unsigned words[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    unsigned out[4] = {0u, 0u, 0u, 0u};
#pragma unroll
    for (int w = 0; w < 8; ++w) {
        const unsigned b0 = quantize_e4m3_bits<T>(static_cast<unsigned short>(words[w] & 0xffffu), scale);
        const unsigned b1 = quantize_e4m3_bits<T>(static_cast<unsigned short>(words[w] >> 16), scale);
        out[w / 2] |= (b0 | (b1 << 8)) << (16 * (w % 2));
    }
    return make_uint4(out[0], out[1], out[2], out[3]);
}

template <int kHeadDim_, int kNWarps_, int kKeysPerWarp_, int kStages_, bool kPaged_, int kMods_, bool kFp8_,
          bool kMla_ = false, bool kKeysAsM_ = false>
struct DecodeConfig {
    static constexpr int kHeadDim = kHeadDim_, kNWarps = kNWarps_, kKeysPerWarp = kKeysPerWarp_;
    static constexpr int kStages = kStages_;
    // MLA: the values are the first columns of the key rows (no V tile), kVCols of them per CTA.
    static constexpr bool kMla = kMla_;
    static constexpr int kVCols = kMla ? 256 : kHeadDim;      // O columns a CTA holds
    static constexpr int kTilesPerStage = kMla ? 1 : 2;        // K and V, or K alone
    // fp8 caches: the stages hold e4m3 bytes (cache_t); the mma operands are fp16 (mma_t) whatever q's type.
    static constexpr bool kFp8 = kFp8_;
    using cache_t = typename Select<kFp8, unsigned char, elem_t>::type;
    using mma_t = typename Select<kFp8, half_t, elem_t>::type;
    static constexpr bool kScaledQ = kFp8 && Same<elem_t, bfloat16_t>::value;   // load_q_tile_fp8
    // Score modifiers compiled in (mask.cuh): softcap and ALiBi from p.score, the mask is decode's own,
    // and a user ScoreMod / MaskMod (their functions compiled ahead of this source, their arguments in
    // p.score.user; see decode_score for the positions they see).
    static constexpr int kMods = kMods_;
    static_assert((kMods & ~(kModSoftcap | kModAlibi | kModMask | kModUserScore | kModUserMask)) == 0,
                  "decode has no bias or block mask");
    static constexpr bool kPaged = kPaged_, kScoreMods = kMods != 0;
    static constexpr bool kSimt = sizeof(elem_t) == 4;
    static constexpr int kNThreads = 32 * kNWarps;
    // The keys as the mma's M dimension and 8 query rows as its N (keys_m_warp_tile), or 16 rows as M.
    static constexpr bool kKeysAsM = kKeysAsM_;
    static constexpr int kBlockM = kSimt || kKeysAsM ? 8 : 16;     // packed query rows per CTA
    static constexpr int kBlockN = kNWarps * kKeysPerWarp;         // keys per pipeline stage
    static constexpr int kChunkElems = 16 / int(sizeof(elem_t));   // elements per 16-byte copy (q, k_new)
    static constexpr int kCacheChunkElems = 16 / int(sizeof(cache_t));   // cache elements per 16-byte copy
    static constexpr int kChunksPerRow = kHeadDim / kCacheChunkElems;     // 16-byte copies per cache row
    static constexpr int kTileElems = kBlockN * kHeadDim;          // one K (or V) stage tile, cache_t
    static constexpr int kTileBytes = kTileElems * int(sizeof(cache_t));
    static constexpr int kLanesPerKey = 32 / kKeysPerWarp;         // float32 path: lanes sharing a key's dot
    static constexpr bool kQInRegs = !kSimt && !kKeysAsM && kHeadDim <= 128;   // Q fragments beside O's accumulators
    // Copies unrolled per loop step: all of them, except beside the large O accumulators of head dims
    // above 128, where fully unrolled address arithmetic would crowd the 255-register budget.
    static constexpr int kLoadIters = kBlockN * kChunksPerRow / kNThreads;
    static constexpr int kLoadUnroll = kHeadDim > 128 && kLoadIters % 4 == 0 ? 4 : kLoadIters;
    // Rows of a chunk count that is no power of two (MLA's 576 columns: 72 chunks; D = 192: 24) are
    // copied a row to 8 threads (copy_rows_by_eights): the chunk-major walk divided each copy's index
    // by 72 and read its row's address again, about 28 instructions a 16-byte copy, which left MLA's
    // 4-warp CTAs latency bound (H200, (32, 4k, 16 heads): 53% of the instructions, 43% of the stall
    // samples). Pages of rows of 16 or more chunks too (a row's address read once for 2 or more
    // copies: H200, D = 128 pages of 16, 0.8-1.7% less time); a contiguous cache of a power of two
    // keeps its walk down the columns (load_kv_tile), which measured the same.
    static constexpr bool kRowsByEights =
        !kSimt && !kFp8 && kChunksPerRow % 8 == 0 && kBlockN % (kNThreads / 8) == 0 &&
        ((kChunksPerRow & (kChunksPerRow - 1)) != 0 || (kPaged && kChunksPerRow >= 16));
    // End-of-loop combine buffer (reuses the K/V stages): per warp its O rows, then m, l, weights, lse.
    static constexpr int kCombStride = kVCols + 8;                 // floats; float2 stores conflict-free
    static constexpr int kCombFloats = kNWarps * kBlockM * kCombStride + 3 * kNWarps * kBlockM + kBlockM;
    // The last split's combine weights reuse it too: up to kMaxSplits (cuflash DECODE_MAX_SPLITS) per row.
    static constexpr int kMaxSplits = 128;
    static_assert(kCombFloats >= kMaxSplits * kBlockM, "the split weights must fit the combine buffer");
    static constexpr int kPFloats = kSimt ? kNWarps * kBlockM * kKeysPerWarp : 0;   // float32 P per warp
    // The K/V stages, which the combine buffer reuses: fp8 stages of few keys can be the smaller.
    static constexpr int kStageBytes = kTilesPerStage * kStages * kTileBytes;
    static constexpr int kStageRegionBytes = kStageBytes > 4 * kCombFloats ? kStageBytes : 4 * kCombFloats;
    static constexpr int kSmemBytes = kBlockM * kHeadDim * int(sizeof(elem_t)) + kStageRegionBytes + 4 * kPFloats;
    static_assert(!kFp8 || (!kSimt && kKeysPerWarp == 16), "fp8 caches: fp16/bf16 queries (mma path)");
    static_assert(!kMla || (!kSimt && !kFp8 && kHeadDim >= kVCols), "MLA: fp16/bf16 latent rows of >= 256 columns");
    static_assert(!kKeysAsM || (!kSimt && !kMla && kKeysPerWarp == 16), "keys as M: fp16/bf16, 16 keys per warp");

    static_assert(kStages >= 2, "the pipeline needs at least two stages");
    static_assert(kSimt || (kKeysPerWarp == 16 && kHeadDim % 64 == 0), "mma path: 16 keys per warp, swizzle");
    static_assert(!kSimt || (kHeadDim % 128 == 0 && 32 % kKeysPerWarp == 0 && kKeysPerWarp <= 16 &&
                             (kHeadDim / 4) % kLanesPerKey == 0),
                  "float32 path: float4 columns per lane, whole lane groups per key");
    static_assert((kBlockN * kChunksPerRow) % kNThreads == 0, "every thread copies the same number of chunks");
    static_assert(kBlockN <= kNThreads, "paged caches: one thread looks up each key row of a tile");
    static_assert(kFp8 || kCombFloats * 4 <= kStageBytes, "16-bit stages hold the combine buffer they become");
};

// fp8 stages: rows of kHeadDim bytes whose 16-byte chunks are XORed with a function of the row, so
// that the 8 consecutive rows one ldmatrix phase reads at a chunk fall in 8 bank groups: row % 8 for
// rows of a multiple of 128 bytes; (row / 2) % 4 for rows of 64 and 192 bytes, where rows 2r and 2r + 1
// already sit 64 bytes apart (the XOR stays inside the row's aligned group of 4 chunks).
template <int kHeadDim>
__device__ __forceinline__ int fp8_chunk_xor(int row) {
    return kHeadDim % 128 == 0 ? row & 7 : (row >> 1) & 3;
}

// A lane's ldmatrix addresses into an fp8 stage for the x4 reads of 16 keys x 32 bytes that
// mma_scores_fp8 and mma_pv_fp8 make: lanes 8m..8m+7 give the rows of matrix m, keys (m % 2) * 8 + 0..7
// and chunk 2 * step + m / 2. As SwizzledLanes: the XOR patterns repeat every kPeriod steps, so an
// address is one of kPeriod registers plus an immediate.
template <int kHeadDim>
struct Fp8Lanes {
    static constexpr int kPeriod = kHeadDim % 128 == 0 ? 4 : 2;   // steps per 128 (64) bytes of XOR pattern
    unsigned row_offset;
    unsigned xor_off[kPeriod];

    __device__ __forceinline__ explicit Fp8Lanes(int lane) {
        const int row = lane % 8 + ((lane / 8) % 2) * 8, half = lane / 16;
        row_offset = row * kHeadDim;
#pragma unroll
        for (int v = 0; v < kPeriod; ++v) xor_off[v] = ((2 * v + half) ^ fp8_chunk_xor<kHeadDim>(row)) * 16;
    }
    // Shared-space address of 32-byte step `step` (compile-time after unrolling) for keys from key0 (a
    // multiple of 16, which leaves the XOR pattern as it is).
    __device__ __forceinline__ unsigned at(unsigned tile, int step, int key0) const {
        return tile + row_offset + xor_off[step % kPeriod] + (step / kPeriod) * (kPeriod * 32) + key0 * kHeadDim;
    }
};

// Element offset of (row, col) inside a K/V stage tile; col is the first column of a 16-byte chunk.
template <class C>
__device__ __forceinline__ int tile_offset(int row, int col) {
    if constexpr (C::kFp8) {
        return row * C::kHeadDim + (((col >> 4) ^ fp8_chunk_xor<C::kHeadDim>(row)) << 4);
    } else if constexpr (C::kSimt) {
        // float4 chunks XORed with (row * kLanesPerKey) % 8: one LDS.128 phase (8 lanes) reads
        // kLanesPerKey consecutive chunks of 8 / kLanesPerKey key rows in S = Q K^T, or 8 chunks of one
        // row in P V; either way 8 distinct bank groups.
        return row * C::kHeadDim + ((((col >> 2) ^ ((row * C::kLanesPerKey) & 7))) << 2);
    } else {
        return swizzled<C::kHeadDim>(row, col);
    }
}

// One (sequence, kv head) as the CTA sees it.
struct DecodeSeq {
    SeqInfo s;               // b, h_kv, seqlen_q = Sq, seqlen_k = cache_len + seqlen_new, diag
    int cache_len;           // keys held by the cache before the append
    void* k_cache;           // at kv head h_kv (and at sequence b for a contiguous cache); C::cache_t
    void* v_cache;
    const elem_t* k_new;     // at (b, h_kv); only read for keys >= cache_len
    const elem_t* v_new;
    const int* pages;        // block_table row of b (paged only)
    float k_scale, v_scale;  // fp8 caches: this kv head's scales (1 otherwise, unused)
};

template <class C> __device__ __forceinline__ typename C::cache_t* k_cache_of(const DecodeSeq& sq) {
    return static_cast<typename C::cache_t*>(sq.k_cache);
}
template <class C> __device__ __forceinline__ typename C::cache_t* v_cache_of(const DecodeSeq& sq) {
    return static_cast<typename C::cache_t*>(sq.v_cache);
}

// fp8: an appended row's chunk (16 values from column c) quantised straight into a stage, as the
// append writes it into the cache; a plain store beside the stage's cp.async copies, seen by every
// warp after the same barrier.
template <class C>
__device__ __forceinline__ void store_new_chunk_fp8(typename C::cache_t* k_tile, typename C::cache_t* v_tile, int off,
                                                    const DecodeParams& p, const DecodeSeq& sq, long long t, int c) {
    *reinterpret_cast<uint4*>(k_tile + off) = quantize_e4m3x16<elem_t>(sq.k_new + t * p.k_new_row_stride + c, sq.k_scale);
    *reinterpret_cast<uint4*>(v_tile + off) = quantize_e4m3x16<elem_t>(sq.v_new + t * p.v_new_row_stride + c, sq.v_scale);
}

// Whether a block_table entry names a page of the cache. Entries outside [0, num_pages) are never
// dereferenced, even when no check_indices ran: rows on them read as zeros and receive no append.
__device__ __forceinline__ bool page_in_cache(int page, int num_pages) {
    return static_cast<unsigned>(page) < static_cast<unsigned>(num_pages);   // negative pages too, one compare
}

// Offsets (elements, from DecodeSeq::k_cache / v_cache) of cache position pos, which is below the
// sequence's capacity (decode_attention leaves sequences that do not fit alone), so its page index
// is a column of block_table. false: the position's page is not the cache's (offsets unset).
template <class C>
__device__ __forceinline__ bool cache_offsets(const DecodeParams& p, const DecodeSeq& sq, int pos, long long* k_off,
                                              long long* v_off) {
    if constexpr (C::kPaged) {
        const int page_idx = pos / p.page_size;
        const int page = __ldg(sq.pages + page_idx);
        if (!page_in_cache(page, p.num_pages)) return false;
        const long long slot = pos - page_idx * p.page_size;
        *k_off = static_cast<long long>(page) * p.k_batch_stride + slot * p.k_row_stride;
        *v_off = static_cast<long long>(page) * p.v_batch_stride + slot * p.v_row_stride;
    } else {
        *k_off = pos * p.k_row_stride;
        *v_off = pos * p.v_row_stride;
    }
    return true;
}

// One stage's rows by kRowsByEights: thread t copies chunks t % 8, t % 8 + 8, ... of rows t / 8, t / 8 +
// kNThreads / 8, ...; row_of(r) gives row r's K and V sources (nullptr: zeros). A thread's rows share
// their swizzle (row % 8 is t / 8 % 8 for every one), so each copy's addresses are the row's plus
// compile-time steps.
template <class C, class RowOf>
__device__ __forceinline__ void copy_rows_by_eights(typename C::cache_t* k_tile, typename C::cache_t* v_tile,
                                                    const DecodeParams& p, const DecodeSeq& sq, RowOf row_of) {
    static_assert(C::kRowsByEights, "rows of 8-chunk groups, 8 threads a row");
    constexpr int kRowStep = C::kNThreads / 8, kGroups = C::kChunksPerRow / 8;
    static_assert(kRowStep % 8 == 0, "a thread's rows share row % 8");
    const int lane8 = threadIdx.x % 8, r0 = threadIdx.x / 8;
    const int col = lane8 * C::kCacheChunkElems;                                // this thread's column in a group
    const int swz = ((lane8 ^ (r0 % 8)) - lane8) * C::kCacheChunkElems;        // its swizzled shift
#pragma unroll
    for (int pass = 0; pass < C::kBlockN / kRowStep; ++pass) {
        const int r = r0 + pass * kRowStep;
        const typename C::cache_t* k_row;
        const typename C::cache_t* v_row;
        row_of(r, k_row, v_row);
        typename C::cache_t* k_dst = k_tile + r * C::kHeadDim + col + swz;
        typename C::cache_t* v_dst = v_tile + r * C::kHeadDim + col + swz;
#pragma unroll
        for (int grp = 0; grp < kGroups; ++grp) {
            const int c = col + grp * 8 * C::kCacheChunkElems;
            const bool valid = k_row != nullptr && c < p.head_dim, v_valid = v_row != nullptr && c < p.out_dim;
            cp_async_16(k_dst + grp * 8 * C::kCacheChunkElems, valid ? k_row + c : k_cache_of<C>(sq), valid);
            if constexpr (!C::kMla)
                cp_async_16(v_dst + grp * 8 * C::kCacheChunkElems, v_valid ? v_row + c : v_cache_of<C>(sq), v_valid);
        }
    }
}

// K and V rows j0 .. j0 + kBlockN - 1 into one stage; rows at or past j_end, K columns past head_dim
// and V columns past out_dim (a value head dim of its own) are zero-filled, never read (cache slots
// past cache_seqlens cannot leak into a result).
template <class C>
__device__ __forceinline__ void load_kv_tile(typename C::cache_t* k_tile, typename C::cache_t* v_tile,
                                             const DecodeParams& p, const DecodeSeq& sq, int j0, int j_end) {
    using cache_t = typename C::cache_t;
    constexpr int kRowStep = C::kNThreads / C::kChunksPerRow;
    const cache_t* k_cache = k_cache_of<C>(sq);
    const cache_t* v_cache = v_cache_of<C>(sq);
    if constexpr (C::kRowsByEights) {
        copy_rows_by_eights<C>(k_tile, v_tile, p, sq, [&](int r, const cache_t*& k_row, const cache_t*& v_row) {
            const int j = j0 + r;
            k_row = v_row = nullptr;
            long long k_off, v_off;
            if (j >= j_end) return;
            if (j >= sq.cache_len) {   // an appended token: read from k_new / v_new, not from the slot being written
                const long long t = j - sq.cache_len;
                k_row = sq.k_new + t * p.k_new_row_stride;
                v_row = sq.v_new + t * p.v_new_row_stride;
            } else if (cache_offsets<C>(p, sq, j, &k_off, &v_off)) {   // (else a page not the cache's: zeros)
                k_row = k_cache + k_off;
                v_row = v_cache + v_off;
            }
        });
        return;
    }
    if constexpr (!C::kPaged && C::kNThreads % C::kChunksPerRow == 0) {
        // Most tiles of a contiguous cache lie wholly inside the cached keys: each thread walks down
        // its column with one pointer per tensor, a constant stride per step (no per-row checks).
        if (j0 + C::kBlockN <= min(sq.cache_len, j_end)) {
            const int r = threadIdx.x / C::kChunksPerRow, c = (threadIdx.x % C::kChunksPerRow) * C::kCacheChunkElems;
            const bool valid = c < p.head_dim, v_valid = c < p.out_dim;
            const cache_t* k_src = valid ? k_cache + (j0 + r) * p.k_row_stride + c : k_cache;
            const cache_t* v_src = v_valid ? v_cache + (j0 + r) * p.v_row_stride + c : v_cache;
            const long long k_step = valid ? kRowStep * p.k_row_stride : 0;
            const long long v_step = v_valid ? kRowStep * p.v_row_stride : 0;
#pragma unroll C::kLoadUnroll
            for (int it = 0; it < C::kLoadIters; ++it) {
                const int off = tile_offset<C>(r + it * kRowStep, c);
                cp_async_16(k_tile + off, k_src, valid);
                if constexpr (!C::kMla) cp_async_16(v_tile + off, v_src, v_valid);
                k_src += k_step;
                v_src += v_step;
            }
            return;
        }
    }
#pragma unroll C::kLoadUnroll
    for (int it = 0; it < C::kLoadIters; ++it) {
        const int idx = threadIdx.x + it * C::kNThreads;
        const int r = idx / C::kChunksPerRow, c = (idx % C::kChunksPerRow) * C::kCacheChunkElems;
        const int j = j0 + r;
        bool row = j < j_end && c < max(p.head_dim, p.out_dim);
        const int off = tile_offset<C>(r, c);
        const cache_t* k_src = k_cache;
        const cache_t* v_src = v_cache;
        if (row) {
            if (j < sq.cache_len) {
                long long k_off, v_off;
                if (cache_offsets<C>(p, sq, j, &k_off, &v_off)) {
                    k_src += k_off + c;
                    v_src += v_off + c;
                } else {
                    row = false;   // a row on a page that is not the cache's reads as zeros
                }
            } else {   // an appended token: read from k_new / v_new, not from the slot being written
                const long long t = j - sq.cache_len;
                if constexpr (C::kFp8) {
                    store_new_chunk_fp8<C>(k_tile, v_tile, off, p, sq, t, c);
                    continue;
                } else {
                    k_src = sq.k_new + t * p.k_new_row_stride + c;
                    v_src = sq.v_new + t * p.v_new_row_stride + c;
                }
            }
        }
        const bool valid = row && c < p.head_dim, v_valid = row && c < p.out_dim;
        cp_async_16(k_tile + off, valid ? k_src : k_cache, valid);
        if constexpr (!C::kMla) cp_async_16(v_tile + off, v_valid ? v_src : v_cache, v_valid);   // MLA: v_tile is k_tile
    }
}

// ---- Paged caches: page lookups one tile ahead of the copies.
//
// A paged K/V row's address depends on a block_table read. Looked up by the copying threads at
// issue time (division by page_size, __ldg, 64-bit multiply per row, kLoadIters rows per thread),
// every tile's cp.async waited out one dependent global-load latency before it could issue, and the
// compute of the current tile waited behind it: the loop ran latency bound, ~25% under the
// contiguous path. Instead, thread r < kBlockN looks up key row r of the tile AFTER the one being
// issued (PagedRowFetch::fetch, at the top of an iteration: the __ldg result is consumed one whole
// loop iteration later, so its latency hides behind that iteration's wait and compute), turns it into
// the row's K and V addresses at the top of the next iteration (publish), and the copying threads
// read those from shared memory: one broadcast LDS.64 per tensor and row, then a 32-bit column
// offset, 16-byte cp.async as before.

// The K and V row addresses of one tile, double buffered: buffer (tile % 2) is written at the top of
// the iteration that issues `tile` (before its __syncthreads) while buffer (tile - 1) % 2 may still
// be read by a slower warp issuing tile - 1; the previous reader of (tile % 2), tile - 2, is behind
// that iteration's barrier. nullptr: a row past key_end (zero-filled).
template <int kRows, typename cache_t>
struct PagedRows {
    const cache_t* k[2][kRows];
    const cache_t* v[2][kRows];
};

// Key j's page in its sequence's block_table row: a shift for pages of a power of two rows (the
// sizes serving engines use), a division otherwise (about twenty instructions). fp8 pages of 16,
// H200, graph-replayed: 6% less time at (1, 32k), within 2% either way at (8, 8k) to (1, 128k).
__device__ __forceinline__ int page_of_key(int j, int page_size) {
    return (page_size & (page_size - 1)) == 0 ? j >> (__ffs(page_size) - 1) : j / page_size;
}

// One key row's page, fetched by thread r = threadIdx.x < kBlockN for row r of a future tile. Only the
// page is held across the iteration and publish recomputes the row inside it: holding both spilled the
// fp8 keys-as-M tile at two CTAs an SM (128 registers).
struct PagedRowFetch {
    int page;   // block_table entry (valid when the row is a cached key; checked by publish)

    template <class C>
    __device__ __forceinline__ void fetch(const DecodeParams& p, const DecodeSeq& sq, int j0, int key_end) {
        const int j = j0 + int(threadIdx.x);
        if (threadIdx.x < C::kBlockN && j < key_end && j < sq.cache_len)
            page = __ldg(sq.pages + page_of_key(j, p.page_size));   // not waited on here: consumed by publish
    }

    // The row's addresses into buffer `buf`; j0 as passed to fetch.
    template <class C>
    __device__ __forceinline__ void publish(PagedRows<C::kBlockN, typename C::cache_t>& rows, int buf,
                                            const DecodeParams& p, const DecodeSeq& sq, int j0, int key_end) const {
        if (threadIdx.x >= C::kBlockN) return;
        const int r = threadIdx.x, j = j0 + r;
        const typename C::cache_t* k_row = nullptr;
        const typename C::cache_t* v_row = nullptr;
        if (j < key_end && j < sq.cache_len) {   // a cached key: fetch loaded its page
            const int slot = j - page_of_key(j, p.page_size) * p.page_size;
            // The page is range-checked here, where its load has landed anyway (in fetch, the test
            // would wait on it); a row on a page that is not the cache's stays nullptr: zeros.
            if (page_in_cache(page, p.num_pages)) {
                // 64-bit: a page pool can exceed 2^31 elements. Once per row per tile, not per copy.
                k_row = k_cache_of<C>(sq) + static_cast<long long>(page) * p.k_batch_stride + slot * p.k_row_stride;
                v_row = v_cache_of<C>(sq) + static_cast<long long>(page) * p.v_batch_stride + slot * p.v_row_stride;
            }
        } else if (j < key_end) {   // an appended token: read from k_new / v_new, not from the slot being written
            // (fp8: left nullptr; load_kv_tile_paged quantises the row from k_new / v_new itself)
            if constexpr (!C::kFp8) {
                const long long t = j - sq.cache_len;
                k_row = sq.k_new + t * p.k_new_row_stride;
                v_row = sq.v_new + t * p.v_new_row_stride;
            }
        }
        rows.k[buf][r] = k_row;
        rows.v[buf][r] = v_row;
    }
};

// K and V rows of one tile into one stage from published row addresses (after a __syncthreads).
// j0, key_end: the tile's first key and the split's end (fp8: appended rows are quantised here).
// kAppended: whether the tile may hold appended rows (fp8 only); the other tiles' copies take no
// branch, so that the compiler batches their reads of the row addresses (with the lookups issued
// before the loop's wait: fp8 pages of 16, H200, graph-replayed, 3-9% less time at (1, 32k),
// (8, 8k), (32, 4k), (1, 128k)).
template <class C, bool kAppended>
__device__ __forceinline__ void copy_paged_rows(typename C::cache_t* k_tile, typename C::cache_t* v_tile,
                                                const PagedRows<C::kBlockN, typename C::cache_t>& rows, int buf,
                                                const DecodeParams& p, const DecodeSeq& sq, int j0, int key_end) {
    if constexpr (C::kRowsByEights) {
        copy_rows_by_eights<C>(k_tile, v_tile, p, sq, [&](int r, const typename C::cache_t*& k_row,
                                                          const typename C::cache_t*& v_row) {
            k_row = rows.k[buf][r];
            v_row = k_row != nullptr ? rows.v[buf][r] : nullptr;
        });
        return;
    }
#pragma unroll C::kLoadUnroll
    for (int it = 0; it < C::kLoadIters; ++it) {
        const int idx = threadIdx.x + it * C::kNThreads;
        const int r = idx / C::kChunksPerRow, c = (idx % C::kChunksPerRow) * C::kCacheChunkElems;
        const typename C::cache_t* k_row = rows.k[buf][r];
        const typename C::cache_t* v_row = rows.v[buf][r];
        const bool valid = k_row != nullptr && c < p.head_dim, v_valid = k_row != nullptr && c < p.out_dim;
        const int off = tile_offset<C>(r, c);
        if constexpr (kAppended) {
            const int j = j0 + r;
            if (!valid && j >= sq.cache_len && j < key_end && c < p.head_dim) {
                store_new_chunk_fp8<C>(k_tile, v_tile, off, p, sq, j - sq.cache_len, c);
                continue;
            }
        }
        cp_async_16(k_tile + off, valid ? k_row + c : k_cache_of<C>(sq), valid);
        if constexpr (!C::kMla) cp_async_16(v_tile + off, v_valid ? v_row + c : v_cache_of<C>(sq), v_valid);
    }
}

template <class C>
__device__ __forceinline__ void load_kv_tile_paged(typename C::cache_t* k_tile, typename C::cache_t* v_tile,
                                                   const PagedRows<C::kBlockN, typename C::cache_t>& rows, int buf,
                                                   const DecodeParams& p, const DecodeSeq& sq, int j0, int key_end) {
    // With score modifiers, whose registers the batched reads would spill into (fp8 keys as M at two
    // CTAs an SM: 4 bytes of 128 registers), every tile takes the checked copies.
    if (C::kFp8 && (C::kScoreMods || (j0 + C::kBlockN > sq.cache_len && j0 < key_end)))
        copy_paged_rows<C, C::kFp8>(k_tile, v_tile, rows, buf, p, sq, j0, key_end);
    else
        copy_paged_rows<C, false>(k_tile, v_tile, rows, buf, p, sq, j0, key_end);
}

// The CTA's packed query rows; rows past Sq * group and columns past head_dim are zero-filled.
// q_start: the sequence's first query row (ragged new tokens, p.cu_seqlens_q; 0 otherwise).
template <class C>
__device__ __forceinline__ void load_q_tile(elem_t* q_tile, const DecodeParams& p, int b, int h_kv, int row0,
                                            int rows_total, long long q_start) {
    // Chunks of q's own type: an fp8 cache row has half as many 16-byte chunks as a q row.
    constexpr int kQChunksPerRow = C::kHeadDim / C::kChunkElems;
    for (int idx = threadIdx.x; idx < C::kBlockM * kQChunksPerRow; idx += C::kNThreads) {
        const int r = idx / kQChunksPerRow, c = (idx % kQChunksPerRow) * C::kChunkElems;
        const int pr = row0 + r;
        const bool valid = pr < rows_total && c < p.head_dim;
        const elem_t* src = static_cast<const elem_t*>(p.q);
        if (valid) {
            const int i = pr / p.group, h = h_kv * p.group + pr % p.group;
            src += b * p.q_batch_stride + (q_start + i) * p.q_row_stride + h * p.q_head_stride + c;
        }
        int off;
        if constexpr (C::kSimt) off = r * C::kHeadDim + c;   // read as broadcasts: no swizzle needed
        else off = swizzled<C::kHeadDim>(r, c);
        cp_async_16(q_tile + off, src, valid);
    }
}

// fp8 caches, bf16 q: the CTA's rows as fp16 mma operands, stored as load_q_tile stores them. Each row
// is scaled by 2^e so that its largest magnitude lies in [2^15, 2^16) (bf16's 8 significant bits keep
// it below fp16's 65504), and q_unscale[r] = 2^-e undoes that on the row's float32 scores. A value
// converts exactly unless it is below 2^-33 of its row's largest, where fp16's subnormals round it by
// at most 2^-40 of that largest value: below float32's rounding of the dot product. An infinite largest
// value keeps e = 0 (infinities and NaN convert to themselves); a zero one (or one below float32's
// normal range) takes e = 126.
template <class C>
__device__ __forceinline__ void load_q_tile_fp8(elem_t* q_tile, float* q_unscale, const DecodeParams& p, int b,
                                                int h_kv, int row0, int rows_total, long long q_start) {
    constexpr int kPairSteps = C::kHeadDim / 64;   // column pairs per lane
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int r = warp; r < C::kBlockM; r += C::kNWarps) {
        const int pr = row0 + r;
        const elem_t* src = nullptr;
        if (pr < rows_total) {
            const int i = pr / p.group, h = h_kv * p.group + pr % p.group;
            src = static_cast<const elem_t*>(p.q) + b * p.q_batch_stride + (q_start + i) * p.q_row_stride +
                  h * p.q_head_stride;
        }
        float2 x[kPairSteps];
        float top = 0.f;
#pragma unroll
        for (int it = 0; it < kPairSteps; ++it) {
            const int c = 2 * lane + 64 * it;
            const unsigned bits = src != nullptr && c < p.head_dim ? *reinterpret_cast<const unsigned*>(src + c) : 0u;
            x[it] = make_float2(__uint_as_float(bits << 16), __uint_as_float(bits & 0xffff0000u));
            top = fmaxf(top, fmaxf(fabsf(x[it].x), fabsf(x[it].y)));
        }
#pragma unroll
        for (int offset = 16; offset > 0; offset /= 2) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, offset));
        const int biased = __float_as_uint(top) >> 23;   // top >= 0: its exponent field
        const int e = biased == 0xff ? 0 : biased == 0 ? 126 : min(15 - (biased - 127), 126);
        const float scale = __uint_as_float(unsigned(127 + e) << 23);
#pragma unroll
        for (int it = 0; it < kPairSteps; ++it) {
            const int c = 2 * lane + 64 * it;
            *reinterpret_cast<unsigned*>(q_tile + swizzled<C::kHeadDim>(r, c)) =
                pack2<half_t>(x[it].x * scale, x[it].y * scale);
        }
        if (lane == 0) q_unscale[r] = __uint_as_float(unsigned(127 - e) << 23);
    }
}

// k_new / v_new rows into the cache at cache_len + t (16-byte vectors; alignment checked by the host;
// fp8: 16 values quantised into 16 bytes per step). Rows whose page is not the cache's are dropped.
template <class C>
__device__ __forceinline__ void append_new_rows(const DecodeParams& p, const DecodeSeq& sq) {
    // Columns: K's head_dim, V's out_dim (a value head dim of its own; fp8 and MLA: out_dim <= head_dim).
    const int chunks = max(p.head_dim, C::kMla ? 0 : p.out_dim) / C::kCacheChunkElems;
    for (int idx = threadIdx.x; idx < p.seqlen_new * chunks; idx += C::kNThreads) {
        const int t = idx / chunks, c = (idx % chunks) * C::kCacheChunkElems;
        long long k_off, v_off;
        if (!cache_offsets<C>(p, sq, sq.cache_len + t, &k_off, &v_off)) continue;
        const elem_t* k_src = sq.k_new + t * p.k_new_row_stride + c;
        const elem_t* v_src = sq.v_new + t * p.v_new_row_stride + c;
        uint4* k_dst = reinterpret_cast<uint4*>(k_cache_of<C>(sq) + k_off + c);
        uint4* v_dst = reinterpret_cast<uint4*>(v_cache_of<C>(sq) + v_off + c);
        if constexpr (C::kFp8) {
            *k_dst = quantize_e4m3x16<elem_t>(k_src, sq.k_scale);
            *v_dst = quantize_e4m3x16<elem_t>(v_src, sq.v_scale);
        } else {
            if (c < p.head_dim) *k_dst = *reinterpret_cast<const uint4*>(k_src);
            if constexpr (!C::kMla) {   // MLA: the same row
                if (c < p.out_dim) *v_dst = *reinterpret_cast<const uint4*>(v_src);
            }
        }
    }
}

// Score of query i (head h) and key j: log2 units on the score-modifier path (mask.cuh's
// modified_score, a user ScoreMod / MaskMod, then decode's mask), otherwise the raw q.k that the
// softmax scales itself. -inf where hidden: padding rows (i < 0), keys of the next split
// (j >= key_end), the window, the masks.
// The decode mask's columns line up with the last mask_keys keys of the sequence (the new tokens of
// a tree mask); keys before them are not masked. mask_keys == 0: a single column for every key.
// A user modifier sees absolute positions in the sequence: q_idx = i + T_b - Sq (query i is token
// cache_len + seqlen_new - Sq + i), kv_idx = j; b the sequence, h the query head (docs/design.md §2b).
template <class C>
__device__ __forceinline__ float decode_score(const DecodeParams& p, const DecodeSeq& sq, float qk, int i, int h,
                                              int j, int key_end) {
    if (i < 0 || j >= key_end) return -CUFLASH_INF;
    if constexpr (C::kScoreMods) {
        SeqInfo s = sq.s;
        s.h = h;
        float x = modified_score<C::kMods & (kModSoftcap | kModAlibi)>(p.score, s, qk, i, j);
        if constexpr ((C::kMods & (kModUserScore | kModUserMask)) != 0) {
            if (in_window(p.score, s, i, j)) {   // outside it: hidden whatever the modifiers say
                const long long q_idx = i + s.diag;
                if constexpr ((C::kMods & kModUserScore) != 0) x = user_score_mod(x, s.b, h, q_idx, j, p.score.user);
                if constexpr ((C::kMods & kModUserMask) != 0)
                    if (!user_mask_mod(s.b, h, q_idx, j, p.score.user)) x = -CUFLASH_INF;
            }
        }
        if ((C::kMods & kModMask) && p.mask != nullptr) {
            const int col = p.mask_keys == 0 ? 0 : j - (s.seqlen_k - p.mask_keys);
            if (col >= 0 && !p.mask[s.b * p.mask_batch_stride + h * p.mask_head_stride + i * p.mask_row_stride +
                                    col * p.mask_col_stride])
                x = -CUFLASH_INF;
        }
        return x * kLog2e;
    } else {
        return in_window(p.score, sq.s, i, j) ? qk : -CUFLASH_INF;
    }
}

// ------------------------------------------------------------------------------ fp16/bf16: mma.sync

// fp8: 16-column chunk h (0 or 1) of an ldmatrix x4 of K's bytes (kf: keys 0..7 and 8..15 of chunk 0,
// then of chunk 1) as fp16 pairs: k[n][0] is columns 4t, 4t + 1 and k[n][1] columns 4t + 2, 4t + 3 of
// key g + 8n, a lane's 4 consecutive bytes of the key row.
__device__ __forceinline__ void fp8_key_pairs(unsigned (&k)[2][2], const unsigned (&kf)[4], int h) {
#pragma unroll
    for (int n = 0; n < 2; ++n) {
        k[n][0] = e4m3_low_pair(kf[2 * h + n]);
        k[n][1] = e4m3_high_pair(kf[2 * h + n]);
    }
}

// fp8: 16-column chunk h of an ldmatrix.trans x4 of V's bytes (vr: keys 0..7 and 8..15 of chunk 0, then
// of chunk 1; a lane gets columns 2g, 2g + 1 of keys 2t, 2t + 1 per matrix) as fp16 pairs: v[0] column
// 2g and v[1] column 2g + 1 of the chunk, [0] of keys 2t, 2t + 1 and [1] of keys 2t + 8, 2t + 9.
__device__ __forceinline__ void fp8_value_pairs(unsigned (&v)[2][2], const unsigned (&vr)[4], int h) {
    const unsigned even = __byte_perm(vr[2 * h], vr[2 * h + 1], 0x6420);   // keys 2t, 2t+1, 2t+8, 2t+9
    const unsigned odd = __byte_perm(vr[2 * h], vr[2 * h + 1], 0x7531);
    v[0][0] = e4m3_low_pair(even);
    v[0][1] = e4m3_high_pair(even);
    v[1][0] = e4m3_low_pair(odd);
    v[1][1] = e4m3_high_pair(odd);
}

// fp8, the A fragment of Q's columns 16 kk.. for mma_scores_fp8's order of the contraction: logical
// columns 2t, 2t + 1 are 16 kk + 4t + 0, 1 and logical 2t + 8, 2t + 9 are 16 kk + 4t + 2, 3, where a
// K row's bytes land in ldmatrix (4 consecutive bytes per lane). Two 8-byte reads of the Q tile.
template <class C>
__device__ __forceinline__ void q_fragment_fp8(unsigned (&qf)[4], const elem_t* q_smem, int kk) {
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const uint2 top = *reinterpret_cast<const uint2*>(q_smem + swizzled<C::kHeadDim>(g, 16 * kk + 4 * t));
    const uint2 bottom = *reinterpret_cast<const uint2*>(q_smem + swizzled<C::kHeadDim>(g + 8, 16 * kk + 4 * t));
    qf[0] = top.x;
    qf[1] = bottom.x;
    qf[2] = top.y;
    qf[3] = bottom.y;
}

// fp8: S = Q K^T for 16 rows x the warp's 16 keys, straight from the stage's bytes. One ldmatrix
// reads 16 keys x 32 bytes; a lane holds 4 consecutive bytes of a key row per matrix, which are its
// B fragment's two pairs once Q's columns are taken in q_fragment_fp8's order.
template <class C>
__device__ __forceinline__ void mma_scores_fp8(float (&acc_s)[1][2][4],
                                               const unsigned (&q_frag)[C::kQInRegs ? C::kHeadDim / 16 : 1][4],
                                               const elem_t* q_smem, unsigned k_tile,
                                               const Fp8Lanes<C::kHeadDim>& lanes, int key0) {
#pragma unroll
    for (int step = 0; step < C::kHeadDim / 32; ++step) {
        unsigned kf[4];   // keys 0..7 and 8..15 of chunk 2 step, then of chunk 2 step + 1
        ldmatrix_x4(kf, lanes.at(k_tile, step, key0));
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            unsigned qf[4];
            if constexpr (C::kQInRegs) {
#pragma unroll
                for (int e = 0; e < 4; ++e) qf[e] = q_frag[2 * step + h][e];
            } else {
                q_fragment_fp8<C>(qf, q_smem, 2 * step + h);
            }
            unsigned k[2][2];
            fp8_key_pairs(k, kf, h);
#pragma unroll
            for (int ni = 0; ni < 2; ++ni) mma_16816<half_t>(acc_s[0][ni], qf, k[ni][0], k[ni][1]);
        }
    }
}

// fp8: O += P V from the stage's bytes. ldmatrix.trans of 16-bit elements hands a lane two keys'
// byte pairs (columns 2g, 2g + 1) per matrix; the even bytes are column 2g of four keys, the odd ones
// column 2g + 1, so chunk c's 16 columns go to two accumulator tiles, acc_o[2c] (n = g: column
// 16c + 2g) and acc_o[2c + 1] (column 16c + 2g + 1), put back in order by mma_warp_store.
template <class C>
__device__ __forceinline__ void mma_pv_fp8(float (&acc_o)[C::kVCols / 8][4], const unsigned (&p_frag)[4],
                                           unsigned v_tile, const Fp8Lanes<C::kHeadDim>& lanes, int key0) {
#pragma unroll
    for (int step = 0; step < C::kHeadDim / 32; ++step) {
        unsigned vr[4];
        ldmatrix_x4_trans(vr, lanes.at(v_tile, step, key0));
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int c = 2 * step + h;
            unsigned v[2][2];
            fp8_value_pairs(v, vr, h);
            mma_16816<half_t>(acc_o[2 * c], p_frag, v[0][0], v[0][1]);
            mma_16816<half_t>(acc_o[2 * c + 1], p_frag, v[1][0], v[1][1]);
        }
    }
}

// A warp's running state on the mma paths: this thread's fragments of O (kTiles accumulator tiles)
// and the online softmax of its two rows.
template <int kTiles>
struct FragmentState {
    float acc_o[kTiles][4];
    OnlineSoftmax<1> softmax;

    __device__ __forceinline__ void init() {
#pragma unroll
        for (int i = 0; i < kTiles; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_o[i][e] = 0.f;
        softmax.init();
    }
};

// O for the CTA's 16 rows: 8 columns a tile.
template <class C>
using MmaWarpState = FragmentState<C::kVCols / 8>;

// The warp's 16 keys of one stage. key0: their first row in the tile; j_warp: the first key's index.
// rows_i / rows_h: query index and head of this thread's rows g and g + 8 (-1: padding).
template <class C>
__device__ __forceinline__ void mma_warp_tile(MmaWarpState<C>& st,
                                              const unsigned (&q_frag)[C::kQInRegs ? C::kHeadDim / 16 : 1][4],
                                              unsigned q_tile, unsigned k_tile, unsigned v_tile,
                                              const SwizzledLanes<C::kHeadDim>& q_lanes,
                                              const SwizzledLanes<C::kHeadDim>& k_lanes,
                                              const SwizzledLanes<C::kHeadDim>& v_lanes,
                                              const Fp8Lanes<C::kHeadDim>& kv8_lanes, const elem_t* q_smem,
                                              const float (&score_factor)[2], int key0, int j_warp,
                                              bool masked, const DecodeParams& p, const DecodeSeq& sq,
                                              int key_end, const int (&rows_i)[2], const int (&rows_h)[2]) {
    const int t = threadIdx.x % 4;
    // S = Q K^T for 16 rows x 16 keys.
    float acc_s[1][2][4];
#pragma unroll
    for (int ni = 0; ni < 2; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_s[0][ni][e] = 0.f;
    if constexpr (C::kFp8) {
        mma_scores_fp8<C>(acc_s, q_frag, q_smem, k_tile, kv8_lanes, key0);
        // K held the e4m3 values (and a bf16 q row its power of two 2^e): k_scale / 2^e per row.
#pragma unroll
        for (int ni = 0; ni < 2; ++ni)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_s[0][ni][e] *= score_factor[e / 2];
    } else {
#pragma unroll
        for (int kk = 0; kk < C::kHeadDim / 16; ++kk) {
            unsigned qf[4];
            if constexpr (C::kQInRegs) {
#pragma unroll
                for (int e = 0; e < 4; ++e) qf[e] = q_frag[kk][e];
            } else {
                ldmatrix_x4(qf, q_lanes.at(q_tile, kk, 0));
            }
            unsigned kf[4];
            ldmatrix_x4(kf, k_lanes.at(k_tile, kk, key0));
            mma_16816<elem_t>(acc_s[0][0], qf, kf[0], kf[1]);
            mma_16816<elem_t>(acc_s[0][1], qf, kf[2], kf[3]);
        }
    }

    // Only tiles on a window edge, the split's end or with score modifiers pay for per-element work.
    if (C::kScoreMods || masked) {
#pragma unroll
        for (int ni = 0; ni < 2; ++ni)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int j = j_warp + ni * 8 + 2 * t + (e % 2);
                acc_s[0][ni][e] = decode_score<C>(p, sq, acc_s[0][ni][e], rows_i[e / 2], rows_h[e / 2], j, key_end);
            }
    }

    float correction[2];
    st.softmax.update(acc_s, correction, C::kScoreMods ? 1.f : p.score.scale_log2);
#pragma unroll
    for (int di = 0; di < C::kVCols / 8; ++di)
#pragma unroll
        for (int e = 0; e < 4; ++e) st.acc_o[di][e] *= correction[e / 2];

    // O += P V with P straight from the S accumulators (their layout is the A layout).
    unsigned p_frag[4];
    p_frag[0] = pack2<typename C::mma_t>(acc_s[0][0][0], acc_s[0][0][1]);
    p_frag[1] = pack2<typename C::mma_t>(acc_s[0][0][2], acc_s[0][0][3]);
    p_frag[2] = pack2<typename C::mma_t>(acc_s[0][1][0], acc_s[0][1][1]);
    p_frag[3] = pack2<typename C::mma_t>(acc_s[0][1][2], acc_s[0][1][3]);
    if constexpr (C::kFp8) {
        mma_pv_fp8<C>(st.acc_o, p_frag, v_tile, kv8_lanes, key0);
    } else {
#pragma unroll
        for (int dj = 0; dj < C::kVCols / 16; ++dj) {
            unsigned vf[4];
            ldmatrix_x4_trans(vf, v_lanes.at(v_tile, dj, key0));
            mma_16816<elem_t>(st.acc_o[2 * dj], p_frag, vf[0], vf[1]);
            mma_16816<elem_t>(st.acc_o[2 * dj + 1], p_frag, vf[2], vf[3]);
        }
    }
}

// The warp's O rows, row maxima and full row sums into the combine buffer.
template <class C>
__device__ __forceinline__ void mma_warp_store(MmaWarpState<C>& st, float* comb, float* warp_m, float* warp_l) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int row = g + 8 * half;
        if constexpr (C::kFp8) {   // mma_pv_fp8's tiles 2c, 2c + 1 hold columns 16c + 4t + 0, 2 and 1, 3
            float* dst = comb + (warp * C::kBlockM + row) * C::kCombStride + 4 * t;
#pragma unroll
            for (int c = 0; c < C::kVCols / 16; ++c)
                *reinterpret_cast<float4*>(dst + c * 16) =
                    make_float4(st.acc_o[2 * c][2 * half], st.acc_o[2 * c + 1][2 * half], st.acc_o[2 * c][2 * half + 1],
                                st.acc_o[2 * c + 1][2 * half + 1]);
        } else {
            float* dst = comb + (warp * C::kBlockM + row) * C::kCombStride + 2 * t;
#pragma unroll
            for (int di = 0; di < C::kVCols / 8; ++di)
                *reinterpret_cast<float2*>(dst + di * 8) =
                    make_float2(st.acc_o[di][2 * half], st.acc_o[di][2 * half + 1]);
        }
        const float row_sum = quad_sum(st.softmax.l[half]);
        if (t == 0) {
            warp_m[warp * C::kBlockM + row] = st.softmax.m[half];
            warp_l[warp * C::kBlockM + row] = row_sum;
        }
    }
}

// ------------------------------------------------------------------- fp16/bf16: keys as the mma's M
//
// With at most 8 packed rows (one new token, a GQA group of up to 8: CUFLASH_KEYS_AS_M), the 16-row
// layout above leaves half or more of every mma, of O's accumulators and of Q's fragments on padding
// rows. Here the products are transposed: S^T = K Q^T (the warp's 16 keys as M, the CTA's 8 rows as
// N) and O^T = V^T P^T (16 of O's columns as M per mma): half the mma and half the accumulator
// registers of the 16-row tile. A lane holds S^T for keys g, g + 8 and rows 2t, 2t + 1, so a row's
// maximum and sum reduce across the 8 lanes of its t (shuffles by 4, 8, 16), and P^T becomes the B
// fragment of O^T = V^T P^T through one movmatrix (an 8x8 transpose in registers) per 8 keys.
// K's A fragments are K's rows as they are (16-bit: ldmatrix; fp8: the bytes in q_fragment_fp8's
// column order, as mma_scores_fp8); V^T's are ldmatrix.trans of V's rows (fp8: O^T's rows g and
// g + 8 are columns 16c + 2g and 16c + 2g + 1, as in mma_pv_fp8).

__device__ __forceinline__ unsigned movmatrix_trans(unsigned x) {
    unsigned r;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(r) : "r"(x));
    return r;
}

// Q^T's B fragments (d as K, the CTA's 8 rows as N) for every 16 columns of d, read once per CTA:
// 16-bit, columns 2t, 2t + 1 and 2t + 8, 2t + 9 of row g; fp8, columns 4t .. 4t + 3 (q_fragment_fp8's order).
template <class C>
__device__ __forceinline__ void q_columns(unsigned (&q_cols)[C::kHeadDim / 16][2], const elem_t* q_smem) {
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
    for (int kk = 0; kk < C::kHeadDim / 16; ++kk) {
        if constexpr (C::kFp8) {
            const uint2 x = *reinterpret_cast<const uint2*>(q_smem + swizzled<C::kHeadDim>(g, 16 * kk + 4 * t));
            q_cols[kk][0] = x.x;
            q_cols[kk][1] = x.y;
        } else {
            q_cols[kk][0] = *reinterpret_cast<const unsigned*>(q_smem + swizzled<C::kHeadDim>(g, 16 * kk + 2 * t));
            q_cols[kk][1] = *reinterpret_cast<const unsigned*>(q_smem + swizzled<C::kHeadDim>(g, 16 * kk + 2 * t + 8));
        }
    }
}

// On this path O^T: 16 columns by 8 rows a tile (this lane's columns g and g + 8 of each, rows 2t and
// 2t + 1), and the online softmax of rows 2t, 2t + 1 (l over this lane's keys).
template <class C>
using KeysMWarpState = FragmentState<C::kVCols / 16>;

// The warp's 16 keys of one stage; row_query / row_head: the CTA's packed rows (shared memory), read
// for rows 2t and 2t + 1 on tiles that need them only (held in registers across the loop, they pushed
// the fp8 tile of two CTAs an SM past its 128). Element e of S^T is key g + 8 (e / 2), row 2t + (e % 2).
template <class C>
__device__ __forceinline__ void keys_m_warp_tile(KeysMWarpState<C>& st, const unsigned (&q_cols)[C::kHeadDim / 16][2],
                                                 unsigned k_tile, unsigned v_tile,
                                                 const SwizzledLanes<C::kHeadDim>& k_lanes,
                                                 const SwizzledLanes<C::kHeadDim>& v_lanes,
                                                 const Fp8Lanes<C::kHeadDim>& kv8_lanes,
                                                 const float (&score_factor)[2], int key0, int j_warp, bool masked,
                                                 const DecodeParams& p, const DecodeSeq& sq, int key_end,
                                                 const int* row_query, const int* row_head) {
    using mma_t = typename C::mma_t;
    const int g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
    float acc_s[4] = {0.f, 0.f, 0.f, 0.f};
    if constexpr (C::kFp8) {
#pragma unroll
        for (int step = 0; step < C::kHeadDim / 32; ++step) {
            unsigned kf[4];   // keys 0..7 and 8..15 of chunk 2 step, then of chunk 2 step + 1
            ldmatrix_x4(kf, kv8_lanes.at(k_tile, step, key0));
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                unsigned k[2][2];
                fp8_key_pairs(k, kf, h);
                const unsigned a[4] = {k[0][0], k[1][0], k[0][1], k[1][1]};   // keys g, g + 8 as rows
                mma_16816<half_t>(acc_s, a, q_cols[2 * step + h][0], q_cols[2 * step + h][1]);
            }
        }
    } else {
#pragma unroll
        for (int kk = 0; kk < C::kHeadDim / 16; ++kk) {
            unsigned a[4];
            ldmatrix_x4(a, k_lanes.at(k_tile, kk, key0));
            mma_16816<elem_t>(acc_s, a, q_cols[kk][0], q_cols[kk][1]);
        }
    }
    if constexpr (C::kFp8) {   // K held the e4m3 values (and a bf16 q row its power of two 2^e): k_scale / 2^e
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_s[e] *= score_factor[e % 2];
    }
    if (C::kScoreMods || masked) {
#pragma unroll
        for (int e = 0; e < 4; ++e)
            acc_s[e] = decode_score<C>(p, sq, acc_s[e], row_query[2 * t + e % 2], row_head[2 * t + e % 2],
                                       j_warp + g + 8 * (e / 2), key_end);
    }

    // The online softmax of rows 2t and 2t + 1: a row's maximum reduces across the 8 lanes of its t.
    const float scale_log2 = C::kScoreMods ? 1.f : p.score.scale_log2;
    float correction[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float top = fmaxf(acc_s[r], acc_s[r + 2]);
#pragma unroll
        for (int offset = 4; offset < 32; offset *= 2) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, offset));
        const float m_scaled = st.softmax.move_max(r, fmaxf(st.softmax.m[r], top), scale_log2, correction[r]);
        acc_s[r] = fast_exp2(fmaf(acc_s[r], scale_log2, -m_scaled));
        acc_s[r + 2] = fast_exp2(fmaf(acc_s[r + 2], scale_log2, -m_scaled));
        st.softmax.l[r] = st.softmax.l[r] * correction[r] + (acc_s[r] + acc_s[r + 2]);
    }
    if (!__all_sync(0xffffffffu, correction[0] == 1.f && correction[1] == 1.f)) {
#pragma unroll
        for (int c = 0; c < C::kVCols / 16; ++c)
#pragma unroll
            for (int e = 0; e < 4; ++e) st.acc_o[c][e] *= correction[e % 2];
    }

    // P^T as O^T's B fragment: keys 2t, 2t + 1 (and + 8) of row g, transposed from this lane's keys g, g + 8.
    const unsigned b0 = movmatrix_trans(pack2<mma_t>(acc_s[0], acc_s[1]));
    const unsigned b1 = movmatrix_trans(pack2<mma_t>(acc_s[2], acc_s[3]));
    if constexpr (C::kFp8) {
#pragma unroll
        for (int step = 0; step < C::kHeadDim / 32; ++step) {
            unsigned vr[4];
            ldmatrix_x4_trans(vr, kv8_lanes.at(v_tile, step, key0));
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                unsigned v[2][2];
                fp8_value_pairs(v, vr, h);
                const unsigned a[4] = {v[0][0], v[1][0], v[0][1], v[1][1]};   // columns 2g, 2g + 1 as rows g, g + 8
                mma_16816<half_t>(st.acc_o[2 * step + h], a, b0, b1);
            }
        }
    } else {
#pragma unroll
        for (int c = 0; c < C::kVCols / 16; ++c) {
            unsigned vf[4];   // keys 0..7 and 8..15 of columns 16c.., then of 16c + 8..
            ldmatrix_x4_trans(vf, v_lanes.at(v_tile, c, key0));
            const unsigned a[4] = {vf[0], vf[2], vf[1], vf[3]};
            mma_16816<elem_t>(st.acc_o[c], a, b0, b1);
        }
    }
}

// The warp's O rows, row maxima and full row sums into the combine buffer (as mma_warp_store).
template <class C>
__device__ __forceinline__ void keys_m_warp_store(KeysMWarpState<C>& st, float* comb, float* warp_m, float* warp_l) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = 2 * t + r;
        float* dst = comb + (warp * C::kBlockM + row) * C::kCombStride;
#pragma unroll
        for (int c = 0; c < C::kVCols / 16; ++c) {
            if constexpr (C::kFp8) {   // O^T's rows g, g + 8: columns 16c + 2g, 16c + 2g + 1
                *reinterpret_cast<float2*>(dst + 16 * c + 2 * g) = make_float2(st.acc_o[c][r], st.acc_o[c][2 + r]);
            } else {
                dst[16 * c + g] = st.acc_o[c][r];
                dst[16 * c + 8 + g] = st.acc_o[c][2 + r];
            }
        }
        float row_sum = st.softmax.l[r];
#pragma unroll
        for (int offset = 4; offset < 32; offset *= 2) row_sum += __shfl_xor_sync(0xffffffffu, row_sum, offset);
        if (g == 0) {
            warp_m[warp * C::kBlockM + row] = st.softmax.m[r];
            warp_l[warp * C::kBlockM + row] = row_sum;
        }
    }
}

// ------------------------------------------------------------------------------ float32: FFMA

template <class C>
struct SimtWarpState {
    static constexpr int kCols = C::kHeadDim / 128;   // float4 columns of O per lane: 4 * (lane + 32 c)
    float m[C::kBlockM];                             // running row maximum (raw scores), warp-uniform
    float l[C::kBlockM];                             // this lane's share of the row sums
    float4 acc[C::kBlockM][kCols];

    __device__ __forceinline__ void init() {
#pragma unroll
        for (int r = 0; r < C::kBlockM; ++r) {
            m[r] = -CUFLASH_INF;
            l[r] = 0.f;
#pragma unroll
            for (int c = 0; c < kCols; ++c) acc[r][c] = make_float4(0.f, 0.f, 0.f, 0.f);
        }
    }
};

// The warp's kKeysPerWarp keys of one stage. Lane = key * kLanesPerKey + part: the part's float4
// columns of the key's dot products, summed over the key's lanes; then the online softmax per row,
// P through shared memory (p_warp: [kBlockM][kKeysPerWarp]) and O += P V on the lane's columns.
template <class C>
__device__ __forceinline__ void simt_warp_tile(SimtWarpState<C>& st, const float* q_tile, const float* k_tile,
                                               const float* v_tile, float* p_warp, int key0, int j_warp,
                                               bool masked, const DecodeParams& p, const DecodeSeq& sq,
                                               int key_end, const int* row_query, const int* row_head) {
    constexpr int kLpk = C::kLanesPerKey, kKeys = C::kKeysPerWarp;
    const int lane = threadIdx.x % 32;
    const int kw = lane / kLpk, part = lane % kLpk;
    const int key_row = key0 + kw;

    float s[C::kBlockM];
#pragma unroll
    for (int r = 0; r < C::kBlockM; ++r) s[r] = 0.f;
#pragma unroll
    for (int it = 0; it < C::kHeadDim / 4 / kLpk; ++it) {
        const int col = 4 * (part + kLpk * it);
        const float4 kv = *reinterpret_cast<const float4*>(k_tile + tile_offset<C>(key_row, col));
#pragma unroll
        for (int r = 0; r < C::kBlockM; ++r) {
            const float4 qv = *reinterpret_cast<const float4*>(q_tile + r * C::kHeadDim + col);
            s[r] = fmaf(qv.x, kv.x, s[r]);
            s[r] = fmaf(qv.y, kv.y, s[r]);
            s[r] = fmaf(qv.z, kv.z, s[r]);
            s[r] = fmaf(qv.w, kv.w, s[r]);
        }
    }
#pragma unroll
    for (int r = 0; r < C::kBlockM; ++r)
#pragma unroll
        for (int off = 1; off < kLpk; off *= 2) s[r] += __shfl_xor_sync(0xffffffffu, s[r], off);

    const int j = j_warp + kw;
    if (C::kScoreMods || masked) {
#pragma unroll
        for (int r = 0; r < C::kBlockM; ++r) s[r] = decode_score<C>(p, sq, s[r], row_query[r], row_head[r], j, key_end);
    }

    // Online softmax over the warp's keys (one per lane group): OnlineSoftmax::update's rule without
    // its lazy reference point (here m follows every new maximum).
    const float scale_log2 = C::kScoreMods ? 1.f : p.score.scale_log2;
#pragma unroll
    for (int r = 0; r < C::kBlockM; ++r) {
        float m_new = s[r];
#pragma unroll
        for (int off = kLpk; off < 32; off *= 2) m_new = fmaxf(m_new, __shfl_xor_sync(0xffffffffu, m_new, off));
        m_new = fmaxf(m_new, st.m[r]);
        // A row that has seen only masked keys keeps m = -inf: subtract 0 so that p = 0, not NaN.
        const float m_scaled = m_new == -CUFLASH_INF ? 0.f : m_new * scale_log2;
        const float correction = fast_exp2(st.m[r] * scale_log2 - m_scaled);
        st.m[r] = m_new;
        const float prob = fast_exp2(fmaf(s[r], scale_log2, -m_scaled));
        st.l[r] = st.l[r] * correction + (part == 0 ? prob : 0.f);
#pragma unroll
        for (int c = 0; c < SimtWarpState<C>::kCols; ++c) {
            st.acc[r][c].x *= correction;
            st.acc[r][c].y *= correction;
            st.acc[r][c].z *= correction;
            st.acc[r][c].w *= correction;
        }
        if (part == 0) p_warp[r * kKeys + kw] = prob;
    }
    __syncwarp();
#pragma unroll
    for (int k = 0; k < kKeys; ++k) {
        float4 v[SimtWarpState<C>::kCols];
#pragma unroll
        for (int c = 0; c < SimtWarpState<C>::kCols; ++c)
            v[c] = *reinterpret_cast<const float4*>(v_tile + tile_offset<C>(key0 + k, 4 * (lane + 32 * c)));
#pragma unroll
        for (int r = 0; r < C::kBlockM; ++r) {
            const float pr = p_warp[r * kKeys + k];
#pragma unroll
            for (int c = 0; c < SimtWarpState<C>::kCols; ++c) {
                st.acc[r][c].x = fmaf(pr, v[c].x, st.acc[r][c].x);
                st.acc[r][c].y = fmaf(pr, v[c].y, st.acc[r][c].y);
                st.acc[r][c].z = fmaf(pr, v[c].z, st.acc[r][c].z);
                st.acc[r][c].w = fmaf(pr, v[c].w, st.acc[r][c].w);
            }
        }
    }
    __syncwarp();   // p_warp is rewritten by the next tile
}

template <class C>
__device__ __forceinline__ void simt_warp_store(SimtWarpState<C>& st, float* comb, float* warp_m, float* warp_l) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
    for (int r = 0; r < C::kBlockM; ++r) {
        float row_sum = st.l[r];
#pragma unroll
        for (int off = 1; off < 32; off *= 2) row_sum += __shfl_xor_sync(0xffffffffu, row_sum, off);
        if (lane == 0) {
            warp_m[warp * C::kBlockM + r] = st.m[r];
            warp_l[warp * C::kBlockM + r] = row_sum;
        }
        float* dst = comb + (warp * C::kBlockM + r) * C::kCombStride;
#pragma unroll
        for (int c = 0; c < SimtWarpState<C>::kCols; ++c)
            *reinterpret_cast<float4*>(dst + 4 * (lane + 32 * c)) = st.acc[r][c];
    }
}

// ------------------------------------------------------------------------------ the kernel

// When the index arrays are small, the decode launch checks them itself instead of a check_indices
// launch ahead of it (whose host and stream time a short decode cannot hide): every CTA applies
// check_indices.cu's rules to all of them before its first write (code 1: 0 <= len,
// len + seqlen_new <= capacity; code 2, paged: each page a sequence uses is in [0, num_pages)), from
// loads that hit L2 after the first CTA, so all CTAs reach the same verdict. cuflash/decode.py
// chooses this for every contiguous cache (B lengths) and for paged tables of up to
// kSelfCheckEntriesPerThread entries per thread (one pass below). CTA (0, 0, 0) records the fault
// for the host (no other kernel of the call needs the verdict): a bad length
// first, else the first bad page. Called by every thread of a CTA.
constexpr int kSelfCheckEntriesPerThread = 8;   // cuflash/_heuristics.py DECODE_SELF_CHECK_PER_THREAD

// The check's findings stay in shared memory, so that a CTA can take the verdict before its loop and
// read it again before its writes without holding it in a register through the loop.
__shared__ int first_bad_len, first_bad_page;
constexpr int kNoBadIndex = 0x7fffffff;

__device__ __forceinline__ bool indices_verdict() { return first_bad_len != kNoBadIndex || first_bad_page != kNoBadIndex; }

template <class C>
__device__ __forceinline__ bool indices_faulted(const DecodeParams& p) {
    if (threadIdx.x == 0) first_bad_len = first_bad_page = kNoBadIndex;
    __syncthreads();
    for (int b = threadIdx.x; b < p.batch; b += C::kNThreads) {
        const int len = p.cache_seqlens != nullptr ? p.cache_seqlens[b] : p.seqlen_cache;
        if (len < 0 || static_cast<long long>(len) + p.seqlen_new > p.seqlen_cache) atomicMin(&first_bad_len, b);
    }
    if constexpr (C::kPaged) {
        // kPerThread entries per thread per pass, every load issued before any is tested, so a
        // table of up to kPerThread * kNThreads entries costs one round trip to L2.
        constexpr int kPerThread = kSelfCheckEntriesPerThread;
        const int entries = p.batch * p.max_pages;
        for (int base = 0; base < entries; base += kPerThread * C::kNThreads) {
            int lens[kPerThread], pages[kPerThread];
#pragma unroll
            for (int k = 0; k < kPerThread; ++k) {
                const int idx = base + k * C::kNThreads + threadIdx.x;
                if (idx < entries) {
                    const int b = idx / p.max_pages, col = idx % p.max_pages;
                    lens[k] = p.cache_seqlens != nullptr ? p.cache_seqlens[b] : p.seqlen_cache;
                    pages[k] = p.block_table[b * p.block_table_batch_stride + col];   // inside the table
                }
            }
#pragma unroll
            for (int k = 0; k < kPerThread; ++k) {
                const int idx = base + k * C::kNThreads + threadIdx.x;
                if (idx >= entries) continue;
                const long long keys = static_cast<long long>(lens[k]) + p.seqlen_new;
                const long long first_key = static_cast<long long>(idx % p.max_pages) * p.page_size;
                if (lens[k] < 0 || keys > p.seqlen_cache || first_key >= keys) continue;   // a length fault, or unused
                if (pages[k] < 0 || pages[k] >= p.num_pages) atomicMin(&first_bad_page, idx);
            }
        }
    }
    __syncthreads();
    const int bad_len = first_bad_len, bad_page = first_bad_page;
    const bool faulted = bad_len != kNoBadIndex || bad_page != kNoBadIndex;
    if (blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0 && threadIdx.x == 0) {
        if (faulted) {
            volatile int* report = p.report;
            if (bad_len != kNoBadIndex) {
                report[1] = bad_len;
                report[2] = p.cache_seqlens[bad_len];
            } else {
                report[1] = bad_page;
                report[2] = p.block_table[(bad_page / p.max_pages) * p.block_table_batch_stride + bad_page % p.max_pages];
            }
            __threadfence_system();
            report[0] = bad_len != kNoBadIndex ? 1 : 2;   // kFaultCacheSeqlens / kFaultBlockTable of check_indices.cu, last
        }
    }
    return faulted;
}

// MLA: the CTAs that share a (row block, split), one per kVCols value columns (1 otherwise).
template <class C>
__device__ __forceinline__ int value_halves(const DecodeParams& p) {
    return C::kMla ? (p.out_dim + C::kVCols - 1) / C::kVCols : 1;
}

// The last split's sum out = sum_s w_s o_s over this CTA's rows and columns. A thread takes kVec
// columns of a row (float4 loads where out's columns come in fours), and the loop over the splits is
// unrolled by 8 so that eight splits' loads go out together. A thread a column with four loads in
// flight made the sum a chain of round trips to L2 on the call's last CTA: at (1, 32k) bf16, 16
// splits, H200, the decode took 41.8 us against 38.5 with this and the weights a warp a row.
template <class C, int kVec>
__device__ __forceinline__ void add_split_partials(const DecodeParams& p, int b, const int* row_query,
                                                   const int* row_head, const float* weights, int c0, long long q_start) {
    using vec_t = typename Select<kVec == 4, float4, float>::type;
    const long long o_split_stride = static_cast<long long>(p.batch) * p.heads_q * p.seqlen_q * p.out_dim;
    const int groups = min(C::kVCols, p.out_dim - c0) / kVec;   // this CTA's columns (all but for MLA)
    for (int idx = threadIdx.x; idx < C::kBlockM * groups; idx += C::kNThreads) {
        const int r = idx / groups, c = c0 + idx % groups * kVec;
        const int i = row_query[r];
        if (i < 0) continue;
        const int h = row_head[r];
        const float* o_in = p.o_part + ((static_cast<long long>(b) * p.seqlen_q + i) * p.heads_q + h) * p.out_dim + c;
        float acc[kVec] = {};
#pragma unroll 8
        for (int split = 0; split < p.num_splits; ++split) {
            const vec_t part = __ldcg(reinterpret_cast<const vec_t*>(o_in + split * o_split_stride));
            const float w = weights[split * C::kBlockM + r];
            if constexpr (kVec == 4) {
                acc[0] = fmaf(w, part.x, acc[0]);
                acc[1] = fmaf(w, part.y, acc[1]);
                acc[2] = fmaf(w, part.z, acc[2]);
                acc[3] = fmaf(w, part.w, acc[3]);
            } else {
                acc[0] = fmaf(w, part, acc[0]);
            }
        }
        elem_t* o = static_cast<elem_t*>(p.o) + b * p.o_batch_stride + (q_start + i) * p.o_row_stride + h * p.o_head_stride + c;
#pragma unroll
        for (int e = 0; e < kVec; ++e) o[e] = from_float<elem_t>(acc[e]);
    }
}

// Split-KV: after writing its partial, a split counts itself done in the stream's counter for its
// (sequence, kv head, row block); the last to arrive combines every split's float32 (o, lse) into
// the output as cuda_src/merge.cu does (m = max_s lse_s, w_s = e^(lse_s - m),
// out = sum_s w_s o_s / sum_s w_s; -inf parts skipped) and sets the counter back to 0. All splits
// of a group count or none does (a faulted call or a skipped sequence returns before its writes in
// every CTA), so no counter is left raised. Combining here instead of in a merge launch saves that
// launch's host time (~3 us) and its stream gap.
// MLA: each value half (c0 = its first column) counts and combines its own columns.
template <class C>
__device__ __forceinline__ void combine_if_last_split(const DecodeParams& p, int b, int h_kv, int row_block,
                                                      const int* row_query, const int* row_head, float* weights,
                                                      int c0, long long q_start) {
    __shared__ int is_last;
    __threadfence();   // this CTA's partials, visible before it counts itself
    __syncthreads();   // (and every thread done with the combine buffer that `weights` reuses)
    if (threadIdx.x == 0) {
        const int half = c0 / C::kVCols, row_groups = p.row_blocks * (C::kMla ? value_halves<C>(p) : 1);
        int* counter = p.split_counters + (static_cast<long long>(b) * p.heads_k + h_kv) * row_groups +
                       half * p.row_blocks + row_block;
        is_last = atomicAdd(counter, 1) == p.num_splits - 1;
        if (is_last) *counter = 0;
    }
    __syncthreads();
    if (!is_last) return;
    __threadfence();   // the other splits' partials: read below through L2 (ld.cg), never a stale L1 line

    // Every split's lse of every row into shared memory (weights[split][row], at most
    // DECODE_MAX_SPLITS x kBlockM floats), all loads in flight at once: a loop of dependent loads
    // over 16-33 splits cost the (1, 32k) decode ~15 us.
    const long long lse_split_stride = static_cast<long long>(p.batch) * p.heads_q * p.seqlen_q;
    for (int idx = threadIdx.x; idx < p.num_splits * C::kBlockM; idx += C::kNThreads) {
        const int split = idx / C::kBlockM, r = idx % C::kBlockM, i = row_query[r];
        weights[idx] = i < 0 ? -CUFLASH_INF
                             : __ldcg(p.lse_part + split * lse_split_stride +
                                      (static_cast<long long>(b) * p.heads_q + row_head[r]) * p.seqlen_q + i);
    }
    __syncthreads();
    // Per row, a warp (split_weights_of_row; a thread a row walking the splits one by one: the (1, 32k)
    // bf16 decode took 40.4 us against 38.7 with a warp, 16 splits, H200). The head's sink enters the
    // sum once, here: the splits' partials have none.
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int r = warp; r < C::kBlockM; r += C::kNWarps) {
        const int i = row_query[r];
        const float sink = p.score.sinks != nullptr ? p.score.sinks[row_head[r]] : -CUFLASH_INF;
        const float lse = split_weights_of_row(weights + r, C::kBlockM, p.num_splits, sink);
        if (lane == 0 && i >= 0 && c0 == 0)   // MLA: the first value half writes it
            p.lse[b * p.lse_batch_stride + row_head[r] * p.lse_head_stride + q_start + i] = lse;
    }
    __syncthreads();
    // out = sum_s w_s o_s. A split that saw no key for a row wrote 0 there (and has w_s = 0).
    if (p.out_dim % 4 == 0) add_split_partials<C, 4>(p, b, row_query, row_head, weights, c0, q_start);
    else add_split_partials<C, 1>(p, b, row_query, row_head, weights, c0, q_start);
}

// Whether the call's index arrays are bad, before the first write of a CTA that got this far.
template <class C>
__device__ __forceinline__ bool call_faulted_here(const DecodeParams& p) {
    return p.self_check ? indices_faulted<C>(p) : call_faulted(p.error);
}

template <class C>
__device__ __forceinline__ void decode_attention(const DecodeParams& p) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    __shared__ int row_query[C::kBlockM];   // query index i of each packed row, -1 for padding
    __shared__ int row_head[C::kBlockM];    // its query head
    __shared__ float q_unscale[C::kScaledQ ? C::kBlockM : 1];   // fp8, bf16 q: 2^-e of load_q_tile_fp8
    // Paged: K/V row addresses of the tile being issued (a 1-row dummy for contiguous caches).
    using cache_t = typename C::cache_t;
    __shared__ PagedRows<C::kPaged ? C::kBlockN : 1, cache_t> paged_rows;
    elem_t* q_smem = reinterpret_cast<elem_t*>(smem_raw);
    // [kStages][K, V][kBlockN][kHeadDim] of cache_t (later the combine buffer), then the float32 path's P
    cache_t* kv_smem = reinterpret_cast<cache_t*>(q_smem + C::kBlockM * C::kHeadDim);
    float* p_smem = reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(kv_smem) + C::kStageRegionBytes);

    const int row_block = blockIdx.x % p.row_blocks, split = (blockIdx.x / p.row_blocks) % p.num_splits;
    const int c0 = C::kMla ? blockIdx.x / (p.row_blocks * p.num_splits) * C::kVCols : 0;   // first value column
    const int h_kv = blockIdx.y, b = blockIdx.z;
    // Ragged new tokens (p.cu_seqlens_q): this sequence's own count, its rows from q_start; the row
    // blocks past them (the grid covers the longest) have nothing to do.
    const long long q_start = p.cu_seqlens_q != nullptr ? p.cu_seqlens_q[b] : 0;
    const int seqlen_q = p.cu_seqlens_q != nullptr ? p.cu_seqlens_q[b + 1] - static_cast<int>(q_start) : p.seqlen_q;
    const int rows_total = seqlen_q * p.group;
    const int row0 = row_block * C::kBlockM;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

    DecodeSeq sq;
    sq.cache_len = p.cache_seqlens != nullptr ? p.cache_seqlens[b] : p.seqlen_cache;
    // A sequence whose keys would not fit its cache is left alone, neither appended to nor attended
    // (even when no check_indices ran): then every position read or written lies below capacity,
    // so a contiguous cache is read only at its rows and block_table only at its max_pages columns.
    const long long capacity = C::kPaged ? static_cast<long long>(p.max_pages) * p.page_size : p.seqlen_cache;
    if (sq.cache_len < 0 || static_cast<long long>(sq.cache_len) + p.seqlen_new > capacity) {
        if (p.self_check) indices_faulted<C>(p);   // the verdict (a fault) still has to be published
        return;
    }
    sq.s.b = b;
    sq.s.h = h_kv * p.group;
    sq.s.h_kv = h_kv;
    sq.s.seqlen_q = seqlen_q;
    sq.s.seqlen_k = sq.cache_len + p.seqlen_new;
    sq.s.q_row0 = 0;
    sq.s.k_row0 = 0;
    sq.s.diag = sq.s.seqlen_k - seqlen_q;   // bottom-right: query i lines up with key i + diag
    const long long cache_batch = C::kPaged ? 0 : b;
    sq.k_cache = static_cast<cache_t*>(p.k_cache) + cache_batch * p.k_batch_stride + h_kv * p.k_head_stride;
    sq.v_cache = static_cast<cache_t*>(p.v_cache) + cache_batch * p.v_batch_stride + h_kv * p.v_head_stride;
    sq.k_scale = sq.v_scale = 1.f;
    if constexpr (C::kFp8) {   // per tensor (stride 0, or a value given on the host) or per kv head
        sq.k_scale = p.k_scale != nullptr ? p.k_scale[h_kv * p.k_scale_stride] : p.k_scale_value;
        sq.v_scale = p.v_scale != nullptr ? p.v_scale[h_kv * p.v_scale_stride] : p.v_scale_value;
    }
    sq.k_new = sq.v_new = nullptr;
    if (p.seqlen_new > 0) {
        sq.k_new = static_cast<const elem_t*>(p.k_new) + b * p.k_new_batch_stride + h_kv * p.k_new_head_stride;
        sq.v_new = static_cast<const elem_t*>(p.v_new) + b * p.v_new_batch_stride + h_kv * p.v_new_head_stride;
    }
    sq.pages = C::kPaged ? p.block_table + b * p.block_table_batch_stride : nullptr;

    // Everything up to the writes only reads, with its own bounds checks, so it may overlap the index
    // check ahead of this launch (fault.cuh); the appends and the outputs wait for its verdict.
    const bool appends = p.seqlen_new > 0 && split == 0 && row_block == 0 && c0 == 0;
    const int rows_here = min(C::kBlockM, rows_total - row0);
    if (rows_here <= 0) {   // no query rows at all (Sq == 0): this launch only appends
        wait_for_prior_kernel();
        if (appends && !call_faulted_here<C>(p)) append_new_rows<C>(p, sq);
        return;
    }
    if (threadIdx.x < C::kBlockM) {
        const int pr = row0 + threadIdx.x;
        row_query[threadIdx.x] = pr < rows_total ? pr / p.group : -1;
        row_head[threadIdx.x] = pr < rows_total ? h_kv * p.group + pr % p.group : 0;
    }
    const int i_lo = row0 / p.group, i_hi = (row0 + rows_here - 1) / p.group + 1;

    // This split's share of the keys the CTA's rows may see, in whole tiles from the first one.
    int key_first, key_last;
    visible_keys(p.score, sq.s, i_lo, i_hi, &key_first, &key_last);
    const int tiles_total = ceil_div(key_last - key_first, C::kBlockN);
    const int tiles_per_split = ceil_div(tiles_total, p.num_splits);
    const int key_begin = key_first + split * tiles_per_split * C::kBlockN;
    const int key_end = min(key_begin + tiles_per_split * C::kBlockN, key_last);
    const int n_tiles = key_end > key_begin ? ceil_div(key_end - key_begin, C::kBlockN) : 0;

    auto k_stage = [&](int stage) { return kv_smem + stage * C::kTilesPerStage * C::kTileElems; };
    // MLA: the values are the key rows' first columns, this CTA's from c0 (a multiple of the swizzle's
    // 64 columns, so the tile's swizzle holds there too).
    auto v_stage = [&](int stage) { return C::kMla ? k_stage(stage) : k_stage(stage) + C::kTileElems; };
    const unsigned v_col_bytes = C::kMla ? c0 * unsigned(sizeof(elem_t)) : 0u;

    if constexpr (C::kScaledQ) load_q_tile_fp8<C>(q_smem, q_unscale, p, b, h_kv, row0, rows_total, q_start);
    else load_q_tile<C>(q_smem, p, b, h_kv, row0, rows_total, q_start);
#pragma unroll
    for (int stage = 0; stage < C::kStages - 1; ++stage) {
        if (stage < n_tiles)
            load_kv_tile<C>(k_stage(stage), v_stage(stage), p, sq, key_begin + stage * C::kBlockN, key_end);
        cp_async_commit();   // empty groups too: the wait counts below assume one group per stage
    }
    // Paged: the pages of the first tile the loop issues (kStages - 1), one iteration early.
    PagedRowFetch next_rows;
    if constexpr (C::kPaged) next_rows.fetch<C>(p, sq, key_begin + (C::kStages - 1) * C::kBlockN, key_end);
    // A call over a contiguous cache that checks its own indices takes the verdict here, its loads
    // beside the first tiles' copies, rather than after the loop, where they were one more round trip
    // before the writes. A paged one checks after the loop: its table's loads held here spilled the
    // fp8 paged variants, which sit at 128 registers.
    if (!C::kPaged && p.self_check) indices_faulted<C>(p);
    __syncthreads();   // row_query / row_head (and q_unscale)

    using MmaState = typename Select<C::kKeysAsM, KeysMWarpState<C>, MmaWarpState<C>>::type;
    typename Select<C::kSimt, SimtWarpState<C>, MmaState>::type state;
    state.init();
    int rows_i[2], rows_h[2];   // mma path: this thread's rows g and g + 8 (keys as M: 2t and 2t + 1)
    float score_factor[2];      // fp8: what the scores of those rows are multiplied by
    if constexpr (!C::kSimt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int row = C::kKeysAsM ? 2 * (lane % 4) + half : lane / 4 + 8 * half;
            rows_i[half] = row_query[row];
            rows_h[half] = row_head[row];
            score_factor[half] = sq.k_scale;
            if constexpr (C::kScaledQ) score_factor[half] *= q_unscale[row];
        }
    }
    unsigned q_frag[C::kQInRegs ? C::kHeadDim / 16 : 1][4];
    unsigned q_cols[C::kKeysAsM ? C::kHeadDim / 16 : 1][2];   // keys as M: Q^T's B fragments
    const SwizzledLanes<C::kHeadDim> q_lanes(lane % 16, lane / 16);
    const SwizzledLanes<C::kHeadDim> k_lanes(lane % 8 + (lane / 16) * 8, (lane / 8) % 2);
    const SwizzledLanes<C::kHeadDim> v_lanes(lane % 8 + ((lane / 8) % 2) * 8, lane / 16);
    const Fp8Lanes<C::kHeadDim> kv8_lanes(lane);
    const unsigned q_tile = smem_addr(q_smem);

    for (int tile = 0; tile < n_tiles; ++tile) {
        const int ahead = tile + C::kStages - 1;
        // Paged: the row addresses of tile `ahead` from the pages fetched last iteration, published
        // before the barrier below; then the next tile's pages, issued before this iteration's wait
        // so that their load lands during it and the compute, not the compute alone (bf16 pages of
        // 16, H200, GQA 32/8: 1-3% less time at (1, 32k), (8, 8k), (32, 4k) and (1, 128k)).
        if constexpr (C::kPaged) {
            if (ahead < n_tiles)
                next_rows.publish<C>(paged_rows, ahead % 2, p, sq, key_begin + ahead * C::kBlockN, key_end);
            if (ahead + 1 < n_tiles)
                next_rows.fetch<C>(p, sq, key_begin + (ahead + 1) * C::kBlockN, key_end);
        }
        cp_async_wait<C::kStages - 2>();
        __syncthreads();   // tile `tile` (and Q) landed; every warp is done with the stage refilled next
        if (ahead < n_tiles) {
            if constexpr (C::kPaged) {
                load_kv_tile_paged<C>(k_stage(ahead % C::kStages), v_stage(ahead % C::kStages), paged_rows,
                                      ahead % 2, p, sq, key_begin + ahead * C::kBlockN, key_end);
            } else {
                load_kv_tile<C>(k_stage(ahead % C::kStages), v_stage(ahead % C::kStages), p, sq,
                                key_begin + ahead * C::kBlockN, key_end);
            }
        }
        cp_async_commit();

        const int stage = tile % C::kStages;
        const int key0 = warp * C::kKeysPerWarp;
        const int j_warp = key_begin + tile * C::kBlockN + key0;
        const bool masked = j_warp + C::kKeysPerWarp > key_end ||
                            !tile_inside_window(p.score, sq.s, i_lo, i_hi, j_warp, j_warp + C::kKeysPerWarp);
        if constexpr (C::kSimt) {
            simt_warp_tile<C>(state, q_smem, k_stage(stage), v_stage(stage),
                              p_smem + warp * C::kBlockM * C::kKeysPerWarp, key0, j_warp, masked, p, sq, key_end,
                              row_query, row_head);
        } else if constexpr (C::kKeysAsM) {
            if (tile == 0) q_columns<C>(q_cols, q_smem);
            // K's A fragments take Q's lane pattern of the 16-row path (rows lane % 16, halves lane / 16).
            keys_m_warp_tile<C>(state, q_cols, smem_addr(k_stage(stage)), smem_addr(v_stage(stage)), q_lanes, v_lanes,
                                kv8_lanes, score_factor, key0, j_warp, masked, p, sq, key_end, row_query, row_head);
        } else {
            if constexpr (C::kQInRegs) {
                if (tile == 0) {
#pragma unroll
                    for (int kk = 0; kk < C::kHeadDim / 16; ++kk) {
                        if constexpr (C::kFp8) q_fragment_fp8<C>(q_frag[kk], q_smem, kk);
                        else ldmatrix_x4(q_frag[kk], q_lanes.at(q_tile, kk, 0));
                    }
                }
            }
            mma_warp_tile<C>(state, q_frag, q_tile, smem_addr(k_stage(stage)), smem_addr(v_stage(stage)) + v_col_bytes,
                             q_lanes, k_lanes, v_lanes, kv8_lanes, q_smem, score_factor, key0, j_warp, masked, p, sq,
                             key_end, rows_i, rows_h);
        }
    }

    // Combine the warps: M = max_w m_w, weight_w = 2^(m_w - M) / sum_w 2^(m_w - M) l_w (base-2 units).
    cp_async_wait<0>();
    __syncthreads();   // no copy in flight and every warp done: the stages become the combine buffer
    float* comb = reinterpret_cast<float*>(kv_smem);
    float* warp_m = comb + C::kNWarps * C::kBlockM * C::kCombStride;
    float* warp_l = warp_m + C::kNWarps * C::kBlockM;
    float* warp_w = warp_l + C::kNWarps * C::kBlockM;
    float* row_lse = warp_w + C::kNWarps * C::kBlockM;
    if constexpr (C::kSimt) simt_warp_store<C>(state, comb, warp_m, warp_l);
    else if constexpr (C::kKeysAsM) keys_m_warp_store<C>(state, comb, warp_m, warp_l);
    else mma_warp_store<C>(state, comb, warp_m, warp_l);
    __syncthreads();
    if (threadIdx.x < C::kBlockM) {
        const int r = threadIdx.x;
        const float scale_log2 = C::kScoreMods ? 1.f : p.score.scale_log2;
        float m = -CUFLASH_INF;
#pragma unroll
        for (int w = 0; w < C::kNWarps; ++w) m = fmaxf(m, warp_m[w * C::kBlockM + r]);
        const float m_scaled = m == -CUFLASH_INF ? 0.f : m * scale_log2;
        float factor[C::kNWarps];
        float row_sum = 0.f;
#pragma unroll
        for (int w = 0; w < C::kNWarps; ++w) {
            factor[w] = fast_exp2(warp_m[w * C::kBlockM + r] * scale_log2 - m_scaled);
            row_sum += factor[w] * warp_l[w * C::kBlockM + r];   // a NaN sum stays NaN: it must propagate
        }
        const bool empty = row_sum == 0.f;   // no visible key: out = 0, lse = -inf (the sink with one)
        // The head's sink joins the denominator here when this CTA finishes the row (one split); the
        // splits' partials stay without it and combine_if_last_split adds it once. As in
        // OnlineSoftmax::finish (online_softmax.cuh): against t = max(m, sink), l' = l 2^(m - t) +
        // 2^(sink - t) >= 1, so a sink far above the scores cannot overflow.
        const float sink = p.num_splits == 1 && p.score.sinks != nullptr ? p.score.sinks[row_head[r]] : -CUFLASH_INF;
        if (sink == -CUFLASH_INF) {
#pragma unroll
            for (int w = 0; w < C::kNWarps; ++w) warp_w[w * C::kBlockM + r] = empty ? 0.f : factor[w] / row_sum;
            row_lse[r] = empty ? -CUFLASH_INF : (m_scaled + log2f(row_sum)) * kLn2;
        } else {
            const float sink2 = sink * kLog2e;
            const float top = empty ? sink2 : fmaxf(m_scaled, sink2);   // a NaN sink reaches total below
            const float keys_part = empty ? 0.f : exp2f(m_scaled - top);
            const float total = fmaf(row_sum, keys_part, exp2f(sink2 - top));
#pragma unroll
            for (int w = 0; w < C::kNWarps; ++w)
                warp_w[w * C::kBlockM + r] = empty ? 0.f : factor[w] * keys_part / total;
            row_lse[r] = empty ? sink : (top + log2f(total)) * kLn2;
        }
    }
    __syncthreads();

    // The appended rows (no CTA reads the cache at their slots: keys at or past cache_len come from
    // k_new / v_new), then the rows: the output itself (one split) or this split's float32 partial.
    wait_for_prior_kernel();
    // A contiguous cache's own check ran before the loop; a paged one's runs here.
    if (!p.self_check ? call_faulted(p.error) : C::kPaged ? indices_faulted<C>(p) : indices_verdict()) return;
    if (appends) append_new_rows<C>(p, sq);
    const long long part_row0 = (static_cast<long long>(split) * p.batch + b) * p.seqlen_q;   // (split, b, i=0)
    for (int idx = threadIdx.x; idx < C::kBlockM * C::kVCols; idx += C::kNThreads) {
        const int r = idx / C::kVCols, cc = idx % C::kVCols, c = c0 + cc;   // cc: this CTA's column, c: out's
        const int i = row_query[r];
        if (i < 0 || c >= p.out_dim) continue;
        const int h = row_head[r];
        float o = 0.f;
        if (row_lse[r] != -CUFLASH_INF) {   // (with a sink, an empty row has weights 0)
#pragma unroll
            for (int w = 0; w < C::kNWarps; ++w)
                o += comb[(w * C::kBlockM + r) * C::kCombStride + cc] * warp_w[w * C::kBlockM + r];
            if constexpr (C::kFp8) o *= sq.v_scale;   // V held the e4m3 values (partials get it too)
        }
        if (p.num_splits == 1)
            static_cast<elem_t*>(p.o)[b * p.o_batch_stride + (q_start + i) * p.o_row_stride + h * p.o_head_stride + c] =
                from_float<elem_t>(o);
        else
            p.o_part[((part_row0 + i) * p.heads_q + h) * p.out_dim + c] = o;
    }
    if (threadIdx.x < C::kBlockM) {
        const int r = threadIdx.x, i = row_query[r];
        if (i >= 0) {
            const int h = row_head[r];
            // MLA: lse by the first value half; every half writes its partials' (the same values), as
            // each half's last split reads them after counting only its own half's CTAs.
            if (p.num_splits == 1 && c0 == 0)
                p.lse[b * p.lse_batch_stride + h * p.lse_head_stride + q_start + i] = row_lse[r];
            else if (p.num_splits > 1)
                p.lse_part[((static_cast<long long>(split) * p.batch + b) * p.heads_q + h) * p.seqlen_q + i] =
                    row_lse[r];
        }
    }
    if (p.num_splits > 1) combine_if_last_split<C>(p, b, h_kv, row_block, row_query, row_head, comb, c0, q_start);
}

}  // namespace cuflash

#ifndef CUFLASH_KV_FP8
#define CUFLASH_KV_FP8 0
#endif
#ifndef CUFLASH_MLA
#define CUFLASH_MLA 0
#endif
#ifndef CUFLASH_KEYS_AS_M
#define CUFLASH_KEYS_AS_M 0
#endif
using Config = cuflash::DecodeConfig<CUFLASH_HEAD_DIM, CUFLASH_WARPS, CUFLASH_KEYS_PER_WARP, CUFLASH_STAGES,
                                     CUFLASH_PAGED != 0, CUFLASH_SCORE_MODS, CUFLASH_KV_FP8 != 0, CUFLASH_MLA != 0,
                                     CUFLASH_KEYS_AS_M != 0>;
#ifdef CUFLASH_SMEM_BYTES
static_assert(CUFLASH_SMEM_BYTES == Config::kSmemBytes, "shared memory size differs from cuflash/_heuristics.py");
#endif

// CUFLASH_MIN_BLOCKS: the CTAs per SM that shared memory allows, so that registers never limit it
// (without a minimum, ptxas for sm_80 capped some float32 variants at 168 registers and spilled).
#ifndef CUFLASH_MIN_BLOCKS
#define CUFLASH_MIN_BLOCKS 1
#endif
extern "C" __global__ void __launch_bounds__(Config::kNThreads, CUFLASH_MIN_BLOCKS) cuflash_decode(const cuflash::DecodeParams p) {
    cuflash::decode_attention<Config>(p);   // returns before its writes when the call faulted
}

// Forward attention for Hopper (sm_90a), fp16/bf16: TMA loads on mbarriers, wgmma, warp specialisation.
//
// A CTA of kConsumers + 1 warpgroups computes kBlockM = 64 kConsumers query rows of one (batch,
// head) at a time:
//   warpgroup 0, the producer: one thread issues TMA copies of Q (into one of kQSlots buffers) and
//     of K/V tiles into a kStages-deep ring of 128B-swizzled shared buffers (full barriers count the
//     bytes in, empty barriers count the consumers out); the warpgroup gives its registers away.
//   warpgroups 1 .. kConsumers, the consumers: 64 rows each (two; three at D = 64 for full
//     attention over long rows, where a third warpgroup's products overlap the others'
//     exponentials). S = Q K^T (wgmma, both operands in shared memory) -> scores/masks
//     (fragments.cuh) -> online softmax (base 2; after a row's first tile speculatively, against
//     its current maximum) -> O += P V (wgmma with P from registers, V transposed by its
//     descriptor).
// Key tiles run from the first to the last (fwd_sm80 goes down): an item's first tile, whose
// softmax nothing overlaps, is then a causal problem's unmasked one, not its diagonal; and the
// CTAs on one head's m-blocks read each K/V tile closer together in time (going down, a causal
// head's tile 0 was read by its m-blocks a whole item apart: at D = 256 causal 8k, 783 MB came
// from HBM, now 556, cuDNN 201). Tiles that the window or the block mask hide entirely are never
// loaded. Rows and keys past the tensor's end come in as zeros (TMA fills out-of-range coordinates
// with zeros); under varlen they are the next sequence's rows, which the masks keep out of results.
// Each consumer's output goes through shared memory and leaves by TMA (store_output_staged). The
// CTAs are persistent and take their work items from a counter (WorkItem, take_item). The two
// consumers start together: staggering them (consumer 1 waiting for consumer 0's first P) paid
// +0.01-0.05 of cuDNN at first, and cost 0.00-0.03 once the producer issued V after the next K
// (docs/decisions.md#fwd-sm90-uncoupled-consumers).
//
// Compile-time configuration: CUFLASH_DTYPE 0/1, CUFLASH_HEAD_DIM 64/128/256 (Q and K),
// CUFLASH_HEAD_DIM_V 64/128/256 (V and O; default CUFLASH_HEAD_DIM), CUFLASH_BLOCK_N (64 or 128 keys),
// CUFLASH_Q_SLOTS 1/2, CUFLASH_STAGES (K/V ring depth), CUFLASH_CONSUMERS 2/3, CUFLASH_SCORE_MODS (bit
// mask, mask.cuh), CUFLASH_DROPOUT, CUFLASH_SMEM_BYTES, CUFLASH_PARAMS_SIZE.
#include "common.cuh"
#include "params.cuh"
#include "fault.cuh"
#include "mask.cuh"
#include "online_softmax.cuh"
#include "philox.cuh"
#include "fragments.cuh"
#include "tma_sm90.cuh"
#include "wgmma_sm90.cuh"
#include "gemm_sm90.cuh"
#include "mma_sm80.cuh"   // ldmatrix_x4

namespace cuflash {

template <int kHeadDim_, int kHeadDimV_, int kBlockN_, int kQSlots_, int kStages_, int kConsumers_, int kMods_,
          bool kDropout_, int kKvCache_ = 0, bool kOnPlainLoop_ = false, bool kTileOneRow_ = false>
struct FwdSm90Config {
    // kHeadDim: Q's and K's columns (S = Q K^T); kHeadDimV: V's and O's (P V, the output).
    static constexpr int kHeadDim = kHeadDim_, kHeadDimV = kHeadDimV_;
    static constexpr int kBlockN = kBlockN_, kQSlots = kQSlots_, kStages = kStages_;
    // ALiBi alone where no visible key lies right of its query's diagonal (j <= i + diag: causal),
    // as a bias of each key column (add_alibi_columns): there -slope |i + diag - j| is slope (j - ref)
    // less slope (i + diag - ref), a term of the row alone that leaves P as it is. So the variant is
    // the one without modifiers (its loop, its speculative softmax, masks on edge tiles only) plus one
    // FFMA an element, and the rows' maxima take their terms back before the lse (ref: the item's
    // first row + diag, which keeps the biases of the keys near the diagonal small, so exact to
    // float32). Through modify_scores (~8 instructions an element) the forward runs at 0.61-0.68x of
    // the call without options, this way at 0.91-0.92x (docs/decisions.md#fwd-sm90-alibi-as-column-biases).
    static constexpr bool kAlibiColumns = kOnPlainLoop_ && kMods_ == kModAlibi;
    // The softcap alone the same way (kSoftcapOnPlainLoop, cap_scores_log2): c tanh(scale qk / c) in
    // log2 units from the raw scores, then the masks of edge tiles, where modify_scores would also
    // scale, test each element's visibility and convert to log2 units one by one.
    static constexpr bool kSoftcapOnPlainLoop = kOnPlainLoop_ && kMods_ == kModSoftcap;
    // A bias (kBiasTile) or a boolean mask (kMaskTile) alone, of q's dtype for the bias, read as a tile
    // of the CTA's rows x the tile's keys that the producer loads by TMA beside K (kScoreTile): column
    // blocks of 128 bytes (64 bias elements or 128 mask bytes) x kBlockM rows, 16-byte chunks
    // XOR-swizzled by row as in every tile here. Both are read before S is issued, so that their
    // loads and conversions stay out of the way between S and its softmax: the bias as S's starting
    // accumulator, bias / scale (start_scores_with_bias), a mask of the CTA's rows as bits
    // (mask_tile_bits, kMaskBits) that hide elements after S (hide_by_bits; one of a row, kTileOneRow,
    // gains nothing so and hides after S from its bytes, hide_by_mask_tile). The loop without modifiers
    // then runs at 0.77x (bias) and 0.83x (mask) of the call without options (forward, D = 128, 8k
    // causal), where modify_scores on the rotated loop, each thread loading its 16-bit values from
    // global memory, runs at 0.15x and 0.33x (docs/decisions.md#fwd-sm90-a-bias-or-mask-as-tiles).
    static constexpr bool kBiasTile = kOnPlainLoop_ && kMods_ == kModBias;
    static constexpr bool kMaskTile = kOnPlainLoop_ && kMods_ == kModMask;
    static constexpr bool kMaskBits = kMaskTile && !kTileOneRow_;
    static constexpr bool kScoreTile = kBiasTile || kMaskTile;
    static_assert(!kOnPlainLoop_ || kAlibiColumns || kSoftcapOnPlainLoop || kScoreTile,
                  "the plain loop takes ALiBi, the softcap, a bias or a mask alone");
    static_assert(!kScoreTile || (kBlockN_ == 128 && kKvCache_ == 0 && kStages_ % 2 == 0),
                  "score tiles of 128 keys, not over a KV cache, an even number of stages");
    // Scores that leave score_step in log2 units (the softmax then scales by 1).
    static constexpr bool kScoresInLog2 = kAlibiColumns || kSoftcapOnPlainLoop;
    // Key tiles from the last (the diagonal's) down: its biases are its rows' largest, so the rows'
    // maxima rarely move after it and the speculative softmax keeps the later tiles. Upwards, every
    // tile's biases pass the last maximum by slope x 128 x log2(e) (more than the softmax's slack
    // from slope 0.043), and each tile would take the exact update and O's rescale.
    static constexpr bool kTilesDown = kAlibiColumns;
    static constexpr int kMods = kOnPlainLoop_ ? 0 : kMods_;   // score modifiers compiled in (mask.cuh)
    static constexpr bool kOnPlainLoop = kOnPlainLoop_;
    // Modifiers that only hide elements (block_mask, a user MaskMod: kMaskOnly) leave the scores raw,
    // as without modifiers, and a tile pays for them element by element only where the producer found
    // a block that is not visible throughout (hide_masked_scores). The others change scores
    // (kScoreMods) and take every tile through modify_scores. Either kind runs the loop with one copy
    // of the score code (kRotated).
    static constexpr bool kMaskOnly = kMods != 0 && (kMods & ~(kModBlockMask | kModUserMask)) == 0;
    static constexpr bool kScoreMods = kMods != 0 && !kMaskOnly, kRotated = kMods != 0, kDropout = kDropout_;
    // Keys and values from a KV cache, contiguous or paged (FwdParams::block_table): decode's many new
    // tokens (chunked prefill). 1: a tile comes by TMA, in boxes of p.kv_box_rows rows (a contiguous
    // cache, or pages of multiples of 8 rows: kv_box_coords); 2 (kKvGather): the producer warpgroup
    // copies its rows (pages of other sizes: kv_cache_row, copy_kv_row).
    // 3 (kKvRowGroups): pages of multiples of 8 rows whose rows continue from page to page (page stride =
    // page_size rows), one TMA copy a box for every column block: the cache seen as one run of rows in
    // groups of 8 (kv_box_coords), each group's column blocks side by side in shared memory. Pages of 16
    // rows at D = 128 take 16 copies a tile of 128 keys this way (0.91x the contiguous forward), 32 as
    // mode 1 (0.78x).
    static constexpr bool kKvCache = kKvCache_ != 0, kKvGather = kKvCache_ == 2, kKvRowGroups = kKvCache_ == 3;
    static_assert(kKvCache_ == 0 || (kBlockN_ / 8 * (kHeadDim_ / 64) <= 32 && kBlockN_ / 8 * (kHeadDimV_ / 64) <= 32),
                  "a KV cache tile's TMA copies, one a lane of a warp (load_boxes)");
    // Named barriers: 1 the consumers (zero_tile_rows), 2 + consumer each consumer's output, and this
    // one the producer warpgroup of a gather.
    static constexpr int kProducerBarrier = 5;
    // 64 query rows per consumer warpgroup.
    static constexpr int kConsumers = kConsumers_, kBlockM = 64 * kConsumers;
    static_assert(kConsumers == 2 || kConsumers == 3, "two or three consumer warpgroups");
    // Exponentials before the tile's maximum is known (OnlineSoftmax::update_if_held); not with
    // modifiers (the masks' reads included) or dropout, whose variants have no registers for a second
    // P buffer, nor with three consumers (160 registers each: ptxas then serialized the wgmmas).
    static constexpr bool kSpeculative = kMods == 0 && !kDropout && kConsumers == 2;
    // Where the wait for P_prev V_prev goes (see the main loop); measured per head dim, and with
    // the speculative softmax below it at every head dim (waiting first cost D = 64 0.08 of cuDNN).
    static constexpr bool kPvWaitBelowSoftmax = kSpeculative || kHeadDimV == 128;
    static constexpr int kNThreads = 128 * (kConsumers + 1);
    // Registers per thread after setmaxnreg: the producer needs more than the usual 24 only to
    // test block masks and to read a KV cache by boxes or rows (24 spilled 12-104 bytes there); the
    // consumers get the rest (160 each when there are three). A score tile's producer keeps to 24
    // (tile_coords): with 40, the consumers' 232 spill 12-32 bytes at D = 128. Row groups keep to 24
    // too (next_item): with 240 against 232, chunked prefill of 2048 tokens onto a 16k prefix (D 128,
    // H200) ran 1-2% faster at pages of 64 and the same at 16.
    static constexpr bool kBlockMask = (kMods & kModBlockMask) != 0;
    static constexpr bool kWideProducer = kBlockMask || (kKvCache && !kKvRowGroups);
    static constexpr int kProducerRegs = kWideProducer ? 40 : 24;
    static constexpr int kConsumerRegs = kConsumers == 3 ? 160 : kWideProducer ? 232 : 240;
    // setmaxnreg.inc waits until the CTA's pool has the registers, and the pool holds only what the
    // launch gave (__launch_bounds__(kNThreads, 1): 65536 / kNThreads per thread, in steps of 8).
    // Asking for more than that hangs the kernel, so it is checked here.
    static_assert(128 * (kProducerRegs + kConsumers * kConsumerRegs) <= kNThreads * ((65536 / kNThreads) & ~7),
                  "the register split exceeds what the launch allocates");
    static constexpr int kNTiles = kBlockN / 8, kDTiles = kHeadDimV / 8;   // S's and O's 8-column n-tiles
    // P V runs in column chunks of at most 128 (one wgmma n each): D = 256 is two of them.
    static constexpr int kPvN = kHeadDimV < 128 ? kHeadDimV : 128, kPvChunks = kHeadDimV / kPvN;
    // Tiles are stored as column blocks of 64 elements (128 bytes: one swizzle row) x all rows.
    static constexpr int kColBlocks = kHeadDim / 64, kVColBlocks = kHeadDimV / 64;
    static constexpr int kQBytes = kBlockM * kHeadDim * 2, kKBytes = kBlockN * kHeadDim * 2;
    static constexpr int kVBytes = kBlockN * kHeadDimV * 2;
    // Where K's and V's 8-row groups and column blocks lie in their tiles: a column block of all rows
    // after the other (as everywhere), or, kKvRowGroups, a group's column blocks side by side.
    static constexpr int kKGroupPitch = kKvRowGroups ? kColBlocks * 1024 : 1024;
    static constexpr int kKBlockPitch = kKvRowGroups ? 1024 : kBlockN * 128;
    static constexpr int kVGroupPitch = kKvRowGroups ? kVColBlocks * 1024 : 1024;
    static constexpr int kVBlockPitch = kKvRowGroups ? 1024 : kBlockN * 128;
    // Each consumer stages its 64-row output tile in shared memory, up to 128 columns at a time
    // (store_output_staged).
    static constexpr int kOutCols = kHeadDimV < 128 ? kHeadDimV : 128;
    static constexpr int kOutBytes = kConsumers * 64 * kOutCols * 2;
    // The score tile (kScoreTile): its 128-byte column blocks and its bytes, in one buffer, which the
    // producer fills for key tile t + 1 once the consumers have read tile t. Two buffers (the output
    // stored from registers to make room at D = 128) run as fast (docs/decisions.md#fwd-sm90-a-bias-or-mask-as-tiles).
    // A bias or mask the same for every query (kTileOneRow: a key padding mask or bias, rows broadcast)
    // comes as one row of keys, which every row reads; each column block still starts a 1024-byte
    // swizzle atom.
    static constexpr bool kTileOneRow = kTileOneRow_;
    static_assert(!kTileOneRow || kScoreTile, "tiles of one row are a score tile's");
    static constexpr int kTileElemBytes = kBiasTile ? 2 : 1, kTileBlocks = kScoreTile ? kBlockN * kTileElemBytes / 128 : 0;
    static constexpr int kTileBlockPitch = kTileOneRow ? 1024 : kBlockM * 128;
    static constexpr int kTileBytes = kTileBlocks * kTileBlockPitch;                        // of shared memory
    static constexpr int kTileLoadBytes = kTileBlocks * (kTileOneRow ? 1 : kBlockM) * 128;   // a tile's TMA bytes
    static constexpr int kSmemBytes = 1024 /* alignment slack */ + kQSlots * kQBytes + kStages * (kKBytes + kVBytes) +
                                      kOutBytes + kTileBytes;
    // (Q's and K's 192 beside V's 128: cuflash/kernels/fwd_sm90.py, SM90_PAIR_QK_DIMS.)
    static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256 || (kHeadDim == 192 && kHeadDimV == 128),
                  "wgmma tiles for head dims 64, 128, 256 (and Q's and K's 192 beside V's 128)");
    static_assert(kHeadDimV == 64 || kHeadDimV == 128 || kHeadDimV == 256, "P V's wgmma n: 64, 128 or 2 x 128");
    static_assert(kBlockN == 64 || kBlockN == 96 || kBlockN == 128, "a wgmma n for S (wgmma_sm90.cuh)");
    static_assert(kQSlots == 1 || kQSlots == 2, "Q is single or double buffered");
};

// Varlen: a key tile that runs past the end of its sequence holds the next sequence's rows (TMA
// zero-fills only past the end of the whole tensor); over a KV cache, the cache's rows past the keys
// in use. Their scores are masked, but P V would still meet them as 0 * V (NaN for stale rows): the
// consumers zero those rows of the V tile before P V (zero_tile_rows).
template <class C>
__device__ __forceinline__ void zero_v_rows(unsigned v_tile, int first_row) {
    zero_tile_rows<C::kBlockN, C::kVColBlocks, C::kConsumers, C::kVBlockPitch, C::kVGroupPitch>(v_tile, first_row);
}

// ALiBi as a bias of each key column (FwdSm90Config::kAlibiColumns): s = s scale_log2 + slope_log2 (key - ref)
// for this thread's columns of a tile whose first key is `key0` (key0_from_ref = key0 - ref), every score
// in log2 units after it (-inf stays -inf). Thread t holds columns 8 ni + 2 t and 8 ni + 2 t + 1 of n-tile ni.
template <int kNTiles>
__device__ __forceinline__ void add_alibi_columns(float (&s)[1][kNTiles][4], float slope_log2, int key0_from_ref,
                                                  int t, float scale_log2) {
    const float base = slope_log2 * float(key0_from_ref + 2 * t);
#pragma unroll
    for (int ni = 0; ni < kNTiles; ++ni) {
        const float c0 = fmaf(slope_log2, float(8 * ni), base), c1 = c0 + slope_log2;
#pragma unroll
        for (int e = 0; e < 4; ++e) s[0][ni][e] = fmaf(s[0][ni][e], scale_log2, e % 2 == 0 ? c0 : c1);
    }
}

// The softcap on raw scores (FwdSm90Config::kSoftcapOnPlainLoop): s = c log2(e) tanh(scale s / c), in log2
// units, with softcap_tanh's tanh (rate = scale x 2 log2(e) / c: the scale folded into it).
template <int kNTiles>
__device__ __forceinline__ void cap_scores_log2(float (&s)[1][kNTiles][4], float rate, float cap_log2) {
#pragma unroll
    for (int ni = 0; ni < kNTiles; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[0][ni][e] = fmaf(-2.f * cap_log2, softcap_tanh_rest(s[0][ni][e], rate), cap_log2);
}

// The bias tile (FwdSm90Config::kBiasTile) as S's starting accumulator: s = bias / scale, so that the S
// GEMM (accumulating from its first k-step) leaves qk + bias / scale and the softmax's FFMA by
// scale log2(e) makes (scale qk + bias) log2(e). This thread's elements: rows warp_row + g and + 8 of
// the tile, columns 8 ni + 2 t and + 1 of n-tile ni. ldmatrix hands out 8 x 8 pieces of 16-bit elements
// in exactly that layout: matrix j of the four holds n-tile ni + j / 2, rows g (j even) or g + 8, and
// lane l gives the address of matrix l / 8's row l % 8 (16 contiguous bytes: one swizzled chunk; with
// kTileOneRow every lane's row is row 0).
template <class C>
__device__ __forceinline__ void start_scores_with_bias(float (&s)[1][C::kNTiles][4], unsigned tile, int warp_row,
                                                       int lane, float inv_scale) {
    // warp_row is a multiple of 8: row % 8 == lane % 8
    const int row = C::kTileOneRow ? 0 : warp_row + (lane / 8 % 2) * 8 + lane % 8;
#pragma unroll
    for (int ni = 0; ni < C::kNTiles; ni += 2) {
        const int nn = ni + lane / 16;
        unsigned bias[4];
        ldmatrix_x4(bias, tile + (nn / 8) * C::kTileBlockPitch + row * 128 + (((nn % 8) ^ (row % 8)) * 16));
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            float* e = &s[0][ni + j / 2][2 * (j % 2)];
            const float lo = to_float(elem_t{static_cast<unsigned short>(bias[j] & 0xffffu)});
            const float hi = to_float(elem_t{static_cast<unsigned short>(bias[j] >> 16)});
            e[0] = lo * inv_scale;
            e[1] = hi * inv_scale;
        }
    }
}

// The mask tile (FwdSm90Config::kMaskTile): -inf where the mask is False, for the elements of
// start_scores_with_bias, after S (a hidden key's NaN or infinite score must not reach its row). The two
// bytes of a thread's column pair, one 16-bit load: a row's 128 bytes are eight chunks of 16 columns,
// n-tile ni in chunk ni / 2 (XOR the row), at byte 8 (ni % 2) + 2 t (kTileOneRow: row 0).
template <class C>
__device__ __forceinline__ void hide_by_mask_tile(float (&s)[1][C::kNTiles][4], unsigned tile, int warp_row, int g,
                                                  int t) {
    const int swizzle = C::kTileOneRow ? 0 : g;   // (warp_row + g) % 8 == g
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const unsigned row = tile + (C::kTileOneRow ? 0 : (warp_row + g + 8 * half) * 128) + 2 * t;
#pragma unroll
        for (int ni = 0; ni < C::kNTiles; ++ni) {
            unsigned short bytes;
            asm volatile("ld.shared.u16 %0, [%1];\n" : "=h"(bytes) : "r"(row + (((ni / 2) ^ swizzle) * 16) + 8 * (ni % 2)));
            if ((bytes & 0xffu) == 0) s[0][ni][2 * half] = -CUFLASH_INF;
            if ((bytes >> 8) == 0) s[0][ni][2 * half + 1] = -CUFLASH_INF;
        }
    }
}

// The mask tile's answers for this thread's elements (those of hide_by_mask_tile) as bits, read before
// S is issued (FwdSm90Config::kMaskBits): hidden[half] bit 2 ni + j is element (row g + 8 half, column
// 8 ni + 2 t + j) hidden.
template <class C>
__device__ __forceinline__ void mask_tile_bits(unsigned (&hidden)[2], unsigned tile, int warp_row, int g, int t) {
    static_assert(!C::kTileOneRow, "a tile of one row hides from its bytes (hide_by_mask_tile)");
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const unsigned row = tile + (warp_row + g + 8 * half) * 128 + 2 * t;   // (warp_row + g) % 8 == g
        unsigned bits = 0;
#pragma unroll
        for (int ni = 0; ni < C::kNTiles; ++ni) {
            unsigned short bytes;
            asm volatile("ld.shared.u16 %0, [%1];\n" : "=h"(bytes) : "r"(row + (((ni / 2) ^ g) * 16) + 8 * (ni % 2)));
            bits |= static_cast<unsigned>((bytes & 0xffu) == 0) << (2 * ni);
            bits |= static_cast<unsigned>((bytes >> 8) == 0) << (2 * ni + 1);
        }
        hidden[half] = bits;
    }
}

// After S: -inf where mask_tile_bits found the mask False.
template <class C>
__device__ __forceinline__ void hide_by_bits(float (&s)[1][C::kNTiles][4], const unsigned (&hidden)[2]) {
#pragma unroll
    for (int ni = 0; ni < C::kNTiles; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            if (hidden[e / 2] & (1u << (2 * ni + e % 2))) s[0][ni][e] = -CUFLASH_INF;
}

// O / l (times 1/(1-p) under dropout) of one consumer's 64 rows, through shared memory, at most 128
// columns per pass (D = 256 takes two). Each thread writes its fragments into the layout of the
// tensor maps (column blocks of 64, 128-byte rows, 16-byte chunks XOR-swizzled by row, which
// also keeps the 8 rows of a fragment in different banks). Then one thread stores the tile with
// TMA, which clips rows past the sequence and columns past the head dim; under varlen the rows
// past a sequence belong to the next one, so the warpgroup copies rows out itself instead.
// lse as store_output.
template <class C>
__device__ __forceinline__ void store_output_staged(const float (&acc_o)[1][C::kDTiles][4], const float (&inv_l)[2],
                                                    const float (&lse)[2], const FwdParams& p, const TmaMap& o_map,
                                                    const SeqInfo& s, int wg_row0, unsigned tile, int consumer) {
    constexpr int kBlocks = C::kOutCols / 64;   // 64-column blocks per pass
    const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4, g = lane / 4, t = lane % 4;
    const bool leader = threadIdx.x % 128 == 0;
    const bool varlen = p.cu_seqlens_q != nullptr;
#pragma unroll
    for (int pass = 0; pass < C::kHeadDimV / C::kOutCols; ++pass) {
        if (leader) bulk_wait_read();             // the last TMA store has read the tile
        named_barrier_sync(2 + consumer, 128);   // ... and every thread's copy-out too
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int r = warp * 16 + g + half * 8;   // row inside the tile
            const float factor = C::kDropout ? inv_l[half] * p.dropout_rescale : inv_l[half];
            const bool no_keys = inv_l[half] == 0.f;
#pragma unroll
            for (int c = 0; c < C::kOutCols / 8; ++c) {   // 16-byte chunk c of this pass: fragment tile di
                const int di = pass * C::kOutCols / 8 + c;
                const unsigned word = no_keys ? 0u
                                              : pack2<elem_t>(acc_o[0][di][2 * half] * factor,
                                                              acc_o[0][di][2 * half + 1] * factor);
                // r % 8 == g: spelled so, the address of the second half is the first's + 1024.
                const unsigned addr = tile + (c / 8) * 64 * 128 + r * 128 + (((c % 8) ^ g) * 16) + t * 4;
                asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(word) : "memory");
            }
            const int i = wg_row0 + r;
            if (pass == 0 && t == 0 && i < s.seqlen_q)
                p.lse[s.b * p.lse_batch_stride + s.h * p.lse_head_stride + s.q_row0 + i] = lse[half];
        }
        if (!varlen) fence_proxy_async();   // the TMA engine reads what the threads wrote
        named_barrier_sync(2 + consumer, 128);
        if (!varlen) {
            if (leader) {
                for (int blk = 0; blk < kBlocks; ++blk)
                    tma_store_4d(&o_map, tile + blk * 64 * 128, (pass * kBlocks + blk) * 64, wg_row0, s.h, s.b);
                bulk_commit();
            }
            continue;
        }
        // Varlen (no batch stride): threads copy rows, consecutive threads consecutive chunks.
        elem_t* o_gmem = static_cast<elem_t*>(p.o) + s.h * p.o_head_stride + (s.q_row0 + wg_row0) * p.o_row_stride;
        const int chunks_used = min(C::kOutCols / 8, p.head_dim_v / 8 - pass * C::kOutCols / 8);
        for (int idx = threadIdx.x % 128; idx < 64 * C::kOutCols / 8; idx += 128) {
            const int r = idx / (C::kOutCols / 8), c = idx % (C::kOutCols / 8);
            if (wg_row0 + r >= s.seqlen_q || c >= chunks_used) continue;
            uint4 v;
            asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                         : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                         : "r"(tile + (c / 8) * 64 * 128 + r * 128 + (((c % 8) ^ (r % 8)) * 16)));
            *reinterpret_cast<uint4*>(o_gmem + r * p.o_row_stride + (pass * C::kOutCols / 8 + c) * 8) = v;
        }
    }
}

// Work items are (m-block, head, batch), numbered so that one head's m-blocks are neighbours
// (longest causal rows first): CTAs that run at the same time then share that head's K/V in L2.
// Under a causal mask that order leaves the heads taken last running their longest m-blocks alone
// at the end of the call, so the last p.tail_heads (head, batch) pairs are numbered m-block-major
// instead (all their longest m-blocks, then all their second longest, ...; _heuristics.py,
// fwd_tail_heads, says how many).
// Each CTA starts at item blockIdx.x and takes the next from a global counter when it starts an
// item (dynamic scheduling balances causal and varlen work, whose items differ in length).
// The counter is handed out exactly `items` times per launch (one failed take per CTA ends it), so
// whoever takes the last value resets it to 0 for the next launch on this stream.
__device__ __forceinline__ int take_item(int* counter, int items) {
    const int ticket = atomicAdd(counter, 1);
    if (ticket == items - 1) atomicExch(counter, 0);
    return ticket + gridDim.x;
}

// Over a paged cache whose pages are not multiples of 8 rows (no TMA box fits them), the producer
// warpgroup copies each key tile itself: thread t copies row t % kBlockN. kv_cache_row looks its
// page up before the thread waits for the stage, so that the lookup's latency is not added to the
// copy's, and returns the row's place in the cache as one number, page x page_size + row in the page
// (< 2^31: the host checks), or -1 for a row at or past the sequence's end: it is not copied (its
// score is masked and its V row zeroed, zero_v_rows). One number, not two: the producer keeps it
// across the wait and, for V, a tile longer, within its 40 registers.
template <int kBlockN>
__device__ __forceinline__ int kv_cache_row(const FwdParams& p, const SeqInfo& s, int key_row) {
    const int pos = key_row + threadIdx.x % 128 % kBlockN;
    if (pos >= s.seqlen_k) return -1;
    return p.block_table[s.b * p.block_table_batch_stride + pos / p.page_size] * p.page_size + pos % p.page_size;
}

// Thread t's row of a K or V tile (kColBlocks 64-column blocks), 16 bytes per cp.async, into the
// layout the TMA boxes would have given (128-byte rows of 64-column blocks, 16-byte chunks XORed with
// the row; the tile is 1024-byte aligned); every (128 / kBlockN)-th column block from t / kBlockN.
// Columns past the run-time head dim `cols` are zero-filled (cp.async's source size 0), as TMA fills
// them. Completion reaches the stage's full barrier through cp_async_arrive_noinc. (Other splits of
// the rows between threads: docs/decisions.md#chunked-prefill-on-fwd_sm90.)
template <int kBlockN, int kColBlocks>
__device__ __forceinline__ void copy_kv_row(unsigned tile, const void* cache, long long page_stride,
                                            long long row_stride, long long head_stride, int cols, int page_size,
                                            int cache_row, int h_kv) {
    constexpr int kThreadsPerRow = 128 / kBlockN;
    if (cache_row < 0) return;
    const int t = threadIdx.x % 128, r = t % kBlockN;
    const elem_t* src = static_cast<const elem_t*>(cache) + cache_row / page_size * page_stride +
                        cache_row % page_size * row_stride + h_kv * head_stride;
    // Not unrolled: the producer has 40 registers, and unrolled copies kept their addresses live
    // (20-28 bytes of spills with the chunks unrolled).
#pragma unroll 1
    for (int blk = t / kBlockN; blk < kColBlocks; blk += kThreadsPerRow)
#pragma unroll 1
        for (int c = 0; c < 8; ++c) {
            const int col = blk * 64 + c * 8;
            const unsigned dst = tile + blk * kBlockN * 128 + r * 128 + ((c ^ (r % 8)) * 16);
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst),
                         "l"(col < cols ? src + col : src), "r"(col < cols ? 16 : 0)
                         : "memory");
        }
}

// Over a KV cache by TMA, where box j (lane j's) of the key tile at key_row is: (page, row in the page)
// of a paged cache, whose pages are cut in boxes of p.kv_box_rows = gcd(page_size, kBlockN) rows (a
// multiple of 8: the 128-byte swizzle's 1024-byte atoms stay whole), or (the sequence's batch, its
// row) of a contiguous one (one box of kBlockN rows). A box at or past the sequence's end looks up the
// page of the sequence's last key (block_table's entries past the end may hold anything) at its own
// row offset: its keys are masked and its V rows zeroed (zero_v_rows). Every lane gets coordinates.
__device__ __forceinline__ void kv_box_coords(const FwdParams& p, const SeqInfo& s, int key_row, int lane, int* page,
                                              int* row) {
    *page = s.b;
    *row = key_row + lane * p.kv_box_rows;
    if (p.block_table != nullptr) {
        const int last = min(*row, s.seqlen_k - 1);
        *page = p.block_table[s.b * p.block_table_batch_stride + last / p.page_size];
        *row %= p.page_size;
    }
}

// One (sequence, head) problem; over a KV cache, sequence b's keys are its cache's first
// seqused_k[b] + seqlen_k_new rows (the call appended the last seqlen_k_new before this launch), its
// queries q's batch b or, ragged, rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1].
template <class C>
__device__ __forceinline__ SeqInfo seq_info(const FwdParams& p, int b, int h) {
    if constexpr (!C::kKvCache) return make_seq_info(p, b, h);
    SeqInfo s;
    s.b = b;
    s.h = h;
    s.h_kv = h / (p.heads_q / p.heads_k);
    s.q_row0 = p.cu_seqlens_q != nullptr ? p.cu_seqlens_q[b] : 0;
    s.seqlen_q = p.cu_seqlens_q != nullptr ? p.cu_seqlens_q[b + 1] - s.q_row0 : p.seqlen_q;
    s.k_row0 = 0;
    s.seqlen_k = p.seqused_k != nullptr ? p.seqused_k[b] + p.seqlen_k_new : p.seqlen_k;
    s.diag = s.seqlen_k - s.seqlen_q;
    return s;
}

template <class C>
struct WorkItem {
    SeqInfo s;
    int m_lo, m_hi;       // query rows of the CTA (m_hi clipped to the sequence)
    int n_first, n_end;   // key tiles [n_first, n_end) that the window leaves visible
    int batch_coord;      // the batch coordinate of the tensor maps (0 under varlen)

    // No constructor, so that it can live in shared memory (the producer hands it to the consumers).
    static __device__ __forceinline__ WorkItem of(const FwdParams& p, int item, int num_m_blocks) {
        WorkItem w;
        const int pairs = p.heads_q * p.batch, head_major = (pairs - p.tail_heads) * num_m_blocks;
        int rank, hb;   // the m-block's place in its pair's order: last m-block first, or work_order's
        if (item < head_major) {
            rank = item % num_m_blocks;
            hb = item / num_m_blocks;
        } else {
            const int r = item - head_major;
            rank = r / p.tail_heads;
            hb = pairs - p.tail_heads + r % p.tail_heads;
        }
        int m_block = num_m_blocks - 1 - rank;
        // Only block-masked calls have an order (its reads in the 24 registers of the other variants'
        // producer spilled 4-8 B at D = 64 and with a value head dim of its own).
        const int* order = C::kBlockMask ? p.work_order : nullptr;
        const int slice = (hb / p.heads_q) * p.work_order_batch_stride + (hb % p.heads_q) * p.work_order_head_stride;
        if (order != nullptr) m_block = order[slice + rank];
        w.s = seq_info<C>(p, hb / p.heads_q, hb % p.heads_q);
        w.m_lo = m_block * C::kBlockM;
        w.m_hi = min(w.m_lo + C::kBlockM, w.s.seqlen_q);
        int key_first, key_last;
        visible_keys(p, w.s, w.m_lo, w.m_hi, &key_first, &key_last);
        w.n_first = key_first / C::kBlockN;
        w.n_end = ceil_div(key_last, C::kBlockN);
        if (order != nullptr) {   // only the key tiles some True block touches (work_bounds)
            const int2 bounds = p.work_bounds[slice + m_block];
            w.n_first = max(w.n_first, bounds.x);
            w.n_end = max(w.n_first, min(w.n_end, bounds.y));
        }
        w.batch_coord = p.cu_seqlens_q != nullptr ? 0 : w.s.b;
        return w;
    }
    // Varlen: the grid is sized by the longest sequence, so shorter ones have m-blocks with no rows.
    __device__ __forceinline__ bool empty() const { return m_lo >= s.seqlen_q; }

    // Which of the 32 key tiles base, base + 1, ..., base + 31 the item visits (bit i: tile
    // base + i): inside [n_first, n_end) and not hidden by the block mask. Each lane of the
    // producer warp tests one tile; all 32 lanes must call it. *masked (kMaskOnly): which of them
    // have elements that the block mask or the MaskMod may hide (every tile without a block mask
    // when there is a MaskMod).
    __device__ __forceinline__ unsigned tiles_from(const FwdParams& p, int base, unsigned* masked) const {
        const int n = base + threadIdx.x % 32;
        bool visible = n < n_end;
        bool partial = (C::kMods & kModUserMask) != 0;
        if (C::kBlockMask && visible && p.block_mask != nullptr) {
            // Four reads at once only in the mask-only variants (block_bytes): with score modifiers
            // too, D = 64 spilled 4 B in the producer.
            const int state = block_mask_tile_state<C::kMaskOnly ? 4 : 1>(p, s, m_lo, m_hi, n * C::kBlockN,
                                                    min((n + 1) * C::kBlockN, s.seqlen_k));
            visible = (state & kBlocksAny) != 0;
            partial = !tile_blocks_whole<C::kMods>(state, p);
        }
        *masked = C::kMaskOnly ? __ballot_sync(0xffffffffu, visible && partial) : 0u;
        return __ballot_sync(0xffffffffu, visible);
    }
    __device__ __forceinline__ int count_tiles(const FwdParams& p) const {
        if (!C::kBlockMask || p.block_mask == nullptr) return n_end - n_first;
        int count = 0;
        unsigned masked;
        for (int base = n_first; base < n_end; base += 32) count += __popc(tiles_from(p, base, &masked));
        return count;
    }
};

// tile_map: the bias's or the mask's (a kScoreTile variant; any other map otherwise, unread).
template <class C>
__device__ __forceinline__ void fwd_sm90(const TmaMap& q_map, const TmaMap& k_map, const TmaMap& v_map,
                                         const TmaMap& o_map, const TmaMap& tile_map, const FwdParams& p,
                                         int* tile_counter) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    __shared__ __align__(8) unsigned long long barriers[2 * C::kQSlots + 4 * C::kStages + (C::kScoreTile ? 2 : 0)];
    // What the producer tells the consumers, published by the arrive on the slot's/stage's full
    // barrier: the item whose Q is in a slot (-1: no more work), its rows and keys (work_of_slot:
    // the consumers would spend ~140 instructions with integer divisions at every item's start on
    // them) and how many key tiles it visits, and the key tile in a stage (the block mask is
    // evaluated once, by the producer).
    __shared__ int item_of_slot[C::kQSlots], tiles_of_slot[C::kQSlots], tile_of_stage[C::kStages];
    __shared__ int masked_of_stage[C::kMaskOnly ? C::kStages : 1];   // the stage's tile needs hide_masked_scores
    __shared__ WorkItem<C> work_of_slot[C::kQSlots];
    // The producer's next item, taken by warp 0's lane 0 as an item starts and read when it ends: kept
    // here, not in one of the producer's 24 registers across the item (over a KV cache it spilled 4
    // bytes there). A gather's warpgroup reads it too: two, one read while the next is written.
    __shared__ int next_item[2];
    // The item's score tiles' head and batch coordinates, kept by the producer here rather than in two
    // of its 24 registers (there the producer spills 8 bytes at D = 128).
    __shared__ int tile_coords[C::kScoreTile ? 2 : 1];
    auto tile_coords_of = [&](int i) { return *static_cast<volatile int*>(&tile_coords[i]); };
    const unsigned smem = (smem_addr(smem_raw) + 1023) & ~1023u;   // swizzle atoms are 1024 bytes
    const unsigned q_smem = smem;                                     // [kQSlots][kColBlocks][kBlockM][64]
    const unsigned k_smem = q_smem + C::kQSlots * C::kQBytes;         // [kStages][kColBlocks][kBlockN][64]
    const unsigned v_smem = k_smem + C::kStages * C::kKBytes;         // [kStages][kVColBlocks][kBlockN][64]
    const unsigned out_smem = v_smem + C::kStages * C::kVBytes;      // [kConsumers][64][kOutCols], staged O
    const unsigned tile_smem = out_smem + C::kOutBytes;               // [kTileBlocks][kTileBlockPitch bytes]
    auto q_full = [&](int slot) { return smem_addr(&barriers[slot]); };
    auto q_empty = [&](int slot) { return smem_addr(&barriers[C::kQSlots + slot]); };
    auto k_full = [&](int stage) { return smem_addr(&barriers[2 * C::kQSlots + stage]); };
    auto v_full = [&](int stage) { return smem_addr(&barriers[2 * C::kQSlots + C::kStages + stage]); };
    // K and V of a stage are released separately: K as soon as S retires, V once P V has.
    auto k_empty = [&](int stage) { return smem_addr(&barriers[2 * C::kQSlots + 2 * C::kStages + stage]); };
    auto v_empty = [&](int stage) { return smem_addr(&barriers[2 * C::kQSlots + 3 * C::kStages + stage]); };
    // The score tile's buffer (kScoreTile): key tile t (counted over items) fills it in phase t % 2, which
    // is the parity of the K/V ring's stage t % kStages (kStages even): no counter of its own in the
    // producer's 24 registers.
    const unsigned tile_full = C::kScoreTile ? smem_addr(&barriers[2 * C::kQSlots + 4 * C::kStages]) : 0u;
    const unsigned tile_empty = C::kScoreTile ? smem_addr(&barriers[2 * C::kQSlots + 4 * C::kStages + 1]) : 0u;

    const int warpgroup = threadIdx.x / 128;
    const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
    if (threadIdx.x == 0) {
        for (int slot = 0; slot < C::kQSlots; ++slot) {
            mbar_init(q_full(slot), 1);
            mbar_init(q_empty(slot), 128 * C::kConsumers);
        }
        // A gather's full barriers count the producer warpgroup's copies (cp_async_arrive_noinc), and K's
        // the arrive that publishes tile_of_stage.
        constexpr bool gather = C::kKvGather;
        for (int stage = 0; stage < C::kStages; ++stage) {
            mbar_init(k_full(stage), gather ? 129 : 1);
            mbar_init(v_full(stage), gather ? 128 : 1);
            mbar_init(k_empty(stage), 128 * C::kConsumers);
            mbar_init(v_empty(stage), 128 * C::kConsumers);
        }
        if (C::kScoreTile) {
            mbar_init(tile_full, 1);
            mbar_init(tile_empty, 128 * C::kConsumers);
        }
        fence_barrier_init();
    }
    __syncthreads();

    const int num_m_blocks = ceil_div(p.seqlen_q, C::kBlockM);
    const int items = num_m_blocks * p.heads_q * p.batch;

    if (warpgroup == 0) {
        // Producer: warp 0 walks the items and their tiles (all lanes, for the block-mask vote);
        // its lane 0 waits on the barriers and issues the copies. While the consumers finish one item,
        // the producer already loads the next one's Q (a free slot) and first K/V tiles. Over a KV
        // cache by TMA, lane j issues box j of each tile (kv_box_coords); over a paged cache whose pages
        // take no TMA box (gather), the whole warpgroup walks the tiles and copies their rows
        // (kv_cache_row, copy_kv_row). Lane 0 of warp 0 alone loads Q and takes the items.
        setmaxnreg_dec<C::kProducerRegs>();
        constexpr bool gather = C::kKvGather, collective = C::kKvCache;   // who calls issue_v_due: all
        if (warp != 0 && !gather) return;
        const bool leader = (gather ? threadIdx.x : lane) == 0;   // lane 0 of warp 0
        int stage = 0, phase = 0, slot = 0, q_phase = 0, item_parity = 0;
        // A tile's V goes out after the next tile's K, the order in which the consumers use them
        // (S of tile j + 1 is issued before P V of tile j): waiting for V's stage to be released
        // then no longer holds back the next K. An item's last V goes before the next item's Q
        // and K, which its last P V would otherwise wait behind (D = 128, 512 keys: 0.93 -> 1.02
        // of cuDNN). The V due is that of the stage before `stage`, at the coordinates kept here
        // (-1: none due). Over a KV cache by TMA, v_row and v_batch are the lane's box's row in its
        // page and page; a gather keeps its thread's kv_cache_row in v_batch.
        int v_row = -1, v_head = 0, v_batch = 0;
        // Over a KV cache by TMA: K or V of a tile (after lane 0 armed the barrier), one copy a lane: lane
        // l the column block l % col_blocks of box l / col_blocks, whose coordinates lane l / col_blocks
        // holds (kv_box_coords). At most 32 copies: tiles of kBlockN / 8 boxes of kColBlocks blocks.
        // One lane a copy, not lane 0 issuing all: pages of 16 rows run at 0.61-0.64x the contiguous
        // forward when one thread issues every copy (docs/decisions.md#chunked-prefill-on-fwd_sm90).
        auto load_boxes = [&](unsigned tile, const TmaMap* map, int col_blocks, int row, int head, int page,
                              unsigned bar) {
            __syncwarp();
            if constexpr (C::kKvRowGroups) {   // lane l: box l, every column block in one copy
                if (lane * p.kv_box_rows < C::kBlockN)
                    tma_load_5d(tile + lane * p.kv_box_rows * col_blocks * 128, map, 0, 0, 0,
                                (page * p.page_size + row) / 8, head, bar);
                return;
            }
            const int box = lane / col_blocks, blk = lane % col_blocks;
            const int box_row = __shfl_sync(0xffffffffu, row, box), box_page = __shfl_sync(0xffffffffu, page, box);
            if (box * p.kv_box_rows < C::kBlockN)
                tma_load_4d(tile + blk * C::kBlockN * 128 + box * p.kv_box_rows * 128, map, blk * 64, box_row, head,
                            box_page, bar);
        };
        auto issue_v_due = [&] {   // lane 0 of warp 0; the whole warp over a KV cache, the warpgroup in a gather
            if (v_row < 0) return;
            const int v_stage = stage == 0 ? C::kStages - 1 : stage - 1;
            const int v_phase = stage == 0 ? phase ^ 1 : phase;
            if constexpr (gather) {
                mbar_wait(v_empty(v_stage), v_phase ^ 1);
                copy_kv_row<C::kBlockN, C::kVColBlocks>(v_smem + v_stage * C::kVBytes, p.v, p.v_batch_stride,
                                                       p.v_row_stride, p.v_head_stride, p.head_dim_v, p.page_size,
                                                       v_batch, v_head);
                cp_async_arrive_noinc(v_full(v_stage));
            } else {
                if (leader) {
                    mbar_wait(v_empty(v_stage), v_phase ^ 1);
                    mbar_arrive_expect_tx(v_full(v_stage), C::kVBytes);
                }
                if constexpr (C::kKvCache) {
                    load_boxes(v_smem + v_stage * C::kVBytes, &v_map, C::kVColBlocks, v_row, v_head, v_batch,
                               v_full(v_stage));
                } else {
                    for (int blk = 0; blk < C::kVColBlocks; ++blk)
                        tma_load_4d(v_smem + v_stage * C::kVBytes + blk * C::kBlockN * 128, &v_map, blk * 64, v_row,
                                    v_head, v_batch, v_full(v_stage));
                }
            }
            v_row = -1;
        };
        for (int item = blockIdx.x;;) {
            if (item >= items) {
                if (collective) issue_v_due();
                if (leader) {
                    if (!collective) issue_v_due();
                    mbar_wait(q_empty(slot), q_phase ^ 1);
                    item_of_slot[slot] = -1;
                    mbar_arrive(q_full(slot));   // releases the write above to the consumers
                }
                return;
            }
            if (leader) next_item[item_parity] = take_item(tile_counter, items);   // read at the end
            const WorkItem<C> w = WorkItem<C>::of(p, item, num_m_blocks);
            if (!w.empty()) {
                const int num_tiles = w.count_tiles(p);
                if (collective) issue_v_due();   // the last item's last V
                if (leader) {
                    if (!collective) issue_v_due();
                    mbar_wait(q_empty(slot), q_phase ^ 1);   // a fresh barrier passes parity 1 at once
                    item_of_slot[slot] = item;
                    tiles_of_slot[slot] = num_tiles;
                    work_of_slot[slot] = w;
                    mbar_arrive_expect_tx(q_full(slot), C::kQBytes);
                    for (int blk = 0; blk < C::kColBlocks; ++blk)
                        tma_load_4d(q_smem + slot * C::kQBytes + blk * C::kBlockM * 128, &q_map, blk * 64,
                                    w.s.q_row0 + w.m_lo, w.s.h, w.batch_coord, q_full(slot));
                }
                if (++slot == C::kQSlots) { slot = 0; q_phase ^= 1; }
                if (C::kScoreTile && leader) {   // 0 where the bias or mask broadcasts over heads or batches
                    tile_coords[0] = (C::kBiasTile ? p.bias_head_stride : p.mask_head_stride) != 0 ? w.s.h : 0;
                    tile_coords[1] = (C::kBiasTile ? p.bias_batch_stride : p.mask_batch_stride) != 0 ? w.s.b : 0;
                }
                for (int base = w.n_first; base < w.n_end; base += 32) {
                unsigned masked;
                for (unsigned todo = w.tiles_from(p, base, &masked); todo != 0; todo &= todo - 1) {
                    const int bit = __ffs(todo) - 1;   // the lowest tile not yet loaded, or (kTilesDown) the highest:
                    // the range [n_first, n_end) mirrored (no block mask: every tile in it is visited)
                    const int n = C::kTilesDown ? w.n_first + w.n_end - 1 - (base + bit) : base + bit;
                    if constexpr (gather) {
                        const int key_row = w.s.k_row0 + n * C::kBlockN;
                        const int cache_row = kv_cache_row<C::kBlockN>(p, w.s, key_row);
                        mbar_wait(k_empty(stage), phase ^ 1);
                        copy_kv_row<C::kBlockN, C::kColBlocks>(k_smem + stage * C::kKBytes, p.k, p.k_batch_stride,
                                                              p.k_row_stride, p.k_head_stride, p.head_dim, p.page_size,
                                                              cache_row, w.s.h_kv);
                        cp_async_arrive_noinc(k_full(stage));
                        if (leader) {
                            tile_of_stage[stage] = n;
                            mbar_arrive(k_full(stage));   // publishes tile_of_stage (the barrier counts it)
                        }
                        issue_v_due();   // the previous tile's
                        v_batch = cache_row;
                        v_row = key_row;
                        v_head = w.s.h_kv;
                    } else if (C::kKvCache) {
                        const int key_row = w.s.k_row0 + n * C::kBlockN;
                        int page, row;
                        kv_box_coords(p, w.s, key_row, lane, &page, &row);   // before the wait: its latency hides
                        if (leader) {
                            mbar_wait(k_empty(stage), phase ^ 1);
                            tile_of_stage[stage] = n;
                            mbar_arrive_expect_tx(k_full(stage), C::kKBytes);
                        }
                        load_boxes(k_smem + stage * C::kKBytes, &k_map, C::kColBlocks, row, w.s.h_kv, page,
                                   k_full(stage));
                        issue_v_due();   // the previous tile's
                        v_row = row;
                        v_batch = page;
                        v_head = w.s.h_kv;
                    } else if (leader) {
                        const int key_row = w.s.k_row0 + n * C::kBlockN;
                        mbar_wait(k_empty(stage), phase ^ 1);
                        tile_of_stage[stage] = n;
                        if constexpr (C::kMaskOnly) masked_of_stage[stage] = (masked >> bit) & 1u;
                        mbar_arrive_expect_tx(k_full(stage), C::kKBytes);
                        for (int blk = 0; blk < C::kColBlocks; ++blk)
                            tma_load_4d(k_smem + stage * C::kKBytes + blk * C::kBlockN * 128, &k_map, blk * 64,
                                        key_row, w.s.h_kv, w.batch_coord, k_full(stage));
                        issue_v_due();   // the previous tile's
                        v_row = key_row;
                        v_head = w.s.h_kv;
                        v_batch = w.batch_coord;
                        if constexpr (C::kScoreTile) {
                            mbar_wait(tile_empty, stage % 2 ^ 1);   // a fresh barrier passes parity 1 at once
                            mbar_arrive_expect_tx(tile_full, C::kTileLoadBytes);
                            for (int blk = 0; blk < C::kTileBlocks; ++blk)
                                tma_load_4d(tile_smem + blk * C::kTileBlockPitch, &tile_map,
                                            n * C::kBlockN + blk * 128 / C::kTileElemBytes, C::kTileOneRow ? 0 : w.m_lo,
                                            tile_coords_of(0), tile_coords_of(1), tile_full);
                        }
                    }
                    if (++stage == C::kStages) { stage = 0; phase ^= 1; }
                }
                }
            }
            if constexpr (gather) {   // the warpgroup takes the next item from warp 0's lane 0, through shared memory
                named_barrier_sync(C::kProducerBarrier, 128);
                item = next_item[item_parity];
                item_parity ^= 1;
            } else {
                item = __shfl_sync(0xffffffffu, leader ? *static_cast<volatile int*>(&next_item[0]) : 0, 0);
            }
        }
    }

    // Consumers: slot, stage and phases run on across items, in step with the producer's.
    setmaxnreg_inc<C::kConsumerRegs>();
    const int consumer = warpgroup - 1;
    const int g = lane / 4, t = lane % 4;
    int stage = 0, phase = 0, slot = 0, q_phase = 0;
    for (;;) {
        mbar_wait(q_full(slot), q_phase);
        const int item = *static_cast<volatile int*>(&item_of_slot[slot]);
        if (item < 0) {
            if (threadIdx.x % 128 == 0) bulk_wait_read();   // output stores still read shared memory
            return;
        }
        const int num_tiles = *static_cast<volatile int*>(&tiles_of_slot[slot]);
        const WorkItem<C> w = work_of_slot[slot];
        const SeqInfo& s = w.s;
        const int m_lo = w.m_lo, m_hi = w.m_hi;
        const int row0 = m_lo + consumer * 64 + warp * 16;   // this warp's first query row
        const unsigned q_tile = q_smem + slot * C::kQBytes;

        float acc_o[1][C::kDTiles][4];
#pragma unroll
        for (int di = 0; di < C::kDTiles; ++di)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_o[0][di][e] = 0.f;
        OnlineSoftmax<1> softmax;
        softmax.init();

        // Software pipeline across key tiles: while the tensor cores run O += P_prev V_prev, the
        // warpgroup computes the softmax of the next S (issued just before), so exp2 and the GEMMs
        // overlap. Only after P_prev V_prev retires are O rescaled and P_prev's registers reused.
        float acc_s[1][C::kNTiles][4];
        // P of the previous tile (read by its P V wgmma) and of this one: the speculative softmax
        // makes the next P while P_prev V_prev still runs, and keeps S intact in acc_s meanwhile.
        unsigned p_frag[C::kBlockN / 16][4], p_next[C::kBlockN / 16][4];
        auto issue_s = [&](int stage) {
            // A descriptor's address field is the low bits, so a k-step's descriptor is the tile's
            // plus its byte offset / 16.
            const unsigned long long q_desc = smem_desc(q_tile + consumer * 64 * 128, 16, 1024);
            const unsigned long long k_desc = smem_desc(k_smem + stage * C::kKBytes, 16, C::kKGroupPitch);
#pragma unroll
            for (int kk = 0; kk < C::kHeadDim / 16; ++kk) {
                // Each 64-column block of the head dim is its own swizzled region, 32 bytes per k-step.
                const unsigned q_off = (kk / 4) * C::kBlockM * 128 + (kk % 4) * 32;
                const unsigned k_off = (kk / 4) * C::kKBlockPitch + (kk % 4) * 32;
                wgmma_ss<C::kBlockN>(*reinterpret_cast<float(*)[C::kBlockN / 2]>(&acc_s[0][0][0]),
                                     q_desc + (q_off >> 4), k_desc + (k_off >> 4), kk > 0 || C::kBiasTile);
            }
            wgmma_commit();
        };
        auto issue_pv = [&](int stage) {
            // 16 keys per step (2048 bytes of V); a chunk's columns span column blocks (leading offset).
            // As in issue_s, each step's descriptor is the tile's plus an offset (one add, not a
            // mask, shift and or per wgmma: at D = 64 that was ~5% of a tile's instructions).
            const unsigned long long v_desc = smem_desc(v_smem + stage * C::kVBytes, C::kVBlockPitch, C::kVGroupPitch);
#pragma unroll
            for (int kk = 0; kk < C::kBlockN / 16; ++kk)
#pragma unroll
                for (int c = 0; c < C::kPvChunks; ++c) {
                    const unsigned v_off = c * (C::kPvN / 64) * C::kVBlockPitch + kk * 2 * C::kVGroupPitch;
                    wgmma_rs<C::kPvN>(&acc_o[0][c * C::kPvN / 8][0], p_frag[kk], v_desc + (v_off >> 4));
                }
            wgmma_commit();
        };
        // mask_scores scales modified scores, add_alibi_columns and cap_scores_log2 theirs.
        const float scale_log2 = C::kScoreMods || C::kScoresInLog2 ? 1.f : p.scale_log2;
        // Key tile n's score tile (its buffer's phase: the stage's parity), read before S is issued: the
        // bias as S's starting accumulator, or the mask's answers as bits (kMaskBits).
        const float inv_scale = C::kBiasTile ? 1.f / p.scale : 0.f;
        unsigned hidden[2];
        auto read_score_tile = [&](int stage) {
            if constexpr (C::kBiasTile || C::kMaskBits) {
                mbar_wait(tile_full, stage % 2);
                if constexpr (C::kBiasTile)
                    start_scores_with_bias<C>(acc_s, tile_smem, consumer * 64 + warp * 16, lane, inv_scale);
                else
                    mask_tile_bits<C>(hidden, tile_smem, consumer * 64 + warp * 16, g, t);
                mbar_arrive(tile_empty);
            }
        };
        float alibi_log2 = 0.f;   // kAlibiColumns: the head's slope x log2(e), its bias relative to key alibi_ref
        const int alibi_ref = m_lo + s.diag;
        if constexpr (C::kAlibiColumns) alibi_log2 = p.alibi_slopes[s.b * p.alibi_batch_stride + s.h] * kLog2e;
        bool masked_tile = false;   // kMaskOnly: the tile of the last wait_tile has elements to hide
        // The block mask alone may come with a MaskMod's bits: this thread's words of the last
        // wait_tile's tile, loaded there, before its S is issued (load_mask_bits_rows).
        constexpr bool kMaskBits = C::kMods == kModBlockMask;
        unsigned mask_words[2][C::kNTiles / 4];
        // S of tile n (retired) -> the scores, masked, in acc_s.
        auto score_step = [&](int n) {
            fence_registers(*reinterpret_cast<float(*)[C::kBlockN / 2]>(&acc_s[0][0][0]));
            // D = 256 with modifiers: what the modifiers derive from the rows alone (visible keys,
            // bias/mask row offsets) is the same for every tile, and NVVM hoisted it out of the tile
            // loop, live beside O's 128 registers: NVRTC 13.0's ptxas spilled 20-24 bytes. Made
            // opaque here, the row is taken anew each tile and those few instructions with it.
            int mod_row0 = row0;
            if constexpr (C::kRotated && C::kHeadDimV == 256) asm volatile("" : "+r"(mod_row0));
            if constexpr (C::kSoftcapOnPlainLoop)   // before the masks: tanh(-inf) is not -inf
                cap_scores_log2(acc_s, p.scale * softcap_rate(p), p.softcap * kLog2e);
            if constexpr (C::kMaskBits) {
                hide_by_bits<C>(acc_s, hidden);
            } else if constexpr (C::kMaskTile) {
                mbar_wait(tile_full, stage % 2);   // (the tile's stage)
                hide_by_mask_tile<C>(acc_s, tile_smem, consumer * 64 + warp * 16, g, t);
                mbar_arrive(tile_empty);
            }
            mask_scores<C::kScoreMods ? C::kMods : 0>(acc_s, p, s, m_lo, m_hi, n * C::kBlockN, mod_row0, g, t);
            if constexpr (C::kMaskOnly) {
                bool bits = false;
                if constexpr (kMaskBits) bits = p.mask_bits_offset != 0;
                if (masked_tile && bits) hide_by_mask_words(acc_s, mask_words, t);
                else if (masked_tile) hide_masked_scores<C::kMods>(acc_s, p, s, n * C::kBlockN, row0, g, t);
            }
            if constexpr (C::kAlibiColumns)
                add_alibi_columns(acc_s, alibi_log2, n * C::kBlockN - alibi_ref, t, p.scale_log2);
        };
        // The scores of tile n -> P in acc_s, returns the row corrections for O.
        auto softmax_step = [&](int n, float (&correction)[2]) {
            softmax.update(acc_s, correction, scale_log2);
            if (C::kDropout) drop_probabilities(acc_s, p, s, row0, n * C::kBlockN, g, t);
        };

        auto retire_pv = [&] {   // waits for every wgmma of the warpgroup, then P V's registers are free
            wgmma_wait<0>();
            fence_registers(*reinterpret_cast<float(*)[C::kHeadDimV / 2]>(&acc_o[0][0][0]));
            fence_registers(p_frag);
        };
        // The key tile that fills this stage (and, kMaskOnly, whether it has elements to hide: read
        // here, since the producer may reuse the stage's entries once S has retired).
        auto wait_tile = [&](int stage, int phase) {
            mbar_wait(k_full(stage), phase);
            if constexpr (C::kMaskOnly) masked_tile = *static_cast<volatile int*>(&masked_of_stage[stage]) != 0;
            const int n = *static_cast<volatile int*>(&tile_of_stage[stage]);
            if constexpr (kMaskBits)
                if (masked_tile && p.mask_bits_offset != 0)
                    load_mask_bits_rows<1, C::kNTiles>(mask_words, p, s, n * C::kBlockN, row0, g);
            return n;
        };
        if constexpr (C::kRotated) {
            // The pipeline of the loop below, rotated so that every tile, the first included, goes
            // through one copy of the per-element score code (that loop, with a first tile of its own
            // and unrolled by two, compiled it three times: 30-45 s of NVRTC per variant with every
            // modifier). Each pass: the scores of tile n and their softmax, then S of the next tile
            // and P V of this one. No speculative softmax here, so P goes straight into p_frag once
            // the previous P V has retired. At D = 256, P V retires before the scores: its P
            // registers are what the modifiers need there (otherwise 24-28 bytes of spills).
            if (num_tiles > 0) {
                int n = wait_tile(stage, phase);
                wgmma_fence();
                issue_s(stage);
                wgmma_wait<0>();
                mbar_arrive(k_empty(stage));
                if (num_tiles == 1) mbar_arrive(q_empty(slot));   // the item's last S has retired
                int prev_stage = stage, prev_phase = phase;
#pragma unroll 1
                for (int i = 0;;) {
                    float correction[2];
                    if constexpr (C::kHeadDimV == 256) retire_pv();
                    score_step(n);
                    if (!C::kPvWaitBelowSoftmax) retire_pv();
                    softmax_step(n, correction);
                    if constexpr (C::kPvWaitBelowSoftmax) {   // as below: a wait on each side of the branch
                        if (rows_moved(correction)) {
                            retire_pv();
                            scale_rows(acc_o, correction);
                        } else {
                            retire_pv();
                        }
                    } else {
                        rescale_rows(acc_o, correction);   // (on the first tile O is 0 and stays 0)
                    }
#pragma unroll
                    for (int kk = 0; kk < C::kBlockN / 16; ++kk) pack_p<elem_t>(p_frag[kk], acc_s[0], kk);
                    if (i > 0) mbar_arrive(v_empty(prev_stage));   // this thread's reads of that V are complete
                    prev_stage = stage;
                    prev_phase = phase;
                    if (++stage == C::kStages) { stage = 0; phase ^= 1; }
                    if (++i == num_tiles) break;
                    n = wait_tile(stage, phase);
                    wgmma_fence();   // orders this thread's writes of P and O before the GEMMs read them
                    issue_s(stage);
                    mbar_wait(v_full(prev_stage), prev_phase);
                    issue_pv(prev_stage);
                    wgmma_wait<1>();   // S retired (groups retire in order); P_prev V_prev may still run
                    mbar_arrive(k_empty(stage));
                    if (i == num_tiles - 1) mbar_arrive(q_empty(slot));
                }
                mbar_wait(v_full(prev_stage), prev_phase);
                const int first_row = s.seqlen_k - n * C::kBlockN;   // as below
                if ((C::kKvCache || p.cu_seqlens_k != nullptr) && first_row < C::kBlockN)
                    zero_v_rows<C>(v_smem + prev_stage * C::kVBytes, first_row);
                wgmma_fence();
                issue_pv(prev_stage);
                retire_pv();
                mbar_arrive(v_empty(prev_stage));
            }
        } else if (num_tiles > 0) {
            int n = wait_tile(stage, phase);
            read_score_tile(stage);
            wgmma_fence();
            issue_s(stage);
            wgmma_wait<0>();
            mbar_arrive(k_empty(stage));
            if (num_tiles == 1) mbar_arrive(q_empty(slot));   // the item's last S has retired
            float correction[2];
            score_step(n);
            softmax_step(n, correction);   // O is still 0: nothing to rescale
#pragma unroll
            for (int kk = 0; kk < C::kBlockN / 16; ++kk) pack_p<elem_t>(p_frag[kk], acc_s[0], kk);
            int prev_stage = stage, prev_phase = phase;
            if (++stage == C::kStages) { stage = 0; phase ^= 1; }
            // Unrolled by two, the copy of p_next into p_frag at the end becomes a renaming of registers.
#pragma unroll 2
            for (int i = 1; i < num_tiles; ++i) {
                const int n_prev = n;
                n = wait_tile(stage, phase);
                read_score_tile(stage);
                wgmma_fence();   // orders this thread's writes of P and O before the GEMMs read them
                issue_s(stage);
                mbar_wait(v_full(prev_stage), prev_phase);
                if constexpr (C::kTilesDown) {   // tiles going down, the first is the one that can run past the end
                    const int first_row = s.seqlen_k - n_prev * C::kBlockN;
                    if (i == 1 && (C::kKvCache || p.cu_seqlens_k != nullptr) && first_row < C::kBlockN) {
                        zero_v_rows<C>(v_smem + prev_stage * C::kVBytes, first_row);
                        wgmma_fence();
                    }
                }
                issue_pv(prev_stage);
                wgmma_wait<1>();   // S retired (groups retire in order); P_prev V_prev may still run
                mbar_arrive(k_empty(stage));
                if (i == num_tiles - 1) mbar_arrive(q_empty(slot));
                score_step(n);
                if (!C::kPvWaitBelowSoftmax) retire_pv();
                // Speculatively first; a row whose maximum moved sends the warp to the exact update.
                // The vote's branch also ends the basic block, which keeps the wait below it.
                bool held = false;
                if constexpr (C::kSpeculative) held = softmax.update_if_held<elem_t>(acc_s, p_next, scale_log2);
                if (held) {
                    retire_pv();   // O keeps its scale (held implies kPvWaitBelowSoftmax)
                } else {
                    softmax_step(n, correction);
                    // ptxas moves a wgmma wait up to the top of its basic block: after the softmax
                    // in the source, it was issued before the row maxima, and P_prev V_prev never
                    // ran beside the exponentials. Deciding O's rescale first, with a wait on each
                    // side of the branch, keeps the wait below the softmax (a branch ends the
                    // block). Same-run A/B without the speculative softmax: D = 128 +0.02-0.04 of
                    // cuDNN; D = 64 and 256 -0.01-0.03, so their exact-only variants (score
                    // modifiers, dropout) wait before the softmax.
                    if constexpr (C::kPvWaitBelowSoftmax) {
                        if (rows_moved(correction)) {
                            retire_pv();
                            scale_rows(acc_o, correction);
                        } else {
                            retire_pv();
                        }
                    } else {
                        rescale_rows(acc_o, correction);
                    }
#pragma unroll
                    for (int kk = 0; kk < C::kBlockN / 16; ++kk) pack_p<elem_t>(p_next[kk], acc_s[0], kk);
                }
                mbar_arrive(v_empty(prev_stage));   // this thread's reads of that V are complete
#pragma unroll
                for (int kk = 0; kk < C::kBlockN / 16; ++kk)
#pragma unroll
                    for (int j = 0; j < 4; ++j) p_frag[kk][j] = p_next[kk][j];
                prev_stage = stage;
                prev_phase = phase;
                if (++stage == C::kStages) { stage = 0; phase ^= 1; }
            }
            mbar_wait(v_full(prev_stage), prev_phase);
            // The last tile is the only one that can run past the sequence's end (tiles go up; going
            // down, the first: the last is it only when it is the only one).
            const int first_row = s.seqlen_k - n * C::kBlockN;   // of the tile, the first past the end
            if ((C::kKvCache || p.cu_seqlens_k != nullptr) && first_row < C::kBlockN)
                zero_v_rows<C>(v_smem + prev_stage * C::kVBytes, first_row);
            wgmma_fence();
            issue_pv(prev_stage);
            retire_pv();
            mbar_arrive(v_empty(prev_stage));
        }
        if (num_tiles == 0) mbar_arrive(q_empty(slot));   // (otherwise released after the last S)
        if (++slot == C::kQSlots) { slot = 0; q_phase ^= 1; }

        if constexpr (C::kAlibiColumns)   // each row's own term of ALiBi, left out of its scores
#pragma unroll
            for (int half = 0; half < 2; ++half) softmax.m[half] -= alibi_log2 * float(row0 + g + 8 * half - m_lo);
        float inv_l[2], lse[2];
        softmax.finish(inv_l, lse, scale_log2,
                       p.sinks != nullptr ? p.sinks[s.h] : -CUFLASH_INF);   // the head's sink (-inf: none)
        store_output_staged<C>(acc_o, inv_l, lse, p, o_map, s, m_lo + consumer * 64,
                               out_smem + consumer * 64 * C::kOutCols * 2, consumer);
    }
}

}  // namespace cuflash

#ifndef CUFLASH_HEAD_DIM_V
#define CUFLASH_HEAD_DIM_V CUFLASH_HEAD_DIM
#endif
#ifndef CUFLASH_KV_CACHE
#define CUFLASH_KV_CACHE 0
#endif
#ifndef CUFLASH_MOD_ON_PLAIN_LOOP
#define CUFLASH_MOD_ON_PLAIN_LOOP 0
#endif
#ifndef CUFLASH_TILE_ONE_ROW
#define CUFLASH_TILE_ONE_ROW 0
#endif
using Config = cuflash::FwdSm90Config<CUFLASH_HEAD_DIM, CUFLASH_HEAD_DIM_V, CUFLASH_BLOCK_N, CUFLASH_Q_SLOTS,
                                      CUFLASH_STAGES, CUFLASH_CONSUMERS, CUFLASH_SCORE_MODS, CUFLASH_DROPOUT != 0,
                                      CUFLASH_KV_CACHE, CUFLASH_MOD_ON_PLAIN_LOOP != 0, CUFLASH_TILE_ONE_ROW != 0>;
#ifdef CUFLASH_SMEM_BYTES
static_assert(CUFLASH_SMEM_BYTES == Config::kSmemBytes, "shared memory size differs from cuflash/_heuristics.py");
#endif

// A variant with a score tile takes its map after O's (cuflash/_forward_plan.py; cuflash/_scores.py, score_tile_spec).
#define CUFLASH_SCORE_TILE (CUFLASH_MOD_ON_PLAIN_LOOP != 0 && (CUFLASH_SCORE_MODS == 4 || CUFLASH_SCORE_MODS == 8))
static_assert(CUFLASH_SCORE_TILE == Config::kScoreTile && cuflash::kModBias == 4 && cuflash::kModMask == 8,
              "the kernel's parameters follow FwdSm90Config::kScoreTile");

extern "C" __global__ void __launch_bounds__(Config::kNThreads, 1)
    cuflash_fwd_sm90(const __grid_constant__ cuflash::TmaMap q_map, const __grid_constant__ cuflash::TmaMap k_map,
                     const __grid_constant__ cuflash::TmaMap v_map, const __grid_constant__ cuflash::TmaMap o_map,
#if CUFLASH_SCORE_TILE
                     const __grid_constant__ cuflash::TmaMap tile_map,
#endif
                     const cuflash::FwdParams p, int* tile_counter) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    // Before the barriers and before any take_item: tile_counter stays 0 for the next launch.
    if (cuflash::call_faulted(p.error)) return;
#if CUFLASH_SCORE_TILE
    cuflash::fwd_sm90<Config>(q_map, k_map, v_map, o_map, tile_map, p, tile_counter);
#else
    cuflash::fwd_sm90<Config>(q_map, k_map, v_map, o_map, o_map, p, tile_counter);
#endif
#endif
}

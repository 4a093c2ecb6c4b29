// Backward attention for Hopper (sm_90a), fp16/bf16: the dK/dV pass (and dQ, added into a float32
// buffer) on wgmma, its operands brought in by TMA, warp-specialised.
//
// A CTA keeps kBlockN = 128 keys of one kv head (64 at D = 256; K and V, loaded once) and walks over
// the query tiles that see them, for each query head of its GQA group in turn (FlashAttention-2's
// backward recomputing P from lse, in FlashAttention-3's arrangement):
//   warpgroup 0, the producer: one thread streams Q, dO (TMA) and the rows' lse2 and D (bulk
//     copies) of each query tile into a kStages-deep ring; it gives its registers away. With
//     ordered dQ, and at D = 128 with 64 rows (kDqAsync), other warps of it, one per dQ share
//     buffer, are the dQ writers, which add the consumers' shares of dQ into dq_accum (below); with
//     80 rows (kDqHandOver) one per consumer.
//   warpgroups 1 and 2, the consumers, 64 keys each. Per query tile (kBlockM rows):
//       S^T = K Q^T,  dP^T = V dO^T          (wgmma, both operands in shared memory; two groups)
//       P^T element by element                (element_prob, bwd_common.cuh; masks of mask.cuh),
//                                              while dP^T is still computed
//       dV += P^T dO                           (wgmma with P^T from registers: the accumulator
//                                              layout is the A-fragment layout; at D = 128 issued
//                                              before dS^T, which it then overlaps)
//       dS^T element by element, dK += dS^T Q  (element_grad; wgmma from registers)
//       dQ += dS K                             (dS^T of both consumers through shared memory, each
//                                              consumer a 64 x 64 share of dQ, added into its
//                                              share of dq_accum's tile by one bulk reduction; at
//                                              D = 128 with 64 rows the previous tile's, so that
//                                              the consumers need not meet, and the reduction
//                                              the writers': kDeferDq, kDqAsync; with 80 rows
//                                              the step's own, the writers' too: kDqHandOver)
//   dK, dV stay in registers across the walk and are written once at the end (through shared memory,
//   as 16-byte row chunks).
// At D = 256 the dK and dV of 64 keys over all columns would take 256 registers per thread, so the
// consumers split the columns instead (consume_dim_halves, below): S^T and dP^T by query halves,
// P^T and dS^T through shared memory, every other product from shared memory.
// With deterministic=True the additions into each dq_accum tile take turns in a fixed order at
// D = 128 (CUFLASH_BWD_DQ=2, cuda_src/dq_order.cuh): the consumers hand their shares to the dQ
// writers (warps 1 and 2 of warpgroup 0, one per share buffer) through mbarriers instead of reducing
// them themselves; a writer waits for each tile's turn, reduces, and passes the turn on once the
// reduction has landed, so that neither the turns nor the reductions' latency stall the tensor cores.
// At D = 64 there is no dQ product here (CUFLASH_BWD_DQ=0): bwd_sm80's dQ pass writes dQ; so at
// D = 256.
//
// Rows past the tensor's end come in as zeros (TMA). Under varlen, a tile's rows past its sequence
// belong to the next one: the consumers zero them in shared memory (queries: Q and dO rows of the
// tile; keys: K rows, which the dQ product would otherwise meet as 0 * K), so nothing outside the
// sequence reaches a gradient, NaN included. Masked elements get P = dS = 0 exactly (element_grad).
//
// Compile-time configuration (cuflash/kernels/bwd_sm90.py): CUFLASH_DTYPE 0/1, CUFLASH_HEAD_DIM
// 64/128/256 (Q, K, dQ, dK; 192 beside a V of 128), CUFLASH_HEAD_DIM_V (V, dO, dV: written only where
// it differs; the pairs of BWD_SM90_PAIRS), CUFLASH_BWD_DQ (0: no dQ, 1: dQ here, 2: in a fixed order),
// CUFLASH_BLOCK_M (query rows per step: 128 for D = 64, 64 for D = 128 and 256, so that dQ is made of
// 64 x 64 shares), CUFLASH_STAGES, CUFLASH_SCORE_MODS (bit mask, mask.cuh), CUFLASH_DROPOUT,
// CUFLASH_SMEM_BYTES, CUFLASH_PARAMS_SIZE, CUFLASH_BWD_PARAMS_SIZE, CUFLASH_ALL_KEYS_SEEN (1: every row
// sees every key of its tiles, BwdSm90Config::kAllKeysSeen), CUFLASH_TILE_GUARD (1: otherwise the
// same tile by tile, kTileGuard), CUFLASH_BWD_DEFER_DQ (default 1: kDeferDq where it applies; 0
// for an A/B against the lockstep), CUFLASH_BWD_DQ_ASYNC (default 1: kDqAsync with kDeferDq; 0 for
// an A/B against the consumers' own reductions), CUFLASH_BWD_DQ_HANDOVER (default 1: kDqHandOver with
// 80-row steps; 0 likewise), CUFLASH_BWD_ORDERED_DQ_ASYNC (default 1: kDqAsync for ordered dQ
// too; 0 likewise), CUFLASH_BWD_RELAG (default 2: kDeferDq's lag made again every 2 steps; 0: at the
// first step only, for an A/B), CUFLASH_BWD_PERSISTENT (1: CTAs that take key blocks from a counter,
// kPersistent), CUFLASH_BWD_DQ_FIRST_STORES (1: the first dQ writer to reach a tile stores its shares
// where the others add theirs, so that bwd_preprocess need not zero dq_accum: kDqFirstStores).
// Score modifiers and dropout take smaller accumulators (BwdSm90Config::kFeatured): D = 128 splits
// the columns as D = 256 does, D = 64 takes 64 query rows per step.
#include "common.cuh"
#include "params.cuh"
#include "bwd_params.cuh"
#include "fault.cuh"
#include "mask.cuh"
#include "philox.cuh"
#include "bwd_common.cuh"
#include "dq_order.cuh"
#include "tma_sm90.cuh"
#include "wgmma_sm90.cuh"
#include "gemm_sm90.cuh"
#include "mma_sm80.cuh"   // ldmatrix_x4_trans

#if CUFLASH_DTYPE == 2
#error "bwd_sm90 computes float16/bfloat16 (CUFLASH_DTYPE 0 or 1)"
#endif
#ifndef CUFLASH_HEAD_DIM_V
#define CUFLASH_HEAD_DIM_V CUFLASH_HEAD_DIM
#endif
#ifndef CUFLASH_ALL_KEYS_SEEN
#define CUFLASH_ALL_KEYS_SEEN 0
#endif
#ifndef CUFLASH_SCORE_TILE
#define CUFLASH_SCORE_TILE 0
#endif
#ifndef CUFLASH_TILE_ONE_ROW
#define CUFLASH_TILE_ONE_ROW 0
#endif
#ifndef CUFLASH_TILE_GUARD
#define CUFLASH_TILE_GUARD 0
#endif
#ifndef CUFLASH_BWD_DEFER_DQ
#define CUFLASH_BWD_DEFER_DQ 1
#endif
#ifndef CUFLASH_BWD_DQ_ASYNC
#define CUFLASH_BWD_DQ_ASYNC 1
#endif
#ifndef CUFLASH_BWD_DQ_HANDOVER
#define CUFLASH_BWD_DQ_HANDOVER 1
#endif
#ifndef CUFLASH_BWD_ORDERED_DQ_ASYNC
#define CUFLASH_BWD_ORDERED_DQ_ASYNC 1
#endif
#ifndef CUFLASH_BWD_RELAG
#define CUFLASH_BWD_RELAG 2
#endif
#ifndef CUFLASH_BWD_PERSISTENT
#define CUFLASH_BWD_PERSISTENT 0
#endif
#ifndef CUFLASH_BWD_DQ_FIRST_STORES
#define CUFLASH_BWD_DQ_FIRST_STORES 0
#endif

namespace cuflash {

// The columns of dK (and of dQ, whose shares are dK's column blocks) and of dV that consumer c owns
// where the two consumers split the columns (head dim d, v's dv). Halves alike at d = 256 (and 128
// featured); at d = 192 beside dv = 128 consumer 0 takes dK's and dQ's first two column blocks and
// consumer 1 the third and all of dV: four 64 x 64 x 64 products a step each, where halves of
// 96 columns would start inside a 64-column swizzle block.
__host__ __device__ constexpr int split_dk_cols(int d, int c) { return d == 192 ? (c == 0 ? 128 : 64) : d / 2; }
__host__ __device__ constexpr int split_dk_col0(int d, int c) { return d == 192 ? (c == 0 ? 0 : 128) : c * (d / 2); }
__host__ __device__ constexpr int split_dv_cols(int d, int dv, int c) { return d == 192 ? (c == 0 ? 0 : dv) : dv / 2; }
__host__ __device__ constexpr int split_dv_col0(int d, int dv, int c) { return d == 192 ? 0 : c * (dv / 2); }

// At D = 256 and 64 the uniform warpgroup index helps what NVRTC 13.0 makes of the consumers (backward
// 4-10% faster at D = 256, up to 8% at D = 64) and not what 13.5 makes (D = 256 3-5% slower, D = 64
// spilled; H200, docs/decisions.md#bwd-sm90-uniform-warpgroup-index): taken by the compiler's version,
// measured at those two.
#if __CUDACC_VER_MAJOR__ * 100 + __CUDACC_VER_MINOR__ < 1305
constexpr bool kUniformWarpgroupByNvrtc = true;
#else
constexpr bool kUniformWarpgroupByNvrtc = false;
#endif

template <int kHeadDim_, int kHeadDimV_, int kBlockM_, int kStages_, int kDqMode_, int kMods_, bool kDropout_>
struct BwdSm90Config {
    // kHeadDim: Q's, K's, dQ's and dK's columns; kHeadDimV: V's, dO's and dV's (the contraction of
    // dP^T = V dO^T and the columns of dV += P^T dO). The tiles, the split between the consumers and
    // the dQ scheme follow kHeadDim; every kHeadDimV == kHeadDim branch is the code of a square call.
    static constexpr int kHeadDim = kHeadDim_, kHeadDimV = kHeadDimV_, kBlockM = kBlockM_, kStages = kStages_;
    // dQ computed here and added into dq_accum (in a fixed order: kOrdered); kDq false: bwd_sm80's dQ
    // pass computes it. Compile-time: an in-flight wgmma on one side of a run-time branch made ptxas
    // serialize them all.
    static constexpr bool kDq = kDqMode_ != 0, kOrdered = kDqMode_ == 2;
    static constexpr int kMods = kMods_;
    // One built-in modifier alone from D = 128, without dropout, keeps the plain tiles
    // (kScoresInPlace): no raw score is kept beside P^T, which is what sends the others to the
    // featured ones. The softcap caps S^T in place before the window's mask (cap_scores), P^T comes
    // from it as from a raw score, and dS^T's factor 1 - tanh^2 is recovered from P^T and the row's
    // lse (softcap_grad_from_prob); ALiBi or the block mask modify S^T in place (modify_scores), their
    // derivative being 1. The softcap's forward + backward runs at 0.75x of the call without it on
    // these tiles, 0.45x on the featured ones (H200, D = 128 8k causal:
    // docs/decisions.md#bwd-sm90-one-modifier-on-the-plain-tiles). From D = 128: D = 64's plain tiles
    // (128 query rows) spilled 44-80 B with the softcap, and D = 128's 12-124 B with the bias's or the
    // mask's loads (kernels/bwd_sm90.py, IN_PLACE_MODS).
    // A bias of q's dtype or a boolean mask alone (kScoreTile, CUFLASH_SCORE_TILE: the host checked its
    // layout) is read as tiles too, as in fwd_sm90: the producer loads a step's (query rows x the CTA's
    // keys) block of it by TMA into the stage beside Q and dO, and the consumers read it transposed:
    // the bias as S^T's starting accumulator (start_scores_with_bias_t), the mask after S^T
    // (hide_by_mask_tile_t); then it modifies S^T in place like ALiBi. At D = 128 only
    // (square), without dropout or ordered dQ, and not for dbias (its stores spill 92 bytes here): its
    // stages take one of dQ's two share buffers.
    static constexpr bool kScoreTile = CUFLASH_SCORE_TILE != 0;
    static constexpr bool kBiasTile = kScoreTile && kMods == kModBias, kMaskTile = kScoreTile && kMods == kModMask;
    static_assert(!kScoreTile || ((kBiasTile || kMaskTile) && !kDropout_ && kHeadDim == 128 && kHeadDimV == 128 &&
                                  kDqMode_ == 1 && kBlockM_ == 64),
                  "score tiles: a bias or mask alone at D = 128, 64-row steps, dQ added in no fixed order");
    static constexpr bool kScoresInPlace =
        !kDropout_ && kHeadDim >= 128 &&
        (kMods == kModSoftcap || kMods == kModAlibi || kMods == kModBlockMask || kScoreTile);
    static constexpr bool kSoftcapAlone = kScoresInPlace && kMods == kModSoftcap;
    static constexpr bool kModifiedInPlace = kScoresInPlace && !kSoftcapAlone;
    static constexpr int kElementMods = kSoftcapAlone ? 0 : kMods;   // element_prob_kept's and element_grad's
    static constexpr bool kScoreMods = kMods != 0 && !kScoresInPlace, kDropout = kDropout_;
    static constexpr bool kBlockMask = (kMods & kModBlockMask) != 0;
    static_assert(!(kOrdered && kBlockMask), "ordered dQ needs every CTA to visit every tile of its range");
    // Score modifiers and dropout (kFeatured) keep the raw scores beside the modified ones and draw
    // Philox words: with dK, dV of 64 keys x 128 columns (128 registers) beside S^T and dP^T, the
    // consumers spilled 50-350 B at D = 128 and 64, so those variants take smaller accumulators
    // (_heuristics.py picks the tiles): D = 128 splits the columns as D = 256 does, D = 64 takes
    // 64 query rows per step.
    static constexpr bool kFeatured = kScoreMods || kDropout;
    // Every key of every tile a row meets is a key the row sees (no mask, window, varlen or score
    // modifier; keys past the end come in as zeros): dS needs no guard for P = 0 (element_grad),
    // an FSETP and an FSEL of the ~8 instructions per score element.
    static constexpr bool kAllKeysSeen = CUFLASH_ALL_KEYS_SEEN != 0 && !kFeatured;
    // Otherwise, without score modifiers or dropout, the same holds tile by tile: a tile with no
    // element masked and no row past the queries' end skips the guard at run time.
    static constexpr bool kTileGuard = CUFLASH_TILE_GUARD != 0 && !kFeatured && !kAllKeysSeen;
    // How the two consumers share a CTA's work: by keys (64 each, dK/dV of all columns) up to
    // D = 128; by columns at D = 256 (dK/dV of 128 columns for all 64 keys), where 64 keys' dK and dV
    // of every column would take 256 registers per thread, and at D = 128 when featured.
    static constexpr bool kSplitDims = kHeadDim >= 192 || (kHeadDim == 128 && kFeatured);
    // ... and at Q's and K's 192 (beside V's 128), not by halves (split_dk_cols).
    static constexpr bool kAsymmetricSplit = kHeadDim == 192;
    // With score modifiers or dropout, split by keys, a consumer computes dP^T after P^T rather than
    // beside it: the modifiers' loads and the Philox rounds then have dP^T's registers.
    static constexpr bool kSerialScores = kFeatured && !kSplitDims;
    static constexpr int kBlockN = kSplitDims ? 64 : 128, kConsumers = 2, kNThreads = 128 * (kConsumers + 1);
    // The producer's walk and copies need 40 registers (with 24 they spilled), the block mask's tests
    // included (query_tiles_from); the consumers get the rest, which holds dK, dV, S^T, dP^T of 64
    // keys (192 at D = 128) without spills (every
    // modifier with dropout at D = 256 spilled 40 B with 224). With 80 query rows (224 of them) the
    // consumers need 240, and the producer's walk at D = 128 (not unrolled) fits in 24.
    static constexpr int kProducerRegs = kBlockM == 80 ? 24 : 40;
    static constexpr int kConsumerRegs = kBlockM == 80 ? 240 : 232;
    static constexpr int kProducerUnroll = kHeadDim == 64 && !CUFLASH_BWD_PERSISTENT ? 2 : 1;
    static_assert(128 * (kProducerRegs + kConsumers * kConsumerRegs) <= kNThreads * ((65536 / kNThreads) & ~7),
                  "the register split exceeds what the launch allocates");
    // A consumer's S^T is 64 keys x kQueryCols (kMTiles 8-column n-tiles); its dK and dV are 64 keys x
    // all columns split by keys, split_dk_cols / split_dv_cols of them split by columns.
    static constexpr int kQueryCols = kSplitDims ? kBlockM / 2 : kBlockM;
    static constexpr int kMTiles = kQueryCols / 8;
    // dV's product: a register-A wgmma of n = kHeadDimV (by keys), or a shared-memory one of n =
    // split_dv_cols starting at a column block of dO (by columns): n of 64 or 128 either way (or none).
    static constexpr int kDimColsV1 = kSplitDims ? split_dv_cols(kHeadDim, kHeadDimV, 1) : kHeadDimV;
    static_assert(kDimColsV1 == 64 || kDimColsV1 == 128, "a consumer's dV has 64 or 128 columns");
    static constexpr int kKeepWords = kDropout ? (kMTiles + 7) / 8 : 1;   // dropout_keep_bits_cols' registers
    // dV's product goes out before dS^T is computed when P^T (float32, for dS^T) and its packed copy
    // (read by the in-flight wgmma) fit beside dK, dV, dP^T: 64 query columns per step, not 128.
    static constexpr bool kEarlyDv = kBlockM == 64;
    // k-steps of dK issued after dQ's product (consume_key_halves), so that the consumer stores its
    // dQ share while they run: half of them at D = 64 (H100, 4k tokens: 0.97 -> 1.035x cuDNN per
    // call). At D = 128, 2 or 4 of its 4 moved the step by less than 1% (dQ's way out then took as
    // much longer as it overlapped): none. (Not with kSerialScores, which waits for dK before dQ.)
    static constexpr int kDkTail = (kDq && !kSerialScores && kHeadDim == 64) ? kBlockM / 32 : 0;
    // dQ (kBlockM x kHeadDim) in 64 x 64 shares: by rows when kBlockM = 128, by columns when 64
    // (split_dk_cols / 64 per consumer: two at D = 256), and at D = 64 with 64 rows (featured) each
    // consumer's product over its own 64 keys, both added into the tile's one share (kDqByKeys). With 80 rows
    // (D = 128 without a window: per step 25% more work for the same K, V and 10% fewer operand bytes
    // read per product than with 64) a consumer computes its 64 columns of dQ transposed,
    // dQ^T = K^T dS^T (wgmma n = 80: m is 64), with dS stored transposed (kDqTransposed).
    static constexpr bool kDqSplitRows = kBlockM == 128, kDqByKeys = kHeadDim == 64 && kBlockM == 64;
    static constexpr bool kDqTransposed = kBlockM == 80;
    // Split by keys at D = 128, the consumers read their sequence again where they need it (dQ's
    // tile, the dK/dV store): held through the walk it spilled, with 80 rows, and with 64 beside
    // dS's guard tile by tile (112 B). At D = 64 reading it again spilled 16-80 B instead.
    static constexpr bool kRereadBatch = kHeadDim == 128;
    static_assert(kDqSplitRows ? kHeadDim == 64
                               : kDqTransposed ? kHeadDim == 128 && !kSplitDims && !kOrdered : kBlockM == 64,
                  "each consumer's share of dQ is made of 64 x 64 products (wgmma_ss_n64_tt), or of 64 x 80 "
                  "ones at D = 128 split by keys (gemm_atbt_ss)");
    static constexpr int kDqRegs = kDqTransposed ? kBlockM / 2 : 32;   // a consumer's dQ (dQ^T) accumulators
    // Split by keys, a consumer's dQ product of a step needs both consumers' dS^T. Made in the same
    // step, that wait (a named barrier) holds the consumers in lockstep: both take their element-wise
    // parts at once, while the tensor cores idle. At D = 128 with 64 rows, each step makes the
    // previous step's dQ instead (kDeferDq): the dS^T tiles (double buffered) pass between the
    // consumers by mbarriers (ds_full, ds_empty), the other consumer's half has long been in, and
    // consumer 1 starts its walk once consumer 0 has its first dP^T (and again every kLagSteps
    // steps, below): a lag of 0.35-0.42 of a step. The stage goes back to the producer before the
    // dQ product is in. H200, bf16 and fp16, 16k tokens: +4-5% at 2k and 4k rows, +1-3% causal up
    // to 4k, none from 8k causal; with 80 rows, -1% (docs/decisions.md#bwd-sm90-deferred-dq).
    static constexpr bool kDeferDq =
        CUFLASH_BWD_DEFER_DQ != 0 && kDq && !kOrdered && !kSplitDims && kHeadDim == 128 && !kDqTransposed;
    // The lag is made again every kLagSteps steps (lag_step): made at the first step alone it wore
    // away along long walks, the stage waits taking it back (16k causal: 0.20 of a step at steps
    // 1-3, 0.04 by step 64, none from step 128), and the step grew 2-3%. Every 2 steps: H200 bf16
    // causal 16k +4-5%, 8k +2-3%, 1k-4k and 512 rows full within the controls' spread
    // (docs/decisions.md#bwd-sm90-relag).
    static constexpr int kLagSteps = CUFLASH_BWD_RELAG > 0 ? CUFLASH_BWD_RELAG : 1 << 30;
    // With kDeferDq the consumers hand their shares over rather than add them themselves: they store
    // them and arrive on the buffer's dq_full, and the dQ writers of the producer's warpgroup (one per
    // buffer, as for ordered dQ) make the stores visible to the bulk copy (the proxy fence) and issue
    // the reductions. With the fence and the reduction its own, a consumer's thread 0 waited 130
    // (consumer 0) to 440 (consumer 1) cycles of a ~4300-cycle step in the fence alone, its stores
    // landing behind the other consumer's products, then for the previous reduction's read and the
    // warpgroup's barrier; handed over, H200 bf16 +1-4% (docs/decisions.md#bwd-sm90-dq-writers).
    // (st.async, which needs no proxy fence, needs a cluster launch and ran 20% slower.)
    // Ordered dQ (deterministic=True) hands its shares over the same way, its writers then making
    // the fence before they wait for the tile's turn: H200 bf16 D = 128 +3-6% from 2k to 16k
    // (docs/decisions.md#bwd-sm90-ordered-dq). CUFLASH_BWD_ORDERED_DQ_ASYNC=0 for an A/B against
    // thread 0's hand-over.
    static constexpr bool kDqAsync =
        CUFLASH_BWD_DQ_ASYNC != 0 && (kDeferDq || (kOrdered && CUFLASH_BWD_ORDERED_DQ_ASYNC != 0));
    // 80-row steps hand their one share buffer over too, each consumer to a writer warp of its own,
    // meeting it at named barriers (hand_dq_share_at_barriers, write_dq_shares_handed_over): H200
    // bf16 +5-7% at 8k and 16k over the consumers' own reductions (through mbarriers the same
    // hand-over gained half that; docs/decisions.md#bwd-sm90-80-row-hand-over). Only where every
    // row sees every key of its tiles: the guarded variant (varlen) spilled 12 B at 240 registers.
    static constexpr bool kDqHandOver =
        kDqTransposed && kDq && !kOrdered && kAllKeysSeen && CUFLASH_BWD_DQ_HANDOVER != 0;
    static constexpr bool kDqByWriters = kOrdered || kDqAsync || kDqHandOver;
    // The first writer to reach a dQ tile (a count of the tile's writers, bp.dq_semaphore, found at 0)
    // stores its shares by bulk copy, and the others add theirs once it has landed (a second count),
    // so that dq_accum needs no zeroing (bwd_preprocess's CUFLASH_DQ_FIRST_STORES). The host's rule
    // makes sure that every tile has a writer (self-attention, not varlen).
    static constexpr bool kDqFirstStores = CUFLASH_BWD_DQ_FIRST_STORES != 0;
    static_assert(!kDqFirstStores || (kDqAsync && !kOrdered), "the first store needs the dQ writers, any order");
    // Shares that pass to the writers through mbarriers (dq_full, dq_empty; kDqHandOver's meet at
    // named barriers instead).
    static constexpr bool kDqMbarriers = kOrdered || kDqAsync;
    // The host takes 80 rows only for calls without a causal mask or window (bwd_sm90_tiles): their
    // scores are masked at the keys' end alone, which leaves the registers that 80 rows need.
    static constexpr bool kWindowed = !kDqTransposed;
    // Persistent CTAs (CUFLASH_BWD_PERSISTENT, the host's choice: kernels/bwd_sm90.py): one CTA an SM
    // takes key blocks from a counter (BwdParams::work_counter) until none is left. Its producer loads
    // the next block's K and V while the consumers store the last one's dK and dV, where a CTA of its
    // own waits for them after its launch: of its ~7.6k cycles outside the walk at D = 64 (1k causal,
    // walks of 4.5 steps of ~5.8k cycles; H200), ~1.2k of prologue and ~2.8k of those loads
    // (docs/decisions.md#bwd-sm90-persistent-ctas-at-head-dim-64). At D = 64 split by keys, with dQ
    // added by the consumers themselves: the hand-over protocols with the fewest turns to carry over.
    static constexpr bool kPersistent = CUFLASH_BWD_PERSISTENT != 0;
    // The consumers' warpgroup index known to be warp-uniform (warpgroup_index), so that their wgmma
    // descriptors stay in uniform registers: D = 128 causal backward 3-6% faster; at D = 256 and 64 it
    // depends on the compiler (kUniformWarpgroupByNvrtc); the D = 64 variant without dQ spills 4 B with it
    // (docs/decisions.md#bwd-sm90-uniform-warpgroup-index).
    static constexpr bool kUniformWarpgroup = (kHeadDim == 128 && kHeadDimV == 128) ||
                                              (kHeadDim == 256 && kHeadDimV == 256 && kUniformWarpgroupByNvrtc) ||
                                              (kHeadDim == 64 && kHeadDimV == 64 && kDq && kUniformWarpgroupByNvrtc);
    static constexpr int kQBytes = kBlockM * kHeadDim * 2, kDoBytes = kBlockM * kHeadDimV * 2;
    static constexpr int kKBytes = kBlockN * kHeadDim * 2, kVBytes = kBlockN * kHeadDimV * 2;
    // dS^T: double buffered when split by keys; split by columns, one tile each of P^T and dS^T (the
    // consumers meet after every step's products). kDqTransposed stores dS instead: [kBlockN / 64 key
    // blocks][kBlockM queries][64 keys], a K-major B operand for dQ^T.
    static constexpr int kDsBytes = kBlockN * kBlockM * 2, kDsTiles = 2;
    // Each consumer's float32 share of dQ on its way to dq_accum (64 x 64; 64 x 80 transposed), double
    // buffered where shared memory allows (D = 128 with 64 rows: 227 KB in all; D = 64's dS^T tiles
    // are twice as large, and with 80 rows so are the shares). At D = 256 the shares pass through the
    // step's own Q and dO buffers, which are free by then.
    static constexpr int kDqShareBytes = kDqRegs * 128 * 4;
    // (With a third stage, D = 128 with 64 rows has room for one buffer: _heuristics.py's
    // BWD_SM90_DEFER_STAGES.)
    static constexpr int kDqBuffers =
        kSplitDims ? 0 : kHeadDim == 128 && !kDqTransposed && kStages == 2 && !kScoreTile ? 2 : 1;
    static_assert(!kOrdered || kDqBuffers == 2, "the dQ writers take turns with double-buffered shares");
    // Ordered dQ: one writer per share buffer. A writer's step is a chain (its tile's turn, the
    // reductions, their landing, the turn passed on) that took longer than the consumers' step: with
    // one writer for both buffers deterministic=True ran 0.89-0.91x the default at D = 128 8k, with
    // two 0.99-1.01x (H100; docs/decisions.md#bwd-sm90-ordered-dq).
    static constexpr int kDqWriters = kDqBuffers;
    // Split by columns, consumer 0's float32 share of dQ passes through the step's Q buffer and
    // consumer 1's through its dO buffer, free by then. Where one is too small (v's head dim the
    // smaller: 64 rows x 128 columns of float32 in dO's 16 KB at (256, 128); consumer 0's two shares
    // in Q's 24 KB at (192, 128)), that consumer's share gets a buffer of its own (kDqOwnBytes).
    static constexpr int kDqShareBytes0 = split_dk_cols(kHeadDim, 0) * kBlockM * 4;
    static constexpr int kDqShareBytes1 = split_dk_cols(kHeadDim, 1) * kBlockM * 4;
    static constexpr int kDqOwnConsumer =
        !kSplitDims ? -1 : kDqShareBytes0 > kQBytes ? 0 : kDqShareBytes1 > kDoBytes ? 1 : -1;
    static constexpr int kDqOwnBytes = kDqOwnConsumer < 0 ? 0 : kDqOwnConsumer == 0 ? kDqShareBytes0 : kDqShareBytes1;
    static_assert(!kSplitDims || (kDqShareBytes0 <= kQBytes || kDqShareBytes1 <= kDoBytes),
                  "one consumer's dQ share at most takes a buffer of its own");
    static_assert(!kSplitDims || !kOrdered, "split by columns, dQ is added in no fixed order (the dQ pass orders it)");
    static_assert(!kOrdered || !kFeatured, "ordered dQ runs without score modifiers and dropout");
    // Each consumer's dK and dV staged on their way out (store_dk_dv_chunks), kStagingBytes apart.
    static constexpr int kStagingBytes =
        kSplitDims ? 128 * (split_dk_cols(kHeadDim, 0) + split_dv_cols(kHeadDim, kHeadDimV, 0) >
                                    split_dk_cols(kHeadDim, 1) + split_dv_cols(kHeadDim, kHeadDimV, 1)
                                ? split_dk_cols(kHeadDim, 0) + split_dv_cols(kHeadDim, kHeadDimV, 0)
                                : split_dk_cols(kHeadDim, 1) + split_dv_cols(kHeadDim, kHeadDimV, 1))
                   : 128 * (kHeadDim + kHeadDimV);
    static_assert(kConsumers * kStagingBytes <= kStages * (kQBytes + kDoBytes),
                  "dK and dV of both consumers fit the stage ring's Q and dO buffers (store_dk_dv_chunks)");
    // Persistent, the ring may hold the next key block's tiles by then: dK and dV go out through the
    // dS^T tile of the walk's last step instead (the next block's first step writes the other one).
    static_assert(!kPersistent || kConsumers * kStagingBytes <= kDsBytes, "dK and dV fit a dS^T tile");
    static_assert(!kPersistent || (kHeadDim == 64 && kHeadDimV == 64 && kBlockM == 128 && kDq && !kOrdered &&
                                   !kDqByWriters && !kFeatured && !kBlockMask && !kScoreTile),
                  "persistent CTAs: D = 64, 128-row steps, dQ added by the consumers, no modifier");
    // A stage's score tile (kScoreTile): 128-byte column blocks (64 bias keys or 128 mask keys) x kBlockM
    // query rows, 128B-swizzled; or, for a bias or mask the same for every query (kTileOneRow, a key
    // padding mask or bias), one row, each block at the start of a 1024-byte swizzle atom.
    static constexpr bool kTileOneRow = CUFLASH_TILE_ONE_ROW != 0;
    static_assert(!kTileOneRow || kScoreTile, "tiles of one row are a score tile's");
    static constexpr int kTileElemBytes = kBiasTile ? 2 : 1, kTileBlocks = kScoreTile ? kBlockN * kTileElemBytes / 128 : 0;
    static constexpr int kTileBlockPitch = kTileOneRow ? 1024 : kBlockM * 128;
    static constexpr int kTileBytes = kTileBlocks * kTileBlockPitch;                        // of shared memory
    static constexpr int kTileLoadBytes = kTileBlocks * (kTileOneRow ? 1 : kBlockM) * 128;   // a tile's TMA bytes
    static constexpr int kSmemBytes = 1024 /* alignment slack */ + kKBytes + kVBytes + kStages * (kQBytes + kDoBytes) +
                                      kDsTiles * kDsBytes + kConsumers * kDqBuffers * kDqShareBytes + kDqOwnBytes +
                                      kStages * kTileBytes;
    static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256 || (kHeadDim == 192 && kHeadDimV == 128),
                  "bwd_sm90 runs head dims 64, 128, 256 (and Q's and K's 192 beside V's 128)");
    static_assert(kHeadDimV == kHeadDim || !kSplitDims || kHeadDim >= 192,
                  "split by columns, v's head dim of its own runs beside q's 192 or 256 only");
};

// kDqHandOver's named barriers, per consumer and its writer warp, both sides at bar.sync: the
// share is in the buffer / the buffer is free again. Ids 1-4 and 9 are the consumers' own (1: both
// consumers, 2 + consumer: one warpgroup, 4 and 9: kDeferDq's lag).
constexpr int kDqFullBarrier = 5, kDqEmptyBarrier = 7, kDqBarrierThreads = 128 + 32;

// kDeferDq's lag: whether consumer 1 starts this step only once consumer 0 has its dP^T (every
// C::kLagSteps steps), and where they meet: ids 4 and 9 in turn. Consumer 0 cannot finish step
// k + 1 before consumer 1 has passed the top of step k (it waits for consumer 1's dS^T of step k),
// so it never arrives twice at one id before consumer 1 has waited there.
template <class C>
__device__ __forceinline__ bool lag_step(int step) { return step % C::kLagSteps == 0; }
template <class C>
__device__ __forceinline__ int lag_barrier(int step) { return (step / C::kLagSteps) % 2 ? 9 : 4; }

// The CTA's static shared memory: the stage ring's barriers (K/V loaded, stage full, stage empty),
// each stage's lse2 and D rows and its tile ((query head << 16) | query tile; -1: the walk is over).
// The dQ writers' (ordered dQ, kDqAsync): per consumer and share buffer, a share is ready (dq_full) /
// free again (dq_empty), and which tile it belongs to ((query head << 16) | query tile; -1: the walk
// is over; kDqHandOver writes it and nobody reads it, hand_dq_share_at_barriers; its barriers are
// named ones); ordered dQ: the parities the consumers' thread 0 waits for next (bit buffer; in
// shared memory: a register held through the walk made ptxas spill).
// (lse2 and dsum first: bulk copies land there, 16-byte aligned.)
template <class C>
struct BwdSm90Shared {
    alignas(16) float lse2[C::kStages][C::kBlockM];
    alignas(16) float dsum[C::kStages][C::kBlockM];
    unsigned long long barriers[2 + 2 * C::kStages];
    unsigned long long dq_barriers[C::kDqMbarriers ? 2 * C::kConsumers * 2 : 1];
    unsigned long long ds_barriers[C::kDeferDq ? 4 : 1];
    int tile_of_stage[C::kStages];
    // Persistent: each stage's key block (x of its place), and in the stage that ends a walk the
    // parity of the block's turn, read where needed: held through the walk, they spilled.
    int block_of_stage[C::kStages];
    int dq_tile_of[C::kConsumers][2], dq_empty_parity[C::kConsumers];

    __device__ __forceinline__ unsigned kv_full() { return smem_addr(&barriers[0]); }
    __device__ __forceinline__ unsigned full(int stage) { return smem_addr(&barriers[1 + stage]); }
    __device__ __forceinline__ unsigned empty(int stage) { return smem_addr(&barriers[1 + C::kStages + stage]); }
    // Persistent: both consumers have issued their last product over K and V (every consumer thread arrives).
    __device__ __forceinline__ unsigned kv_empty() { return smem_addr(&barriers[1 + 2 * C::kStages]); }
    __device__ __forceinline__ unsigned dq_full(int consumer, int buf) {
        return smem_addr(&dq_barriers[consumer * 2 + buf]);
    }
    __device__ __forceinline__ unsigned dq_empty(int consumer, int buf) {
        return smem_addr(&dq_barriers[2 * C::kConsumers + consumer * 2 + buf]);
    }
    // kDeferDq: dS^T tile buf holds both consumers' halves / both consumers' dQ products have read it
    // (each warp of both consumers arrives).
    __device__ __forceinline__ unsigned ds_full(int buf) { return smem_addr(&ds_barriers[buf]); }
    __device__ __forceinline__ unsigned ds_empty(int buf) { return smem_addr(&ds_barriers[2 + buf]); }
};

// Shared-memory addresses of the CTA's tiles (column blocks of 64 elements, 128B-swizzled):
// K [kHeadDim / 64][kBlockN][64], V [kHeadDimV / 64][kBlockN][64]; Q [kStages][kHeadDim / 64][kBlockM][64],
// dO [kStages][kHeadDimV / 64][kBlockM][64]; ds [2][kBlockM / 64][kBlockN][64] (dS^T, or at D = 256 P^T
// then dS^T); dq [kConsumers][kDqBuffers][64 x 64 float], or one consumer's share (kDqOwnBytes);
// score [kStages][kTileBlocks][kTileBlockPitch bytes] (kScoreTile).
struct BwdSm90Tiles {
    unsigned k, v, q, dout, ds, dq, score;
};

// Where a CTA's work lies: its block of kBlockN keys (x), its slot (y: kv head * splits + split) and
// its sequence (z), the causal grid's last pairs read key-block-major (bwd_grid_place,
// bwd_common.cuh). Ordered dQ dispatches the highest key block first (dq_order.cuh). Made once
// (cta_place) and kept in shared memory (bwd_cta_place), read again where it is needed: kept in
// registers through the walk, such values spilled. Persistent CTAs keep two, by the parity of the
// key block's turn in the CTA (`turn`): the producer writes the next one while the consumers still
// read the last; x = -1 ends the CTA.
__shared__ int4 bwd_cta_place[2];

// The first of the query heads whose tiles the CTA of slot `slot` walks (heads_per_cta of its kv head's
// group).
__device__ __forceinline__ int slot_first_query_head(const BwdParams& bp, int slot) {
    const int group = bp.fwd.heads_q / bp.fwd.heads_k, splits = group / bp.heads_per_cta;
    return (slot / splits) * group + (slot % splits) * bp.heads_per_cta;
}

// Where a block-masked call's work order (FwdParams::work_order, work_bounds) holds the CTA's key block.
__device__ __forceinline__ int work_index(const FwdParams& p, int b, int h0, int key_block) {
    return b * p.work_order_batch_stride + h0 * p.work_order_head_stride + key_block;
}

template <class C>
__device__ __forceinline__ int4 cta_place(const BwdParams& bp) {
    if constexpr (C::kOrdered) return make_int4(gridDim.x - 1 - blockIdx.x, blockIdx.y, blockIdx.z, 0);
    int4 place = bwd_grid_place(bp.tail_pairs);
    if (C::kBlockMask && bp.fwd.work_order != nullptr)   // the x-th longest walk of its (sequence, first query head)
        place.x = bp.fwd.work_order[work_index(bp.fwd, place.z, slot_first_query_head(bp, place.y), place.x)];
    return place;
}

__device__ __forceinline__ int read_cta_place(const int& field) {
    int v;
    asm volatile("ld.shared.s32 %0, [%1];\n" : "=r"(v) : "r"(smem_addr(&field)));
    return v;
}
// The CTA's block of kBlockN keys, its slot and its sequence (BwdSm90Config::kRereadBatch says where
// the consumers read the sequence again rather than hold it).
__device__ __forceinline__ int cta_key_block(int turn = 0) { return read_cta_place(bwd_cta_place[turn & 1].x); }
__device__ __forceinline__ int cta_slot(int turn = 0) { return read_cta_place(bwd_cta_place[turn & 1].y); }
__device__ __forceinline__ int cta_batch(int turn = 0) { return read_cta_place(bwd_cta_place[turn & 1].z); }
// The grid's slots (its y: kv heads x splits), which persistent CTAs are not launched as.
template <class C>
__device__ __forceinline__ int grid_slots(const BwdParams& bp) {
    if constexpr (C::kPersistent) return bp.fwd.heads_k * (bp.fwd.heads_q / bp.fwd.heads_k / bp.heads_per_cta);
    return gridDim.y;
}

// Where in dq_accum (floats) the tile of query head h whose first row is m_lo lies, in sequence b
// (whose first row is q_row0 under varlen).
template <class C>
__device__ __forceinline__ long long dq_accum_offset(const BwdParams& bp, int b, int q_row0, int h, int m_lo,
                                                     bool varlen) {
    return b * bp.dqa_batch_stride + h * bp.dqa_head_stride +
           (dq_tile_row0(q_row0, b, C::kBlockM, varlen) + m_lo) * bp.dqa_row_stride;
}

// The same, the CTA's sequence and its first row read again (cta_batch).
template <class C>
__device__ __forceinline__ float* dq_accum_tile(const BwdParams& bp, int h, int m_lo) {
    const int b = cta_batch();
    const bool varlen = bp.fwd.cu_seqlens_q != nullptr;
    return bp.dq_accum + dq_accum_offset<C>(bp, b, varlen ? bp.fwd.cu_seqlens_q[b] : 0, h, m_lo, varlen);
}

// Where a consumer keeps P^T: in score2 with score modifiers (acc_s keeps the raw scores), in acc_s
// without.
template <bool kScoreMods, class S, class S2>
__device__ __forceinline__ S& probabilities(S& acc_s, S2& score2) {
    if constexpr (kScoreMods) return score2;
    else return acc_s;
}

// Sets to -inf the scores outside the causal/sliding window or past the keys' end, unless the
// whole tile (queries m_lo.., the CTA's keys n_lo..) is inside; returns whether it was. Element
// (mi, e) of acc_s is key keys[e / 2], query m_lo + col + 8 mi + e % 2 (col: the thread's first
// query column in the tile). The queries that see key j are
// [j - diag - right, j - diag + left] (in_window turned around), none for a key past the end: two
// bounds per key row, one compare per element.
template <class C>
__device__ __forceinline__ bool mask_outside_window(const FwdParams& p, const SeqInfo& s, int m_lo, int n_lo,
                                                    const int (&keys)[2], int col, float (&acc_s)[C::kMTiles][4]) {
    if constexpr (!C::kWindowed) {   // the keys' end only (rows past the queries' end have lse2 = +inf)
        if (n_lo + C::kBlockN <= s.seqlen_k) return true;
#pragma unroll
        for (int mi = 0; mi < C::kMTiles; ++mi)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                if (keys[e / 2] >= s.seqlen_k) acc_s[mi][e] = -CUFLASH_INF;
        return false;
    }
    if (tile_inside_window(p, s, m_lo, min(m_lo + C::kBlockM, s.seqlen_q), n_lo, n_lo + C::kBlockN)) return true;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        int lo, hi;
        visible_queries(p, s, keys[r], keys[r] + 1, &lo, &hi);
        if (keys[r] >= s.seqlen_k) hi = lo;
        lo -= m_lo + col;   // bounds on the column offset 8 mi + e % 2 of this thread's elements
        hi -= m_lo + col;
#pragma unroll
        for (int mi = 0; mi < C::kMTiles; ++mi)
#pragma unroll
            for (int e = 2 * r; e < 2 * r + 2; ++e) {
                const int x = mi * 8 + e % 2;
                if (x < lo || x >= hi) acc_s[mi][e] = -CUFLASH_INF;
            }
    }
    return false;
}

// The softcap alone (C::kSoftcapAlone): each raw score qk becomes c tanh(scale qk / c) / scale, the
// capped score in qk's units, so that P^T comes from it as from a raw one.
template <class C>
__device__ __forceinline__ void cap_scores(const FwdParams& p, float (&acc_s)[C::kMTiles][4]) {
    const float rate = softcap_rate(p), unscale = p.softcap / p.scale;
#pragma unroll
    for (int mi = 0; mi < C::kMTiles; ++mi)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_s[mi][e] = unscale * softcap_tanh(acc_s[mi][e] * p.scale, rate);
}

// The bias tile (C::kBiasTile) as a consumer's S^T accumulator before S^T = K Q^T adds to it: bias /
// scale (so that scale S^T is scale qk + bias; fwd_sm90's start_scores_with_bias), element (mi, e) being
// key key0 + g + 8 (e / 2) of the CTA's block (key0: the warp's first, a multiple of 16) and query
// 8 mi + 2 t + e % 2 of the step. The tile's rows are queries:
// an 8 x 8 piece of queries x keys, transposed by ldmatrix, hands each thread the pair of queries of one
// key it holds. Matrix j of the four: n-tile mi + j / 2, keys + 8 (j % 2); lane l addresses row l % 8 of
// matrix l / 8 (16 bytes of keys, one swizzled chunk).
template <class C>
__device__ __forceinline__ void start_scores_with_bias_t(float (&acc_s)[C::kMTiles][4], unsigned tile, int key0,
                                                         int lane, float inv_scale) {
    if constexpr (C::kTileOneRow) {   // the thread's two keys' values, for all its queries
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int key = key0 + lane / 4 + 8 * half;
            unsigned short bits;
            asm volatile("ld.shared.u16 %0, [%1];\n"
                         : "=h"(bits)
                         : "r"(tile + (key / 64) * C::kTileBlockPitch + (key % 64) * 2));   // row 0: no swizzle
            const float bias = to_float(elem_t{bits}) * inv_scale;
#pragma unroll
            for (int mi = 0; mi < C::kMTiles; ++mi) {
                acc_s[mi][2 * half] = bias;
                acc_s[mi][2 * half + 1] = bias;
            }
        }
        return;
    }
    const int key = key0 + 8 * (lane / 8 % 2);   // the first key of the lane's matrix
    const unsigned block = tile + (key / 64) * C::kTileBlockPitch + ((key % 64 / 8) ^ (lane % 8)) * 16;
#pragma unroll
    for (int mi = 0; mi < C::kMTiles; mi += 2) {
        unsigned bias[4];
        ldmatrix_x4_trans(bias, block + (8 * (mi + lane / 16) + lane % 8) * 128);   // query row % 8 == lane % 8
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            float* e = &acc_s[mi + j / 2][2 * (j % 2)];
            e[0] = to_float(elem_t{static_cast<unsigned short>(bias[j] & 0xffffu)}) * inv_scale;
            e[1] = to_float(elem_t{static_cast<unsigned short>(bias[j] >> 16)}) * inv_scale;
        }
    }
}

// The mask tile (C::kMaskTile): -inf where the mask is False, for the elements of
// start_scores_with_bias_t (scores in log2 units, after modify_scores). A query's 128 key bytes are
// eight chunks of 16, key k in chunk k / 16 (XOR the query row), at byte k % 16; one byte an element. The thread's keys key0 + g and + 8
// share a chunk, and its queries 8 mi + 2 t + e the row's XOR (2 t + e): one base address per e, the
// rest immediate offsets (with each address made whole, the consumers spill 24 bytes).
template <class C>
__device__ __forceinline__ void hide_by_mask_tile_t(float (&acc_s)[C::kMTiles][4], unsigned tile, int key0, int g,
                                                    int t) {
    if constexpr (C::kTileOneRow) {   // the thread's two keys' bytes, for all its queries (row 0: byte = key)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            unsigned short byte;
            asm volatile("ld.shared.u8 %0, [%1];\n" : "=h"(byte) : "r"(tile + key0 + g + 8 * half));
            if (byte == 0)
#pragma unroll
                for (int mi = 0; mi < C::kMTiles; ++mi) acc_s[mi][2 * half] = acc_s[mi][2 * half + 1] = -CUFLASH_INF;
        }
        return;
    }
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        const int row = 2 * t + e;   // the query row % 8
        const unsigned base = tile + row * 128 + ((key0 / 16) ^ row) * 16 + g;
#pragma unroll
        for (int mi = 0; mi < C::kMTiles; ++mi)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                unsigned short byte;
                asm volatile("ld.shared.u8 %0, [%1];\n" : "=h"(byte) : "r"(base + mi * 1024 + 8 * half));
                if (byte == 0) acc_s[mi][2 * half + e] = -CUFLASH_INF;
            }
    }
}

// The bits of the MaskMod a block mask was derived from (FwdParams::mask_bits_offset) on S^T in place:
// element (mi, e) is key keys[e / 2] and query queries[2 mi + e % 2]. The thread's two keys (8 apart
// in a 16-aligned group) share a 32-key word, so each query reads one word (load_mask_bits_t; queries
// and keys past the ends read inside the bits' padding, load_mask_bits_rows in fragments.cuh, their
// scores not used), and hide_by_mask_bits_t applies them. The loads are L2 reads: a consumer that can
// issues them while S^T is computed.
template <class C>
__device__ __forceinline__ void load_mask_bits_t(const FwdParams& p, const SeqInfo& s, const int (&keys)[2],
                                                 int query0, unsigned (&words)[2 * C::kMTiles]) {
    const unsigned* bits = reinterpret_cast<const unsigned*>(p.block_mask + p.mask_bits_offset) +
                           s.b * p.mask_bits_batch_stride + s.h * p.mask_bits_head_stride + (keys[0] >> 5);
#pragma unroll
    for (int x = 0; x < 2 * C::kMTiles; ++x)
        words[x] = __ldg(bits + (query0 + (x / 2) * 8 + x % 2) * static_cast<int>(p.mask_bits_row_stride));
}
template <class C>
__device__ __forceinline__ void hide_by_mask_bits_t(const int (&keys)[2], const unsigned (&words)[2 * C::kMTiles],
                                                    float (&acc_s)[C::kMTiles][4]) {
    const int bit0 = keys[0] & 31;
#pragma unroll
    for (int x = 0; x < 2 * C::kMTiles; ++x) {
        const unsigned word = words[x] >> bit0;
        if ((word & 1u) == 0u) acc_s[x / 2][x % 2] = -CUFLASH_INF;
        if ((word & 0x100u) == 0u) acc_s[x / 2][2 + x % 2] = -CUFLASH_INF;
    }
}

// The words of a warp whose keys share one 32-key word (the one of `key`), one a query of the tile
// from m_lo: lane l holds query m_lo + 32 j + l in slot j (kWarpBitSlots slots).
template <class C>
constexpr int kWarpBitSlots = (C::kBlockM + 31) / 32;
template <class C>
__device__ __forceinline__ void load_warp_mask_bits(const FwdParams& p, const SeqInfo& s, int key, int m_lo, int lane,
                                                    unsigned (&slots)[kWarpBitSlots<C>]) {
    const unsigned* bits = reinterpret_cast<const unsigned*>(p.block_mask + p.mask_bits_offset) +
                           s.b * p.mask_bits_batch_stride + s.h * p.mask_bits_head_stride + (key >> 5);
#pragma unroll
    for (int j = 0; j < kWarpBitSlots<C>; ++j) {
        const int q = 32 * j + lane;
        slots[j] = q < C::kBlockM ? __ldg(bits + (m_lo + q) * static_cast<int>(p.mask_bits_row_stride)) : 0u;
    }
}

// P^T of a consumer's elements from its raw scores acc_s: element (mi, e) is key keys[e / 2] and
// query m_lo + col + 8 mi + e % 2 (col: the thread's first query column in the tile); lse2 holds the
// tile's rows. With score modifiers the scores in log2 units go to score2 (modify_scores,
// key-major) and acc_s keeps the raw ones (the softcap's derivative needs them) or, with a user
// ScoreMod, takes each element's chain factor (modify_scores); with one modifier modified in place
// (C::kModifiedInPlace) they replace the raw ones in acc_s; without, the window alone (after
// cap_scores for the softcap alone), and P^T replaces S^T in acc_s (probabilities() says where P^T
// is). With dropout the keep bits come from dropout_keep_bits_cols. Returns whether every element of
// the tile is a key its row sees and no row is past the queries' end (then dS needs no guard:
// C::kTileGuard). score_tile: the step's bias or mask tile (C::kScoreTile).
template <class C>
__device__ __forceinline__ bool take_probabilities(const FwdParams& p, const SeqInfo& s, int m_lo, int n_lo,
                                                   const int (&keys)[2], int col, const float* lse2,
                                                   const unsigned (&keep)[C::kKeepWords],
                                                   float (&acc_s)[C::kMTiles][4],
                                                   float (&score2)[C::kScoreMods ? C::kMTiles : 1][4],
                                                   bool blocks_whole, unsigned score_tile = 0,
                                                   const unsigned* bit_slots = nullptr) {
    if constexpr (C::kScoreMods || C::kModifiedInPlace) {
        int queries[2 * C::kMTiles];
#pragma unroll
        for (int x = 0; x < 2 * C::kMTiles; ++x) queries[x] = m_lo + col + (x / 2) * 8 + x % 2;
        auto raw = [&](int r, int x) -> float& { return acc_s[x / 2][2 * r + x % 2]; };
        if constexpr (C::kScoreTile) {   // the window and the ends by modify_scores, the tile's part here
            const int key0 = (keys[0] - n_lo) & ~15, lane = threadIdx.x % 32;
            modify_scores<0, 2, 2 * C::kMTiles, true, false>(p, s, keys, queries, raw, raw, blocks_whole);
            if constexpr (C::kMaskTile) hide_by_mask_tile_t<C>(acc_s, score_tile, key0, lane / 4, lane % 4);
        } else if constexpr (C::kModifiedInPlace) {
            // A MaskMod's bits beside a derived block mask: read here (hide_by_mask_bits_t), one word
            // per query for the thread's two keys, the block mask's own test skipped.
            const bool bits = C::kMods == kModBlockMask && p.mask_bits_offset != 0;
            modify_scores<C::kMods, 2, 2 * C::kMTiles, true, false, false, false>(p, s, keys, queries, raw, raw,
                                                                                  blocks_whole || bits);
            if (bits && !blocks_whole) {   // bit_slots: the warp's words, loaded by the caller (load_warp_mask_bits)
                unsigned words[2 * C::kMTiles];
                // Query m_lo + col + 8 mi + e is in slot mi / 4 of lane 8 mi % 32 + col + e.
                if (bit_slots != nullptr) {
#pragma unroll
                    for (int x = 0; x < 2 * C::kMTiles; ++x)
                        words[x] = __shfl_sync(0xffffffffu, bit_slots[x / 8], (x / 2) * 8 % 32 + col + x % 2);
                } else {
                    load_mask_bits_t<C>(p, s, keys, queries[0], words);
                }
                hide_by_mask_bits_t<C>(keys, words, acc_s);
            }
        } else {
#pragma unroll
            for (int mi = 0; mi < C::kMTiles; ++mi)
#pragma unroll
                for (int e = 0; e < 4; ++e) score2[mi][e] = acc_s[mi][e];
            // A MaskMod at every element (hide_scores): the featured tiles have the registers.
            modify_scores<C::kMods, 2, 2 * C::kMTiles, true, true, true>(
                p, s, keys, queries, [&](int r, int x) -> float& { return score2[x / 2][2 * r + x % 2]; }, raw,
                blocks_whole);
        }
    }
    bool whole = false;
    if constexpr (C::kSoftcapAlone) cap_scores<C>(p, acc_s);
    if constexpr (!C::kScoreMods && !C::kModifiedInPlace)
        whole = mask_outside_window<C>(p, s, m_lo, n_lo, keys, col, acc_s) && m_lo + C::kBlockM <= s.seqlen_q;
    float(&prob)[C::kMTiles][4] = probabilities<C::kScoreMods>(acc_s, score2);
#pragma unroll
    for (int mi = 0; mi < C::kMTiles; ++mi) {
        const float2 col_lse2 = *reinterpret_cast<const float2*>(&lse2[col + mi * 8]);
#pragma unroll
        for (int e = 0; e < 4; ++e)
            prob[mi][e] = element_prob_kept<C::kElementMods, C::kDropout>(
                p, acc_s[mi][e], C::kScoreMods ? score2[mi][e] : acc_s[mi][e], e % 2 ? col_lse2.y : col_lse2.x,
                C::kDropout && ((keep[mi / 8] >> (4 * (mi % 8) + e)) & 1u));
    }
    return whole;
}

// dS^T (as dL/dx) of a consumer's elements, in place of dP^T in acc_dp: the elements as in
// take_probabilities, prob their P^T, acc_s the raw scores, dsum and lse2 the tile's rows of D and
// of the lse (the latter read by the softcap alone). With a bias, each element's dS also goes to dbias.
template <class C, bool kGuard>
__device__ __forceinline__ void take_gradients_as(const BwdParams& bp, const SeqInfo& s, int m_lo,
                                                  const int (&keys)[2], int col, const float* dsum, const float* lse2,
                                                  const float (&prob)[C::kMTiles][4],
                                                  const float (&acc_s)[C::kMTiles][4], float (&acc_dp)[C::kMTiles][4]) {
#pragma unroll
    for (int mi = 0; mi < C::kMTiles; ++mi) {
        const float2 col_dsum = *reinterpret_cast<const float2*>(&dsum[col + mi * 8]);
        float2 col_lse2;
        if constexpr (C::kSoftcapAlone) col_lse2 = *reinterpret_cast<const float2*>(&lse2[col + mi * 8]);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            float ds;
            acc_dp[mi][e] = element_grad<C::kElementMods, C::kDropout, kGuard>(
                bp.fwd, prob[mi][e], acc_s[mi][e], acc_dp[mi][e], e % 2 ? col_dsum.y : col_dsum.x, &ds);
            if constexpr (C::kSoftcapAlone)
                acc_dp[mi][e] *= softcap_grad_from_prob(bp.fwd, prob[mi][e], e % 2 ? col_lse2.y : col_lse2.x);
            if constexpr ((C::kMods & kModBias) != 0 && !C::kScoreTile)   // (dbias: on the featured tiles)
                store_dbias(bp, s, m_lo + col + mi * 8 + e % 2, keys[e / 2], ds);
        }
    }
}

// ``whole``: take_probabilities' verdict on the tile.
template <class C>
__device__ __forceinline__ void take_gradients(const BwdParams& bp, const SeqInfo& s, int m_lo, const int (&keys)[2],
                                               int col, const float* dsum, const float* lse2,
                                               const float (&prob)[C::kMTiles][4],
                                               const float (&acc_s)[C::kMTiles][4], float (&acc_dp)[C::kMTiles][4],
                                               bool whole) {
    if (C::kTileGuard && whole)
        take_gradients_as<C, false>(bp, s, m_lo, keys, col, dsum, lse2, prob, acc_s, acc_dp);
    else
        take_gradients_as<C, !C::kAllKeysSeen>(bp, s, m_lo, keys, col, dsum, lse2, prob, acc_s, acc_dp);
}

// The CTA's sequence and kv head, looked up again at the end of the walk rather than kept in
// registers through it (two values of the prologue held there spilled), and so is the group's shape.
__device__ __forceinline__ SeqInfo end_of_walk_seq_info(const BwdParams& bp, int b, int turn = 0) {
    const FwdParams& p = bp.fwd;
    const int group_e = p.heads_q / p.heads_k, kv_head = cta_slot(turn) / (group_e / bp.heads_per_cta);
    return make_seq_info(p, b, kv_head * group_e);
}

// A consumer's accumulators of 64 keys x kCols columns (dK, dV): kCols / 8 n-tiles of 4 (one where
// kCols is 0: a consumer that owns no dV, split_dv_cols).
template <int kCols>
using KeyRowsAcc = float[kCols > 0 ? kCols / 8 : 1][4];

// A consumer's accumulators of dK and dV, zeroed before its walk.
template <int kDk, int kDv>
__device__ __forceinline__ void zero_key_rows(KeyRowsAcc<kDk>& acc_dk, KeyRowsAcc<kDv>& acc_dv) {
#pragma unroll
    for (int di = 0; di < kDk / 8; ++di)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_dk[di][e] = 0.f;
#pragma unroll
    for (int di = 0; di < kDv / 8; ++di)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_dv[di][e] = 0.f;
}

// dK (scaled, kDk columns) and dV (kDv) of a consumer's keys (rows key_row0 and key_row0 + 8 of the
// CTA's block), columns col0 + 8 di + 2 t (+1) of dK and col0_v + ... of dV, once at the end of the walk.
template <class C, int kDk, int kDv>
__device__ __forceinline__ void store_dk_dv(const BwdParams& bp, int b, int key_row0, int col0, int col0_v,
                                            const KeyRowsAcc<kDk>& acc_dk, const KeyRowsAcc<kDv>& acc_dv, int turn = 0) {
    const FwdParams& p = bp.fwd;
    const int t = threadIdx.x % 4;
    const SeqInfo se = end_of_walk_seq_info(bp, b, turn);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int r = cta_key_block(turn) * C::kBlockN + key_row0 + 8 * half;
        if (r >= se.seqlen_k) continue;
        const DkDvRow<elem_t> dkdv(bp, se, cta_slot(turn), r);
#pragma unroll
        for (int di = 0; di < kDk / 8; ++di) {
            const int col = col0 + di * 8 + 2 * t;
            if (col < p.head_dim)
                dkdv.store_dk(col, acc_dk[di][2 * half] * p.scale, acc_dk[di][2 * half + 1] * p.scale);
        }
#pragma unroll
        for (int di = 0; di < kDv / 8; ++di) {
            const int col = col0_v + di * 8 + 2 * t;
            if (col < p.head_dim_v) dkdv.store_dv(col, acc_dv[di][2 * half], acc_dv[di][2 * half + 1]);
        }
    }
}

// A consumer's staged 64 keys x kCols columns of dK or dV (store_dk_dv_chunks) to global memory as
// whole 16-byte chunks of consecutive columns: rows r0 .. r0 + 63 of the sequence (below seqlen_k)
// of `dst` (whose row 0 is the sequence's first), columns col0 .. (below head_dim). Every thread of
// the consumer's warpgroup takes part.
template <int kCols>
__device__ __forceinline__ void copy_staged_key_rows(unsigned staging, elem_t* dst, long long row_stride, int r0,
                                                     int seqlen_k, int col0, int head_dim) {
    constexpr int kRowBytes = kCols * 2, kChunks = kCols / 8;
#pragma unroll 4
    for (int i = threadIdx.x % 128; i < 64 * kChunks; i += 128) {
        const int row = i / kChunks, chunk = i % kChunks, col = col0 + chunk * 8;
        if (r0 + row >= seqlen_k || col >= head_dim) continue;
        uint4 x;
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(x.x), "=r"(x.y), "=r"(x.z), "=r"(x.w)
                     : "r"(staging + row * kRowBytes + ((chunk ^ (row % 8)) * 16)));
        *reinterpret_cast<uint4*>(dst + (r0 + row) * row_stride + col) = x;
    }
}

// The same through shared memory, as 16-byte row chunks: a consumer's 64 keys x kDk columns of dK
// (scaled) and 64 x kDv of dV go to its staging area in the stage ring's Q/dO buffers at `ring`
// (C::kStagingBytes a consumer; row-major, 16-byte chunks XOR-swizzled by row: conflict-free both
// ways), then each thread stores whole chunks of consecutive columns (copy_staged_key_rows).
// store_dk_dv's 4-byte stores, half a 32-byte sector each, took ~5 us of a 30-50 us CTA at D = 128.
// `key0` is the consumer's first key inside the CTA's block, `col0` / `col0_v` its first column of
// dK / dV. Every thread of the consumer calls it, once the ring is no longer read; where 16-byte
// chunks cannot be used (float32 partial sums, head dims % 8, unaligned pointers or strides) it
// falls back to store_dk_dv.
template <class C, int kDk, int kDv>
__device__ __forceinline__ void store_dk_dv_chunks(const BwdParams& bp, int b, int key0, int col0, int col0_v,
                                                   unsigned ring, const KeyRowsAcc<kDk>& acc_dk,
                                                   const KeyRowsAcc<kDv>& acc_dv, int turn = 0) {
    const FwdParams& p = bp.fwd;
    const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
    const int consumer = warpgroup_index<C::kUniformWarpgroup>() - 1;
    const long long strides = bp.dk_batch_stride | bp.dk_head_stride | bp.dk_row_stride | bp.dv_batch_stride |
                              bp.dv_head_stride | bp.dv_row_stride;
    const bool chunks = bp.dkv_partial == 0 && p.head_dim % 8 == 0 && p.head_dim_v % 8 == 0 && strides % 8 == 0 &&
                        ((reinterpret_cast<unsigned long long>(bp.dk) | reinterpret_cast<unsigned long long>(bp.dv)) &
                         15) == 0;
    if (!chunks) {
        store_dk_dv<C, kDk, kDv>(bp, b, key0 + warp * 16 + lane / 4, col0, col0_v, acc_dk, acc_dv, turn);
        return;
    }
    constexpr int kDkBytes = 64 * kDk * 2;
    const unsigned staging = ring + consumer * C::kStagingBytes;   // this consumer's dK tile, then its dV tile
    // Fragment (di, e): row warp * 16 + g + 8 (e / 2), chunk di; rows % 8 = g, the swizzle's phase.
    // dK's and dV's fragments of a chunk are stored together (all of dK's first, or the same loop as
    // a function of its own, spilled 12 B at D = 64 with every key seen).
    static_assert(kDk >= 64 && (kDv == 0 || kDv >= 64), "the swizzle XORs the chunk index with the row's 3 low bits");
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int di = 0; di < (kDk > kDv ? kDk : kDv) / 8; ++di)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int row = warp * 16 + g + 8 * half;
            const unsigned chunk = ((di ^ g) * 16) + t * 4;
            if (di < kDk / 8)
                asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(staging + row * (kDk * 2) + chunk),
                             "r"(pack2<elem_t>(acc_dk[di][2 * half] * p.scale, acc_dk[di][2 * half + 1] * p.scale))
                             : "memory");
            if (di < kDv / 8)
                asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(staging + kDkBytes + row * (kDv * 2) + chunk),
                             "r"(pack2<elem_t>(acc_dv[di][2 * half], acc_dv[di][2 * half + 1]))
                             : "memory");
        }
    named_barrier_sync(2 + consumer, 128);

    const SeqInfo se = end_of_walk_seq_info(bp, b, turn);
    const int r0 = cta_key_block(turn) * C::kBlockN + key0;   // the consumer's first key in the sequence
    elem_t* dk = static_cast<elem_t*>(bp.dk) + b * bp.dk_batch_stride + se.h_kv * bp.dk_head_stride +
                 se.k_row0 * bp.dk_row_stride;
    elem_t* dv = static_cast<elem_t*>(bp.dv) + b * bp.dv_batch_stride + se.h_kv * bp.dv_head_stride +
                 se.k_row0 * bp.dv_row_stride;
    copy_staged_key_rows<kDk>(staging, dk, bp.dk_row_stride, r0, se.seqlen_k, col0, p.head_dim);
    if constexpr (kDv > 0)
        copy_staged_key_rows<kDv>(staging + kDkBytes, dv, bp.dv_row_stride, r0, se.seqlen_k, col0_v, p.head_dim_v);
}

// The first of the query heads whose tiles a CTA walks (heads_per_cta of its kv head's group), from the
// slot kept in shared memory (slot_first_query_head's, written out: through it, ptxas laid out the
// 80-row and ordered-dQ variants anew and spilled 4-12 B there).
__device__ __forceinline__ int first_query_head(const BwdParams& bp, int turn = 0) {
    const int group = bp.fwd.heads_q / bp.fwd.heads_k, splits = group / bp.heads_per_cta;
    const int slot = cta_slot(turn);
    return (slot / splits) * group + (slot % splits) * bp.heads_per_cta;
}

// kDqHandOver's writer of consumer `consumer`'s shares (a whole warp of the producer's warpgroup,
// for the named barriers; lane 0 issues). It walks the tiles as the producer does (these variants
// skip none: no block mask), so no tile index crosses threads. Writer and consumer meet twice a
// share, both at bar.sync: at kDqFullBarrier once the consumer has stored its share, at
// kDqEmptyBarrier once the bulk reduction has read it; and once more at kDqFullBarrier at the end
// of the walk.
template <class C>
__device__ __forceinline__ void write_dq_shares_handed_over(const BwdParams& bp, const BwdSm90Tiles& tiles,
                                                            const SeqInfo& s, int b, bool varlen, int c_begin,
                                                            int c_end, int consumer) {
    static_assert(!C::kBlockMask, "the producer's walk skips no tile");
    const int lane = threadIdx.x % 32, h0 = first_query_head(bp);
#pragma unroll 1
    for (int h = h0; h < h0 + bp.heads_per_cta; ++h) {
#pragma unroll 1
        for (int c = c_begin; c < c_end; ++c) {
            named_barrier_sync(kDqFullBarrier + consumer, kDqBarrierThreads);
            if (lane == 0) {
                const long long offset = dq_accum_offset<C>(bp, b, s.q_row0, h, c * C::kBlockM, varlen);
                fence_proxy_async();   // the consumer's plain stores, ordered before by the barrier
                bulk_reduce_add(bp.dq_accum + offset + consumer * (C::kDqShareBytes / 4),
                                tiles.dq + consumer * C::kDqShareBytes, C::kDqShareBytes);
                bulk_commit();
                bulk_wait_read();
            }
            __syncwarp();
            named_barrier_sync(kDqEmptyBarrier + consumer, kDqBarrierThreads);
        }
    }
    named_barrier_sync(kDqFullBarrier + consumer, kDqBarrierThreads);   // the consumer's end of the walk
    // (count_dq_landed for its consumer, once the reductions have landed)
    if (lane == 0 && bp.dq_done != nullptr) {
        bulk_wait();
        release_count(bp.dq_done + cta_batch() * gridDim.y + cta_slot(), 1);
    }
}

// The dQ writer of share buffer buf (ordered dQ, kDqAsync; lane 0 of a warp of the producer's
// warpgroup). With two buffers the consumers' shares alternate between them, the first in buffer 1
// (ds_buf's order; kDeferDq: dq_share_buffer). Both consumers' shares of a step belong to the same
// tile, whose counters (ordered dQ) are consecutive.
template <class C>
__device__ __forceinline__ void write_dq_shares(const BwdParams& bp, BwdSm90Shared<C>& sh, const BwdSm90Tiles& tiles,
                                                SeqInfo s, int b, bool varlen, int n_lo, int buf) {
    const FwdParams& p = bp.fwd;
    for (int full_parity = 0;; full_parity ^= 1) {
        mbar_wait(sh.dq_full(0, buf), full_parity);
        const int tile = *static_cast<volatile int*>(&sh.dq_tile_of[0][buf]);
        if (tile < 0) break;   // both consumers end together
        s.h = tile >> 16;
        const int c = tile & 0xffff;
        const long long offset = dq_accum_offset<C>(bp, b, s.q_row0, s.h, c * C::kBlockM, varlen);
        // One counter per tile (kBlockM rows of kHeadDim floats) and share.
        const int counter = static_cast<int>(offset / (C::kBlockM * C::kHeadDim)) * C::kConsumers;
        const int rank = C::kOrdered ? dq_rank<C::kBlockM, C::kBlockN>(p, s, n_lo / C::kBlockN, c) : 0;
        // kDqFirstStores: the tile's count of writers (and, one on, of first stores landed).
        bool first = false;
        if constexpr (C::kDqFirstStores) {
            first = atomicAdd(bp.dq_semaphore + counter, 1) == 0;
            if (!first) dq_wait_turn(bp.dq_semaphore + counter + 1, 1);   // the first store has landed
        }
        for (int consumer = 0; consumer < C::kConsumers; ++consumer) {
            if (consumer > 0) mbar_wait(sh.dq_full(consumer, buf), full_parity);
            // kDqAsync: the consumers' plain stores, acquired through dq_full, made visible to the
            // bulk copy here rather than by a fence in every consumer thread.
            if constexpr (C::kDqAsync) fence_proxy_async();
            if constexpr (C::kOrdered) dq_wait_turn(bp.dq_semaphore + counter + consumer, rank);
            float* dst = bp.dq_accum + offset + consumer * (C::kDqShareBytes / 4);
            const unsigned share = tiles.dq + (consumer * C::kDqBuffers + buf) * C::kDqShareBytes;
            if (first) bulk_store(dst, share, C::kDqShareBytes);
            else bulk_reduce_add(dst, share, C::kDqShareBytes);
            bulk_commit();
        }
        bulk_wait_read();
        for (int consumer = 0; consumer < C::kConsumers; ++consumer) mbar_arrive(sh.dq_empty(consumer, buf));
        if (first) {   // landed: the tile's other writers may add
            bulk_wait();
            fence_proxy_async_global();   // the async proxy's stores ordered before the release
            release_count(bp.dq_semaphore + counter + 1, 1);
        }
        if constexpr (C::kOrdered) {
            bulk_wait();
            for (int consumer = 0; consumer < C::kConsumers; ++consumer)
                dq_pass_turn(bp.dq_semaphore + counter + consumer);
        }
    }
    // Ordered: every reduction has landed. Otherwise the writers count for the consumers
    // (count_dq_landed: kConsumers counts a CTA), once their reductions have landed.
    if constexpr (C::kDqAsync) {
        static_assert(C::kConsumers % C::kDqWriters == 0, "the writers count for every consumer");
        if (bp.dq_done != nullptr) {
            bulk_wait();
            release_count(bp.dq_done + cta_batch() * gridDim.y + cta_slot(), C::kConsumers / C::kDqWriters);
        }
    }
}

// Which of the 32 query tiles base, base + 1, ..., base + 31 the CTA's keys [n_lo, n_lo + kBlockN)
// visit (bit i: tile base + i): below c_end and not hidden by the block mask; *whole: which of them
// have blocks that hide nothing (tile_blocks_whole). Each lane tests one tile, so that the walk pays
// one dependent load per 32 tiles: a tile at a time, each tile a document mask hides costs the walk
// ~1 us, which puts the mask's backward at the causal call's time (H200, 16k tokens in documents of
// 512..4096, D = 128: docs/decisions.md#bwd-sm90-the-block-masks-walk-32-tiles-a-step).
// Every lane of the warp must call it.
template <class C>
__device__ __forceinline__ unsigned query_tiles_from(const FwdParams& p, const SeqInfo& s, int base, int c_end,
                                                     int n_lo, unsigned* whole) {
    const int c = base + threadIdx.x % 32;
    int state = 0;
    if (c < c_end && p.block_mask == nullptr) {
        state = kBlocksAny | kBlocksAll;
    } else if (c < c_end) {
        const int bq0 = c * C::kBlockM / p.block_q, bq1 = (min((c + 1) * C::kBlockM, s.seqlen_q) - 1) / p.block_q;
        const int bk0 = n_lo / p.block_k, bk1 = (min(n_lo + C::kBlockN, s.seqlen_k) - 1) / p.block_k;
        unsigned any, all;   // OR and AND of the bytes (block_bytes: one loop, no division per block)
        block_bytes(p.block_mask + s.b * p.block_mask_batch_stride + s.h * p.block_mask_head_stride,
                    p.block_mask_row_stride, p.block_mask_col_stride, bq0, bq1, bk0, bk1, any, all);
        state = block_state(any, all);
    }
    *whole = __ballot_sync(0xffffffffu, tile_blocks_whole<C::kMods>(state, p));
    return __ballot_sync(0xffffffffu, (state & kBlocksAny) != 0);
}

// One key block's K and V, then its query tiles into the stage ring (from `stage`, `phase`, which
// it leaves past the tile that ends the walk); warp 0 of the producer's warpgroup, lane 0 issuing.
// `turn`: the block's turn in a persistent CTA (bwd_cta_place), 0 otherwise. tile_map: the bias's or
// the mask's (C::kScoreTile; another map otherwise, unread).
template <class C>
__device__ __forceinline__ void produce_key_block(const TmaMap& q_map, const TmaMap& k_map, const TmaMap& v_map,
                                                  const TmaMap& do_map, const TmaMap& tile_map, const BwdParams& bp,
                                                  SeqInfo s, int b, bool varlen, int n_lo, int c_begin, int c_end,
                                                  BwdSm90Shared<C>& sh, const BwdSm90Tiles& tiles, int& stage,
                                                  int& phase, int turn) {
    const FwdParams& p = bp.fwd;
    const int batch_coord = varlen ? 0 : b;
    const int lane = threadIdx.x % 32;
    // Producer: warp 0 walks the tiles (all lanes, a tile each, with a block mask); lane 0 issues.
    if (lane == 0) {
        mbar_arrive_expect_tx(sh.kv_full(), C::kKBytes + C::kVBytes);
        for (int blk = 0; blk < C::kHeadDim / 64; ++blk)
            tma_load_4d(tiles.k + blk * C::kBlockN * 128, &k_map, blk * 64, s.k_row0 + n_lo, s.h_kv, batch_coord,
                        sh.kv_full());
        for (int blk = 0; blk < C::kHeadDimV / 64; ++blk)
            tma_load_4d(tiles.v + blk * C::kBlockN * 128, &v_map, blk * 64, s.k_row0 + n_lo, s.h_kv, batch_coord,
                        sh.kv_full());
    }
    const int h0 = first_query_head(bp, turn);
    // Query tile c into the stage ring (lane 0), with the head's lse2 and D (padded to a multiple of
    // every block size: whole rows, no bounds); whole: its blocks hide nothing, so the consumers skip
    // the block mask and the MaskMod.
    auto load_query_tile = [&](int c, int whole, const float* lse2_head, const float* dsum_head) {
        const int m_lo = c * C::kBlockM;
        if (lane == 0) {
            mbar_wait(sh.empty(stage), phase ^ 1);   // a fresh barrier passes parity 1 at once
            // (whole, query head, query tile) in one int: heads < 2^14, tiles < 2^16 (-1 ends the walk).
            sh.tile_of_stage[stage] = (whole << 30) | (s.h << 16) | c;
            if constexpr (C::kPersistent) sh.block_of_stage[stage] = n_lo / C::kBlockN;
            mbar_arrive_expect_tx(sh.full(stage), C::kQBytes + C::kDoBytes + 2 * C::kBlockM * 4 + C::kTileLoadBytes);
            for (int blk = 0; blk < C::kHeadDim / 64; ++blk)
                tma_load_4d(tiles.q + stage * C::kQBytes + blk * C::kBlockM * 128, &q_map, blk * 64,
                            s.q_row0 + m_lo, s.h, batch_coord, sh.full(stage));
            for (int blk = 0; blk < C::kHeadDimV / 64; ++blk)
                tma_load_4d(tiles.dout + stage * C::kDoBytes + blk * C::kBlockM * 128, &do_map, blk * 64,
                            s.q_row0 + m_lo, s.h, batch_coord, sh.full(stage));
            bulk_load(smem_addr(&sh.lse2[stage][0]), lse2_head + m_lo, C::kBlockM * 4, sh.full(stage));
            bulk_load(smem_addr(&sh.dsum[stage][0]), dsum_head + m_lo, C::kBlockM * 4, sh.full(stage));
            if constexpr (C::kScoreTile) {   // a head or batch the bias or mask broadcasts over: 0
                const bool per_head = (C::kBiasTile ? p.bias_head_stride : p.mask_head_stride) != 0;
                const bool per_batch = (C::kBiasTile ? p.bias_batch_stride : p.mask_batch_stride) != 0;
                for (int blk = 0; blk < C::kTileBlocks; ++blk)
                    tma_load_4d(tiles.score + stage * C::kTileBytes + blk * C::kTileBlockPitch, &tile_map,
                                n_lo + blk * 128 / C::kTileElemBytes, C::kTileOneRow ? 0 : m_lo, per_head ? s.h : 0,
                                per_batch ? b : 0, sh.full(stage));
            }
        }
        if (++stage == C::kStages) { stage = 0; phase ^= 1; }
    };
    // Unrolled as far as ptxas then needs no spills in any warpgroup (kProducerUnroll; NVRTC
    // 13.0: D = 128 spilled in the producer unrolled 4 times, D = 64 in the consumers not unrolled
    // and in the producer unrolled 4 times; persistent at D = 64, unrolled twice, 24 B).
#pragma unroll 1
    for (int hh = 0; hh < bp.heads_per_cta; ++hh) {
        s.h = h0 + hh;
        if constexpr (C::kBlockMask) {
            // 32 tiles a step, a lane each (query_tiles_from), then the visited ones in order.
#pragma unroll 1
            for (int base = c_begin; base < c_end; base += 32) {
                unsigned whole;
                unsigned visited = query_tiles_from<C>(p, s, base, c_end, n_lo, &whole);
#pragma unroll 1
                while (visited != 0u) {
                    const int i = __ffs(visited) - 1;
                    visited &= visited - 1u;
                    // The head's rows found again at each visited tile: kept through the walk
                    // beside its test of 32 tiles, they spilled 16-36 B in the producer's 40 registers.
                    const int row0 = bwd_row_index(bp, b, s.h, 0);
                    load_query_tile(base + i, (whole >> i) & 1u, bp.lse2 + row0, bp.dsum + row0);
                }
            }
        } else {
            const float* lse2_head = bp.lse2 + bwd_row_index(bp, b, s.h, 0);
            const float* dsum_head = bp.dsum + bwd_row_index(bp, b, s.h, 0);
#pragma unroll C::kProducerUnroll
            for (int c = c_begin; c < c_end; ++c) {
                // kDqHandOver: c made opaque, so that ptxas makes each tile's addresses from it rather
                // than carrying them from tile to tile (with the writer's code beside the walk, at 24
                // registers, those carried addresses spilled 16 B).
                if constexpr (C::kDqHandOver) asm volatile("" : "+r"(c));
                load_query_tile(c, 0, lse2_head, dsum_head);
            }
        }
    }
    if (lane == 0) {
        mbar_wait(sh.empty(stage), phase ^ 1);
        sh.tile_of_stage[stage] = -1;
        if constexpr (C::kPersistent) sh.block_of_stage[stage] = turn & 1;
        mbar_arrive(sh.full(stage));   // releases the writes above to the consumers
    }
    if (++stage == C::kStages) { stage = 0; phase ^= 1; }   // (the consumers release the end's stage too)
}

// Warpgroup 0: warp 0 streams the query tiles into the stage ring (produce_key_block); with ordered
// dQ and kDqAsync warp 1 (and 2, with two share buffers) are the dQ writers, with kDqHandOver warps 1
// and 2 (one per consumer). Returns when its part is done.
template <class C>
__device__ __forceinline__ void produce(const TmaMap& q_map, const TmaMap& k_map, const TmaMap& v_map,
                                        const TmaMap& do_map, const TmaMap& tile_map, const BwdParams& bp, SeqInfo s,
                                        int b, bool varlen, int n_lo, int c_begin, int c_end, BwdSm90Shared<C>& sh,
                                        const BwdSm90Tiles& tiles) {
    const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
    setmaxnreg_dec<C::kProducerRegs>();
    if constexpr (C::kDqHandOver) {
        if (warp >= 1 && warp <= C::kConsumers) {
            write_dq_shares_handed_over<C>(bp, tiles, s, b, varlen, c_begin, c_end, warp - 1);
            return;
        }
    } else if constexpr (C::kDqByWriters) {
        if (warp >= 1 && warp <= C::kDqWriters && lane == 0) {
            const int buf = C::kDqWriters == 2 ? 2 - warp : 0;   // warp 1 writes buffer 1's shares
            write_dq_shares<C>(bp, sh, tiles, s, b, varlen, n_lo, buf);
            return;
        }
    }
    if (warp != 0) return;
    int stage = 0, phase = 0;
    produce_key_block<C>(q_map, k_map, v_map, do_map, tile_map, bp, s, b, varlen, n_lo, c_begin, c_end, sh, tiles,
                         stage, phase, 0);
}

// The producer of persistent CTAs (C::kPersistent): warp 0 takes key blocks from bp.work_counter in
// the launch grid's order (bwd_grid_place_of) until none is left. Once both consumers have issued
// their last product over the last block's K and V (kv_empty), the next block's place goes into the
// slot of its turn (its last reader, the block before the last, is done with it by then) and its K
// and V load, while the consumers store the last block's dK and dV; the stage ring runs on from block
// to block. Non-varlen calls only.
template <class C>
__device__ __forceinline__ void produce_persistent(const TmaMap& q_map, const TmaMap& k_map, const TmaMap& v_map,
                                                   const TmaMap& do_map, const TmaMap& tile_map, const BwdParams& bp,
                                                   BwdSm90Shared<C>& sh, const BwdSm90Tiles& tiles) {
    const FwdParams& p = bp.fwd;
    const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
    setmaxnreg_dec<C::kProducerRegs>();
    if (warp != 0) return;
    int stage = 0, phase = 0;
#pragma unroll 1
    for (int turn = 0;; ++turn) {
        // The grid's shape, made again at each turn from opaque copies of its parameters: hoisted out
        // of the loop and held through the walk, it made the kernel spill 28 B.
        int heads_q = p.heads_q, heads_k = p.heads_k, seqlen_k = p.seqlen_k, batch = p.batch;
        asm volatile("" : "+r"(heads_q), "+r"(heads_k), "+r"(seqlen_k), "+r"(batch));
        const int group = heads_q / heads_k, splits = group / bp.heads_per_cta;
        const int nx = ceil_div(seqlen_k, C::kBlockN), ny = heads_k * splits, blocks = nx * ny * batch;
        int linear = 0;
        if (lane == 0) linear = atomicAdd(bp.work_counter, 1);
        linear = __shfl_sync(0xffffffffu, linear, 0);
        const int4 place = linear < blocks ? bwd_grid_place_of(linear, nx, ny, batch, bp.tail_pairs)
                                           : make_int4(-1, 0, 0, 0);   // the end
        if (lane == 0) {
            mbar_wait(sh.kv_empty(), (turn & 1) ^ 1);   // (a fresh barrier passes parity 1 at once)
            bwd_cta_place[turn & 1] = place;
            if (place.x < 0) mbar_arrive(sh.kv_full());   // the consumers read the end and leave
        }
        __syncwarp();   // the whole warp reads the place back (first_query_head) after lane 0's write
        if (place.x < 0) return;
        const SeqInfo s = make_seq_info(p, place.z, (place.y / splits) * group);
        const int n_lo = place.x * C::kBlockN;
        int q_first, q_last;
        visible_queries(p, s, n_lo, min(n_lo + C::kBlockN, s.seqlen_k), &q_first, &q_last);
        produce_key_block<C>(q_map, k_map, v_map, do_map, tile_map, bp, s, place.z, false, n_lo, q_first / C::kBlockM,
                             ceil_div(q_last, C::kBlockM), sh, tiles, stage, phase, turn);
    }
}

// Varlen: the CTA's keys past the sequence's end are the next sequence's; the dQ product reads every
// K row of the block, so they become zeros (their dS is 0 anyway).
template <class C>
__device__ __forceinline__ void zero_keys_past_sequence(const SeqInfo& s, const BwdSm90Tiles& tiles, bool varlen) {
    if (C::kDq && varlen && (cta_key_block() + 1) * C::kBlockN > s.seqlen_k)
        zero_tile_rows<C::kBlockN, C::kHeadDim / 64, C::kConsumers>(tiles.k, s.seqlen_k - cta_key_block() * C::kBlockN);
}

// A consumer's next query tile from the stage ring: waits for the stage, sets s.h, the tile's first
// row m_lo and blocks_whole (the producer found that its blocks hide nothing: tile_blocks_whole);
// false at the end of the walk. Under varlen the tile's rows past the sequence are the next
// sequence's queries, made zeros in its Q and dO as the keys above.
template <class C>
__device__ __forceinline__ bool next_query_tile(BwdSm90Shared<C>& sh, const BwdSm90Tiles& tiles, int stage, int phase,
                                                bool varlen, SeqInfo& s, int& m_lo, bool& blocks_whole) {
    mbar_wait(sh.full(stage), phase);
    const int tile = *static_cast<volatile int*>(&sh.tile_of_stage[stage]);
    if (tile < 0) return false;
    s.h = (tile >> 16) & 0x3fff;
    m_lo = (tile & 0xffff) * C::kBlockM;
    blocks_whole = (tile >> 30) != 0;
    if (varlen && m_lo + C::kBlockM > s.seqlen_q) {
        zero_tile_rows<C::kBlockM, C::kHeadDim / 64, C::kConsumers>(tiles.q + stage * C::kQBytes, s.seqlen_q - m_lo);
        zero_tile_rows<C::kBlockM, C::kHeadDimV / 64, C::kConsumers>(tiles.dout + stage * C::kDoBytes,
                                                                      s.seqlen_q - m_lo);
    }
    return true;
}

// With bwd_convert launched behind this kernel as its programmatic dependent (bp.dq_done), each
// consumer counts itself once its dQ reductions have landed (after the dK/dV store, by which time
// they have; with kDqAsync or kDqHandOver the dQ writers count for them, once their own have): the
// conversion of a (sequence, slot)'s query heads starts as soon as every consumer of the slot's CTAs
// has counted, while the kernel's last CTAs still run (bwd_convert.cu).
template <class C>
__device__ __forceinline__ void count_dq_landed(const BwdParams& bp, int turn = 0) {
    if constexpr (C::kDq && !C::kDqByWriters) {
        if (threadIdx.x % 128 == 0 && bp.dq_done != nullptr) {
            bulk_wait();
            release_count(bp.dq_done + cta_batch(turn) * grid_slots<C>(bp) + cta_slot(turn), 1);   // dq_done_index's word
        }
    }
}

// A consumer's share of dQ = dS K over the CTA's keys from the dS^T tile ds_tile (one wgmma group).
template <class C>
__device__ __forceinline__ void issue_dq_product(float (&dq_flat)[C::kDqRegs], unsigned ds_tile, const BwdSm90Tiles& tiles,
                                                 int consumer) {
    if constexpr (C::kDqTransposed) {
        // Its 64 columns of dQ^T = K^T dS^T over all kBlockN keys: A = the consumer's column block of
        // K read transposed, B = dS (both tiles hold kBlockN keys).
        gemm_atbt_ss<C::kBlockM, C::kBlockN, C::kBlockM>(dq_flat, tiles.k + consumer * C::kBlockN * 128, ds_tile);
    } else if constexpr (C::kDqByKeys) {   // over this consumer's 64 keys (rows of dS^T and K)
        gemm_atb_ss_n64<64>(dq_flat, ds_tile + consumer * 64 * 128, tiles.k + consumer * 64 * 128);
    } else {
        // Its 64 x 64 share over all kBlockN keys: A = dS^T read transposed, B = K read transposed
        // (both tiles have the keys as rows).
        const unsigned a_tile = ds_tile + (C::kDqSplitRows ? consumer : 0) * C::kBlockN * 128;
        const unsigned b_tile = tiles.k + (C::kDqSplitRows ? 0 : consumer) * C::kBlockN * 128;
        gemm_atb_ss_n64<C::kBlockN>(dq_flat, a_tile, b_tile);
    }
    wgmma_commit();
}

// A consumer's share of dQ into shared memory at share, in dq_tile_offset's order: thread t's
// accumulators nj at (nj * 128 + t) * 16 bytes (16-byte stores, no bank conflicts).
template <class C>
__device__ __forceinline__ void store_dq_share(unsigned share, const float (&acc_dq)[C::kDqRegs / 4][4]) {
    const int wg_thread = threadIdx.x % 128;
#pragma unroll
    for (int nj = 0; nj < C::kDqRegs / 4; ++nj)
        asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(share + (nj * 128 + wg_thread) * 16),
                     "f"(acc_dq[nj][0]), "f"(acc_dq[nj][1]), "f"(acc_dq[nj][2]), "f"(acc_dq[nj][3])
                     : "memory");
}

// The consumer's share of dQ for query head h, rows m_lo .. (64 x 64; 64 x 80 of dQ^T) leaves through
// shared memory (buffer buf) in dq_tile_offset's order (16-byte stores, no bank conflicts) and is
// added to the tile's share of dq_accum, 16 KB (20 KB) in one place, by one bulk reduction that
// thread 0 of the warpgroup issues (ordered dQ: hands it to the writer). Per call the shares of all
// CTAs add up to (key blocks) x the size of dQ in float32: atomics or row-wise reductions from every
// warp kept the consumers waiting on them (row-wise reductions took 3.4 of a call's 13.4 ms at
// D = 128; docs/decisions.md#bwd-sm90-dq-accumulator-tiles). Consecutive shares take the two
// buffers in turn.
template <class C>
__device__ __forceinline__ void send_dq_share(const BwdParams& bp, BwdSm90Shared<C>& sh, const BwdSm90Tiles& tiles,
                                              float (&acc_dq)[C::kDqRegs / 4][4], int consumer, int h, int m_lo,
                                              int b, const SeqInfo& s, int buf) {
    fence_registers(*reinterpret_cast<float(*)[C::kDqRegs]>(&acc_dq[0][0]));
    const int wg_thread = threadIdx.x % 128;
    const int dq_buf = C::kDqBuffers == 2 ? buf : 0;
    if constexpr (C::kDqBuffers == 1) {
        if (wg_thread == 0) bulk_wait_read();   // the previous step's reduction has read the buffer
        named_barrier_sync(2 + consumer, 128);
    }
    if constexpr (C::kOrdered) {
        if (wg_thread == 0) {   // the writer has read this buffer's previous share
            mbar_wait(sh.dq_empty(consumer, dq_buf), ((sh.dq_empty_parity[consumer] >> dq_buf) & 1) ^ 1);
            sh.dq_empty_parity[consumer] ^= 1 << dq_buf;
        }
        named_barrier_sync(2 + consumer, 128);
    }
    const unsigned share = tiles.dq + (consumer * C::kDqBuffers + dq_buf) * C::kDqShareBytes;
    store_dq_share<C>(share, acc_dq);
    fence_proxy_async();   // the bulk-copy unit reads what the threads wrote
    // Two buffers: the previous share's reduction (the other buffer) must have read it before the
    // next share is written there; the barrier below tells every thread.
    if (!C::kOrdered && C::kDqBuffers == 2 && wg_thread == 0) bulk_wait_read();
    named_barrier_sync(2 + consumer, 128);
    if (wg_thread == 0) {
        if constexpr (C::kOrdered) {   // to the writer
            sh.dq_tile_of[consumer][dq_buf] = (h << 16) | (m_lo / C::kBlockM);
            mbar_arrive(sh.dq_full(consumer, dq_buf));
        } else {
            const bool varlen = bp.fwd.cu_seqlens_q != nullptr;
            float* tile = C::kRereadBatch ? dq_accum_tile<C>(bp, h, m_lo)
                                          : bp.dq_accum + dq_accum_offset<C>(bp, b, s.q_row0, h, m_lo, varlen);
            bulk_reduce_add(tile + (C::kDqByKeys ? 0 : consumer * (C::kDqShareBytes / 4)), share, C::kDqShareBytes);
            bulk_commit();
        }
    }
}

// Shares handed to the dQ writers through mbarriers (kDqAsync): the buffer of a consumer's share number
// n - 1 (n >= 1: with kDeferDq the share step n sends, the previous step's; otherwise step n - 1's),
// and which use of that buffer it is. Two buffers take turns, the first share in buffer 1.
template <class C>
__device__ __forceinline__ int dq_share_buffer(int n) { return C::kDqBuffers == 2 ? n & 1 : 0; }
template <class C>
__device__ __forceinline__ int dq_share_use(int n) { return C::kDqBuffers == 2 ? (n - 1) >> 1 : n - 1; }

// kDqAsync: the consumer's share of dQ for tile ((query head << 16) | query tile) to buffer buf's
// writer, whose use-th share it is: once the writer has read the one before (dq_empty), the threads
// store their parts (dq_tile_offset's order) and each warp arrives on dq_full; the writer, not the
// consumer, then waits for the stores to be visible to the bulk copy (its proxy fence).
template <class C>
__device__ __forceinline__ void hand_dq_share(BwdSm90Shared<C>& sh, const BwdSm90Tiles& tiles,
                                              float (&acc_dq)[C::kDqRegs / 4][4], int consumer, int tile, int buf,
                                              int use) {
    fence_registers(*reinterpret_cast<float(*)[C::kDqRegs]>(&acc_dq[0][0]));
    const int wg_thread = threadIdx.x % 128;
    mbar_wait(sh.dq_empty(consumer, buf), (use & 1) ^ 1);   // a fresh barrier passes parity 1 at once
    if (wg_thread == 0) sh.dq_tile_of[consumer][buf] = tile;
    const unsigned share = tiles.dq + (consumer * C::kDqBuffers + buf) * C::kDqShareBytes;
    store_dq_share<C>(share, acc_dq);
    __syncwarp();   // the warp's stores before its lane 0's arrival releases them
    if (threadIdx.x % 32 == 0) mbar_arrive(sh.dq_full(consumer, buf));
}

// kDqHandOver: the consumer's share of dQ to its writer, at the named barriers
// (write_dq_shares_handed_over): once the writer has had the previous one read (not the first
// time), the threads store their parts and meet the writer again. The tile ((query head << 16) |
// query tile) is still written to dq_tile_of, though the writer walks the tiles itself and reads
// nothing there: with that store ptxas schedules the consumer so that 80-row steps run 3% faster
// (H200 bf16 8k-16k; docs/decisions.md#bwd-sm90-80-row-hand-over).
template <class C>
__device__ __forceinline__ void hand_dq_share_at_barriers(BwdSm90Shared<C>& sh, const BwdSm90Tiles& tiles,
                                                          float (&acc_dq)[C::kDqRegs / 4][4], int consumer, int tile,
                                                          bool first) {
    fence_registers(*reinterpret_cast<float(*)[C::kDqRegs]>(&acc_dq[0][0]));
    if (!first) named_barrier_sync(kDqEmptyBarrier + consumer, kDqBarrierThreads);
    if (threadIdx.x % 128 == 0) sh.dq_tile_of[consumer][0] = tile;
    store_dq_share<C>(tiles.dq + consumer * C::kDqShareBytes, acc_dq);
    named_barrier_sync(kDqFullBarrier + consumer, kDqBarrierThreads);
}

// The end of a consumer's walk for buffer buf's writer: its use-th share is the tile -1 (lane 0 of
// each warp arrives, as for a share; warp 0's after the write).
template <class C>
__device__ __forceinline__ void end_dq_shares(BwdSm90Shared<C>& sh, int consumer, int buf, int use) {
    if (threadIdx.x % 32 == 0) {
        mbar_wait(sh.dq_empty(consumer, buf), (use & 1) ^ 1);
        if (threadIdx.x % 128 == 0) sh.dq_tile_of[consumer][buf] = -1;
        mbar_arrive(sh.dq_full(consumer, buf));
    }
}

// kDeferDq: at step `step` (>= 1), the share of dQ made from the previous step's tile prev_tile
// ((query head << 16) | query tile) leaves: to the dQ writers (kDqAsync), or reduced by the consumer.
template <class C>
__device__ __forceinline__ void send_previous_dq_share(const BwdParams& bp, BwdSm90Shared<C>& sh,
                                                       const BwdSm90Tiles& tiles, float (&acc_dq)[C::kDqRegs / 4][4],
                                                       int consumer, int prev_tile, int b, const SeqInfo& s, int step) {
    if constexpr (C::kDqAsync)
        hand_dq_share<C>(sh, tiles, acc_dq, consumer, prev_tile, dq_share_buffer<C>(step), dq_share_use<C>(step));
    else
        send_dq_share<C>(bp, sh, tiles, acc_dq, consumer, prev_tile >> 16, (prev_tile & 0xffff) * C::kBlockM, b, s,
                         step & 1);
}

// Consumers up to D = 128: each owns 64 of the CTA's 128 keys.
template <class C>
__device__ __forceinline__ void walk_key_halves(const BwdParams& bp, SeqInfo s, int b, BwdSm90Shared<C>& sh,
                                                const BwdSm90Tiles& tiles, int& stage, int& phase, int& ds_buf,
                                                int& turn) {
    const FwdParams& p = bp.fwd;
    const bool varlen = p.cu_seqlens_q != nullptr;
    const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
    const int consumer = warpgroup_index<C::kUniformWarpgroup>() - 1;
    const int g = lane / 4, t = lane % 4;
    const int key_row0 = consumer * 64 + warp * 16 + g;   // this thread's first key inside the CTA's block
    KeyRowsAcc<C::kHeadDim> acc_dk;
    KeyRowsAcc<C::kHeadDimV> acc_dv;
    zero_key_rows<C::kHeadDim, C::kHeadDimV>(acc_dk, acc_dv);

    if constexpr (!C::kPersistent) mbar_wait(sh.kv_full(), 0);   // (persistent: the caller has)
    zero_keys_past_sequence<C>(s, tiles, varlen);

    // step: the walk's step; prev_tile ((query head << 16) | query tile): kDeferDq's previous tile.
    int step = 0, prev_tile = 0;
    for (;;) {
        int m_lo;
        bool blocks_whole;
        if (!next_query_tile<C>(sh, tiles, stage, phase, varlen, s, m_lo, blocks_whole)) break;
        if (C::kDeferDq && consumer == 1 && lag_step<C>(step))   // the lag
            named_barrier_sync(lag_barrier<C>(step), 128 * C::kConsumers);
        const unsigned q_tile = tiles.q + stage * C::kQBytes, do_tile = tiles.dout + stage * C::kDoBytes;

        // S^T = K Q^T and dP^T = V dO^T for this consumer's 64 keys, in two groups: P^T is taken
        // from S^T while dP^T is still being computed; with score modifiers or dropout, dP^T starts
        // only once P^T is in (C::kSerialScores).
        float acc_s[C::kMTiles][4], acc_dp[C::kMTiles][4];
        float(&s_flat)[C::kBlockM / 2] = *reinterpret_cast<float(*)[C::kBlockM / 2]>(&acc_s[0][0]);
        float(&dp_flat)[C::kBlockM / 2] = *reinterpret_cast<float(*)[C::kBlockM / 2]>(&acc_dp[0][0]);
        auto issue_dp = [&] {
            gemm_abt_ss<C::kBlockM, C::kHeadDimV, C::kBlockN, C::kBlockM>(dp_flat, tiles.v + consumer * 64 * 128,
                                                                         do_tile);
            wgmma_commit();
        };
        if constexpr (C::kBiasTile)   // this warp's keys of the step's bias tile (landed with Q and dO)
            start_scores_with_bias_t<C>(acc_s, tiles.score + stage * C::kTileBytes, consumer * 64 + warp * 16, lane,
                                        1.f / p.scale);
        wgmma_fence();
        gemm_abt_ss<C::kBlockM, C::kHeadDim, C::kBlockN, C::kBlockM, C::kBiasTile>(
            s_flat, tiles.k + consumer * 64 * 128, q_tile);
        wgmma_commit();
        if constexpr (!C::kSerialScores) issue_dp();

        // Element (mi, e) of this thread is key n_lo + key_row0 + 8 (e / 2), query m_lo + 8 mi + 2 t
        // + e % 2. Dropout's keep bits are drawn while S^T is computed.
        const int n_lo = (C::kPersistent ? read_cta_place(sh.block_of_stage[stage]) : cta_key_block()) * C::kBlockN;
        const int keys[2] = {n_lo + key_row0, n_lo + key_row0 + 8};
        unsigned keep[C::kKeepWords];
        if constexpr (C::kDropout) dropout_keep_bits_cols<C::kMTiles>(p, s, m_lo + 2 * t, keys[0], lane, keep);
        // A MaskMod's bits beside the block mask alone, on a tile the blocks leave partly visible:
        // loaded here too, under the GEMMs. The warp's keys lie in one 32-key word, so the warp needs
        // one word a query: lane l loads queries l, l + 32, ... (load_warp_mask_bits), and
        // take_probabilities hands each thread its words by shuffles (20 words a thread loaded here
        // spilled 40-48 B at D = 128).
        constexpr bool kBits = C::kModifiedInPlace && C::kMods == kModBlockMask;
        unsigned bit_slots[kBits ? kWarpBitSlots<C> : 1];
        if constexpr (kBits)
            if (p.mask_bits_offset != 0 && !blocks_whole) load_warp_mask_bits<C>(p, s, keys[0], m_lo, lane, bit_slots);
        wgmma_wait<C::kSerialScores ? 0 : 1>();
        fence_registers(s_flat);

        // P^T element by element.
        float score2[C::kScoreMods ? C::kMTiles : 1][4];
        const bool whole = take_probabilities<C>(p, s, m_lo, n_lo, keys, 2 * t, sh.lse2[stage], keep, acc_s, score2,
                                                 blocks_whole, tiles.score + stage * C::kTileBytes,
                                                 kBits ? bit_slots : nullptr);   // read where loaded
        float(&prob)[C::kMTiles][4] = probabilities<C::kScoreMods>(acc_s, score2);
        unsigned p_frag[C::kBlockM / 16][4], ds_frag[C::kBlockM / 16][4];
        auto pack_pdrop = [&] {
#pragma unroll
            for (int kk = 0; kk < C::kBlockM / 16; ++kk)
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const float* x = prob[2 * kk + half];
                    p_frag[kk][2 * half] = pack2<elem_t>(element_pdrop<C::kDropout>(p, x[0]),
                                                         element_pdrop<C::kDropout>(p, x[1]));
                    p_frag[kk][2 * half + 1] = pack2<elem_t>(element_pdrop<C::kDropout>(p, x[2]),
                                                             element_pdrop<C::kDropout>(p, x[3]));
                }
        };

        // dV += P^T dO (dO is an MN-major B operand: its rows are the queries). Issued before dS^T
        // when the registers allow P^T to stay in float32 beside its packed copy (C::kEarlyDv).
        float(&dv_flat)[C::kHeadDimV / 2] = *reinterpret_cast<float(*)[C::kHeadDimV / 2]>(&acc_dv[0][0]);
        float(&dk_flat)[C::kHeadDim / 2] = *reinterpret_cast<float(*)[C::kHeadDim / 2]>(&acc_dk[0][0]);
        if constexpr (C::kSerialScores) {
            wgmma_fence();
            issue_dp();
        }
        if constexpr (C::kEarlyDv) {
            pack_pdrop();
            wgmma_fence();
            gemm_ab_rs<C::kHeadDimV, C::kBlockM, C::kBlockM>(dv_flat, p_frag, do_tile);
            wgmma_commit();
            wgmma_wait<1>();   // dP^T (the older group) is in; dV runs on
        } else {
            // (ptxas waits for dP^T here before the exponentials anyway: with 128 query columns
            // they can only be written in place, over accumulator registers. With 80 columns P^T
            // is made complete first, so that its exponentials run beside dP^T's product rather
            // than after it, where they also raised the registers' peak.)
            if constexpr (C::kDqTransposed)
                fence_registers(*reinterpret_cast<float(*)[C::kBlockM / 2]>(&prob[0][0]));
            wgmma_wait<0>();
        }
        fence_registers(dp_flat);
        if (C::kDeferDq && consumer == 0 && lag_step<C>(step))   // the lag
            named_barrier_arrive(lag_barrier<C>(step), 128 * C::kConsumers);

        // dS^T element by element, into acc_dp as dL/dx.
        take_gradients<C>(bp, s, m_lo, keys, 2 * t, sh.dsum[stage], sh.lse2[stage], prob, acc_s, acc_dp, whole);
#pragma unroll
        for (int kk = 0; kk < C::kBlockM / 16; ++kk) {
            ds_frag[kk][0] = pack2<elem_t>(acc_dp[2 * kk][0], acc_dp[2 * kk][1]);
            ds_frag[kk][1] = pack2<elem_t>(acc_dp[2 * kk][2], acc_dp[2 * kk][3]);
            ds_frag[kk][2] = pack2<elem_t>(acc_dp[2 * kk + 1][0], acc_dp[2 * kk + 1][1]);
            ds_frag[kk][3] = pack2<elem_t>(acc_dp[2 * kk + 1][2], acc_dp[2 * kk + 1][3]);
        }

        // dK += dS^T Q (and dV here when it could not go first: P^T packed only now, as each float32
        // value of it is read for the last time). With dQ here, the last k-steps of dK go after dQ's
        // product (C::kDkTail), so that dQ's way out through shared memory overlaps them.
        if constexpr (!C::kEarlyDv) pack_pdrop();
        wgmma_fence();
        if constexpr (!C::kEarlyDv) gemm_ab_rs<C::kHeadDimV, C::kBlockM, C::kBlockM>(dv_flat, p_frag, do_tile);
        gemm_ab_rs<C::kHeadDim, C::kBlockM, C::kBlockM, 0, C::kBlockM / 16 - C::kDkTail>(dk_flat, ds_frag, q_tile);
        wgmma_commit();
        if constexpr (C::kSerialScores) {
            // dQ's accumulators did not fit beside dK's and dV's in-flight operands either.
            wgmma_wait<0>();
            fence_registers(dv_flat);
            fence_registers(dk_flat);
            fence_registers(p_frag);
            fence_registers(ds_frag);
        }

        float acc_dq[C::kDqRegs / 4][4];
        float(&dq_flat)[C::kDqRegs] = *reinterpret_cast<float(*)[C::kDqRegs]>(&acc_dq[0][0]);
        if constexpr (C::kDq) {
            // dS^T of this consumer's keys into the shared tile [kBlockM / 64][kBlockN keys][64 queries],
            // 16-byte chunks XOR-swizzled by key (conflict-free: a warp's 8 keys x 4 pairs hit 32 banks).
            const unsigned ds_tile = tiles.ds + ds_buf * C::kDsBytes;
            // kDeferDq: both consumers' products of step - 2 (at step - 1) have read this tile.
            if (C::kDeferDq && step >= 2) mbar_wait(sh.ds_empty(ds_buf), ((step >> 1) & 1) ^ 1);
            if constexpr (C::kDqTransposed) {
                // dS (the tile's queries x this consumer's keys) into key block `consumer` of the tile.
                store_transposed<C::kBlockM>(ds_tile + consumer * C::kBlockM * 128, ds_frag);
            } else {
                // Row key_row0 (+ 8: the same swizzle phase), chunk mi % 8 of block mi / 8: the tile is
                // 1024-byte aligned, so the chunk's XOR is one with the chunk index on the row's address.
                const unsigned ds_row = (ds_tile + key_row0 * 128 + ((key_row0 % 8) * 16)) + t * 4;
#pragma unroll
                for (int mi = 0; mi < C::kMTiles; ++mi)
#pragma unroll
                    for (int half = 0; half < 2; ++half) {
                        const unsigned addr =
                            (ds_row ^ ((mi % 8) * 16)) + (mi / 8) * C::kBlockN * 128 + half * 8 * 128;
                        asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr),
                                     "r"(ds_frag[mi / 2][(mi % 2) * 2 + half])
                                     : "memory");
                    }
            }
            fence_proxy_async();
            unsigned dq_ds_tile = ds_tile;
            if constexpr (C::kDeferDq) {
                __syncwarp();   // the warp's stores (and fences) before its lane 0 tells the other consumer
                if (lane == 0) mbar_arrive(sh.ds_full(ds_buf));
                // The previous step's dQ, from its dS^T (both halves in). At the first step the product
                // reads a tile that holds nothing yet and is not sent: a wgmma issued under a run-time
                // condition made ptxas serialize every wgmma of the kernel (C7512).
                if (step > 0) mbar_wait(sh.ds_full(ds_buf ^ 1), ((step - 1) >> 1) & 1);
                dq_ds_tile = tiles.ds + (ds_buf ^ 1) * C::kDsBytes;
            } else {
                named_barrier_sync(1, 128 * C::kConsumers);   // both consumers' dS^T are in
            }
            issue_dq_product<C>(dq_flat, dq_ds_tile, tiles, consumer);
            if constexpr (C::kDkTail > 0) {
                gemm_ab_rs<C::kHeadDim, C::kBlockM, C::kBlockM, C::kBlockM / 16 - C::kDkTail>(dk_flat, ds_frag, q_tile);
                wgmma_commit();
            }
            ds_buf ^= 1;
        }
        // Everything but dK's tail (kDeferDq: the previous step's dQ) is in (products complete in
        // the order they were issued).
        wgmma_wait<(C::kDkTail > 0 || C::kDeferDq ? 1 : 0)>();
        fence_registers(dv_flat);
        fence_registers(p_frag);
        auto release_stage = [&] {
            fence_registers(dk_flat);
            fence_registers(ds_frag);
            mbar_arrive(sh.empty(stage));   // Q, dO, lse2 and D of this stage are no longer read
        };
        if constexpr (C::kDkTail == 0) release_stage();

        if constexpr (C::kDeferDq) {
            wgmma_wait<0>();
            __syncwarp();
            if (step > 0) {
                if (lane == 0) mbar_arrive(sh.ds_empty(ds_buf));   // (flipped above: the previous step's tile)
                send_previous_dq_share<C>(bp, sh, tiles, acc_dq, consumer, prev_tile, b, s, step);
            }
            prev_tile = (s.h << 16) | (m_lo / C::kBlockM);
        } else if constexpr (C::kDqHandOver) {
            hand_dq_share_at_barriers<C>(sh, tiles, acc_dq, consumer, (s.h << 16) | (m_lo / C::kBlockM), step == 0);
        } else if constexpr (C::kDqAsync) {   // this step's share (ordered dQ)
            hand_dq_share<C>(sh, tiles, acc_dq, consumer, (s.h << 16) | (m_lo / C::kBlockM), dq_share_buffer<C>(step + 1),
                             dq_share_use<C>(step + 1));
        } else if constexpr (C::kDq) {
            send_dq_share<C>(bp, sh, tiles, acc_dq, consumer, s.h, m_lo, b, s, C::kDqBuffers == 2 ? ds_buf : 0);
        }
        if constexpr (C::kDkTail > 0) {
            wgmma_wait<0>();
            release_stage();
        }
        if (++stage == C::kStages) { stage = 0; phase ^= 1; }
        ++step;
    }

    if constexpr (C::kDeferDq) {   // the last step's dQ (read from the tile that holds nothing, with no step)
        float acc_dq[C::kDqRegs / 4][4];
        float(&dq_flat)[C::kDqRegs] = *reinterpret_cast<float(*)[C::kDqRegs]>(&acc_dq[0][0]);
        if (step > 0) mbar_wait(sh.ds_full(ds_buf ^ 1), ((step - 1) >> 1) & 1);
        wgmma_fence();
        issue_dq_product<C>(dq_flat, tiles.ds + (ds_buf ^ 1) * C::kDsBytes, tiles, consumer);
        wgmma_wait<0>();
        if (step > 0) send_previous_dq_share<C>(bp, sh, tiles, acc_dq, consumer, prev_tile, b, s, step);
    }

    if constexpr (C::kPersistent) {
        // The stage that ended the walk goes back too, once it has told the turn's parity; every
        // product over K and V is in (each step waits for its own), so the producer may load the next
        // block's once both consumers say so.
        turn = read_cta_place(sh.block_of_stage[stage]);
        mbar_arrive(sh.empty(stage));
        if (++stage == C::kStages) { stage = 0; phase ^= 1; }
        mbar_arrive(sh.kv_empty());
    }

    // The end of the walk: each writer's next share (step shares have gone, either way). (With one
    // writer as a loop of one turn, ptxas scheduled the whole 80-row kernel differently.) kDqHandOver:
    // the writer's last read, then the meeting that ends its walk (write_dq_shares_handed_over).
    if constexpr (C::kDqHandOver) {
        if (step > 0) named_barrier_sync(kDqEmptyBarrier + consumer, kDqBarrierThreads);
        named_barrier_sync(kDqFullBarrier + consumer, kDqBarrierThreads);
    } else if constexpr (C::kDqAsync) {
        for (int next = step + 1; next <= step + C::kDqWriters; ++next)
            end_dq_shares<C>(sh, consumer, dq_share_buffer<C>(next), dq_share_use<C>(next));
    } else if (C::kDq && C::kOrdered && threadIdx.x % 128 == 0) {   // the end of the walk, to both writers
        for (int w = 0; w < C::kDqWriters; ++w) {
            const int buf = ds_buf ^ 1 ^ w;   // the next buffer first, then the last step's
            mbar_wait(sh.dq_empty(consumer, buf), ((sh.dq_empty_parity[consumer] >> buf) & 1) ^ 1);
            sh.dq_tile_of[consumer][buf] = -1;
            mbar_arrive(sh.dq_full(consumer, buf));
        }
    }

    // Before the CTA leaves, its dQ reductions must have read their shared memory; their adds land
    // by the end of the kernel.
    if (C::kDq && !C::kOrdered && threadIdx.x % 128 == 0) bulk_wait_read();
    // The stage ring's Q and dO buffers are free once both consumers have left the walk (persistent:
    // the last step's dS^T tile, which both consumers' dQ products have read by then).
    named_barrier_sync(1, 128 * C::kConsumers);
    store_dk_dv_chunks<C, C::kHeadDim, C::kHeadDimV>(bp, C::kRereadBatch ? cta_batch(turn) : b, consumer * 64, 0, 0,
                                                     C::kPersistent ? tiles.ds + (ds_buf ^ 1) * C::kDsBytes : tiles.q,
                                                     acc_dk, acc_dv, turn);
    count_dq_landed<C>(bp, turn);
}

// The consumers split by keys: one walk, or, in persistent CTAs, one a key block until the producer
// tells the end (bwd_cta_place's x = -1); the stage ring and the dS^T tiles run on from walk to walk.
template <class C>
__device__ __forceinline__ void consume_key_halves(const BwdParams& bp, SeqInfo s, int b, BwdSm90Shared<C>& sh,
                                                   const BwdSm90Tiles& tiles) {
    int stage = 0, phase = 0, ds_buf = 0;
    if constexpr (C::kPersistent) {
        const FwdParams& p = bp.fwd;
        // turn: the parity of the block's turn, which the walk reads again from its last stage.
#pragma unroll 1
        for (int turn = 0;; turn ^= 1) {
            mbar_wait(sh.kv_full(), turn);
            if (cta_key_block(turn) < 0) return;
            const int group = p.heads_q / p.heads_k, splits = group / bp.heads_per_cta;
            const int bt = cta_batch(turn);
            walk_key_halves<C>(bp, make_seq_info(p, bt, (cta_slot(turn) / splits) * group), bt, sh, tiles, stage,
                               phase, ds_buf, turn);
        }
    } else {
        int turn = 0;
        walk_key_halves<C>(bp, s, b, sh, tiles, stage, phase, ds_buf, turn);
    }
}

// Split by columns: a consumer's Pdrop^T (from prob) and dS^T (ds) into their [64 keys][64 queries]
// tiles: row key_row0 (+ 8), 16-byte chunk col0 / 8 + mi XOR-swizzled by the row (rows % 8 = g: a
// warp's 8 rows x 4 pairs hit 32 banks). One tile after the other rather than element by element
// in turns: H200, 0-4% faster at D = 256 under a causal mask, ~1% without
// (docs/decisions.md#bwd-sm90-store-order-at-head-dim-256).
template <class C>
__device__ __forceinline__ void store_split_tiles(const FwdParams& p, unsigned pt_tile, unsigned ds_tile, int key_row0,
                                                  int col0, const float (&prob)[C::kMTiles][4],
                                                  const float (&ds)[C::kMTiles][4]) {
    const int g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
    auto store_tile = [&](unsigned tile, const float(&x)[C::kMTiles][4], bool pdrop) {
#pragma unroll
        for (int mi = 0; mi < C::kMTiles; ++mi)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const unsigned off = (key_row0 + 8 * half) * 128 + (((col0 / 8 + mi) ^ g) * 16) + t * 4;
                const float lo = x[mi][2 * half], hi = x[mi][2 * half + 1];
                asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(tile + off),
                             "r"(pdrop ? pack2<elem_t>(element_pdrop<C::kDropout>(p, lo),
                                                       element_pdrop<C::kDropout>(p, hi))
                                       : pack2<elem_t>(lo, hi))
                             : "memory");
            }
    };
    store_tile(pt_tile, prob, true);
    store_tile(ds_tile, ds, false);
}

// Split by columns: S^T = K Q^T and dP^T = V dO^T of a consumer's query columns, two commit groups
// (B starts col0 rows into the Q / dO tiles: a multiple of the swizzle's 8 rows).
template <class C>
__device__ __forceinline__ void issue_split_scores(float (&s_flat)[C::kQueryCols / 2],
                                                   float (&dp_flat)[C::kQueryCols / 2], const BwdSm90Tiles& tiles,
                                                   unsigned q_tile, unsigned do_tile, int col0) {
    wgmma_fence();
    gemm_abt_ss<C::kQueryCols, C::kHeadDim, C::kBlockN, C::kBlockM>(s_flat, tiles.k, q_tile + col0 * 128);
    wgmma_commit();
    gemm_abt_ss<C::kQueryCols, C::kHeadDimV, C::kBlockN, C::kBlockM>(dp_flat, tiles.v, do_tile + col0 * 128);
    wgmma_commit();
}

// Split by columns: a consumer's products of one step, one commit group: its kDk / 64 shares of dQ
// (64 x 64 each; A = dS^T read transposed, B = K's column blocks from dk_col0), then dV (kDv columns
// from dv_col0, none where kDv is 0) and dK over the whole tile (B = its column blocks of dO / Q).
template <class C, int kDk, int kDv>
__device__ __forceinline__ void issue_split_products(float (&acc_dq)[kDk / 64][32], KeyRowsAcc<kDk>& acc_dk,
                                                     KeyRowsAcc<kDv>& acc_dv, unsigned pt_tile, unsigned ds_tile,
                                                     unsigned q_tile, unsigned do_tile, unsigned k_tile, int dk_col0,
                                                     int dv_col0) {
    float(&dv_flat)[kDv > 0 ? kDv / 2 : 4] = *reinterpret_cast<float(*)[kDv > 0 ? kDv / 2 : 4]>(&acc_dv[0][0]);
    float(&dk_flat)[kDk / 2] = *reinterpret_cast<float(*)[kDk / 2]>(&acc_dk[0][0]);
    const unsigned cols = (dk_col0 / 64) * C::kBlockM * 128, cols_v = (dv_col0 / 64) * C::kBlockM * 128;
    wgmma_fence();
    if constexpr (C::kDq) {
#pragma unroll
        for (int j = 0; j < kDk / 64; ++j)
            gemm_atb_ss_n64<C::kBlockN>(acc_dq[j], ds_tile, k_tile + (dk_col0 / 64 + j) * C::kBlockN * 128);
    }
    if constexpr (kDv > 0) gemm_ab_ss<kDv, C::kBlockM, C::kBlockM>(dv_flat, pt_tile, do_tile + cols_v);
    gemm_ab_ss<kDk, C::kBlockM, C::kBlockM>(dk_flat, ds_tile, q_tile + cols);
    wgmma_commit();
}

// ... and once they are in: the registers the products wrote.
template <int kDk, int kDv>
__device__ __forceinline__ void fence_split_products(float (&acc_dq)[kDk / 64][32], KeyRowsAcc<kDk>& acc_dk,
                                                     KeyRowsAcc<kDv>& acc_dv) {
    if constexpr (kDv > 0) fence_registers(*reinterpret_cast<float(*)[kDv / 2]>(&acc_dv[0][0]));
    fence_registers(*reinterpret_cast<float(*)[kDk / 2]>(&acc_dk[0][0]));
#pragma unroll
    for (int j = 0; j < kDk / 64; ++j) fence_registers(acc_dq[j]);
}

// Split by columns: a consumer's shares of dQ for query head h, rows m_lo .. into `share` (in
// dq_tile_offset's order: share j is the tile's share dk_col0 / 64 + j), then one bulk reduction
// into the tile of dq_accum that thread 0 of the warpgroup issues.
template <class C, int kShares>
__device__ __forceinline__ void send_split_dq_share(const BwdParams& bp, const float (&acc_dq)[kShares][32],
                                                    unsigned share, int consumer, int b, const SeqInfo& s, int h,
                                                    int m_lo, int dk_col0, bool varlen) {
    const int wg_thread = threadIdx.x % 128;
#pragma unroll
    for (int j = 0; j < kShares; ++j)
#pragma unroll
        for (int nj = 0; nj < 8; ++nj)
            asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(
                             share + j * C::kDqShareBytes + (nj * 128 + wg_thread) * 16),
                         "f"(acc_dq[j][4 * nj]), "f"(acc_dq[j][4 * nj + 1]), "f"(acc_dq[j][4 * nj + 2]),
                         "f"(acc_dq[j][4 * nj + 3])
                         : "memory");
    fence_proxy_async();   // the bulk-copy unit reads what the threads wrote
    named_barrier_sync(2 + consumer, 128);
    if (wg_thread == 0) {
        float* dq_tile = bp.dq_accum + dq_accum_offset<C>(bp, b, s.q_row0, h, m_lo, varlen);
        bulk_reduce_add(dq_tile + (dk_col0 / 64) * (C::kDqShareBytes / 4), share, kShares * C::kDqShareBytes);
        bulk_commit();
    }
}

// Consumers at D = 256: the CTA keeps 64 keys and consumer c owns columns 128c .. 128c + 127 of
// their dK and dV (128 registers; dV's 64c .. 64c + 63 where v's head dim is 128). Per query tile of
// 64 rows:
//   S^T, dP^T of the 64 keys x the queries 32c .. 32c + 31 (wgmma n = 32), P^T and dS^T element
//   by element, both into shared memory as 16-bit tiles [64 keys][64 queries] (P^T, then dS^T in
//   tiles.ds), which each consumer then reads whole:
//   dV[:, c] += P^T dO[:, c],  dK[:, c] += dS^T Q[:, c]    (both operands in shared memory)
//   dQ[:, c]  = dS K[:, c]                                 (two 64 x 64 products)
// The consumer's share of dQ (64 x 128 float32) leaves through the step's own Q (consumer 0) or dO
// (consumer 1; where dO's buffer is the smaller, a buffer of its own: kDqOwnBytes) buffer, once both
// consumers' products have read it, as one 32 KB bulk reduction into dq_accum. The stage goes back
// to the producer when that reduction has read it: thread 0 checks at the next step, after issuing
// its products, and the warpgroup then frees the stage. (Q's and K's 192, whose consumers' columns
// differ: consume_dim_pipelined.)
template <class C>
__device__ __forceinline__ void consume_dim_halves(const BwdParams& bp, SeqInfo s, int b, BwdSm90Shared<C>& sh,
                                                   const BwdSm90Tiles& tiles) {
    const FwdParams& p = bp.fwd;
    const bool varlen = p.cu_seqlens_q != nullptr;
    const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4, wg_thread = threadIdx.x % 128;
    const int consumer = warpgroup_index<C::kUniformWarpgroup>() - 1;
    const int g = lane / 4, t = lane % 4;
    const int key_row0 = warp * 16 + g;          // this thread's first key inside the CTA's block
    const int col0 = consumer * C::kQueryCols;   // this consumer's first query column of a tile
    const unsigned pt_tile = tiles.ds, ds_tile = tiles.ds + C::kDsBytes;
    // This consumer's columns of dK and dQ (kDk, from dk_col0: kDqShares column blocks) and of dV.
    static_assert(!C::kAsymmetricSplit, "the consumers' columns are halves alike");
    constexpr int kDk = split_dk_cols(C::kHeadDim, 0), kDv = split_dv_cols(C::kHeadDim, C::kHeadDimV, 0);
    constexpr int kDqShares = kDk / 64;
    const int dk_col0 = split_dk_col0(C::kHeadDim, consumer);
    const int dv_col0 = split_dv_col0(C::kHeadDim, C::kHeadDimV, consumer);
    KeyRowsAcc<kDk> acc_dk;
    KeyRowsAcc<kDv> acc_dv;
    zero_key_rows<kDk, kDv>(acc_dk, acc_dv);

    mbar_wait(sh.kv_full(), 0);
    zero_keys_past_sequence<C>(s, tiles, varlen);

    int stage = 0, phase = 0, pending = -1;   // pending: the stage whose dQ reduction may still read it
    for (;;) {
        int m_lo;
        bool blocks_whole;
        if (!next_query_tile<C>(sh, tiles, stage, phase, varlen, s, m_lo, blocks_whole)) break;
        const unsigned q_tile = tiles.q + stage * C::kQBytes, do_tile = tiles.dout + stage * C::kDoBytes;

        // Element (mi, e) of this thread is key n_lo + key_row0 + 8 (e / 2), query m_lo + col0 +
        // 8 mi + 2 t + e % 2. Dropout's keep bits are drawn before the products (beside their
        // accumulators, with score modifiers, the Philox rounds spilled at D = 256).
        const int n_lo = cta_key_block() * C::kBlockN;
        const int keys[2] = {n_lo + key_row0, n_lo + key_row0 + 8};
        unsigned keep[C::kKeepWords];
        if constexpr (C::kDropout) dropout_keep_bits_cols<C::kMTiles>(p, s, m_lo + col0 + 2 * t, keys[0], lane, keep);

        // S^T = K Q^T and dP^T = V dO^T for this consumer's query columns.
        float acc_s[C::kMTiles][4], acc_dp[C::kMTiles][4];
        float(&s_flat)[C::kQueryCols / 2] = *reinterpret_cast<float(*)[C::kQueryCols / 2]>(&acc_s[0][0]);
        float(&dp_flat)[C::kQueryCols / 2] = *reinterpret_cast<float(*)[C::kQueryCols / 2]>(&acc_dp[0][0]);
        issue_split_scores<C>(s_flat, dp_flat, tiles, q_tile, do_tile, col0);
        if (pending >= 0) {   // the previous step's dQ reduction has read its stage (thread 0 issued it)
            if (wg_thread == 0) bulk_wait_read();
            named_barrier_sync(2 + consumer, 128);
            mbar_arrive(sh.empty(pending));
        }
        wgmma_wait<1>();
        fence_registers(s_flat);

        // P^T element by element.
        float score2[C::kScoreMods ? C::kMTiles : 1][4];
        const bool whole =
            take_probabilities<C>(p, s, m_lo, n_lo, keys, col0 + 2 * t, sh.lse2[stage], keep, acc_s, score2,
                                  blocks_whole);
        float(&prob)[C::kMTiles][4] = probabilities<C::kScoreMods>(acc_s, score2);
        wgmma_wait<0>();
        fence_registers(dp_flat);
        // dS^T element by element, into acc_dp (prob keeps P, for Pdrop below).
        take_gradients<C>(bp, s, m_lo, keys, col0 + 2 * t, sh.dsum[stage], sh.lse2[stage], prob, acc_s, acc_dp,
                          whole);
        store_split_tiles<C>(p, pt_tile, ds_tile, key_row0, col0, prob, acc_dp);
        fence_proxy_async();
        named_barrier_sync(1, 128 * C::kConsumers);   // both consumers' halves of P^T and dS^T are in

        float acc_dq[kDqShares][32];
        issue_split_products<C, kDk, kDv>(acc_dq, acc_dk, acc_dv, pt_tile, ds_tile, q_tile, do_tile, tiles.k, dk_col0,
                                          dv_col0);
        wgmma_wait<0>();
        fence_split_products<kDk, kDv>(acc_dq, acc_dk, acc_dv);
        // Both consumers are done with this stage's Q and dO, and with P^T and dS^T.
        named_barrier_sync(1, 128 * C::kConsumers);

        if constexpr (C::kDq) {
            const unsigned share = consumer == C::kDqOwnConsumer ? tiles.dq : consumer == 0 ? q_tile : do_tile;
            send_split_dq_share<C, kDqShares>(bp, acc_dq, share, consumer, b, s, s.h, m_lo, dk_col0, varlen);
            pending = stage;
        } else {
            mbar_arrive(sh.empty(stage));
        }
        if (++stage == C::kStages) { stage = 0; phase ^= 1; }
    }
    // The stage ring's Q and dO buffers (the last dQ shares passed through them) are free once both
    // consumers' reductions have read them.
    if (C::kDq && wg_thread == 0) bulk_wait_read();
    named_barrier_sync(1, 128 * C::kConsumers);
    store_dk_dv_chunks<C, kDk, kDv>(bp, b, 0, dk_col0, dv_col0, tiles.q, acc_dk, acc_dv);
    count_dq_landed<C>(bp);
}

// Consumers at Q's and K's 192 (beside V's 128): split by columns as in consume_dim_halves, each
// compiled for its own columns, with the products of a step (dQ, dV, dK) issued after the next
// step's S^T and dP^T, so that they run while the warpgroup takes that step's P^T and dS^T element
// by element (consume_dim_halves runs them one after the other). Step i: S^T_i and dP^T_i, then the
// products of step i - 1 (its P^T and dS^T tiles, stage i - 1's Q and dO); P^T_i once S^T_i is in,
// dS^T_i once dP^T_i is; then, the products in, step i - 1's share of dQ leaves, and once both
// consumers' products have read the P^T and dS^T tiles, step i's go there. A stage is freed one step
// later than in consume_dim_halves, so three are needed (with two, the end of the walk would wait
// for a stage the consumers still hold). Every wgmma is issued unconditionally (one under a run-time
// condition made ptxas serialize them all): the products of "step -1", and of the last step of a
// walk that had none, read zeros, the P^T and dS^T tiles and consumer 0's dQ buffer as Q and dO,
// zeroed before the walk (that buffer is first written by step 1's share of dQ).
template <class C, int kWhich>
__device__ __forceinline__ void consume_dim_pipelined(const BwdParams& bp, SeqInfo s, int b, BwdSm90Shared<C>& sh,
                                                      const BwdSm90Tiles& tiles) {
    static_assert(C::kStages >= 3, "a stage is held for two steps");
    static_assert(C::kDqOwnConsumer == 0 && C::kDqOwnBytes >= C::kQBytes && C::kDqOwnBytes >= C::kDoBytes,
                  "consumer 1 reads stage i - 1's Q while consumer 0's share of dQ leaves; its buffer holds zeros "
                  "for Q and dO at first");
    const FwdParams& p = bp.fwd;
    const bool varlen = p.cu_seqlens_q != nullptr;
    const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4, wg_thread = threadIdx.x % 128;
    constexpr int consumer = kWhich;
    const int g = lane / 4, t = lane % 4;
    const int key_row0 = warp * 16 + g;          // this thread's first key inside the CTA's block
    const int col0 = consumer * C::kQueryCols;   // this consumer's first query column of a tile
    const unsigned pt_tile = tiles.ds, ds_tile = tiles.ds + C::kDsBytes;
    constexpr int kDk = split_dk_cols(C::kHeadDim, kWhich), kDv = split_dv_cols(C::kHeadDim, C::kHeadDimV, kWhich);
    constexpr int kDqShares = kDk / 64;
    constexpr int dk_col0 = split_dk_col0(C::kHeadDim, kWhich);
    constexpr int dv_col0 = split_dv_col0(C::kHeadDim, C::kHeadDimV, kWhich);
    KeyRowsAcc<kDk> acc_dk;
    KeyRowsAcc<kDv> acc_dv;
    zero_key_rows<kDk, kDv>(acc_dk, acc_dv);

    // Zeros for step -1's products: P^T and dS^T, and consumer 0's dQ buffer as Q and dO.
    for (int i = threadIdx.x - 128; i < (C::kDsTiles * C::kDsBytes + C::kDqOwnBytes) / 16; i += 128 * C::kConsumers) {
        const unsigned addr = i < C::kDsTiles * C::kDsBytes / 16 ? tiles.ds + i * 16
                                                                 : tiles.dq + i * 16 - C::kDsTiles * C::kDsBytes;
        asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(addr), "r"(0) : "memory");
    }
    fence_proxy_async();
    named_barrier_sync(1, 128 * C::kConsumers);

    mbar_wait(sh.kv_full(), 0);
    zero_keys_past_sequence<C>(s, tiles, varlen);

    // prev_*: step i - 1's stage (-1: none), Q and dO tiles, query head and first row.
    int stage = 0, phase = 0, pending = -1;   // pending: the stage whose dQ reduction may still read it
    int prev_stage = -1, prev_h = 0, prev_m_lo = 0;
    unsigned prev_q = tiles.dq, prev_do = tiles.dq;
    float acc_dq[kDqShares][32];
    // Step i - 1's products are in: its share of dQ leaves (or, without dQ here, its stage is freed).
    auto finish_previous_step = [&] {
        if (prev_stage < 0) return;
        if constexpr (C::kDq) {
            send_split_dq_share<C, kDqShares>(bp, acc_dq, consumer == 0 ? tiles.dq : prev_do, consumer, b, s, prev_h,
                                              prev_m_lo, dk_col0, varlen);
            pending = prev_stage;
        } else {
            mbar_arrive(sh.empty(prev_stage));
        }
    };
    auto free_pending_stage = [&] {   // its dQ reduction (thread 0 issued it) has read it
        if (pending < 0) return;
        if (wg_thread == 0) bulk_wait_read();
        named_barrier_sync(2 + consumer, 128);
        mbar_arrive(sh.empty(pending));
        pending = -1;
    };
    for (;;) {
        int m_lo;
        bool blocks_whole;
        if (!next_query_tile<C>(sh, tiles, stage, phase, varlen, s, m_lo, blocks_whole)) break;
        const unsigned q_tile = tiles.q + stage * C::kQBytes, do_tile = tiles.dout + stage * C::kDoBytes;

        const int n_lo = cta_key_block() * C::kBlockN;
        const int keys[2] = {n_lo + key_row0, n_lo + key_row0 + 8};
        unsigned keep[C::kKeepWords];
        if constexpr (C::kDropout) dropout_keep_bits_cols<C::kMTiles>(p, s, m_lo + col0 + 2 * t, keys[0], lane, keep);

        // S^T_i, dP^T_i, then step i - 1's products.
        float acc_s[C::kMTiles][4], acc_dp[C::kMTiles][4];
        float(&s_flat)[C::kQueryCols / 2] = *reinterpret_cast<float(*)[C::kQueryCols / 2]>(&acc_s[0][0]);
        float(&dp_flat)[C::kQueryCols / 2] = *reinterpret_cast<float(*)[C::kQueryCols / 2]>(&acc_dp[0][0]);
        issue_split_scores<C>(s_flat, dp_flat, tiles, q_tile, do_tile, col0);
        issue_split_products<C, kDk, kDv>(acc_dq, acc_dk, acc_dv, pt_tile, ds_tile, prev_q, prev_do, tiles.k, dk_col0,
                                          dv_col0);
        free_pending_stage();
        wgmma_wait<2>();
        fence_registers(s_flat);

        float score2[C::kScoreMods ? C::kMTiles : 1][4];
        const bool whole =
            take_probabilities<C>(p, s, m_lo, n_lo, keys, col0 + 2 * t, sh.lse2[stage], keep, acc_s, score2,
                                  blocks_whole);
        float(&prob)[C::kMTiles][4] = probabilities<C::kScoreMods>(acc_s, score2);
        wgmma_wait<1>();
        fence_registers(dp_flat);
        take_gradients<C>(bp, s, m_lo, keys, col0 + 2 * t, sh.dsum[stage], sh.lse2[stage], prob, acc_s, acc_dp,
                          whole);
        wgmma_wait<0>();
        fence_split_products<kDk, kDv>(acc_dq, acc_dk, acc_dv);
        finish_previous_step();
        named_barrier_sync(1, 128 * C::kConsumers);   // both consumers' products have read P^T and dS^T
        store_split_tiles<C>(p, pt_tile, ds_tile, key_row0, col0, prob, acc_dp);
        fence_proxy_async();
        named_barrier_sync(1, 128 * C::kConsumers);   // both consumers' halves of P^T and dS^T are in
        prev_stage = stage, prev_h = s.h, prev_m_lo = m_lo, prev_q = q_tile, prev_do = do_tile;
        if (++stage == C::kStages) { stage = 0; phase ^= 1; }
    }
    // The last step's products.
    issue_split_products<C, kDk, kDv>(acc_dq, acc_dk, acc_dv, pt_tile, ds_tile, prev_q, prev_do, tiles.k, dk_col0,
                                      dv_col0);
    free_pending_stage();
    wgmma_wait<0>();
    fence_split_products<kDk, kDv>(acc_dq, acc_dk, acc_dv);
    finish_previous_step();
    // The stage ring's Q and dO buffers (the last dQ shares passed through them) are free once both
    // consumers' reductions have read them.
    if (C::kDq && wg_thread == 0) bulk_wait_read();
    named_barrier_sync(1, 128 * C::kConsumers);
    store_dk_dv_chunks<C, kDk, kDv>(bp, b, 0, dk_col0, dv_col0, tiles.q, acc_dk, acc_dv);
    count_dq_landed<C>(bp);
}

// The CTA's mbarriers (thread 0).
template <class C>
__device__ __forceinline__ void init_barriers(BwdSm90Shared<C>& sh) {
    mbar_init(sh.kv_full(), 1);
    mbar_init(sh.kv_empty(), 128 * C::kConsumers);   // persistent: every consumer thread
    for (int stage = 0; stage < C::kStages; ++stage) {
        mbar_init(sh.full(stage), 1);
        mbar_init(sh.empty(stage), 128 * C::kConsumers);   // every consumer thread frees a stage
    }
    if constexpr (C::kDqMbarriers) {
        for (int i = 0; i < 2 * C::kConsumers; ++i) {
            mbar_init(smem_addr(&sh.dq_barriers[i]), C::kDqAsync ? 4 : 1);   // each warp arrives
            mbar_init(smem_addr(&sh.dq_barriers[2 * C::kConsumers + i]), 1);
        }
        for (int i = 0; i < C::kConsumers; ++i) sh.dq_empty_parity[i] = 0;
    }
    if constexpr (C::kDeferDq)
        for (int i = 0; i < 4; ++i) mbar_init(smem_addr(&sh.ds_barriers[i]), 4 * C::kConsumers);
    fence_barrier_init();
}

template <class C>
__device__ __forceinline__ void bwd_sm90(const TmaMap& q_map, const TmaMap& k_map, const TmaMap& v_map,
                                         const TmaMap& do_map, const TmaMap& tile_map, const BwdParams& bp) {
    const FwdParams& p = bp.fwd;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    __shared__ __align__(16) BwdSm90Shared<C> sh;
    BwdSm90Tiles tiles;
    tiles.k = (smem_addr(smem_raw) + 1023) & ~1023u;
    tiles.v = tiles.k + C::kKBytes;
    tiles.q = tiles.v + C::kVBytes;
    tiles.dout = tiles.q + C::kStages * C::kQBytes;
    tiles.ds = tiles.dout + C::kStages * C::kDoBytes;
    tiles.dq = tiles.ds + C::kDsTiles * C::kDsBytes;
    tiles.score = tiles.dq + C::kConsumers * C::kDqBuffers * C::kDqShareBytes + C::kDqOwnBytes;

    // bwd_convert, when launched behind this kernel, may start once every CTA here has: it waits
    // for its heads' counts (count_dq_landed) on SMs this grid no longer needs.
    let_dependents_start();
    if constexpr (C::kPersistent) {   // one CTA an SM, key blocks from a counter (produce_persistent)
        if (threadIdx.x == 0) init_barriers<C>(sh);
        __syncthreads();
        if (threadIdx.x < 128) {
            produce_persistent<C>(q_map, k_map, v_map, do_map, tile_map, bp, sh, tiles);
            return;
        }
        setmaxnreg_inc<C::kConsumerRegs>();
        consume_key_halves<C>(bp, SeqInfo{}, 0, sh, tiles);
        return;
    }
    // Which keys, which heads: slot = kv head * splits + split; the CTA sums the query heads
    // h0 .. h0 + heads_per_cta - 1 of that kv head's group (all of it unless the host split it).
    // The consumers learn each tile's head from the producer.
    const int4 place = cta_place<C>(bp);
    const int b = place.z;
    const int group = p.heads_q / p.heads_k, splits = group / bp.heads_per_cta;
    SeqInfo s = make_seq_info(p, b, (place.y / splits) * group);
    const int n_lo = place.x * C::kBlockN;
    if (n_lo >= s.seqlen_k) {   // a short sequence of a varlen batch (the whole CTA leaves)
        if (C::kDq && !C::kOrdered && threadIdx.x == 0 && bp.dq_done != nullptr)
            release_count(bp.dq_done + b * gridDim.y + place.y, C::kConsumers);
        return;
    }
    const int n_hi = min(n_lo + C::kBlockN, s.seqlen_k);
    int q_first, q_last;
    visible_queries(p, s, n_lo, n_hi, &q_first, &q_last);
    int c_begin = q_first / C::kBlockM, c_end = ceil_div(q_last, C::kBlockM);
    // With a work order, the query steps some True block touches (work_bounds): the walk stops at the
    // end of a document rather than testing every tile to the sequence's end. Bounds are per head of
    // the mask, so a CTA of several heads takes them only where the mask is the same for every head.
    if constexpr (C::kBlockMask)
        if (p.work_order != nullptr && (bp.heads_per_cta == 1 || p.work_order_head_stride == 0)) {
            const int2 bounds = p.work_bounds[work_index(p, b, slot_first_query_head(bp, place.y), place.x)];
            c_begin = max(c_begin, bounds.x);
            c_end = max(c_begin, min(c_end, bounds.y));
        }
    const bool varlen = p.cu_seqlens_q != nullptr;

    if (threadIdx.x == 0) {
        bwd_cta_place[0] = place;
        init_barriers<C>(sh);
    }
    __syncthreads();

    if (threadIdx.x < 128) {
        produce<C>(q_map, k_map, v_map, do_map, tile_map, bp, s, b, varlen, n_lo, c_begin, c_end, sh, tiles);
        return;
    }
    setmaxnreg_inc<C::kConsumerRegs>();
    static_assert(!C::kBiasTile || (!C::kAsymmetricSplit && !C::kSplitDims), "the bias starts S^T in walk_key_halves");
    if constexpr (C::kAsymmetricSplit) {
        if (threadIdx.x < 256) consume_dim_pipelined<C, 0>(bp, s, b, sh, tiles);
        else consume_dim_pipelined<C, 1>(bp, s, b, sh, tiles);
    } else if constexpr (C::kSplitDims) {
        consume_dim_halves<C>(bp, s, b, sh, tiles);
    } else {
        consume_key_halves<C>(bp, s, b, sh, tiles);
    }
}


}  // namespace cuflash

using Config = cuflash::BwdSm90Config<CUFLASH_HEAD_DIM, CUFLASH_HEAD_DIM_V, CUFLASH_BLOCK_M, CUFLASH_STAGES,
                                      CUFLASH_BWD_DQ, CUFLASH_SCORE_MODS, CUFLASH_DROPOUT != 0>;
#ifdef CUFLASH_SMEM_BYTES
static_assert(CUFLASH_SMEM_BYTES == Config::kSmemBytes, "shared memory size differs from cuflash/_heuristics.py");
#endif

// A variant with score tiles takes the bias's or mask's map after dO's (cuflash/_backward_plan.py).
extern "C" __global__ void __launch_bounds__(Config::kNThreads, 1)
    cuflash_bwd_sm90(const __grid_constant__ cuflash::TmaMap q_map, const __grid_constant__ cuflash::TmaMap k_map,
                     const __grid_constant__ cuflash::TmaMap v_map, const __grid_constant__ cuflash::TmaMap do_map,
#if CUFLASH_SCORE_TILE
                     const __grid_constant__ cuflash::TmaMap tile_map,
#endif
                     const cuflash::BwdParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (cuflash::call_faulted(p.fwd.error)) return;
#if CUFLASH_SCORE_TILE
    cuflash::bwd_sm90<Config>(q_map, k_map, v_map, do_map, tile_map, p);
#else
    cuflash::bwd_sm90<Config>(q_map, k_map, v_map, do_map, do_map, p);
#endif
#endif
}

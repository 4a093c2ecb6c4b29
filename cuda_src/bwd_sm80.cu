// Backward attention on tensor cores with mma.sync m16n8k16 (sm_80 and newer), fp16/bf16.
//
// Two passes share one kernel body (FlashAttention-2's backward, recomputing P from lse):
//
//   pass 0 (dK/dV, CUFLASH_BWD_PASS=0): a CTA keeps kBlockR keys (K, V) in shared memory and walks
//     over the query tiles that see them (Q, dO, lse2, D streamed through a two-stage cp.async
//     buffer), for each query head of its GQA group in turn, so dK/dV of a kv head are summed in
//     registers in a fixed order. Per query tile:
//         dP^T = V dO^T,  S^T = K Q^T  ->  P, dS (score_grad)  ->  dV += P^T dO,  dK += dS^T Q
//     and, unless the caller asked for deterministic gradients, dQ += dS K for the tile, added with
//     float32 atomics into dq_accum (dS goes through shared memory for that product).
//   pass 1 (dQ, CUFLASH_BWD_PASS=1, deterministic mode): a CTA keeps kBlockR query rows (Q, dO) and
//     walks over the key tiles they see: S = Q K^T, dP = dO V^T -> dS -> dQ += dS K, written once.
//
// In both passes the rows the CTA keeps ("R", keys or queries) are the mma rows: warp w owns 16 of
// them, so P^T / dS^T (pass 0) and dS (pass 1) come out of the S and dP accumulators already in the
// A-operand layout of the next product, exactly as P does in the forward; only the atomic dQ
// product needs dS transposed, through shared memory. With kDSplit > 1 (large head dims) the warps
// that share 16 rows split the head-dim columns of the accumulators and compute S and dP redundantly.
//
// Only tiles on a window edge or the key tail pay for per-element masking (plain variants); rows
// past the end and rows that see no key are silenced by lse2 = +inf from bwd_preprocess.cu.
//
// v's head dim may differ from q's and k's (CUFLASH_HEAD_DIM_V): V, dO and dV have kHeadDimV columns
// (the a2/b2 tiles and the dV accumulator), Q, K, dQ and dK kHeadDim; dP = dO V^T runs over kHeadDimV.
//
// Compile-time configuration (cuflash/kernels/bwd_sm80.py): CUFLASH_DTYPE 0 fp16 / 1 bf16,
// CUFLASH_HEAD_DIM (multiple of 64), CUFLASH_HEAD_DIM_V (default CUFLASH_HEAD_DIM), CUFLASH_BLOCK_R, CUFLASH_BLOCK_C, CUFLASH_WARPS, CUFLASH_DSPLIT,
// CUFLASH_MIN_BLOCKS, CUFLASH_BWD_PASS, CUFLASH_SCORE_MODS (bit mask, mask.cuh), CUFLASH_DROPOUT.
#include "common.cuh"
#include "params.cuh"
#include "bwd_params.cuh"
#include "fault.cuh"
#include "mask.cuh"
#include "mma_sm80.cuh"
#include "philox.cuh"
#include "bwd_common.cuh"

#if CUFLASH_DTYPE == 2
#error "bwd_sm80 computes float16/bfloat16 (CUFLASH_DTYPE 0 or 1)"
#endif
#ifndef CUFLASH_HEAD_DIM_V
#define CUFLASH_HEAD_DIM_V CUFLASH_HEAD_DIM
#endif

namespace cuflash {

template <int kHeadDim_, int kHeadDimV_, int kBlockR_, int kBlockC_, int kSubC_, int kNWarps_, int kDSplit_,
          bool kPassDq_, int kMods_, bool kDropout_>
struct BwdSm80Config {
    static constexpr int kHeadDim = kHeadDim_, kBlockR = kBlockR_, kBlockC = kBlockC_, kSubC = kSubC_;
    static constexpr int kHeadDimV = kHeadDimV_;           // columns of V, dO, dV
    static constexpr int kNWarps = kNWarps_, kDSplit = kDSplit_;
    static constexpr int kMods = kMods_;   // score modifiers compiled in (mask.cuh)
    static constexpr bool kPassDq = kPassDq_, kScoreMods = kMods != 0, kDropout = kDropout_;
    static constexpr int kNThreads = 32 * kNWarps;
    static constexpr int kRowGroups = kNWarps / kDSplit;   // warps along the rows, 16 rows each
    static constexpr int kCTiles = kSubC / 8;              // 8-column mma tiles of S in one slice of the streamed tile
    static constexpr int kDCols = kHeadDim / kDSplit;      // head-dim columns of one warp's accumulators
    static constexpr int kDTiles = kDCols / 8;
    static constexpr int kDColsV = kHeadDimV / kDSplit;    // the same for dV
    static constexpr int kDTilesV = kDColsV / 8;
    // Pass 0's atomic product dQ (kBlockC x kHeadDim) = dS (kBlockC x kBlockR) K: the warps tile it
    // kDqWarpRows x kDqWarpCols, 16 query rows by kDqCols head-dim columns each.
    static constexpr int kDqWarpRows = kBlockC / 16;
    static constexpr int kDqWarpCols = kNWarps / kDqWarpRows;
    static constexpr int kDqCols = kHeadDim / kDqWarpCols;
    static constexpr int kDqTiles = kDqCols / 8;
    static constexpr int kDqSliceTiles = kDqTiles % 8 == 0 ? 8 : kDqTiles;   // tiles of dQ live at once
    // Shared memory: two R tiles, two stages of two C tiles, dS^T and two stages of lse2 / D (pass 0).
    static constexpr int kSmemElems =
        kBlockR * (kHeadDim + kHeadDimV) + 2 * kBlockC * (kHeadDim + kHeadDimV) + (kPassDq ? 0 : kBlockR * kBlockC);
    static constexpr int kSmemFloats = kPassDq ? 0 : 4 * kBlockC;
    static constexpr int kSmemBytes = 2 * kSmemElems + 4 * kSmemFloats;

    static_assert(kNWarps % kDSplit == 0 && kBlockR == 16 * kRowGroups, "each warp owns 16 rows");
    static_assert(kHeadDim % 64 == 0 && kDCols % 16 == 0 && kHeadDimV % 64 == 0 && kDColsV % 16 == 0,
                  "head-dim slices of whole 16-column steps");
    static_assert(kSubC % 16 == 0 && kBlockC % kSubC == 0, "streamed tiles in slices of whole 16-row steps");
    static_assert(kPassDq || (kBlockC % 64 == 0 && kNWarps % kDqWarpRows == 0 && kDqCols % 16 == 0),
                  "pass 0 stores dS^T with the 64-column swizzle and tiles the dQ product over all warps");
};

// ldmatrix addresses into a swizzled tile (mma_sm80.cuh's layout) for a lane that reads row `row`
// (+ multiples of 8) and 8-column half `half` of 16-column steps counted from a run-time step0 (a
// warp's slice of the head dim or of a tile). As with SwizzledLanes, only four XOR patterns exist,
// so any step is one of four registers plus an immediate.
template <int kCols>
struct SwizzledLanesFrom {
    unsigned base[4];   // bytes from the tile start to this lane's chunk of step step0 + v, v = 0..3

    __device__ __forceinline__ SwizzledLanesFrom(int row, int half, int step0) {
        static_assert(kCols % 64 == 0, "swizzle needs rows of a multiple of 8 chunks");
#pragma unroll
        for (int v = 0; v < 4; ++v) {
            const int a = step0 + v;
            base[v] = row * kCols * 2 + (a / 4) * 128 + (((2 * (a % 4) + half) ^ (row & 7)) * 16);
        }
    }
    // Shared-space address of step step0 + `step` (compile-time after unrolling), `rows_down` rows on.
    __device__ __forceinline__ unsigned at(unsigned tile, int step, int rows_down) const {
        return tile + base[step % 4] + (step / 4) * 128 + rows_down * kCols * 2;
    }
};

// acc (16 x kSubC per warp) += A B^T over a head dim of kDim columns: A = the warp's 16 rows of a kept
// tile, B = rows c0 .. c0 + kSubC - 1 of a streamed tile, both row-major in shared memory.
template <class C, int kDim>
__device__ __forceinline__ void gemm_abt(float (&acc)[C::kCTiles][4], const SwizzledLanesFrom<kDim>& a_lanes,
                                         unsigned a_tile, const SwizzledLanesFrom<kDim>& b_lanes,
                                         unsigned b_tile, int c0) {
#pragma unroll
    for (int kk = 0; kk < kDim / 16; ++kk) {
        unsigned a[4];
        ldmatrix_x4(a, a_lanes.at(a_tile, kk, 0));
#pragma unroll
        for (int nj = 0; nj < C::kCTiles / 2; ++nj) {
            unsigned bb[4];
            ldmatrix_x4(bb, b_lanes.at(b_tile, kk, c0 + nj * 16));
            mma_16816<elem_t>(acc[2 * nj], a, bb[0], bb[1]);
            mma_16816<elem_t>(acc[2 * nj + 1], a, bb[2], bb[3]);
        }
    }
}

template <int kN>
__device__ __forceinline__ void zero(float (&acc)[kN][4]) {
#pragma unroll
    for (int i = 0; i < kN; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][e] = 0.f;
}

template <class C>
__device__ __forceinline__ void bwd_sm80(const BwdParams& bp) {
    const FwdParams& p = bp.fwd;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    elem_t* a1_smem = reinterpret_cast<elem_t*>(smem_raw);       // [kBlockR][kHeadDim]: K (pass 0) / Q (pass 1)
    elem_t* a2_smem = a1_smem + C::kBlockR * C::kHeadDim;        // [kBlockR][kHeadDimV]: V / dO
    elem_t* b1_smem = a2_smem + C::kBlockR * C::kHeadDimV;       // [2][kBlockC][kHeadDim]: Q / K
    elem_t* b2_smem = b1_smem + 2 * C::kBlockC * C::kHeadDim;    // [2][kBlockC][kHeadDimV]: dO / V
    elem_t* ds_smem = b2_smem + 2 * C::kBlockC * C::kHeadDimV;   // [kBlockR][kBlockC]: dS^T (pass 0)
    float* lse2_smem = reinterpret_cast<float*>(ds_smem + (C::kPassDq ? 0 : C::kBlockR * C::kBlockC));  // [2][kBlockC]
    float* dsum_smem = lse2_smem + 2 * C::kBlockC;                                                      // [2][kBlockC]

    // Which rows, which heads. Pass 0: place.y = kv head * splits + split, the CTA sums the
    // query heads h0 .. h0 + heads - 1 of that kv head's group.
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
    // Pass 1 takes the longest causal rows first, pass 0 the keys that the most queries see.
    const int r_block = C::kPassDq ? gridDim.x - 1 - place.x : place.x;
    const int r_len = C::kPassDq ? s.seqlen_q : s.seqlen_k;
    const int c_len = C::kPassDq ? s.seqlen_k : s.seqlen_q;
    const int r_lo = r_block * C::kBlockR;
    if (r_lo >= r_len) return;   // a short sequence of a varlen batch
    const int r_hi = min(r_lo + C::kBlockR, r_len);
    int c_first, c_last;
    if constexpr (C::kPassDq) {
        visible_keys(p, s, r_lo, r_hi, &c_first, &c_last);
    } else {
        visible_queries(p, s, r_lo, r_hi, &c_first, &c_last);
    }
    const int c_begin = c_first / C::kBlockC, c_end = ceil_div(c_last, C::kBlockC);

    const elem_t* q_gmem = static_cast<const elem_t*>(p.q) + b * p.q_batch_stride + s.q_row0 * p.q_row_stride;
    const elem_t* do_gmem =
        static_cast<const elem_t*>(bp.dout) + b * bp.do_batch_stride + s.q_row0 * bp.do_row_stride;
    const elem_t* k_gmem = static_cast<const elem_t*>(p.k) + b * p.k_batch_stride + s.h_kv * p.k_head_stride +
                           s.k_row0 * p.k_row_stride;
    const elem_t* v_gmem = static_cast<const elem_t*>(p.v) + b * p.v_batch_stride + s.h_kv * p.v_head_stride +
                           s.k_row0 * p.v_row_stride;

    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g = lane / 4, t = lane % 4;                 // mma fragment coordinates
    const int row_group = warp % C::kRowGroups, dsplit = warp / C::kRowGroups;
    const int warp_row0 = row_group * 16;                  // this warp's first row inside the R tile

    // The streamed tiles of one step: pass 0 the queries of head h0 + hh (with their lse2 and D),
    // pass 1 the keys.
    auto load_stage = [&](int stage, int hh, int c) {
        const int c_lo = c * C::kBlockC;
        elem_t* b1 = b1_smem + stage * C::kBlockC * C::kHeadDim;
        elem_t* b2 = b2_smem + stage * C::kBlockC * C::kHeadDimV;
        if constexpr (C::kPassDq) {
            load_tile<C::kBlockC, C::kHeadDim, C::kNThreads>(b1, k_gmem, p.k_row_stride, c_lo, c_len, p.head_dim);
            load_tile<C::kBlockC, C::kHeadDimV, C::kNThreads>(b2, v_gmem, p.v_row_stride, c_lo, c_len, p.head_dim_v);
        } else {
            const int h = h0 + hh;
            load_tile<C::kBlockC, C::kHeadDim, C::kNThreads>(b1, q_gmem + h * p.q_head_stride, p.q_row_stride, c_lo,
                                                              c_len, p.head_dim);
            load_tile<C::kBlockC, C::kHeadDimV, C::kNThreads>(b2, do_gmem + h * bp.do_head_stride, bp.do_row_stride,
                                                               c_lo, c_len, p.head_dim_v);
            // lse2 and D are padded to a multiple of every block size: whole chunks, no bounds.
            const long long row = bwd_row_index(bp, b, h, c_lo);
            for (int x = threadIdx.x; x < C::kBlockC / 2; x += C::kNThreads) {
                const bool is_lse = x < C::kBlockC / 4;
                const int chunk = is_lse ? x : x - C::kBlockC / 4;
                cp_async_16((is_lse ? lse2_smem : dsum_smem) + stage * C::kBlockC + chunk * 4,
                            (is_lse ? bp.lse2 : bp.dsum) + row + chunk * 4, true);
            }
        }
    };

    if constexpr (C::kPassDq) {
        load_tile<C::kBlockR, C::kHeadDim, C::kNThreads>(a1_smem, q_gmem + h0 * p.q_head_stride, p.q_row_stride, r_lo,
                                                          r_len, p.head_dim);
        load_tile<C::kBlockR, C::kHeadDimV, C::kNThreads>(a2_smem, do_gmem + h0 * bp.do_head_stride,
                                                           bp.do_row_stride, r_lo, r_len, p.head_dim_v);
    } else {
        load_tile<C::kBlockR, C::kHeadDim, C::kNThreads>(a1_smem, k_gmem, p.k_row_stride, r_lo, r_len, p.head_dim);
        load_tile<C::kBlockR, C::kHeadDimV, C::kNThreads>(a2_smem, v_gmem, p.v_row_stride, r_lo, r_len, p.head_dim_v);
    }
    int hh = 0, c = c_begin - 1;
    bool have = next_tile<C::kBlockC, C::kMods, !C::kPassDq>(p, s, h0, heads, r_lo, r_hi, c_begin, c_end, hh, c);
    if (have) load_stage(0, hh, c);
    cp_async_commit();

    // Pass 1 rows are queries: their lse2 and D stay in registers (the padded buffers need no bounds).
    float row_lse2[2] = {0.f, 0.f}, row_dsum[2] = {0.f, 0.f};
    if constexpr (C::kPassDq) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const long long idx = bwd_row_index(bp, b, h0, r_lo + warp_row0 + g + 8 * half);
            row_lse2[half] = bp.lse2[idx];
            row_dsum[half] = bp.dsum[idx];
        }
    }

    // acc_1: dK (pass 0) or dQ (pass 1), acc_2: dV (pass 0); rows of this warp x its head-dim slice.
    float acc_1[C::kDTiles][4];
    float acc_2[C::kPassDq ? 1 : C::kDTilesV][4];
    zero(acc_1);
    zero(acc_2);

    // ldmatrix lanes: kept rows as A; streamed rows as B (S, dP) and, transposed, as B of dV/dK/dQ.
    const SwizzledLanesFrom<C::kHeadDim> a_lanes(warp_row0 + lane % 16, lane / 16, 0);
    const SwizzledLanesFrom<C::kHeadDim> b_lanes(lane % 8 + (lane / 16) * 8, (lane / 8) % 2, 0);
    const SwizzledLanesFrom<C::kHeadDim> bt_lanes(lane % 8 + ((lane / 8) % 2) * 8, lane / 16,
                                                  dsplit * C::kDCols / 16);
    // The same over the kHeadDimV-wide tiles (V, dO); equal to the above when the head dims are.
    const SwizzledLanesFrom<C::kHeadDimV> a_lanes_v(warp_row0 + lane % 16, lane / 16, 0);
    const SwizzledLanesFrom<C::kHeadDimV> b_lanes_v(lane % 8 + (lane / 16) * 8, (lane / 8) % 2, 0);
    const SwizzledLanesFrom<C::kHeadDimV> bt_lanes_v(lane % 8 + ((lane / 8) % 2) * 8, lane / 16,
                                                     dsplit * C::kDColsV / 16);
    const unsigned a1_tile = smem_addr(a1_smem), a2_tile = smem_addr(a2_smem);

    int stage = 0;
    while (have) {
        int hh_next = hh, c_next = c;
        const bool have_next = next_tile<C::kBlockC, C::kMods, !C::kPassDq>(p, s, h0, heads, r_lo, r_hi,
                                                                                c_begin, c_end, hh_next, c_next);
        cp_async_wait<0>();
        __syncthreads();   // this stage has landed, and every warp is done with the other one
        if (have_next) load_stage(stage ^ 1, hh_next, c_next);
        cp_async_commit();
        s.h = h0 + hh;
        const unsigned b1_tile = smem_addr(b1_smem + stage * C::kBlockC * C::kHeadDim);
        const unsigned b2_tile = smem_addr(b2_smem + stage * C::kBlockC * C::kHeadDimV);
        const int c_lo = c * C::kBlockC;

        bool check_window = false;
        if constexpr (!C::kScoreMods) {
            check_window = C::kPassDq ? !tile_inside_window(p, s, r_lo, r_hi, c_lo, c_lo + C::kBlockC)
                                      : !tile_inside_window(p, s, c_lo, min(c_lo + C::kBlockC, s.seqlen_q), r_lo,
                                                            r_lo + C::kBlockR);
        }
        // The streamed tile in slices of kSubC columns (registers: S and dP of one slice are live),
        // unrolled; with score modifiers one slice at a time (a loop of one unrolled slice):
        // unrolled, ptxas interleaved the slices' modifier loads and spilled, and compiled the
        // per-element code once per slice. (Two loops rather than #pragma unroll(N): that changed
        // the code of the variants without modifiers.)
        constexpr int kSlices = C::kBlockC / C::kSubC, kUnrolled = C::kScoreMods ? 1 : kSlices;
#pragma unroll 1
        for (int sub0 = 0; sub0 < kSlices; sub0 += kUnrolled)
#pragma unroll
        for (int u = 0; u < kUnrolled; ++u) {
            const int sub = sub0 + u;
            const int c0 = sub * C::kSubC;   // first column of the slice inside the tile
            // dP = dO V^T (pass 1) / dP^T = V dO^T (pass 0), then S likewise.
            float acc_dp[C::kCTiles][4];
            zero(acc_dp);
            gemm_abt<C, C::kHeadDimV>(acc_dp, a_lanes_v, a2_tile, b_lanes_v, b2_tile, c0);
            float acc_s[C::kCTiles][4];
            zero(acc_s);
            gemm_abt<C, C::kHeadDim>(acc_s, a_lanes, a1_tile, b_lanes, b1_tile, c0);

            // With score modifiers, the scores in log2 units (modify_scores; acc_s keeps the raw q.k
            // for the softcap's derivative, or takes the chain factor of a user ScoreMod). This thread's elements: kept rows warp_row0 + g (+ 8) x
            // streamed columns c0 + 8 ni + 2 t (+ 1); the queries are the kept rows in pass 1, the
            // streamed ones in pass 0.
            float score2[C::kCTiles][4];
            if constexpr (C::kScoreMods) {
                int kept[2], streamed[2 * C::kCTiles];
#pragma unroll
                for (int h = 0; h < 2; ++h) kept[h] = r_lo + warp_row0 + g + 8 * h;
#pragma unroll
                for (int x = 0; x < 2 * C::kCTiles; ++x) streamed[x] = c_lo + c0 + (x / 2) * 8 + 2 * t + x % 2;
#pragma unroll
                for (int ni = 0; ni < C::kCTiles; ++ni)
#pragma unroll
                    for (int e = 0; e < 4; ++e) score2[ni][e] = acc_s[ni][e];
                if constexpr (C::kPassDq) {
                    modify_scores<C::kMods>(p, s, kept, streamed,
                                            [&](int r, int x) -> float& { return score2[x / 2][2 * r + x % 2]; },
                                            [&](int r, int x) -> float& { return acc_s[x / 2][2 * r + x % 2]; });
                } else {
                    modify_scores<C::kMods>(p, s, streamed, kept,
                                            [&](int x, int r) -> float& { return score2[x / 2][2 * r + x % 2]; },
                                            [&](int x, int r) -> float& { return acc_s[x / 2][2 * r + x % 2]; });
                }
            }
            // Only tiles on a window edge or the key tail pay for per-element masking.
            if (check_window) {
#pragma unroll
                for (int ni = 0; ni < C::kCTiles; ++ni)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int rr = warp_row0 + g + (e / 2) * 8, cc = c0 + ni * 8 + 2 * t + (e % 2);
                        const int i = C::kPassDq ? r_lo + rr : c_lo + cc;
                        const int j = C::kPassDq ? c_lo + cc : r_lo + rr;
                        if (!in_window(p, s, i, j)) acc_s[ni][e] = -CUFLASH_INF;
                    }
            }
            // P and dS element by element: acc_s becomes Pdrop, acc_dp becomes dL/dx.
#pragma unroll
            for (int ni = 0; ni < C::kCTiles; ++ni) {
                float2 col_lse2 = make_float2(0.f, 0.f), col_dsum = make_float2(0.f, 0.f);
                if constexpr (!C::kPassDq) {
                    const int offset = stage * C::kBlockC + c0 + ni * 8 + 2 * t;
                    col_lse2 = *reinterpret_cast<const float2*>(lse2_smem + offset);
                    col_dsum = *reinterpret_cast<const float2*>(dsum_smem + offset);
                }
                unsigned words[4] = {0u, 0u, 0u, 0u};
                if constexpr (C::kDropout) {
                    if constexpr (C::kPassDq) {
                        dropout_words_rows(p, s, r_lo + warp_row0 + g, c_lo + c0 + ni * 8 + 2 * t, words);
                    } else {
                        dropout_words_cols(p, s, c_lo + c0 + ni * 8 + 2 * t, r_lo + warp_row0 + g, lane, words);
                    }
                }
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int rr = warp_row0 + g + (e / 2) * 8, cc = c0 + ni * 8 + 2 * t + (e % 2);
                    const int i = C::kPassDq ? r_lo + rr : c_lo + cc;
                    const int j = C::kPassDq ? c_lo + cc : r_lo + rr;
                    const float lse2 = C::kPassDq ? row_lse2[e / 2] : (e % 2 ? col_lse2.y : col_lse2.x);
                    const float dsum = C::kPassDq ? row_dsum[e / 2] : (e % 2 ? col_dsum.y : col_dsum.x);
                    float pd, ds, dx;
                    score_grad<C::kMods, C::kDropout>(p, acc_s[ni][e], C::kScoreMods ? score2[ni][e] : 0.f,
                                                      acc_dp[ni][e], lse2, dsum, words[e], &pd, &ds, &dx);
                    if constexpr ((C::kMods & kModBias) && !C::kPassDq) {
                        if (dsplit == 0) store_dbias(bp, s, i, j, ds);
                    }
                    acc_s[ni][e] = pd;
                    acc_dp[ni][e] = dx;
                }
            }

            // dV += P^T dO and dK += dS^T Q (pass 0) / dQ += dS K (pass 1), the A operands straight
            // from the accumulators (their layout is the A layout).
#pragma unroll
            for (int kk = 0; kk < C::kSubC / 16; ++kk) {
                unsigned ds_frag[4];
                ds_frag[0] = pack2<elem_t>(acc_dp[2 * kk][0], acc_dp[2 * kk][1]);
                ds_frag[1] = pack2<elem_t>(acc_dp[2 * kk][2], acc_dp[2 * kk][3]);
                ds_frag[2] = pack2<elem_t>(acc_dp[2 * kk + 1][0], acc_dp[2 * kk + 1][1]);
                ds_frag[3] = pack2<elem_t>(acc_dp[2 * kk + 1][2], acc_dp[2 * kk + 1][3]);
                if constexpr (!C::kPassDq) {
                    unsigned p_frag[4];
                    p_frag[0] = pack2<elem_t>(acc_s[2 * kk][0], acc_s[2 * kk][1]);
                    p_frag[1] = pack2<elem_t>(acc_s[2 * kk][2], acc_s[2 * kk][3]);
                    p_frag[2] = pack2<elem_t>(acc_s[2 * kk + 1][0], acc_s[2 * kk + 1][1]);
                    p_frag[3] = pack2<elem_t>(acc_s[2 * kk + 1][2], acc_s[2 * kk + 1][3]);
#pragma unroll
                    for (int dj = 0; dj < C::kDTilesV / 2; ++dj) {
                        unsigned bb[4];
                        ldmatrix_x4_trans(bb, bt_lanes_v.at(b2_tile, dj, c0 + kk * 16));
                        mma_16816<elem_t>(acc_2[2 * dj], p_frag, bb[0], bb[1]);
                        mma_16816<elem_t>(acc_2[2 * dj + 1], p_frag, bb[2], bb[3]);
                    }
                }
#pragma unroll
                for (int dj = 0; dj < C::kDTiles / 2; ++dj) {
                    unsigned bb[4];
                    ldmatrix_x4_trans(bb, bt_lanes.at(b1_tile, dj, c0 + kk * 16));
                    mma_16816<elem_t>(acc_1[2 * dj], ds_frag, bb[0], bb[1]);
                    mma_16816<elem_t>(acc_1[2 * dj + 1], ds_frag, bb[2], bb[3]);
                }
            }

            // Pass 0 with atomic dQ: dS^T of the slice to shared memory (one copy: the warps of dsplit 0).
            if constexpr (!C::kPassDq) {
                if (bp.dq_accum != nullptr && dsplit == 0) {
#pragma unroll
                    for (int ni = 0; ni < C::kCTiles; ++ni)
#pragma unroll
                        for (int half = 0; half < 2; ++half)
                            *reinterpret_cast<unsigned*>(
                                ds_smem + swizzled<C::kBlockC>(warp_row0 + g + 8 * half, c0 + ni * 8 + 2 * t)) =
                                pack2<elem_t>(acc_dp[ni][2 * half], acc_dp[ni][2 * half + 1]);
                }
            }
        }

        if constexpr (!C::kPassDq) {
            if (bp.dq_accum != nullptr) {
                // dQ = dS K over all warps, added to dq_accum. The next step's first barrier keeps
                // ds_smem until all warps are done reading it.
                __syncthreads();
                const int wr = warp % C::kDqWarpRows, wc = warp / C::kDqWarpRows;
                // dS rows (queries) as A, read transposed from dS^T; K as B, read transposed.
                const SwizzledLanesFrom<C::kBlockC> ds_lanes(lane % 8 + (lane / 16) * 8, (lane / 8) % 2, wr);
                const SwizzledLanesFrom<C::kHeadDim> kt_lanes(lane % 8 + ((lane / 8) % 2) * 8, lane / 16,
                                                              wc * C::kDqCols / 16);
                const unsigned ds_tile = smem_addr(ds_smem);
                float* dqa = bp.dq_accum + b * bp.dqa_batch_stride + s.h * bp.dqa_head_stride +
                             s.q_row0 * bp.dqa_row_stride;
                // In slices of kDqSliceTiles 8-column tiles: the dK/dV accumulators are live here.
#pragma unroll 1
                for (int slice = 0; slice < C::kDqTiles / C::kDqSliceTiles; ++slice) {
                    float acc_dq[C::kDqSliceTiles][4];
                    zero(acc_dq);
#pragma unroll
                    for (int kk = 0; kk < C::kBlockR / 16; ++kk) {
                        unsigned a[4];
                        ldmatrix_x4_trans(a, ds_lanes.at(ds_tile, 0, kk * 16));
#pragma unroll
                        for (int dj = 0; dj < C::kDqSliceTiles / 2; ++dj) {
                            unsigned bb[4];
                            ldmatrix_x4_trans(bb, kt_lanes.at(a1_tile, dj, kk * 16) + slice * C::kDqSliceTiles * 16);
                            mma_16816<elem_t>(acc_dq[2 * dj], a, bb[0], bb[1]);
                            mma_16816<elem_t>(acc_dq[2 * dj + 1], a, bb[2], bb[3]);
                        }
                    }
#pragma unroll
                    for (int half = 0; half < 2; ++half) {
                        const int i = c_lo + wr * 16 + g + 8 * half;
                        if (i >= s.seqlen_q) continue;
                        float* row = dqa + i * bp.dqa_row_stride;
#pragma unroll
                        for (int dj = 0; dj < C::kDqSliceTiles; ++dj) {
                            const int col = wc * C::kDqCols + (slice * C::kDqSliceTiles + dj) * 8 + 2 * t;
                            if (col < p.head_dim)
                                atomic_add2(row + col, acc_dq[dj][2 * half], acc_dq[dj][2 * half + 1]);
                        }
                    }
                }
            }
        }
        hh = hh_next;
        c = c_next;
        have = have_next;
        stage ^= 1;
    }
    cp_async_wait<0>();   // with no visible tile, the kept tiles' copies are still outstanding

    // Outputs: pass 0 dK (scaled) and dV of the kv head (or float32 partials of this head chunk),
    // pass 1 dQ (scaled) of the query head. Columns past head_dim are never written.
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int r = r_lo + warp_row0 + g + 8 * half;
        if (r >= r_len) continue;
        const DkDvRow<elem_t> dkdv(bp, s, h0 / bp.heads_per_cta, C::kPassDq ? 0 : r);
        if constexpr (!C::kPassDq && C::kHeadDimV == C::kHeadDim) {
#pragma unroll
            for (int dj = 0; dj < C::kDTiles; ++dj) {
                const int col = dsplit * C::kDCols + dj * 8 + 2 * t;
                if (col >= p.head_dim) continue;
                dkdv.store(col, acc_1[dj][2 * half] * p.scale, acc_1[dj][2 * half + 1] * p.scale, acc_2[dj][2 * half],
                           acc_2[dj][2 * half + 1]);
            }
        } else {
#pragma unroll
            for (int dj = 0; dj < C::kDTiles; ++dj) {
                const int col = dsplit * C::kDCols + dj * 8 + 2 * t;
                if (col >= p.head_dim) continue;
                if constexpr (C::kPassDq) {
                    elem_t* dq = static_cast<elem_t*>(bp.dq) + b * bp.dq_batch_stride + s.h * bp.dq_head_stride +
                                 (s.q_row0 + r) * bp.dq_row_stride + col;
                    *reinterpret_cast<unsigned*>(dq) =
                        pack2<elem_t>(acc_1[dj][2 * half] * p.scale, acc_1[dj][2 * half + 1] * p.scale);
                } else {
                    dkdv.store_dk(col, acc_1[dj][2 * half] * p.scale, acc_1[dj][2 * half + 1] * p.scale);
                }
            }
            if constexpr (!C::kPassDq) {
#pragma unroll
                for (int dj = 0; dj < C::kDTilesV; ++dj) {
                    const int col = dsplit * C::kDColsV + dj * 8 + 2 * t;
                    if (col < p.head_dim_v) dkdv.store_dv(col, acc_2[dj][2 * half], acc_2[dj][2 * half + 1]);
                }
            }
        }
    }
}

}  // namespace cuflash

using Config = cuflash::BwdSm80Config<CUFLASH_HEAD_DIM, CUFLASH_HEAD_DIM_V, CUFLASH_BLOCK_R, CUFLASH_BLOCK_C, CUFLASH_SUB_C, CUFLASH_WARPS,
                                      CUFLASH_DSPLIT,
                                      CUFLASH_BWD_PASS == 1, CUFLASH_SCORE_MODS, CUFLASH_DROPOUT != 0>;
#ifdef CUFLASH_SMEM_BYTES
static_assert(CUFLASH_SMEM_BYTES == Config::kSmemBytes, "shared memory size differs from cuflash/_heuristics.py");
#endif

extern "C" __global__ void __launch_bounds__(Config::kNThreads, CUFLASH_MIN_BLOCKS)
    cuflash_bwd_sm80(const cuflash::BwdParams p) {
    if (cuflash::call_faulted(p.fwd.error)) return;
    cuflash::bwd_sm80<Config>(p);
}

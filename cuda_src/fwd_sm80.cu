// Forward attention on tensor cores with mma.sync m16n8k16 (sm_80 and newer), fp16/bf16.
//
// One CTA computes kBlockM query rows of one (sequence, head). Its warps each own 16 * kMTiles rows;
// Q stays in shared memory, K and V tiles of kBlockN keys stream through a two-stage cp.async buffer.
// Per key tile:  S = Q K^T  ->  score pipeline / masks  ->  online softmax (base 2)  ->  O += P V.
// Key tiles are visited from the last to the first, so a causal problem meets its one partly masked
// diagonal tile first; tiles that the window or block_mask hide entirely are never loaded.
//
// Compile-time configuration (set by cuflash/_heuristics.py, one module per combination):
//   CUFLASH_DTYPE 0 fp16 / 1 bf16, CUFLASH_HEAD_DIM (multiple of 64), CUFLASH_HEAD_DIM_V (v's and out's,
//   multiple of 64; default CUFLASH_HEAD_DIM), CUFLASH_BLOCK_M, CUFLASH_BLOCK_N,
//   CUFLASH_WARPS, CUFLASH_MIN_BLOCKS (CTAs per SM the register budget aims at),
//   CUFLASH_SCORE_MODS (bit mask of softcap / alibi / bias / mask / block_mask: mask.cuh), CUFLASH_DROPOUT.
#include "common.cuh"
#include "params.cuh"
#include "fault.cuh"
#include "mask.cuh"
#include "online_softmax.cuh"
#include "mma_sm80.cuh"
#include "philox.cuh"
#include "fragments.cuh"

#ifndef CUFLASH_HEAD_DIM_V
#define CUFLASH_HEAD_DIM_V CUFLASH_HEAD_DIM
#endif

namespace cuflash {

template <int kHeadDim_, int kHeadDimV_, int kBlockM_, int kBlockN_, int kNWarps_, int kMods_, bool kDropout_>
struct FwdSm80Config {
    static constexpr int kHeadDim = kHeadDim_, kBlockM = kBlockM_, kBlockN = kBlockN_, kNWarps = kNWarps_;
    static constexpr int kHeadDimV = kHeadDimV_;   // columns of V and O
    static constexpr int kMods = kMods_;   // score modifiers compiled in (mask.cuh)
    static constexpr bool kScoreMods = kMods != 0, kDropout = kDropout_;
    static constexpr int kNThreads = 32 * kNWarps;
    static constexpr int kMTiles = kBlockM / (16 * kNWarps);   // 16-row mma tiles per warp
    static constexpr int kNTiles = kBlockN / 8;                 // 8-key mma tiles of S
    static constexpr int kDTiles = kHeadDimV / 8;               // 8-column mma tiles of O
    // Q + 2 stages of K and of V
    static constexpr int kSmemElems = (kBlockM + 2 * kBlockN) * kHeadDim + 2 * kBlockN * kHeadDimV;
    static_assert(kBlockM % (16 * kNWarps) == 0, "each warp owns whole 16-row tiles");
    static_assert(kBlockN % 16 == 0 && kHeadDim % 64 == 0 && kHeadDimV % 64 == 0, "tile shape");
};

// The last key tile at or before n that block_mask leaves visible (n_first - 1 if none).
template <class C>
__device__ __forceinline__ int previous_visible_tile(const FwdParams& p, const SeqInfo& s, int n, int n_first,
                                                     int m_lo, int m_hi) {
    if constexpr ((C::kMods & kModBlockMask) != 0) {
        while (n >= n_first && !block_mask_tile_visible(p, s, m_lo, m_hi, n * C::kBlockN,
                                                        min((n + 1) * C::kBlockN, s.seqlen_k)))
            --n;
    }
    return n;
}

template <class C>
__device__ __forceinline__ void fwd_sm80(const FwdParams& p) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    elem_t* q_smem = reinterpret_cast<elem_t*>(smem_raw);
    elem_t* k_smem = q_smem + C::kBlockM * C::kHeadDim;          // [2][kBlockN][kHeadDim]
    elem_t* v_smem = k_smem + 2 * C::kBlockN * C::kHeadDim;      // [2][kBlockN][kHeadDimV]

    const int m_block = gridDim.x - 1 - blockIdx.x;   // longest causal rows first
    const SeqInfo s = make_seq_info(p, blockIdx.z, blockIdx.y);
    const int m_lo = m_block * C::kBlockM;
    if (m_lo >= s.seqlen_q) return;                   // a short sequence of a varlen batch
    const int m_hi = min(m_lo + C::kBlockM, s.seqlen_q);

    int key_first, key_last;
    visible_keys(p, s, m_lo, m_hi, &key_first, &key_last);
    const int n_first = key_first / C::kBlockN;
    const int n_end = ceil_div(key_last, C::kBlockN);

    const elem_t* q_gmem = static_cast<const elem_t*>(p.q) + s.b * p.q_batch_stride + s.h * p.q_head_stride +
                           s.q_row0 * p.q_row_stride;
    const elem_t* k_gmem = static_cast<const elem_t*>(p.k) + s.b * p.k_batch_stride +
                           s.h_kv * p.k_head_stride + s.k_row0 * p.k_row_stride;
    const elem_t* v_gmem = static_cast<const elem_t*>(p.v) + s.b * p.v_batch_stride +
                           s.h_kv * p.v_head_stride + s.k_row0 * p.v_row_stride;

    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g = lane / 4, t = lane % 4;               // mma fragment coordinates
    const int warp_row0 = warp * C::kMTiles * 16;        // this warp's first row inside the tile

    load_tile<C::kBlockM, C::kHeadDim, C::kNThreads>(q_smem, q_gmem, p.q_row_stride, m_lo, s.seqlen_q, p.head_dim);
    int n = previous_visible_tile<C>(p, s, n_end - 1, n_first, m_lo, m_hi);
    if (n >= n_first) {
        load_tile<C::kBlockN, C::kHeadDim, C::kNThreads>(k_smem, k_gmem, p.k_row_stride, n * C::kBlockN,
                                                          s.seqlen_k, p.head_dim);
        load_tile<C::kBlockN, C::kHeadDimV, C::kNThreads>(v_smem, v_gmem, p.v_row_stride, n * C::kBlockN,
                                                           s.seqlen_k, p.head_dim_v);
    }
    cp_async_commit();

    float acc_o[C::kMTiles][C::kDTiles][4];
#pragma unroll
    for (int mi = 0; mi < C::kMTiles; ++mi)
#pragma unroll
        for (int di = 0; di < C::kDTiles; ++di)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_o[mi][di][e] = 0.f;
    OnlineSoftmax<C::kMTiles> softmax;
    softmax.init();

    // ldmatrix lanes: Q and K read rows (A / non-transposed B), V reads keys (transposed B).
    const SwizzledLanes<C::kHeadDim> q_lanes(warp_row0 + lane % 16, lane / 16);
    const SwizzledLanes<C::kHeadDim> k_lanes(lane % 8 + (lane / 16) * 8, (lane / 8) % 2);
    const SwizzledLanes<C::kHeadDimV> v_lanes(lane % 8 + ((lane / 8) % 2) * 8, lane / 16);
    const unsigned q_tile = smem_addr(q_smem);

    int stage = 0;
    while (n >= n_first) {
        // Prefetch the next visible tile into the other stage while this one is computed.
        const int n_next = previous_visible_tile<C>(p, s, n - 1, n_first, m_lo, m_hi);
        cp_async_wait<0>();
        __syncthreads();   // tile n has landed, and every warp is done with the other stage
        if (n_next >= n_first) {
            const int other = (stage ^ 1) * C::kBlockN;
            load_tile<C::kBlockN, C::kHeadDim, C::kNThreads>(k_smem + other * C::kHeadDim, k_gmem, p.k_row_stride,
                                                              n_next * C::kBlockN, s.seqlen_k, p.head_dim);
            load_tile<C::kBlockN, C::kHeadDimV, C::kNThreads>(v_smem + other * C::kHeadDimV, v_gmem,
                                                               p.v_row_stride, n_next * C::kBlockN, s.seqlen_k,
                                                               p.head_dim_v);
        }
        cp_async_commit();
        const unsigned k_tile = smem_addr(k_smem + stage * C::kBlockN * C::kHeadDim);
        const unsigned v_tile = smem_addr(v_smem + stage * C::kBlockN * C::kHeadDimV);

        // S = Q K^T
        float acc_s[C::kMTiles][C::kNTiles][4];
#pragma unroll
        for (int mi = 0; mi < C::kMTiles; ++mi)
#pragma unroll
            for (int ni = 0; ni < C::kNTiles; ++ni)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc_s[mi][ni][e] = 0.f;
#pragma unroll
        for (int kk = 0; kk < C::kHeadDim / 16; ++kk) {
            unsigned q_frag[C::kMTiles][4];
#pragma unroll
            for (int mi = 0; mi < C::kMTiles; ++mi)
                ldmatrix_x4(q_frag[mi], q_lanes.at(q_tile, kk, mi * 16));
#pragma unroll
            for (int nj = 0; nj < C::kNTiles / 2; ++nj) {
                unsigned k_frag[4];
                ldmatrix_x4(k_frag, k_lanes.at(k_tile, kk, nj * 16));
#pragma unroll
                for (int mi = 0; mi < C::kMTiles; ++mi) {
                    mma_16816<elem_t>(acc_s[mi][2 * nj], q_frag[mi], k_frag[0], k_frag[1]);
                    mma_16816<elem_t>(acc_s[mi][2 * nj + 1], q_frag[mi], k_frag[2], k_frag[3]);
                }
            }
        }

        // Scores, -inf where hidden (raw q.k unless score modifiers are on: see fragments.cuh).
        const int n_lo = n * C::kBlockN;
        mask_scores<C::kMods>(acc_s, p, s, m_lo, m_hi, n_lo, m_lo + warp_row0, g, t);

        float correction[2 * C::kMTiles];
        softmax.update(acc_s, correction, C::kScoreMods ? 1.f : p.scale_log2);
        rescale_rows(acc_o, correction);
        if (C::kDropout) drop_probabilities(acc_s, p, s, m_lo + warp_row0, n_lo, g, t);

        // O += P V, with P taken straight from the S accumulators (their layout is the A layout).
#pragma unroll
        for (int kk = 0; kk < C::kBlockN / 16; ++kk) {
            unsigned p_frag[C::kMTiles][4];
#pragma unroll
            for (int mi = 0; mi < C::kMTiles; ++mi) pack_p<elem_t>(p_frag[mi], acc_s[mi], kk);
#pragma unroll
            for (int dj = 0; dj < C::kDTiles / 2; ++dj) {
                unsigned v_frag[4];
                ldmatrix_x4_trans(v_frag, v_lanes.at(v_tile, dj, kk * 16));
#pragma unroll
                for (int mi = 0; mi < C::kMTiles; ++mi) {
                    mma_16816<elem_t>(acc_o[mi][2 * dj], p_frag[mi], v_frag[0], v_frag[1]);
                    mma_16816<elem_t>(acc_o[mi][2 * dj + 1], p_frag[mi], v_frag[2], v_frag[3]);
                }
            }
        }
        n = n_next;
        stage ^= 1;
    }

    // out = O / l (times 1/(1-p) under dropout), l with the head's sink; lse per row.
    float inv_l[2 * C::kMTiles], lse[2 * C::kMTiles];
    softmax.finish(inv_l, lse, C::kScoreMods ? 1.f : p.scale_log2, p.sinks != nullptr ? p.sinks[s.h] : -CUFLASH_INF);
    store_output<C::kDropout>(acc_o, inv_l, lse, p, s, m_lo + warp_row0, g, t);
}

}  // namespace cuflash

using Config = cuflash::FwdSm80Config<CUFLASH_HEAD_DIM, CUFLASH_HEAD_DIM_V, CUFLASH_BLOCK_M, CUFLASH_BLOCK_N, CUFLASH_WARPS,
                                      CUFLASH_SCORE_MODS, CUFLASH_DROPOUT != 0>;
#ifdef CUFLASH_SMEM_BYTES
static_assert(CUFLASH_SMEM_BYTES == Config::kSmemElems * sizeof(cuflash::elem_t),
              "shared memory size differs from cuflash/_heuristics.py");
#endif

extern "C" __global__ void __launch_bounds__(Config::kNThreads, CUFLASH_MIN_BLOCKS)
    cuflash_fwd_sm80(const cuflash::FwdParams p) {
    if (cuflash::call_faulted(p.error)) return;
    cuflash::fwd_sm80<Config>(p);
}

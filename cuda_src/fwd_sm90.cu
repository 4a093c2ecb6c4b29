// Forward attention for Hopper (sm_90a), fp16/bf16: TMA loads on mbarriers, wgmma, warp specialisation.
//
// A CTA of three warpgroups computes kBlockM = 128 query rows of one (batch, head):
//   warpgroup 0, the producer: one thread issues TMA copies of Q once and of K/V tiles into a
//     kStages-deep ring of 128B-swizzled shared buffers (full barriers count the bytes in, empty
//     barriers count the consumers out); the warpgroup gives its registers to the consumers.
//   warpgroups 1 and 2, the consumers: 64 rows each.  S = Q K^T (wgmma, both operands in shared
//     memory) -> scores/masks (fragments.cuh) -> online softmax (base 2) -> O += P V (wgmma with P
//     from registers, V transposed by its descriptor).
// Key tiles run from the last to the first, like fwd_sm80, so a causal problem meets its partly
// masked diagonal tile first; tiles that the window hides entirely are never loaded. Rows and keys
// past the sequence end come in as zeros (TMA fills out-of-range coordinates with zeros).
//
// Compile-time configuration: CUFLASH_DTYPE 0/1, CUFLASH_HEAD_DIM 64/128, CUFLASH_BLOCK_N 64/128,
// CUFLASH_SCORE_MODS, CUFLASH_DROPOUT, CUFLASH_SMEM_BYTES, CUFLASH_PARAMS_SIZE.
#include "common.cuh"
#include "params.cuh"
#include "mask.cuh"
#include "online_softmax.cuh"
#include "philox.cuh"
#include "fragments.cuh"
#include "tma_sm90.cuh"
#include "wgmma_sm90.cuh"

namespace cuflash {

template <int kHeadDim_, int kBlockN_, bool kScoreMods_, bool kDropout_>
struct FwdSm90Config {
    static constexpr int kHeadDim = kHeadDim_, kBlockN = kBlockN_;
    static constexpr bool kScoreMods = kScoreMods_, kDropout = kDropout_;
    static constexpr int kBlockM = 128, kConsumers = 2, kStages = 2;
    static constexpr int kNThreads = 128 * (kConsumers + 1);
    static constexpr int kNTiles = kBlockN / 8, kDTiles = kHeadDim / 8;
    // Tiles are stored as column blocks of 64 elements (128 bytes: one swizzle row) x all rows.
    static constexpr int kColBlocks = kHeadDim / 64;
    static constexpr int kQBytes = kBlockM * kHeadDim * 2, kKVBytes = kBlockN * kHeadDim * 2;
    static constexpr int kSmemBytes = 1024 /* alignment slack */ + kQBytes + 2 * kStages * kKVBytes;
    static_assert(kHeadDim == 64 || kHeadDim == 128, "wgmma tiles for head dims 64 and 128");
    static_assert(kBlockN == 64 || kBlockN == 128, "wgmma n for S");
};

// Dispatch to the wgmma of the right N (the accumulator is a flat view of [1][N/8][4]).
template <int N>
__device__ __forceinline__ void gemm_qk(float (&acc)[1][N / 8][4], unsigned long long a, unsigned long long b,
                                        int scale_d) {
    float(&d)[N / 2] = *reinterpret_cast<float(*)[N / 2]>(&acc[0][0][0]);
    if constexpr (N == 64) wgmma_ss_n64(d, a, b, scale_d, elem_t{});
    else wgmma_ss_n128(d, a, b, scale_d, elem_t{});
}
template <int N>
__device__ __forceinline__ void gemm_pv(float (&acc)[1][N / 8][4], const unsigned (&a)[4], unsigned long long b) {
    float(&d)[N / 2] = *reinterpret_cast<float(*)[N / 2]>(&acc[0][0][0]);
    if constexpr (N == 64) wgmma_rs_n64(d, a, b, elem_t{});
    else wgmma_rs_n128(d, a, b, elem_t{});
}

template <class C>
__device__ __forceinline__ void fwd_sm90(const TmaMap& q_map, const TmaMap& k_map, const TmaMap& v_map,
                                         const FwdParams& p) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    __shared__ __align__(8) unsigned long long barriers[2 + 4 * C::kStages];
    const unsigned smem = (smem_addr(smem_raw) + 1023) & ~1023u;   // swizzle atoms are 1024 bytes
    const unsigned q_smem = smem;
    const unsigned k_smem = q_smem + C::kQBytes;                      // [kStages][kColBlocks][kBlockN][64]
    const unsigned v_smem = k_smem + C::kStages * C::kKVBytes;
    const unsigned q_full = smem_addr(&barriers[0]), q_empty = smem_addr(&barriers[1 + 4 * C::kStages]);
    auto k_full = [&](int stage) { return smem_addr(&barriers[1 + stage]); };
    auto v_full = [&](int stage) { return smem_addr(&barriers[1 + C::kStages + stage]); };
    // K and V of a stage are released separately: K as soon as S retires, V once P V has.
    auto k_empty = [&](int stage) { return smem_addr(&barriers[1 + 2 * C::kStages + stage]); };
    auto v_empty = [&](int stage) { return smem_addr(&barriers[1 + 3 * C::kStages + stage]); };

    const int warpgroup = threadIdx.x / 128;
    if (threadIdx.x == 0) {
        mbar_init(q_full, 1);
        mbar_init(q_empty, 128 * C::kConsumers);
        for (int stage = 0; stage < C::kStages; ++stage) {
            mbar_init(k_full(stage), 1);
            mbar_init(v_full(stage), 1);
            mbar_init(k_empty(stage), 128 * C::kConsumers);
            mbar_init(v_empty(stage), 128 * C::kConsumers);
        }
        fence_barrier_init();
    }
    __syncthreads();

    // Persistent: the grid is at most one CTA per SM and each walks the work list (m-block, head,
    // batch) with a stride of the grid. The m-blocks of one head are neighbours in the list (longest
    // causal rows first), so CTAs running at the same time share that head's K/V in L2. The
    // producer runs ahead into the next item (its Q as soon as the consumers are done with Q, its
    // K/V as slots free up), so the start and the epilogue of one item overlap other work.
    const int num_m_blocks = ceil_div(p.seqlen_q, C::kBlockM);
    const int items = num_m_blocks * p.heads_q * p.batch;
    auto work = [&](int item, SeqInfo* s, int* m_lo, int* m_hi, int* n_first, int* n_end) {
        const int m_block = num_m_blocks - 1 - item % num_m_blocks;
        const int hb = item / num_m_blocks;
        *s = make_seq_info(p, hb / p.heads_q, hb % p.heads_q);
        *m_lo = m_block * C::kBlockM;
        *m_hi = min(*m_lo + C::kBlockM, s->seqlen_q);
        int key_first, key_last;
        visible_keys(p, *s, *m_lo, *m_hi, &key_first, &key_last);
        *n_first = key_first / C::kBlockN;
        *n_end = ceil_div(key_last, C::kBlockN);
    };

    if (warpgroup == 0) {
        // Producer: one thread walks the same items and tiles as the consumers.
        setmaxnreg_dec<24>();
        if (threadIdx.x != 0) return;
        int stage = 0, phase = 0, q_phase = 0;
        for (int item = blockIdx.x; item < items; item += gridDim.x) {
            SeqInfo s;
            int m_lo, m_hi, n_first, n_end;
            work(item, &s, &m_lo, &m_hi, &n_first, &n_end);
            mbar_wait(q_empty, q_phase ^ 1);   // a fresh barrier passes parity 1 at once
            mbar_arrive_expect_tx(q_full, C::kQBytes);
            for (int blk = 0; blk < C::kColBlocks; ++blk)
                tma_load_4d(q_smem + blk * C::kBlockM * 128, &q_map, blk * 64, m_lo, s.h, s.b, q_full);
            q_phase ^= 1;
            for (int n = n_end - 1; n >= n_first; --n) {
                mbar_wait(k_empty(stage), phase ^ 1);
                mbar_arrive_expect_tx(k_full(stage), C::kKVBytes);
                for (int blk = 0; blk < C::kColBlocks; ++blk)
                    tma_load_4d(k_smem + stage * C::kKVBytes + blk * C::kBlockN * 128, &k_map, blk * 64,
                                n * C::kBlockN, s.h_kv, s.b, k_full(stage));
                mbar_wait(v_empty(stage), phase ^ 1);
                mbar_arrive_expect_tx(v_full(stage), C::kKVBytes);
                for (int blk = 0; blk < C::kColBlocks; ++blk)
                    tma_load_4d(v_smem + stage * C::kKVBytes + blk * C::kBlockN * 128, &v_map, blk * 64,
                                n * C::kBlockN, s.h_kv, s.b, v_full(stage));
                if (++stage == C::kStages) { stage = 0; phase ^= 1; }
            }
        }
        return;
    }

    // Consumers: stage/phase run on across items, in step with the producer's.
    setmaxnreg_inc<240>();
    const int consumer = warpgroup - 1;
    const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
    const int g = lane / 4, t = lane % 4;
    int stage = 0, phase = 0, q_phase = 0;
    for (int item = blockIdx.x; item < items; item += gridDim.x) {
        SeqInfo s;
        int m_lo, m_hi, n_first, n_end;
        work(item, &s, &m_lo, &m_hi, &n_first, &n_end);
        const int row0 = m_lo + consumer * 64 + warp * 16;   // this warp's first query row

        float acc_o[1][C::kDTiles][4];
#pragma unroll
        for (int di = 0; di < C::kDTiles; ++di)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_o[0][di][e] = 0.f;
        OnlineSoftmax<1> softmax;
        softmax.init();
        mbar_wait(q_full, q_phase);
        q_phase ^= 1;

        // Software pipeline across key tiles: while the tensor cores run O += P_prev V_prev, the
        // warpgroup computes the softmax of the next S (issued just before), so exp2 and the GEMMs
        // overlap. Only after P_prev V_prev retires are O rescaled and P_prev's registers reused.
        float acc_s[1][C::kNTiles][4];
        unsigned p_frag[C::kBlockN / 16][4];
        auto issue_s = [&](int stage) {
            const unsigned k_tile = k_smem + stage * C::kKVBytes;
#pragma unroll
            for (int kk = 0; kk < C::kHeadDim / 16; ++kk) {
                // Each 64-column block of the head dim is its own swizzled region, 32 bytes per k-step.
                const unsigned q_off = (kk / 4) * C::kBlockM * 128 + consumer * 64 * 128 + (kk % 4) * 32;
                const unsigned k_off = (kk / 4) * C::kBlockN * 128 + (kk % 4) * 32;
                gemm_qk<C::kBlockN>(acc_s, smem_desc(q_smem + q_off, 16, 1024), smem_desc(k_tile + k_off, 16, 1024),
                                    kk > 0);
            }
            wgmma_commit();
        };
        auto issue_pv = [&](int stage) {
            // 16 keys per step (2048 bytes of V); the head dim spans column blocks (leading offset).
            const unsigned v_tile = v_smem + stage * C::kKVBytes;
#pragma unroll
            for (int kk = 0; kk < C::kBlockN / 16; ++kk)
                gemm_pv<C::kHeadDim>(acc_o, p_frag[kk], smem_desc(v_tile + kk * 2048, C::kBlockN * 128, 1024));
            wgmma_commit();
        };
        // S of tile n (retired) -> P in acc_s, returns the row corrections for O.
        auto softmax_step = [&](int n, float (&correction)[2]) {
            fence_registers(*reinterpret_cast<float(*)[C::kBlockN / 2]>(&acc_s[0][0][0]));
            const int n_lo = n * C::kBlockN;
            mask_scores<C::kScoreMods>(acc_s, p, s, m_lo, m_hi, n_lo, row0, g, t);
            softmax.update(acc_s, correction, C::kScoreMods ? 1.f : p.scale_log2);
            if (C::kDropout) drop_probabilities(acc_s, p, s, row0, n_lo, g, t);
        };

        int n = n_end - 1;
        if (n >= n_first) {
            mbar_wait(k_full(stage), phase);
            wgmma_fence();
            issue_s(stage);
            wgmma_wait<0>();
            mbar_arrive(k_empty(stage));
            float correction[2];
            softmax_step(n, correction);   // O is still 0: nothing to rescale
#pragma unroll
            for (int kk = 0; kk < C::kBlockN / 16; ++kk) pack_p<elem_t>(p_frag[kk], acc_s[0], kk);
            int prev_stage = stage, prev_phase = phase;
            if (++stage == C::kStages) { stage = 0; phase ^= 1; }
            for (--n; n >= n_first; --n) {
                mbar_wait(k_full(stage), phase);
                wgmma_fence();   // orders this thread's writes of P and O before the GEMMs read them
                issue_s(stage);
                mbar_wait(v_full(prev_stage), prev_phase);
                issue_pv(prev_stage);
                wgmma_wait<1>();   // S retired (groups retire in order); P_prev V_prev may still run
                mbar_arrive(k_empty(stage));
                softmax_step(n, correction);
                wgmma_wait<0>();
                fence_registers(*reinterpret_cast<float(*)[C::kHeadDim / 2]>(&acc_o[0][0][0]));
                fence_registers(p_frag);
                mbar_arrive(v_empty(prev_stage));   // this thread's reads of that V are complete
                rescale_rows(acc_o, correction);
#pragma unroll
                for (int kk = 0; kk < C::kBlockN / 16; ++kk) pack_p<elem_t>(p_frag[kk], acc_s[0], kk);
                prev_stage = stage;
                prev_phase = phase;
                if (++stage == C::kStages) { stage = 0; phase ^= 1; }
            }
            mbar_wait(v_full(prev_stage), prev_phase);
            wgmma_fence();
            issue_pv(prev_stage);
            wgmma_wait<0>();
            fence_registers(*reinterpret_cast<float(*)[C::kHeadDim / 2]>(&acc_o[0][0][0]));
            fence_registers(p_frag);
            mbar_arrive(v_empty(prev_stage));
        }
        mbar_arrive(q_empty);   // every GEMM of this item has retired: Q may be replaced

        float inv_l[2], lse[2];
        softmax.finish(inv_l, lse, C::kScoreMods ? 1.f : p.scale_log2);
        store_output<C::kDropout>(acc_o, inv_l, lse, p, s, row0, g, t);
    }
}

}  // namespace cuflash

using Config = cuflash::FwdSm90Config<CUFLASH_HEAD_DIM, CUFLASH_BLOCK_N, CUFLASH_SCORE_MODS != 0,
                                      CUFLASH_DROPOUT != 0>;
#ifdef CUFLASH_SMEM_BYTES
static_assert(CUFLASH_SMEM_BYTES == Config::kSmemBytes, "shared memory size differs from cuflash/_heuristics.py");
#endif

extern "C" __global__ void __launch_bounds__(Config::kNThreads, 1)
    cuflash_fwd_sm90(const __grid_constant__ cuflash::TmaMap q_map, const __grid_constant__ cuflash::TmaMap k_map,
                     const __grid_constant__ cuflash::TmaMap v_map, const cuflash::FwdParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    cuflash::fwd_sm90<Config>(q_map, k_map, v_map, p);
#endif
}

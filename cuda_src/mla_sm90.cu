// MLA decode on Hopper (sm_90a): a few new query tokens of many query heads against one latent KV
// head of 576 columns, the values being its first 512 (DeepSeek-V2/V3's multi-head latent attention).
//
// decode.cu runs MLA on mma.sync with 16 packed rows a CTA, so each 64-key tile costs a warp a chain
// of ~100 dependent mma and 128 query heads re-read every tile eight times. Here a CTA takes 64
// packed rows (query i, head h: row i * heads_q + h) and one split of the keys, on wgmma:
//
//   warpgroup 0, the producer: its 128 threads copy the CTA's Q rows (cp.async, zero rows past the
//     call's), then thread 0 streams 64-key tiles of the cache by TMA into a ring of two stages
//     (9 boxes of 64 columns x 64 rows; a page of the cache holds whole tiles: page_size % 64 == 0);
//   warpgroups 1 and 2, the consumers c = 0, 1: S_c = Q K^T over keys 32c .. 32c + 31 of the tile
//     (m64n32, 36 k-steps), the row maxima exchanged through shared memory so both hold the tile's,
//     P_c into columns 32c .. of a 64 x 64 tile of P in shared memory, then O_c += P V over value
//     columns 256c .. 256c + 255 (two m64n128 products, 4 k-steps each, V = the stage's first 8
//     column blocks). Each consumer thus computes half of S and half of O, and both read the tile
//     from the same stage.
//
// With at most 16 packed rows (16 query heads of one new token) a CTA takes 16 rows and the keys go on
// wgmma's M instead (mla_consume_keys_m): 64 rows would be three quarters padding.
//
// The row sums l are per consumer (its keys); the two are added at the end. A split writes its
// float32 partial (o_part, lse_part, decode.cu's layout) and the last split of a (sequence, row
// block) to finish combines them into out and lse, as decode.cu does; one split writes them directly.
// Bad indices: the index check (check_indices.cu) runs ahead; without an append in between the
// kernel is launched as its programmatic dependent, reads within the cache whatever the lengths say,
// and writes nothing on a fault (mla_verdict_clean).
// Keys past a sequence's end (cache_seqlens[b] + seqlen_new keys; appends are written by
// append_kv.cu ahead of this launch) are masked, and the last tile's rows past it are zeroed before
// use (0 * a NaN of an unused cache row would be NaN). Query i sees keys j <= i + seqlen_k - seqlen_q.
//
// Grid: (row_blocks * num_splits, 1, batch), 384 threads. Compile-time: CUFLASH_DTYPE (fp16/bf16),
// CUFLASH_MLA_ROWS (64 or 16).
// Runs only where cuflash/_mla_plan.py says: one kv head, head dims 576 / 512, no score modifier, no
// sinks, no window.
#include "common.cuh"
#include "params.cuh"
#include "decode_params.cuh"
#include "fault.cuh"
#include "tma_sm90.cuh"
#include "wgmma_sm90.cuh"
#include "gemm_sm90.cuh"
#include "online_softmax.cuh"

namespace cuflash {

#ifndef CUFLASH_MLA_ROWS
#define CUFLASH_MLA_ROWS 64   // packed query rows a CTA: 64 (wgmma's M) or 16 (the keys as M)
#endif

struct MlaSm90 {
    static constexpr int kDim = 576, kDimV = 512;
    static constexpr int kRows = CUFLASH_MLA_ROWS;       // packed query rows a CTA
    static constexpr bool kKeysAsM = kRows == 16;        // S^T = K Q^T and O^T = V^T P^T (mla_consume_keys_m)
    static constexpr int kKeys = 64;                     // keys a tile
    static constexpr int kConsumerKeys = kKeys / 2;      // 64 rows: S over half the keys a consumer
    static constexpr int kConsumerCols = kDimV / 2;      // value columns a consumer
    static constexpr int kStages = 2;
    static constexpr int kColBlocks = kDim / 64;         // 128-byte swizzle rows of 64 columns
    static constexpr int kBlockBytes = kKeys * 128;      // one column block of a tile
    static constexpr int kTileBytes = kColBlocks * kBlockBytes;
    static constexpr int kQBlockBytes = kRows * 128;     // one column block of Q
    static constexpr int kQBytes = kColBlocks * kQBlockBytes;
    // P: one 64 x 64 tile the consumers share, or with the keys as M one 16 x 64 tile each
    static constexpr int kPBytes = kKeysAsM ? 2 * kRows * 128 : kRows * 128;
    // Keys as M: each consumer's column maxima (two tiles' worth) and row sums, four warps x 16 queries
    static constexpr int kExchangeBytes = kKeysAsM ? (2 * 2 * 4 * 16 + 2 * 4 * 16) * 4 : 0;
    static constexpr int kSmemBytes = kQBytes + kStages * kTileBytes + kPBytes + kExchangeBytes + 1024;   // + alignment
    static constexpr int kThreads = 384;
    static constexpr int kProducerRegs = 40, kConsumerRegs = 232;
    static_assert(kRows == 64 || kRows == 16, "64 packed rows, or 16 with the keys as M");
};

#ifdef CUFLASH_SMEM_BYTES
static_assert(CUFLASH_SMEM_BYTES == MlaSm90::kSmemBytes, "shared memory size differs from cuflash/kernels/mla_sm90.py");
#endif

struct MlaShared {
    unsigned long long full[MlaSm90::kStages], empty[MlaSm90::kStages], q_full;
    float row_max[2][MlaSm90::kRows];   // 64 rows: each consumer's tile maxima (exchanged every tile)
    float row_sum[2][MlaSm90::kRows];   // 64 rows: each consumer's l at the end
    int is_last;
};

// The CTA's work: its row block, split and sequence, and the keys the split streams.
struct MlaWork {
    int b, row_block, split;
    int rows_total;   // seqlen_q * heads_q
    int seqlen_k;     // keys of the sequence (cache_seqlens[b] + seqlen_new)
    int diag;         // query i sees keys j <= i + diag
    int tile_begin, tiles;
};

__device__ __forceinline__ MlaWork mla_work(const DecodeParams& p) {
    MlaWork w;
    w.b = blockIdx.z;
    w.row_block = blockIdx.x % p.row_blocks;
    w.split = blockIdx.x / p.row_blocks;
    w.rows_total = p.seqlen_q * p.heads_q;
    // Bounded by the cache: behind the index check the kernel reads the lengths before the check's
    // verdict (mla_verdict_clean), and a bad one must read nothing outside the cache or its block table.
    const long long cache_len = p.cache_seqlens != nullptr ? p.cache_seqlens[w.b] : p.seqlen_cache;
    w.seqlen_k = static_cast<int>(min(max(cache_len, 0LL) + p.seqlen_new, static_cast<long long>(p.seqlen_cache)));
    w.diag = w.seqlen_k - p.seqlen_q;
    // The keys the block's rows may see end at the last row's diagonal (all of them for one new token).
    const int last_i = min(w.rows_total, (w.row_block + 1) * MlaSm90::kRows) - 1;
    const int keys = max(0, min(w.seqlen_k, last_i / p.heads_q + w.diag + 1));
    const int tiles_total = (keys + MlaSm90::kKeys - 1) / MlaSm90::kKeys;
    const int per_split = (tiles_total + p.num_splits - 1) / p.num_splits;
    w.tile_begin = w.split * per_split;
    w.tiles = max(0, min(per_split, tiles_total - w.tile_begin));
    return w;
}

// Warpgroup 0: the Q rows (all 128 threads, cp.async, rows past the call's zeroed), then the tiles
// (thread 0, TMA).
__device__ __forceinline__ void mla_produce(const TmaMap& kv_map, const DecodeParams& p, const MlaWork& w,
                                            MlaShared& sh, unsigned q_tile, unsigned stages) {
    using C = MlaSm90;
    const int t = threadIdx.x;
    // Q: kRows rows x 72 chunks of 16 bytes; kThreadsPerRow threads a row, thread t copying chunks
    // t % kThreadsPerRow + kThreadsPerRow k of its row, in the 128-byte swizzle (chunk c of a row goes
    // to column block c / 8, chunk (c % 8) ^ (row % 8)).
    {
        constexpr int kThreadsPerRow = 128 / C::kRows;
        const int r = t / kThreadsPerRow, pr = w.row_block * C::kRows + r;
        const bool valid = pr < w.rows_total;
        const int i = valid ? pr / p.heads_q : 0, h = valid ? pr % p.heads_q : 0;
        const elem_t* src = static_cast<const elem_t*>(p.q) + w.b * p.q_batch_stride + i * p.q_row_stride +
                            h * p.q_head_stride;
#pragma unroll 4
        for (int c = t % kThreadsPerRow; c < C::kColBlocks * 8; c += kThreadsPerRow) {
            const unsigned dst = q_tile + (c / 8) * C::kQBlockBytes + r * 128 + (((c % 8) ^ (r % 8)) * 16);
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src + c * 8),
                         "r"(valid ? 16 : 0)
                         : "memory");
        }
        cp_async_arrive_noinc(smem_addr(&sh.q_full));
    }
    setmaxnreg_dec<C::kProducerRegs>();
    if (t != 0) return;
    for (int n = 0; n < w.tiles; ++n) {
        const int stage = n % C::kStages, phase = (n / C::kStages) & 1;
        const int j0 = (w.tile_begin + n) * C::kKeys;
        // The tile's page (a page holds whole tiles), looked up before the wait so the load overlaps it.
        int row = j0, outer = w.b;
        if (p.block_table != nullptr) {
            outer = p.block_table[w.b * p.block_table_batch_stride + j0 / p.page_size];
            row = j0 % p.page_size;
        }
        mbar_wait(smem_addr(&sh.empty[stage]), phase ^ 1);   // a fresh barrier passes parity 1 at once
        mbar_arrive_expect_tx(smem_addr(&sh.full[stage]), C::kTileBytes);
#pragma unroll
        for (int blk = 0; blk < C::kColBlocks; ++blk)
            tma_load_4d(stages + stage * C::kTileBytes + blk * C::kBlockBytes, &kv_map, blk * 64, row, 0, outer,
                        smem_addr(&sh.full[stage]));
    }
}

// Tile n of the CTA's split, once landed (both consumers): its shared-memory address. On the sequence's
// last tile the rows past its end are zeroed (they are V rows too), and every consumer thread sees the
// stores before either reads the stage.
__device__ __forceinline__ unsigned mla_wait_tile(MlaShared& sh, const MlaWork& w, unsigned stages, int n) {
    using C = MlaSm90;
    const int stage = n % C::kStages;
    const unsigned tile = stages + stage * C::kTileBytes;
    const int j0 = (w.tile_begin + n) * C::kKeys;
    mbar_wait(smem_addr(&sh.full[stage]), (n / C::kStages) & 1);
    if (j0 + C::kKeys > w.seqlen_k) zero_tile_rows<C::kKeys, C::kColBlocks, 2>(tile, w.seqlen_k - j0);
    return tile;
}

// Row `row`'s limit: keys j < limit are visible (rows past the call's: the sequence's keys).
__device__ __forceinline__ int mla_key_limit(const DecodeParams& p, const MlaWork& w, int row) {
    const int pr = w.row_block * MlaSm90::kRows + row;
    return pr < w.rows_total ? min(w.seqlen_k, pr / p.heads_q + w.diag + 1) : w.seqlen_k;
}

// Whether the call may write (the consumers ask after their loop, before their first global write):
// launched as a programmatic dependent of the index check (mla_plan), the kernel runs its loop beside
// the check and waits for its verdict here (fault.cuh); otherwise the wait returns at once. Every
// thread reads the same word, so a CTA's consumers return together.
__device__ __forceinline__ bool mla_verdict_clean(const DecodeParams& p) {
    wait_for_prior_kernel();
    return !call_faulted(p.error);
}

// The last split of a (sequence, row block) adds every split's partial into out and lse (decode.cu's
// combine_if_last_split, for 64 rows and 512 columns over the 256 consumer threads; `weights`: shared
// memory for num_splits x 64 floats).
__device__ __forceinline__ void mla_combine_if_last(const DecodeParams& p, const MlaWork& w, MlaShared& sh,
                                                    float* weights) {
    using C = MlaSm90;
    const int ct = threadIdx.x - 128;   // 0 .. 255
    __threadfence();   // this CTA's partials, visible before it counts itself
    named_barrier_sync(1, 256);
    if (ct == 0) {
        int* counter = p.split_counters + static_cast<long long>(w.b) * p.row_blocks + w.row_block;
        sh.is_last = atomicAdd(counter, 1) == p.num_splits - 1;
        if (sh.is_last) *counter = 0;
    }
    named_barrier_sync(1, 256);
    if (!sh.is_last) return;
    __threadfence();
    const long long lse_split_stride = static_cast<long long>(p.batch) * p.heads_q * p.seqlen_q;
    const long long o_split_stride = lse_split_stride * p.out_dim;
    for (int idx = ct; idx < p.num_splits * C::kRows; idx += 256) {
        const int split = idx / C::kRows, r = idx % C::kRows, pr = w.row_block * C::kRows + r;
        weights[idx] = pr >= w.rows_total ? -CUFLASH_INF
                                          : __ldcg(p.lse_part + split * lse_split_stride +
                                                   (static_cast<long long>(w.b) * p.heads_q + pr % p.heads_q) *
                                                       p.seqlen_q + pr / p.heads_q);
    }
    named_barrier_sync(1, 256);
    const int warp = ct / 32, lane = ct % 32;
    for (int r = warp; r < C::kRows; r += 8) {   // a warp a row (online_softmax.cuh)
        const int pr = w.row_block * C::kRows + r;
        const float lse = split_weights_of_row(weights + r, C::kRows, p.num_splits);
        if (lane == 0 && pr < w.rows_total)
            p.lse[w.b * p.lse_batch_stride + (pr % p.heads_q) * p.lse_head_stride + pr / p.heads_q] = lse;
    }
    named_barrier_sync(1, 256);
    // out = sum_s w_s o_s, four columns a thread.
    for (int idx = ct; idx < C::kRows * (C::kDimV / 4); idx += 256) {
        const int r = idx / (C::kDimV / 4), col = idx % (C::kDimV / 4) * 4, pr = w.row_block * C::kRows + r;
        if (pr >= w.rows_total) continue;
        const int i = pr / p.heads_q, h = pr % p.heads_q;
        const float* o_in = p.o_part + ((static_cast<long long>(w.b) * p.seqlen_q + i) * p.heads_q + h) * p.out_dim + col;
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
        for (int split = 0; split < p.num_splits; ++split) {
            const float4 part = __ldcg(reinterpret_cast<const float4*>(o_in + split * o_split_stride));
            const float wt = weights[split * C::kRows + r];
            acc.x = fmaf(wt, part.x, acc.x);
            acc.y = fmaf(wt, part.y, acc.y);
            acc.z = fmaf(wt, part.z, acc.z);
            acc.w = fmaf(wt, part.w, acc.w);
        }
        elem_t* o = static_cast<elem_t*>(p.o) + w.b * p.o_batch_stride + i * p.o_row_stride + h * p.o_head_stride + col;
        *reinterpret_cast<uint2*>(o) = make_uint2(pack2<elem_t>(acc.x, acc.y), pack2<elem_t>(acc.z, acc.w));
    }
}

// Warpgroups 1 and 2 (consumer c): half of S and half of O, as the file's head says.
__device__ __forceinline__ void mla_consume(const DecodeParams& p, const MlaWork& w, MlaShared& sh, unsigned q_tile,
                                            unsigned stages, unsigned p_tile, float* combine_smem) {
    using C = MlaSm90;
    const int c = warpgroup_index<true>() - 1;
    const int wg_thread = threadIdx.x % 128, warp = wg_thread / 32, lane = threadIdx.x % 32;
    const int r0 = 16 * warp + lane / 4, tq = lane % 4;   // this thread's rows r0, r0 + 8 and column pairs
    const int limits[2] = {mla_key_limit(p, w, r0), mla_key_limit(p, w, r0 + 8)};
    const int block_limit = mla_key_limit(p, w, 0);       // the smallest of the block's rows
    const float scale_log2 = p.score.scale_log2;

    float acc_o[2][64];
#pragma unroll
    for (int k = 0; k < 2; ++k)
#pragma unroll
        for (int e = 0; e < 64; ++e) acc_o[k][e] = 0.f;
    float m[2] = {-CUFLASH_INF, -CUFLASH_INF}, l[2] = {0.f, 0.f};

    mbar_wait(smem_addr(&sh.q_full), 0);
    for (int n = 0; n < w.tiles; ++n) {
        const unsigned tile = mla_wait_tile(sh, w, stages, n);
        const int j0 = (w.tile_begin + n) * C::kKeys;

        float acc_s[16];
        wgmma_fence();
        gemm_abt_ss<C::kConsumerKeys, C::kDim, C::kRows, C::kKeys>(acc_s, q_tile,
                                                                  tile + c * C::kConsumerKeys * 128);
        wgmma_commit();
        wgmma_wait<0>();
        fence_registers(acc_s);

        // Masked keys (the tile's end passes the block's first row's limit) get -inf.
        if (j0 + C::kKeys > block_limit) {
#pragma unroll
            for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int j = j0 + c * C::kConsumerKeys + 8 * nt + 2 * tq + e % 2;
                    if (j >= limits[e / 2]) acc_s[4 * nt + e] = -CUFLASH_INF;
                }
        }
        // The tile's row maxima: this consumer's 32 keys, then the other's through shared memory.
        float tile_max[2];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float x = -CUFLASH_INF;
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) x = fmaxf(x, fmaxf(acc_s[4 * nt + 2 * half], acc_s[4 * nt + 2 * half + 1]));
            tile_max[half] = quad_max(x);
            if (tq == 0) sh.row_max[c][r0 + 8 * half] = tile_max[half];
        }
        named_barrier_sync(2, 256);
        float correction[2], m_scaled[2];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float m_new = fmaxf(m[half], fmaxf(tile_max[half], sh.row_max[1 - c][r0 + 8 * half]));
            // Lazy rescale (online_softmax.cuh): m moves only past the slack; both consumers take the
            // same decision from the same maxima, so their halves of O stay alike in scale.
            if ((m_new - m[half]) * scale_log2 <= OnlineSoftmax<1>::kRescaleSlack) m_new = m[half];
            m_scaled[half] = m_new == -CUFLASH_INF ? 0.f : m_new * scale_log2;
            correction[half] = m_new == m[half] ? 1.f : fast_exp2(m[half] * scale_log2 - m_scaled[half]);
            m[half] = m_new;
        }
        // P of this consumer's keys, into P's tile in shared memory (row r, key column 32 c + k: byte
        // 2 (k % 8) of 16-byte chunk (4 c + k / 8) ^ (r % 8)).
        float sum[2] = {0.f, 0.f};
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
            float e[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                e[i] = fast_exp2(fmaf(acc_s[4 * nt + i], scale_log2, -m_scaled[i / 2]));
                sum[i / 2] += e[i];
            }
            const int chunk = 4 * c + nt;
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int r = r0 + 8 * half;
                const unsigned addr = p_tile + r * 128 + ((chunk ^ (r % 8)) * 16) + tq * 4;
                asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(pack2<elem_t>(e[2 * half], e[2 * half + 1]))
                             : "memory");
            }
        }
#pragma unroll
        for (int half = 0; half < 2; ++half) l[half] = l[half] * correction[half] + sum[half];
        if (correction[0] != 1.f || correction[1] != 1.f) {
#pragma unroll
            for (int k = 0; k < 2; ++k)
#pragma unroll
                for (int e = 0; e < 64; ++e) acc_o[k][e] *= correction[(e % 4) / 2];
        }
        fence_proxy_async();   // P's stores, for the wgmma that reads them
        named_barrier_sync(2, 256);

        // O_c += P V: value columns 256 c .. 256 c + 255 are column blocks 4 c .. 4 c + 3 of the tile.
        wgmma_fence();
        gemm_ab_ss<128, C::kKeys, C::kKeys>(acc_o[0], p_tile, tile + (4 * c) * C::kBlockBytes);
        gemm_ab_ss<128, C::kKeys, C::kKeys>(acc_o[1], p_tile, tile + (4 * c + 2) * C::kBlockBytes);
        wgmma_commit();
        wgmma_wait<0>();
        fence_registers(acc_o[0]);
        fence_registers(acc_o[1]);
        mbar_arrive(smem_addr(&sh.empty[n % C::kStages]));
    }

    if (!mla_verdict_clean(p)) return;
    // l over both consumers' keys; then out (or this split's partial) and lse.
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        l[half] = quad_sum(l[half]);
        if (tq == 0) sh.row_sum[c][r0 + 8 * half] = l[half];
    }
    named_barrier_sync(2, 256);
    const bool partial = p.num_splits > 1;
    const long long part_row0 = static_cast<long long>(w.split) * p.batch + w.b;   // (split, b) of o_part
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int r = r0 + 8 * half, pr = w.row_block * C::kRows + r;
        if (pr >= w.rows_total) continue;
        const int i = pr / p.heads_q, h = pr % p.heads_q;
        // No visible key: out = 0, lse = -inf. A NaN score makes total NaN, which must reach out and lse.
        const float total = l[half] + sh.row_sum[1 - c][r];
        const bool empty = total == 0.f;
        const float inv = empty ? 0.f : 1.f / total;
        const float lse = empty ? -CUFLASH_INF : (m[half] * scale_log2 + __log2f(total)) * kLn2;
        if (c == 0 && tq == 0) {
            if (partial) p.lse_part[(part_row0 * p.heads_q + h) * p.seqlen_q + i] = lse;
            else p.lse[w.b * p.lse_batch_stride + h * p.lse_head_stride + i] = lse;
        }
#pragma unroll
        for (int k = 0; k < 2; ++k)
#pragma unroll
            for (int nt = 0; nt < 16; ++nt) {
                const int col = c * C::kConsumerCols + 128 * k + 8 * nt + 2 * tq;
                const float x = acc_o[k][4 * nt + 2 * half] * inv, y = acc_o[k][4 * nt + 2 * half + 1] * inv;
                if (partial) {
                    float* o = p.o_part + ((part_row0 * p.seqlen_q + i) * p.heads_q + h) * p.out_dim + col;
                    *reinterpret_cast<float2*>(o) = make_float2(x, y);
                } else {
                    elem_t* o = static_cast<elem_t*>(p.o) + w.b * p.o_batch_stride + i * p.o_row_stride +
                                h * p.o_head_stride + col;
                    *reinterpret_cast<unsigned*>(o) = pack2<elem_t>(x, y);
                }
            }
    }
    if (partial) mla_combine_if_last(p, w, sh, combine_smem);
}

// Warpgroups 1 and 2 (consumer c) with the keys as wgmma's M, for at most 16 packed rows (16 query
// heads of one new token): with 64 rows, 48 of them padding, a tile cost four times the tensor work it
// needed. Both consumers compute S^T = K Q^T (64 keys x 16 queries, m64n16) in full, so each has the
// tile's softmax without the other; consumer c then adds O^T (its 256 value columns x 16 queries) +=
// V^T P^T, four m64n16 products over column blocks 4 c .. 4 c + 3 of the tile (V^T: the tile's rows
// are keys, read transposed), from P in a 16 x 64 tile of its own. A query's maximum and sum run over
// the keys, which lie across the lanes (lane / 4) and the four warps: shuffles, then shared memory.
__device__ __forceinline__ void mla_consume_keys_m(const DecodeParams& p, const MlaWork& w, MlaShared& sh,
                                                   unsigned q_tile, unsigned stages, unsigned p_tiles,
                                                   float* exchange, float* combine_smem) {
    using C = MlaSm90;
    const int c = warpgroup_index<true>() - 1;
    const int wg_thread = threadIdx.x % 128, warp = wg_thread / 32, lane = threadIdx.x % 32;
    const int k0 = 16 * warp + lane / 4, tq = lane % 4;   // keys k0, k0 + 8 of a tile; queries 8 j + 2 tq + e
    const unsigned p_tile = p_tiles + c * C::kRows * 128;
    float* col_max = exchange + c * (2 * 4 * 16);          // [tile parity][warp][query]
    float* col_sum = exchange + 2 * (2 * 4 * 16) + c * (4 * 16);   // [warp][query]
    int limits[4];   // query 8 j + 2 tq + e, at [2 j + e]
#pragma unroll
    for (int q = 0; q < 4; ++q) limits[q] = mla_key_limit(p, w, 8 * (q / 2) + 2 * tq + q % 2);
    const int block_limit = mla_key_limit(p, w, 0);
    const float scale_log2 = p.score.scale_log2;

    float acc_o[4][8];
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
        for (int e = 0; e < 8; ++e) acc_o[mt][e] = 0.f;
    float m[4], l[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) { m[q] = -CUFLASH_INF; l[q] = 0.f; }

    mbar_wait(smem_addr(&sh.q_full), 0);
    for (int n = 0; n < w.tiles; ++n) {
        const unsigned tile = mla_wait_tile(sh, w, stages, n);
        const int j0 = (w.tile_begin + n) * C::kKeys;

        // S^T = K Q^T: A the tile (K-major, 64 rows a column block), B Q (K-major, 16 rows a column block).
        float acc_s[8];
        wgmma_fence();
        {
            const unsigned long long a = smem_desc(tile, 16, 1024), b = smem_desc(q_tile, 16, 1024);
            wgmma_ss_n16_first(acc_s, a, b);
#pragma unroll
            for (int kk = 1; kk < C::kDim / 16; ++kk)
                wgmma_ss_n16<0>(acc_s, a + (kmajor_step<C::kKeys>(kk) >> 4), b + (kmajor_step<C::kRows>(kk) >> 4));
        }
        wgmma_commit();
        wgmma_wait<0>();
        fence_registers(acc_s);

        // Element 4 j + e: key k0 + 8 (e / 2), query 8 j + 2 tq + e % 2, at [2 j + e % 2] below.
        if (j0 + C::kKeys > block_limit) {
#pragma unroll
            for (int e = 0; e < 8; ++e)
                if (j0 + k0 + 8 * ((e % 4) / 2) >= limits[2 * (e / 4) + e % 2]) acc_s[e] = -CUFLASH_INF;
        }
        // Each query's maximum over the tile: this thread's two keys, the warp's 16 (lanes apart by
        // 4, 8, 16), then the four warps through shared memory (two buffers by the tile's parity, so
        // the next tile's writes wait for nobody's reads).
        float* maxima = col_max + (n % 2) * (4 * 16);
        float tile_max[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const int e = 4 * (q / 2) + q % 2;
            float x = fmaxf(acc_s[e], acc_s[e + 2]);
            x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 4));
            x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 8));
            x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 16));
            if (lane < 4) maxima[warp * 16 + 8 * (q / 2) + 2 * tq + q % 2] = x;
        }
        named_barrier_sync(3 + c, 128);
        float correction[4], m_scaled[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const int col = 8 * (q / 2) + 2 * tq + q % 2;
            tile_max[q] = fmaxf(fmaxf(maxima[col], maxima[16 + col]), fmaxf(maxima[32 + col], maxima[48 + col]));
            float m_new = fmaxf(m[q], tile_max[q]);
            if ((m_new - m[q]) * scale_log2 <= OnlineSoftmax<1>::kRescaleSlack) m_new = m[q];
            m_scaled[q] = m_new == -CUFLASH_INF ? 0.f : m_new * scale_log2;
            correction[q] = m_new == m[q] ? 1.f : fast_exp2(m[q] * scale_log2 - m_scaled[q]);
            m[q] = m_new;
        }
        // P^T, and P into this consumer's tile (query row q, key column k: byte 2 (k % 8) of chunk
        // (k / 8) ^ (q % 8)).
#pragma unroll
        for (int q = 0; q < 4; ++q) l[q] *= correction[q];
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const int q = 2 * (e / 4) + e % 2, col = 8 * (e / 4) + 2 * tq + e % 2, key = k0 + 8 * ((e % 4) / 2);
            const float x = fast_exp2(fmaf(acc_s[e], scale_log2, -m_scaled[q]));
            l[q] += x;
            const unsigned addr = p_tile + col * 128 + (((key / 8) ^ (col % 8)) * 16) + (key % 8) * 2;
            asm volatile("st.shared.u16 [%0], %1;\n" ::"r"(addr), "h"(static_cast<unsigned short>(pack2<elem_t>(x, 0.f)))
                         : "memory");
        }
        if (correction[0] != 1.f || correction[1] != 1.f || correction[2] != 1.f || correction[3] != 1.f) {
#pragma unroll
            for (int mt = 0; mt < 4; ++mt)
#pragma unroll
                for (int e = 0; e < 8; ++e) acc_o[mt][e] *= correction[2 * (e / 4) + e % 2];
        }
        fence_proxy_async();   // P's stores, for the wgmma that reads them
        named_barrier_sync(3 + c, 128);

        // O^T += V^T P^T: A = value columns 64 mt .. of column block 4 c + mt (the tile's rows are the
        // keys: MN-major, transposed by the descriptor), B = P (K-major, 16 rows).
        wgmma_fence();
        {
            const unsigned long long b = smem_desc(p_tile, 16, 1024);
#pragma unroll
            for (int mt = 0; mt < 4; ++mt) {
                const unsigned long long a = smem_desc(tile + (4 * c + mt) * C::kBlockBytes, C::kKeys * 128, 1024);
#pragma unroll
                for (int kk = 0; kk < C::kKeys / 16; ++kk)
                    wgmma_ss_n16<1>(acc_o[mt], a + (mnmajor_step(kk) >> 4), b + (kmajor_step<C::kRows>(kk) >> 4));
            }
        }
        wgmma_commit();
        wgmma_wait<0>();
#pragma unroll
        for (int mt = 0; mt < 4; ++mt) fence_registers(acc_o[mt]);
        mbar_arrive(smem_addr(&sh.empty[n % C::kStages]));
    }

    if (!mla_verdict_clean(p)) return;
    // Each query's sum over all keys: lanes, then warps (both consumers hold the same sums).
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        float x = l[q];
        x += __shfl_xor_sync(0xffffffffu, x, 4);
        x += __shfl_xor_sync(0xffffffffu, x, 8);
        x += __shfl_xor_sync(0xffffffffu, x, 16);
        if (lane < 4) col_sum[warp * 16 + 8 * (q / 2) + 2 * tq + q % 2] = x;
    }
    named_barrier_sync(3 + c, 128);
    const bool partial = p.num_splits > 1;
    const long long part_row0 = static_cast<long long>(w.split) * p.batch + w.b;   // (split, b) of o_part
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        const int col = 8 * (q / 2) + 2 * tq + q % 2, pr = w.row_block * C::kRows + col;
        if (pr >= w.rows_total) continue;
        const int i = pr / p.heads_q, h = pr % p.heads_q;
        // No visible key: out = 0, lse = -inf. A NaN score makes total NaN, which must reach out and lse.
        const float total = col_sum[col] + col_sum[16 + col] + col_sum[32 + col] + col_sum[48 + col];
        const bool empty = total == 0.f;
        const float inv = empty ? 0.f : 1.f / total;
        if (c == 0 && warp == 0 && lane < 4) {
            const float lse = empty ? -CUFLASH_INF : (m[q] * scale_log2 + __log2f(total)) * kLn2;
            if (partial) p.lse_part[(part_row0 * p.heads_q + h) * p.seqlen_q + i] = lse;
            else p.lse[w.b * p.lse_batch_stride + h * p.lse_head_stride + i] = lse;
        }
#pragma unroll
        for (int mt = 0; mt < 4; ++mt)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int vcol = c * C::kConsumerCols + 64 * mt + k0 + 8 * half;
                const float x = acc_o[mt][4 * (q / 2) + 2 * half + q % 2] * inv;
                if (partial) {
                    p.o_part[((part_row0 * p.seqlen_q + i) * p.heads_q + h) * p.out_dim + vcol] = x;
                } else {
                    elem_t* o = static_cast<elem_t*>(p.o) + w.b * p.o_batch_stride + i * p.o_row_stride +
                                h * p.o_head_stride + vcol;
                    *o = from_float<elem_t>(x);
                }
            }
    }
    if (partial) mla_combine_if_last(p, w, sh, combine_smem);
}

__device__ __forceinline__ void mla_sm90(const TmaMap& kv_map, const DecodeParams& p) {
    using C = MlaSm90;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    __shared__ MlaShared sh;
    const unsigned base = (smem_addr(smem_raw) + 1023) & ~1023u;
    const unsigned q_tile = base, stages = base + C::kQBytes, p_tile = stages + C::kStages * C::kTileBytes;
    const MlaWork w = mla_work(p);
    if (w.row_block * C::kRows >= w.rows_total) return;
    if (threadIdx.x == 0) {
        for (int s = 0; s < C::kStages; ++s) {
            mbar_init(smem_addr(&sh.full[s]), 1);
            mbar_init(smem_addr(&sh.empty[s]), 256);   // every consumer thread frees a stage
        }
        mbar_init(smem_addr(&sh.q_full), 128);         // every producer thread's Q copies
        fence_barrier_init();
    }
    __syncthreads();
    if (threadIdx.x < 128) {
        mla_produce(kv_map, p, w, sh, q_tile, stages);
        return;
    }
    setmaxnreg_inc<C::kConsumerRegs>();
    // The combine's weights reuse the stages (free once both consumers are past the loop).
    float* combine_smem = reinterpret_cast<float*>(smem_raw + (stages - smem_addr(smem_raw)));
    if constexpr (C::kKeysAsM) {
        float* exchange = reinterpret_cast<float*>(smem_raw + (p_tile + C::kPBytes - smem_addr(smem_raw)));
        mla_consume_keys_m(p, w, sh, q_tile, stages, p_tile, exchange, combine_smem);
    } else {
        mla_consume(p, w, sh, q_tile, stages, p_tile, combine_smem);
    }
}

}  // namespace cuflash

extern "C" __global__ void __launch_bounds__(cuflash::MlaSm90::kThreads, 1)
    cuflash_mla_sm90(const __grid_constant__ cuflash::TmaMap kv_map, const cuflash::DecodeParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    cuflash::mla_sm90(kv_map, p);   // the index check's verdict: read before the first write (mla_verdict_clean)
#endif
}

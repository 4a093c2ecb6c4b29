// Online softmax over a thread's slice of an mma accumulator tile, in base 2.
//
// A warp's S tile is kMTiles x kNTiles fragments of 16x8; each thread holds rows (lane/4) and
// (lane/4 + 8) of every 16-row m-tile, so it owns 2 * kMTiles rows. The 4 threads of a quad share a
// row: row maxima are reduced across the quad at once, row sums only at the end (FlashAttention-2).
#pragma once
#include "common.cuh"

namespace cuflash {

__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// The maximum of row `half` of a thread's slice of an m-tile, as a tree, not a chain: a chain of
// kNTiles dependent FMNMX sat on the critical path of every tile (fwd_sm90 D = 64: 16 deep per row).
template <int kNTiles>
__device__ __forceinline__ float row_max(const float (&s_mi)[kNTiles][4], int half) {
    float tile_max[kNTiles];
#pragma unroll
    for (int ni = 0; ni < kNTiles; ++ni) tile_max[ni] = fmaxf(s_mi[ni][2 * half], s_mi[ni][2 * half + 1]);
#pragma unroll
    for (int width = 1; width < kNTiles; width *= 2)
#pragma unroll
        for (int ni = 0; ni + width < kNTiles; ni += 2 * width)
            tile_max[ni] = fmaxf(tile_max[ni], tile_max[ni + width]);
    return tile_max[0];
}

// Lazy rescaling: the running maximum m is only a reference point, and any value gives the same
// result once O is divided by l; it only has to keep 2^(s - m) from overflowing. So m moves only
// when a row's maximum grows past it by more than kRescaleSlack (log2 units: p stays <= 2^8, far
// from overflow in float32, bf16 and fp16), and otherwise its correction is exactly 1 and the
// caller's rescale of O is skipped (rescale_rows). FlashAttention-4 does the same; in fwd_sm90 at
// D = 256 the rescale had cost four FMULs per score.
template <int kMTiles>
struct OnlineSoftmax {
    static constexpr int kRows = 2 * kMTiles;
    static constexpr float kRescaleSlack = 8.f;
    float m[kRows];   // running row maximum of s (before scaling)
    float l[kRows];   // running row sum of 2^(s - m), this thread's columns only

    __device__ __forceinline__ void init() {
#pragma unroll
        for (int r = 0; r < kRows; ++r) { m[r] = -CUFLASH_INF; l[r] = 0.f; }
    }

    // s holds scores that become log2 units when multiplied by scale_log2 > 0 (-inf where masked).
    // Maxima are taken before scaling, so p = 2^(s * scale_log2 - m * scale_log2) is one FFMA and
    // one exp2 per element. On return s holds p and correction[r] = 2^(m_old - m_new) (scaled), by
    // which the caller rescales its output accumulator.
    template <int kNTiles>
    __device__ __forceinline__ void update(float (&s)[kMTiles][kNTiles][4], float (&correction)[kRows],
                                           float scale_log2) {
#pragma unroll
        for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int r = 2 * mi + half;
                const float m_scaled = move_max(r, quad_max(fmaxf(m[r], row_max(s[mi], half))), scale_log2,
                                                correction[r]);
                float sum = 0.f;
#pragma unroll
                for (int ni = 0; ni < kNTiles; ++ni) {
#pragma unroll
                    for (int e = 2 * half; e < 2 * half + 2; ++e) {
                        s[mi][ni][e] = fast_exp2(fmaf(s[mi][ni][e], scale_log2, -m_scaled));
                        sum += s[mi][ni][e];
                    }
                }
                l[r] = l[r] * correction[r] + sum;
            }
        }
    }

    // Row r's running maximum after a tile that took it to m_new (reduced over the whole row), with
    // the lazy rescaling: sets correction = 2^(m_old - m_new) (scaled; exactly 1 when m holds) and
    // returns m * scale_log2, what the tile's exponentials subtract. For layouts whose rows update()
    // does not reduce (decode's keys-as-M tile).
    __device__ __forceinline__ float move_max(int r, float m_new, float scale_log2, float& correction) {
        // From m = -inf the difference is +inf (or NaN while the row has seen only masked keys):
        // both fail the test, so a row's first visible keys always set m.
        if ((m_new - m[r]) * scale_log2 <= kRescaleSlack) m_new = m[r];
        // A row that has seen only masked keys keeps m = -inf; subtracting 0 instead makes its p
        // exactly 0 rather than NaN from (-inf) - (-inf).
        const float m_scaled = m_new == -CUFLASH_INF ? 0.f : m_new * scale_log2;
        correction = m_new == m[r] ? 1.f : fast_exp2(m[r] * scale_log2 - m_scaled);
        m[r] = m_new;
        return m_scaled;
    }

    // update(), speculatively, for one m-tile, with P packed into m16k16 A fragments of T as it is
    // made. Once a row has a reference m, its maximum usually stays within the slack, and then
    // update() keeps m and computes p = 2^(s * scale_log2 - m * scale_log2): this takes those
    // exponentials at once, so they no longer wait for the tile's maximum (a tree of FMNMX and two
    // shuffles), which is reduced beside them only to check that m holds. If m holds for every
    // row of the warp, P, l and m are exactly what update() would give (same operations, same
    // order) and it returns true. Otherwise it returns false and has changed only p: s is intact,
    // and the caller runs update() on it. (A row whose maximum jumped 2^128 past m gets p = +inf
    // here; that p is never used.) Called by whole warps.
    template <typename T, int kNTiles>
    __device__ __forceinline__ bool update_if_held(const float (&s)[1][kNTiles][4], unsigned (&p)[kNTiles / 2][4],
                                                   float scale_log2) {
        static_assert(kMTiles == 1, "one m-tile: the warpgroup's 64 rows of an sm90 tile");
        float m_scaled[2], sum[2] = {0.f, 0.f};
#pragma unroll
        for (int half = 0; half < 2; ++half) m_scaled[half] = m[half] == -CUFLASH_INF ? 0.f : m[half] * scale_log2;
#pragma unroll
        for (int ni = 0; ni < kNTiles; ++ni) {
            float e[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                e[i] = fast_exp2(fmaf(s[0][ni][i], scale_log2, -m_scaled[i / 2]));
                sum[i / 2] += e[i];
            }
            // Two n-tiles make one 16-key A fragment (as pack_p in fragments.cuh).
            p[ni / 2][2 * (ni % 2)] = pack2<T>(e[0], e[1]);
            p[ni / 2][2 * (ni % 2) + 1] = pack2<T>(e[2], e[3]);
        }
        bool held = true;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const float m_new = quad_max(fmaxf(m[half], row_max(s[0], half)));
            held &= (m_new - m[half]) * scale_log2 <= kRescaleSlack;   // update()'s test, NaN included
        }
        if (!__all_sync(0xffffffffu, held)) return false;
#pragma unroll
        for (int half = 0; half < 2; ++half) l[half] += sum[half];   // update()'s fma(l, 1, sum)
        return true;
    }

    // After the last tile: the full row sums, 1/l for normalising (0 for rows with no visible key,
    // so they come out as 0) and lse = ln(sum exp(s_natural)) (-inf for those rows).
    // The approximate reciprocal and log2 (one MUFU instruction each, ~1 ulp and 2^-22 absolute,
    // subnormals flushed) suffice: a row that sees a key has 1 <= l <= keys * 2^kRescaleSlack (m
    // never exceeds the row's maximum, whose own term is then >= 1), far from the subnormal and
    // huge ranges where they lose accuracy. The IEEE versions branch on those ranges, which kept
    // the rows' chains apart: ~800 clock cycles of each item's epilogue in fwd_sm90
    // (docs/decisions.md#fwd-sm90-epilogue).
    //
    // sink: the row's attention sink in natural units (docs/design.md §2b; FwdParams::sinks), -inf
    // for none. It joins the denominator only, exp(sink) beside the keys' terms: with the larger of
    // m and the sink as the reference point t, l' = l 2^(m - t) + 2^(sink - t) >= 1 (one of the two
    // terms is 2^0), so the MUFU approximations above stay accurate, and a sink far above the scores
    // cannot overflow. O, accumulated against m, is divided by l' 2^(t - m). A row with no visible
    // key still gets inv_l = 0 (out = 0), and lse = sink.
    __device__ __forceinline__ void finish(float (&inv_l)[kRows], float (&lse)[kRows], float scale_log2,
                                           float sink = -CUFLASH_INF) {
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
            const float row_sum = quad_sum(l[r]);
            if (sink == -CUFLASH_INF) {
                inv_l[r] = row_sum == 0.f ? 0.f : fast_rcp(row_sum);
                lse[r] = row_sum == 0.f ? -CUFLASH_INF : (m[r] * scale_log2 + fast_log2(row_sum)) * kLn2;
            } else {
                const float m_scaled = m[r] * scale_log2, sink2 = sink * kLog2e;   // -inf * scale_log2 = -inf
                const float top = fmaxf(m_scaled, sink2);
                const float keys_part = fast_exp2(m_scaled - top);                 // 0 for a row with no key
                const float total = fmaf(row_sum, keys_part, fast_exp2(sink2 - top));
                inv_l[r] = row_sum == 0.f ? 0.f : keys_part * fast_rcp(total);
                lse[r] = row_sum == 0.f ? sink : (top + fast_log2(total)) * kLn2;
            }
        }
    }
};

// Split-KV's combine for one row, by one warp (its lanes over the splits; decode.cu and mla_sm90.cu):
// weights[s * stride] holds split s's lse and becomes its weight w_s = e^(lse_s - t) / sum in place,
// sum = sum_s e^(lse_s - t) + e^(sink - t), t the larger of the splits' maximum and the sink (-inf for
// none): the sink is one more term of the sum with no value, and a sink far above the scores cannot
// overflow. Returns the row's lse; a row no split saw a key of gets weights 0 (out = 0) and lse = sink.
// fmaxf skips a NaN lse, which still makes the sum NaN.
__device__ __forceinline__ float split_weights_of_row(float* weights, int stride, int num_splits,
                                                      float sink = -CUFLASH_INF) {
    const int lane = threadIdx.x % 32;
    float m = -CUFLASH_INF;
    for (int split = lane; split < num_splits; split += 32) m = fmaxf(m, weights[split * stride]);
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
    const float top = fmaxf(m, sink);   // a NaN sink reaches the sum below
    const float m_safe = top == -CUFLASH_INF ? 0.f : top;
    float keys_sum = 0.f;
    for (int split = lane; split < num_splits; split += 32) {
        const float x = weights[split * stride];
        if (x != -CUFLASH_INF) keys_sum += expf(x - m_safe);
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) keys_sum += __shfl_xor_sync(0xffffffffu, keys_sum, offset);
    const bool empty = m == -CUFLASH_INF && keys_sum == 0.f;
    const float sum = sink != -CUFLASH_INF ? keys_sum + expf(sink - m_safe) : keys_sum;
    const float inv_sum = empty ? 0.f : 1.f / sum;
    for (int split = lane; split < num_splits; split += 32) {   // each lane rewrites only what it read
        const float x = weights[split * stride];
        weights[split * stride] = x == -CUFLASH_INF ? 0.f : expf(x - m_safe) * inv_sum;
    }
    return empty ? sink : m_safe + logf(sum);
}

}  // namespace cuflash

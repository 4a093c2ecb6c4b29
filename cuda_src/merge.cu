// Merge attention states: n partial results over disjoint key sets -> the result over their union.
//
// Part i holds o_i (normalised over its keys) and lse_i = log sum_{j in part i} exp(s_j). For one
// (b, s, h) row:
//     m = max_i lse_i,  w_i = exp(lse_i - m),  out = sum_i w_i o_i / sum_i w_i,  lse = m + log sum_i w_i.
// Parts with lse_i = -inf saw no key and are skipped (their o_i is never read into the result, even if
// it is garbage); when every part is -inf the row is out = 0, lse = -inf. A NaN lse_i propagates.
//
// One warp per (b, s, h) row, its lanes over the head dim, CUFLASH_MERGE_ROWS rows a block: a block
// of its own per row is launch-bound (1M rows of D = 128, a ring shard of 64k tokens x 16 heads, then
// take ~8x the time their bytes need on an H200). Used by cuflash.merge_states.
//
// Compile-time configuration: CUFLASH_IN_DTYPE and CUFLASH_OUT_DTYPE (0 fp16, 1 bf16, 2 fp32, 3 fp64),
// CUFLASH_MERGE_ROWS (rows, that is warps, per block).
#include "common.cuh"

namespace cuflash {

struct MergeParams {
    const void* outs;      // (n, B, S, H, D), the in dtype, any strides
    const float* lses;     // (n, B, H, S)
    void* out;             // (B, S, H, D), the out dtype
    float* lse;            // (B, H, S)
    long long outs_part_stride, outs_batch_stride, outs_row_stride, outs_head_stride, outs_col_stride;
    long long lses_part_stride, lses_batch_stride, lses_head_stride, lses_row_stride;
    long long out_batch_stride, out_row_stride, out_head_stride, out_col_stride;
    long long lse_batch_stride, lse_head_stride, lse_row_stride;
    int num_parts, batch, seqlen, heads, head_dim, pad_;
};

#ifdef CUFLASH_MERGE_PARAMS_SIZE
static_assert(sizeof(MergeParams) == CUFLASH_MERGE_PARAMS_SIZE, "MergeParams differs from cuflash/merge.py");
#endif

template <int kCode> struct MergeType;
template <> struct MergeType<kFloat16> { using type = half_t; };
template <> struct MergeType<kBFloat16> { using type = bfloat16_t; };
template <> struct MergeType<kFloat32> { using type = float; };
template <> struct MergeType<kFloat64> { using type = double; };

using in_t = typename MergeType<CUFLASH_IN_DTYPE>::type;
using out_t = typename MergeType<CUFLASH_OUT_DTYPE>::type;
// float64 data is merged in float64; everything else in float32.
constexpr bool kDouble = CUFLASH_IN_DTYPE == kFloat64 || CUFLASH_OUT_DTYPE == kFloat64;
using acc_t = typename MergeType<kDouble ? kFloat64 : kFloat32>::type;

__device__ __forceinline__ acc_t load_acc(half_t x) { return static_cast<acc_t>(to_float(x)); }
__device__ __forceinline__ acc_t load_acc(bfloat16_t x) { return static_cast<acc_t>(to_float(x)); }
__device__ __forceinline__ acc_t load_acc(float x) { return static_cast<acc_t>(x); }
__device__ __forceinline__ acc_t load_acc(double x) { return static_cast<acc_t>(x); }

template <typename T> __device__ __forceinline__ T store_as(acc_t x) { return from_float<T>(static_cast<float>(x)); }
template <> __device__ __forceinline__ double store_as<double>(acc_t x) { return static_cast<double>(x); }

__device__ __forceinline__ float exp_acc(float x) { return expf(x); }
__device__ __forceinline__ double exp_acc(double x) { return exp(x); }
__device__ __forceinline__ float log_acc(float x) { return logf(x); }
__device__ __forceinline__ double log_acc(double x) { return log(x); }

constexpr int kMergeRowsPerBlock = CUFLASH_MERGE_ROWS;

__device__ __forceinline__ void merge_row(const MergeParams& p, long long row, int lane) {
    const int h = static_cast<int>(row % p.heads);
    const long long bs = row / p.heads;
    const int s = static_cast<int>(bs % p.seqlen), b = static_cast<int>(bs / p.seqlen);
    const float* lse_in = p.lses + b * p.lses_batch_stride + h * p.lses_head_stride + s * p.lses_row_stride;

    // fmaxf skips NaN; a NaN lse_i still makes the sum below NaN.
    float m = -CUFLASH_INF;
    for (int i = 0; i < p.num_parts; ++i) m = fmaxf(m, lse_in[i * p.lses_part_stride]);
    const acc_t m_safe = m == -CUFLASH_INF ? acc_t(0) : acc_t(m);
    acc_t sum = 0;
    for (int i = 0; i < p.num_parts; ++i) {
        const float x = lse_in[i * p.lses_part_stride];
        if (x != -CUFLASH_INF) sum += exp_acc(acc_t(x) - m_safe);
    }
    const bool empty = sum == acc_t(0);
    const acc_t inv_sum = empty ? acc_t(0) : acc_t(1) / sum;
    if (lane == 0)
        p.lse[b * p.lse_batch_stride + h * p.lse_head_stride + s * p.lse_row_stride] =
            empty ? -CUFLASH_INF : static_cast<float>(m_safe + log_acc(sum));

    const in_t* src = static_cast<const in_t*>(p.outs) + b * p.outs_batch_stride + s * p.outs_row_stride +
                      h * p.outs_head_stride;
    out_t* dst = static_cast<out_t*>(p.out) + b * p.out_batch_stride + s * p.out_row_stride + h * p.out_head_stride;
    for (int c = lane; c < p.head_dim; c += 32) {
        acc_t acc = 0;
        for (int i = 0; i < p.num_parts; ++i) {
            const float x = lse_in[i * p.lses_part_stride];
            if (x != -CUFLASH_INF)
                acc += exp_acc(acc_t(x) - m_safe) * load_acc(src[i * p.outs_part_stride + c * p.outs_col_stride]);
        }
        dst[c * p.out_col_stride] = store_as<out_t>(empty ? acc_t(0) : acc * inv_sum);
    }
}

}  // namespace cuflash

extern "C" __global__ void __launch_bounds__(32 * cuflash::kMergeRowsPerBlock) cuflash_merge(const cuflash::MergeParams p) {
    const long long row = static_cast<long long>(blockIdx.x) * cuflash::kMergeRowsPerBlock + threadIdx.x / 32;
    if (row >= static_cast<long long>(p.batch) * p.seqlen * p.heads) return;
    cuflash::merge_row(p, row, threadIdx.x % 32);
}

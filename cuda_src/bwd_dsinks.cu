// dL/dsinks (attention sinks, docs/design.md §2b): per query head h,
//   dsinks[h] = sum over sequences b and rows i of -exp(sinks[h] - lse_i) D_i
// from the per-CTA sums bwd_preprocess.cu writes into BwdParams::dsink_part, (B, Hq, seqlen_q_pad / 16).
// One CTA per head adds them in a fixed order (each thread a strided share, then a fixed tree), so
// that dsinks are bitwise reproducible whether or not the call is deterministic; it writes
// dsinks[h] outright (no zeroed accumulator, no atomics).
//
// Grid: (Hq, 1, 1), kThreads threads. Compile-time: the parameter sizes only.
#include "common.cuh"
#include "params.cuh"
#include "bwd_params.cuh"
#include "fault.cuh"

namespace cuflash {

constexpr int kDsinkThreads = 256;

__device__ __forceinline__ void bwd_dsinks(const BwdParams& bp) {
    const int h = blockIdx.x, blocks = bp.seqlen_q_pad / 16, heads = bp.fwd.heads_q;
    float sum = 0.f;
    for (int b = 0; b < bp.fwd.batch; ++b) {
        const float* part = bp.dsink_part + (static_cast<long long>(b) * heads + h) * blocks;
        for (int x = threadIdx.x; x < blocks; x += kDsinkThreads) sum += part[x];
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    __shared__ float warp_sums[kDsinkThreads / 32];
    if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = sum;
    __syncthreads();
    if (threadIdx.x == 0) {
        float total = 0.f;
#pragma unroll
        for (int w = 0; w < kDsinkThreads / 32; ++w) total += warp_sums[w];
        bp.dsinks[h] = total;
    }
}

}  // namespace cuflash

extern "C" __global__ void __launch_bounds__(cuflash::kDsinkThreads) cuflash_bwd_dsinks(const cuflash::BwdParams p) {
    if (cuflash::call_faulted(p.fwd.error)) return;
    cuflash::bwd_dsinks(p);
}

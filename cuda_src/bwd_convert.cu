// float32 accumulators -> output dtype, with a scale and a fixed-order sum over partial buffers:
//   dst[r, h, d] = scale * sum_{s < num_partials} src[s * partial_stride + r * src_row_stride
//                                                     + h * src_head_stride + d]
// dQ from the atomically accumulated dq_accum (scale = softmax scale, one partial), and dK/dV of GQA
// problems whose query-head groups were split over several CTAs (partials summed in order, so the
// result is the same on every run). Writes element by element: any head_dim, any dst alignment.
//
// Grid: (ceil(rows * heads / 8)), 256 threads: 8 (row, head) pairs per CTA, a warp each; for
// bwd_sm90's tiled dQ (tile_rows > 0) (ceil(rows / 8), heads, batch).
// Compile-time: CUFLASH_DTYPE (0 fp16, 1 bf16, 2 fp32) of dst.
#include "common.cuh"
#include "bwd_params.cuh"
#include "fault.cuh"
#include "bwd_common.cuh"

namespace cuflash {

__device__ __forceinline__ void bwd_convert(const ConvertParams& cp) {
    const int pair = blockIdx.x * 8 + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (pair >= cp.rows * cp.heads) return;
    const int r = pair / cp.heads, h = pair % cp.heads;
    const float* src = cp.src + r * cp.src_row_stride + h * cp.src_head_stride;
    elem_t* dst = static_cast<elem_t*>(cp.dst) + r * cp.dst_row_stride + h * cp.dst_head_stride;
    for (int d = lane; d < cp.head_dim; d += 32) {
        float acc = src[d];
        for (int s = 1; s < cp.num_partials; ++s) acc += src[s * cp.partial_stride + d];
        dst[d] = from_float<elem_t>(acc * cp.scale);
    }
}

// dQ from bwd_sm90's tiles: grid (ceil(rows / 8), heads, batch), a warp per row of one sequence.
__device__ __forceinline__ void bwd_convert_tiles(const ConvertParams& cp) {
    const int i = blockIdx.x * 8 + threadIdx.x / 32, lane = threadIdx.x % 32, h = blockIdx.y, b = blockIdx.z;
    const bool varlen = cp.cu_seqlens != nullptr;
    const int row0 = varlen ? cp.cu_seqlens[b] : 0;
    if (i >= (varlen ? cp.cu_seqlens[b + 1] - row0 : cp.rows)) return;
    const int tile_row = dq_tile_row0(row0, b, cp.tile_rows, varlen) + i;
    const float* tile = cp.src + b * cp.src_batch_stride + h * cp.src_head_stride +
                        (tile_row / cp.tile_rows) * cp.tile_rows * cp.src_row_stride;
    elem_t* dst = static_cast<elem_t*>(cp.dst) + b * cp.dst_batch_stride + h * cp.dst_head_stride +
                  (row0 + i) * cp.dst_row_stride;
    for (int d = lane; d < cp.head_dim; d += 32)
        dst[d] = from_float<elem_t>(tile[dq_tile_offset(i % cp.tile_rows, d, cp.tile_rows)] * cp.scale);
}

}  // namespace cuflash

extern "C" __global__ void __launch_bounds__(256) cuflash_bwd_convert(const cuflash::ConvertParams p) {
    if (cuflash::call_faulted(p.error)) return;
    if (p.tile_rows) cuflash::bwd_convert_tiles(p);
    else cuflash::bwd_convert(p);
}

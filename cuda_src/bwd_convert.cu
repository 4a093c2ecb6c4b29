// float32 accumulators -> output dtype, with a scale and a fixed-order sum over partial buffers:
//   dst[r, h, d] = scale * sum_{s < num_partials} src[s * partial_stride + r * src_row_stride
//                                                     + h * src_head_stride + d]
// dQ from the atomically accumulated dq_accum (scale = softmax scale, one partial), and dK/dV of GQA
// problems whose query-head groups were split over several CTAs (partials summed in order, so the
// result is the same on every run). Writes element by element (bwd_sm90's dQ tiles: 16-byte chunks
// where dst allows): any head_dim, any dst alignment.
//
// Grid: (ceil(rows * heads / 8)), 256 threads: 8 (row, head) pairs per CTA, a warp each; for
// bwd_sm90's tiled dQ (tile_rows > 0) (tiles per sequence, heads, batch), a CTA per tile.
// bwd_sm90's dQ conversion may be launched as its programmatic dependent (ConvertParams::done): its
// CTAs then start on the SMs that bwd_sm90's last wave leaves idle and convert each head as soon as
// bwd_sm90's counts say that the head's reductions have all landed, instead of after the whole grid.
// Compile-time: CUFLASH_DTYPE (0 fp16, 1 bf16, 2 fp32) of dst.
#include "common.cuh"
#include "bwd_params.cuh"
#include "fault.cuh"
#include "bwd_common.cuh"

namespace cuflash {

// Spins until *counter >= target (acquire: what was released with the counts is then visible).
// A CTA waits at most as long as bwd_sm90's last wave (tens to hundreds of us); sleeping 0.5 us
// between reads keeps the polls of up to 8 waiting CTAs per SM off L2 and adds at most that.
__device__ __forceinline__ void acquire_wait(const int* counter, int target) {
    for (;;) {
        int seen;
        asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(seen) : "l"(counter) : "memory");
        if (seen >= target) return;
        __nanosleep(500);
    }
}

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

// dQ from bwd_sm90's tiles: grid (tiles per sequence (varlen: of the longest), heads, batch), a CTA
// per tile. The tile is read as it lies (float4s in the wgmma fragment order of dq_tile_offset, each
// two elements of a row and the same two of the row 8 below), scaled and rounded into a row-major
// copy in shared memory, and written out row by row in 16-byte chunks where dQ's rows allow: whole
// 16-byte reads and writes (H100, bf16 D = 128, 16k tokens: 69 us, cuDNN's conversion 76; reading the
// fragment order element by element took 110). Dynamic shared memory: tile_rows x (columns + 8)
// elements.
// (16-bit outputs only: bwd_sm90 runs no float32.)
#if CUFLASH_DTYPE != 2
__device__ __forceinline__ void bwd_convert_tiles(const ConvertParams& cp) {
    extern __shared__ __align__(16) unsigned char convert_smem[];
    const int tile = blockIdx.x, h = blockIdx.y, b = blockIdx.z, rows = cp.tile_rows;
    const bool varlen = cp.cu_seqlens != nullptr;
    const int row0 = varlen ? cp.cu_seqlens[b] : 0;
    const int seqlen = varlen ? cp.cu_seqlens[b + 1] - row0 : cp.rows;
    if (tile * rows >= seqlen) return;
    if (cp.done != nullptr) {   // launched behind bwd_sm90, which may still run: wait for this head's adds
        if (threadIdx.x == 0)
            acquire_wait(cp.done + dq_done_index(b, h, cp.heads, cp.heads_per_slot), cp.done_expected);
        __syncthreads();
    }
    // Rows padded by 16 bytes: a warp's stores (8 rows x 4 column pairs) hit 32 banks.
    const int width = static_cast<int>(cp.src_row_stride), pitch = width + 8;
    const float4* src = reinterpret_cast<const float4*>(
        cp.src + b * cp.src_batch_stride + h * cp.src_head_stride +
        (dq_tile_row0(row0, b, rows, varlen) + tile * rows) * cp.src_row_stride);
    elem_t* rowmajor = reinterpret_cast<elem_t*>(convert_smem);
    if (rows == 80) {
        // Shares of dQ^T: float4 f holds elements (r, c), (r + 1, c), (r, c + 8), (r + 1, c + 8).
        for (int f = threadIdx.x; f < rows * width / 4; f += blockDim.x) {
            const int share = f / 1280, row8 = (f % 1280) / 128, thread = f % 128;
            const int c = share * 64 + (thread / 32) * 16 + (thread % 32) / 4, r = row8 * 8 + 2 * (thread % 4);
            const float4 v = __ldcg(src + f);   // L2: other SMs' reductions wrote it (cp.done)
            rowmajor[r * pitch + c] = from_float<elem_t>(v.x * cp.scale);
            rowmajor[(r + 1) * pitch + c] = from_float<elem_t>(v.y * cp.scale);
            rowmajor[r * pitch + c + 8] = from_float<elem_t>(v.z * cp.scale);
            rowmajor[(r + 1) * pitch + c + 8] = from_float<elem_t>(v.w * cp.scale);
        }
    }
    for (int f = threadIdx.x; rows != 80 && f < rows * width / 4; f += blockDim.x) {
        // float4 f holds elements (r, c), (r, c + 1), (r + 8, c), (r + 8, c + 1): invert dq_tile_offset.
        const int share = f / 1024, col8 = (f % 1024) / 128, thread = f % 128;
        const int rr = (thread / 32) * 16 + (thread % 32) / 4, cc = col8 * 8 + 2 * (thread % 4);
        const int r = rows == 128 ? share * 64 + rr : rr, c = rows == 128 ? cc : share * 64 + cc;
        const float4 v = __ldcg(src + f);
        *reinterpret_cast<unsigned*>(&rowmajor[r * pitch + c]) = pack2<elem_t>(v.x * cp.scale, v.y * cp.scale);
        *reinterpret_cast<unsigned*>(&rowmajor[(r + 8) * pitch + c]) = pack2<elem_t>(v.z * cp.scale, v.w * cp.scale);
    }
    __syncthreads();
    elem_t* dst = static_cast<elem_t*>(cp.dst) + b * cp.dst_batch_stride + h * cp.dst_head_stride +
                  (row0 + tile * rows) * cp.dst_row_stride;
    const int n_rows = min(rows, seqlen - tile * rows);
    const bool chunks =
        cp.head_dim % 8 == 0 && cp.dst_row_stride % 8 == 0 && reinterpret_cast<size_t>(dst) % 16 == 0;
    if (chunks) {
        const int per_row = cp.head_dim / 8;
        for (int k = threadIdx.x; k < n_rows * per_row; k += blockDim.x) {
            const int r = k / per_row, c = (k % per_row) * 8;
            *reinterpret_cast<uint4*>(dst + r * cp.dst_row_stride + c) =
                *reinterpret_cast<const uint4*>(&rowmajor[r * pitch + c]);
        }
    } else {
        for (int k = threadIdx.x; k < n_rows * cp.head_dim; k += blockDim.x) {
            const int r = k / cp.head_dim, c = k % cp.head_dim;
            dst[r * cp.dst_row_stride + c] = rowmajor[r * pitch + c];
        }
    }
}
#endif

}  // namespace cuflash

extern "C" __global__ void __launch_bounds__(256) cuflash_bwd_convert(const cuflash::ConvertParams p) {
    const bool faulted = cuflash::call_faulted(p.error);
#if CUFLASH_DTYPE != 2
    if (p.tile_rows) {
        if (!faulted) cuflash::bwd_convert_tiles(p);
        // Launched behind bwd_sm90 (p.done), this grid must not end before bwd_sm90 has: what follows
        // in the stream may read dK and dV, which bwd_sm90 writes after its counts. One CTA waits.
        if (p.done != nullptr && blockIdx.x + blockIdx.y + blockIdx.z == 0) cuflash::wait_for_prior_kernel();
        return;
    }
#endif
    if (!faulted) cuflash::bwd_convert(p);
}

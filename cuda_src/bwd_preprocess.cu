// Backward preprocessing, one thread octet per query row:
//   dsum[b, h, i] = D_i = rowsum(dO_i * O_i)   (float32; the dS = P (dP - D) term of every backward pass)
//                   - dlse_i                   (when the loss reads lse: d lse_i / d s_ij = P_ij, so its
//                                               gradient joins dS as P (dP - D + dlse))
//   lse2[b, h, i] = lse_i * log2(e)            (the passes exponentiate in base 2)
// in a layout padded to seqlen_q_pad rows per (sequence, head), so that the passes read whole tiles
// without bounds checks. A row that sees no key (lse = -inf) and every pad row get lse2 = +inf,
// which makes their P exactly 0 (2^(s - inf)) instead of NaN; pad rows get D = 0.
// With return_dsinks (BwdParams::dsink_part) each CTA also writes the sum over its rows of
//   -exp(sinks[h] - lse_i) D_i                (dL/dsinks[h]'s terms: the sink's probability times -D_i,
//                                              D_i less dlse_i as above)
// which bwd_dsinks.cu adds up per head in a fixed order.
// It also zeroes the row's dq_accum (when the dK/dV pass accumulates dQ with atomics) and bwd_sm90's
// dq_done and dq_semaphore counters, which saves the call a memset (~1-2 us of host time). Rows outside
// every varlen sequence are not rows of any CTA here: cuflash/backward.py zeroes varlen accumulators
// with a memset as well.
//
// Grid: (seqlen_q_pad / 16, Hq, B), 128 threads. Compile-time: CUFLASH_DTYPE (0 fp16, 1 bf16, 2 fp32),
// CUFLASH_DQ_FIRST_STORES (1: dq_accum is left as it is, its tiles' first writers store them).
#include "common.cuh"
#include "params.cuh"
#include "bwd_params.cuh"
#include "fault.cuh"
#include "mask.cuh"
#include "bwd_common.cuh"

#ifndef CUFLASH_DQ_FIRST_STORES
#define CUFLASH_DQ_FIRST_STORES 0   // 1: bwd_sm90's first writer of each dQ tile stores it (no zeroing here)
#endif

namespace cuflash {

// Dot product of two 16-byte chunks of elem_t, in float32.
template <typename T> __device__ __forceinline__ float dot_chunk(uint4 a, uint4 b);

template <> __device__ __forceinline__ float dot_chunk<float>(uint4 a, uint4 b) {
    float acc = __uint_as_float(a.x) * __uint_as_float(b.x);
    acc = fmaf(__uint_as_float(a.y), __uint_as_float(b.y), acc);
    acc = fmaf(__uint_as_float(a.z), __uint_as_float(b.z), acc);
    return fmaf(__uint_as_float(a.w), __uint_as_float(b.w), acc);
}

template <typename T>
__device__ __forceinline__ float dot_pair(unsigned a, unsigned b) {
    const float a0 = to_float(T{static_cast<unsigned short>(a & 0xffffu)});
    const float a1 = to_float(T{static_cast<unsigned short>(a >> 16)});
    const float b0 = to_float(T{static_cast<unsigned short>(b & 0xffffu)});
    const float b1 = to_float(T{static_cast<unsigned short>(b >> 16)});
    return fmaf(a1, b1, a0 * b0);
}

template <> __device__ __forceinline__ float dot_chunk<half_t>(uint4 a, uint4 b) {
    return dot_pair<half_t>(a.x, b.x) + dot_pair<half_t>(a.y, b.y) + dot_pair<half_t>(a.z, b.z) +
           dot_pair<half_t>(a.w, b.w);
}
template <> __device__ __forceinline__ float dot_chunk<bfloat16_t>(uint4 a, uint4 b) {
    return dot_pair<bfloat16_t>(a.x, b.x) + dot_pair<bfloat16_t>(a.y, b.y) + dot_pair<bfloat16_t>(a.z, b.z) +
           dot_pair<bfloat16_t>(a.w, b.w);
}

__device__ __forceinline__ void bwd_preprocess(const BwdParams& bp) {
    const FwdParams& p = bp.fwd;
    const SeqInfo s = make_seq_info(p, blockIdx.z, blockIdx.y);
    const int i = blockIdx.x * 16 + threadIdx.x / 8, lane8 = threadIdx.x % 8;
    constexpr int kPerChunk = 16 / sizeof(elem_t);
    float acc = 0.f;
    if (i < s.seqlen_q) {
        const elem_t* o = static_cast<const elem_t*>(p.o) + s.b * p.o_batch_stride + s.h * p.o_head_stride +
                          (s.q_row0 + i) * p.o_row_stride;
        const elem_t* d_o = static_cast<const elem_t*>(bp.dout) + s.b * bp.do_batch_stride + s.h * bp.do_head_stride +
                            (s.q_row0 + i) * bp.do_row_stride;
        for (int c = lane8 * kPerChunk; c < p.head_dim_v; c += 8 * kPerChunk)   // dO and O: v's head dim
            acc += dot_chunk<elem_t>(*reinterpret_cast<const uint4*>(o + c), *reinterpret_cast<const uint4*>(d_o + c));
    }
    if (bp.dq_accum != nullptr) {
        // Row by row; bwd_sm90's tiles (dqa_tile_rows) are zeroed whole, the rows past the sequence
        // included: a tile is one block that its reductions cover entirely.
        const int tile = bp.dqa_tile_rows;
        const bool zero = tile ? i < ceil_div(s.seqlen_q, tile) * tile : i < s.seqlen_q;
        const int row = tile ? dq_tile_row0(s.q_row0, s.b, tile, p.cu_seqlens_q != nullptr) + i : s.q_row0 + i;
        const int width = tile ? static_cast<int>(bp.dqa_row_stride) : p.head_dim;
        float4* dqa = reinterpret_cast<float4*>(bp.dq_accum + s.b * bp.dqa_batch_stride + s.h * bp.dqa_head_stride +
                                                row * bp.dqa_row_stride);
        // (Not where bwd_sm90's first writer of each tile stores it: CUFLASH_DQ_FIRST_STORES.)
        if (zero && !CUFLASH_DQ_FIRST_STORES)
            for (int c = lane8; c < width / 4; c += 8) dqa[c] = make_float4(0.f, 0.f, 0.f, 0.f);
        // bwd_sm90's counters of a tile's writers (ordered dQ's turns, or the first store's counts):
        // two a tile.
        if (tile && zero && bp.dq_semaphore != nullptr && i % tile == 0 && lane8 == 0) {
            const long long counter =
                (s.b * bp.dqa_batch_stride + s.h * bp.dqa_head_stride + row * bp.dqa_row_stride) /
                (tile * bp.dqa_row_stride) * 2;
            bp.dq_semaphore[counter] = 0;
            bp.dq_semaphore[counter + 1] = 0;
        }
    }
    // bwd_sm90's persistent CTAs' counter of key blocks taken.
    if (bp.work_counter != nullptr && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0 && threadIdx.x == 0)
        *bp.work_counter = 0;
    // bwd_sm90's count of landed dQ reductions per (sequence, slot of heads_per_cta query heads).
    if (bp.dq_done != nullptr && blockIdx.x == 0 && threadIdx.x == 0 && s.h % bp.heads_per_cta == 0)
        bp.dq_done[dq_done_index(s.b, s.h, p.heads_q, bp.heads_per_cta)] = 0;
#pragma unroll
    for (int offset = 1; offset < 8; offset *= 2) acc += __shfl_xor_sync(0xffffffffu, acc, offset);
    const long long lse_at = s.b * p.lse_batch_stride + s.h * p.lse_head_stride + s.q_row0 + i;
    const float lse = i < s.seqlen_q ? p.lse[lse_at] : -CUFLASH_INF;
    // A row that sees nothing (lse = -inf) has P = 0 everywhere: its dlse (whatever a loss made of an
    // infinite lse) reaches no gradient.
    if (bp.dlse != nullptr && lse != -CUFLASH_INF) acc -= bp.dlse[lse_at];
    if (lane8 == 0) {
        const long long idx = bwd_row_index(bp, s.b, s.h, i);
        bp.dsum[idx] = acc;
        // (With a sink, a row that sees no key has lse = sinks[h], finite: its P is 0 from its -inf scores.)
        bp.lse2[idx] = lse == -CUFLASH_INF ? CUFLASH_INF : lse * kLog2e;
    }
    if (bp.dsink_part != nullptr) {   // the same for the whole launch
        // Row i's term, the sink's probability exp(sink - lse_i) times -D_i (dS of a key of value 0);
        // none for rows past the sequence and for a row with neither keys nor sink (lse = -inf).
        float term = lane8 == 0 && lse != -CUFLASH_INF ? -expf(p.sinks[s.h] - lse) * acc : 0.f;
        // The CTA's 16 rows, in a fixed order (dsinks are bitwise reproducible): the 4 rows of a warp
        // (lanes 0, 8, 16, 24), then the 4 warps.
        term += __shfl_xor_sync(0xffffffffu, term, 8);
        term += __shfl_xor_sync(0xffffffffu, term, 16);
        __shared__ float warp_terms[4];
        if (threadIdx.x % 32 == 0) warp_terms[threadIdx.x / 32] = term;
        __syncthreads();
        if (threadIdx.x == 0)
            bp.dsink_part[(static_cast<long long>(s.b) * p.heads_q + s.h) * gridDim.x + blockIdx.x] =
                (warp_terms[0] + warp_terms[1]) + (warp_terms[2] + warp_terms[3]);
    }
}

}  // namespace cuflash

extern "C" __global__ void __launch_bounds__(128) cuflash_bwd_preprocess(const cuflash::BwdParams p) {
    if (cuflash::call_faulted(p.fwd.error)) return;
    cuflash::bwd_preprocess(p);
}

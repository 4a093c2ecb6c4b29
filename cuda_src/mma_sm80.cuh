// Register-level wrappers for Ampere-style tensor-core work (sm_80+): cp.async copies from global
// to shared memory, ldmatrix from shared memory to fragments, and mma.sync m16n8k16.
#pragma once
#include "common.cuh"

namespace cuflash {

// 16-byte global -> shared copy; with valid == false it writes zeros and reads nothing, which is how
// tails past a sequence's end and head-dim padding stay out of every result.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
    const int src_bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
                 "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending)); }

// Four 8x8 b16 matrices; lanes 8q..8q+7 give the row addresses (shared-space) of matrix q.
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// d += a * b for one 16x8x16 tile: a row-major 16x16 (4 regs), b "col" 16x8 (2 regs), fp32 d.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1);

template <>
__device__ __forceinline__ void mma_16816<bfloat16_t>(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                                         unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_16816<half_t>(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Shared-memory tiles of kCols 16-bit elements per row, stored as 16-byte chunks whose index is
// XORed with (row % 8): the 8 rows an ldmatrix reads then fall in 8 different bank groups.
// kCols must be a multiple of 64 so the XOR stays inside the row.
template <int kCols>
__device__ __forceinline__ int swizzled(int row, int col) {
    static_assert(kCols % 64 == 0, "swizzle needs rows of a multiple of 8 chunks");
    const int chunk = (col >> 3) ^ (row & 7);
    return row * kCols + (chunk << 3) + (col & 7);
}

// A lane's ldmatrix addresses into a swizzled tile, for a lane that reads row `row` (+ multiples of 8)
// and 16-column steps whose 8-column half is `half` (0 or 1). Only four XOR patterns exist per lane,
// so the address of any step is one of four registers plus an immediate; written this way the
// compiler keeps 4 registers per operand instead of hoisting one per unrolled step.
template <int kCols>
struct SwizzledLanes {
    unsigned row_offset;   // bytes from the tile start to this lane's row
    unsigned xor_off[4];   // bytes to the chunk of steps 4k + v, v = 0..3, inside a 128-byte group

    __device__ __forceinline__ SwizzledLanes(int row, int half) {
        row_offset = row * kCols * 2;
#pragma unroll
        for (int v = 0; v < 4; ++v) xor_off[v] = ((2 * v + half) ^ (row & 7)) * 16;
    }
    // Shared-space address of 16-column step `step` (compile-time after unrolling), `rows_down` rows on.
    __device__ __forceinline__ unsigned at(unsigned tile, int step, int rows_down) const {
        return tile + row_offset + xor_off[step % 4] + (step / 4) * 128 + rows_down * kCols * 2;
    }
};

// Global -> shared: kRows rows x kHeadDim columns into a swizzled tile with 16-byte cp.async; rows
// past `rows` and columns past `head_dim` are zero-filled, not read (tails never reach a result).
template <int kRows, int kHeadDim, int kNThreads>
__device__ __forceinline__ void load_tile(elem_t* tile_smem, const elem_t* gmem, long long row_stride, int row0,
                                          int rows, int head_dim) {
    constexpr int kChunksPerRow = kHeadDim / 8;
    constexpr int kChunks = kRows * kChunksPerRow;
    if constexpr (kNThreads % kChunksPerRow == 0 && kRows % (kNThreads / kChunksPerRow) == 0) {
        // Each thread keeps one 16-byte column and walks down the rows by a constant stride.
        constexpr int kRowStep = kNThreads / kChunksPerRow;
        const int r = threadIdx.x / kChunksPerRow, c = (threadIdx.x % kChunksPerRow) * 8;
        const bool col_valid = c < head_dim;
        const elem_t* src = gmem + (row0 + r) * row_stride + c;
#pragma unroll
        for (int it = 0; it < kRows / kRowStep; ++it) {
            const bool valid = col_valid && row0 + r + it * kRowStep < rows;
            cp_async_16(tile_smem + swizzled<kHeadDim>(r + it * kRowStep, c), valid ? src : gmem, valid);
            src += kRowStep * row_stride;
        }
    } else {
#pragma unroll
        for (int it = 0; it < ceil_div(kChunks, kNThreads); ++it) {
            const int idx = threadIdx.x + it * kNThreads;
            if (kChunks % kNThreads != 0 && idx >= kChunks) break;
            const int r = idx / kChunksPerRow, c = (idx % kChunksPerRow) * 8;
            const bool valid = row0 + r < rows && c < head_dim;
            cp_async_16(tile_smem + swizzled<kHeadDim>(r, c), valid ? gmem + (row0 + r) * row_stride + c : gmem,
                        valid);
        }
    }
}

}  // namespace cuflash

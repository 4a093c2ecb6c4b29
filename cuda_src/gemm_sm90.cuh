// Tile GEMMs on wgmma (sm_90a) over 128B-swizzled shared-memory tiles: the products of the Hopper
// kernels, named by what they compute, for one warpgroup's 64 accumulator rows.
//
// Tiles are stored as TMA writes them: column blocks of 64 elements (one 128-byte swizzle row) x
// all rows of the tile, 1024-byte aligned. An operand is either
//   K-major: its tile's rows are the M (or N) index and its columns the contraction index K
//     (Q, K, dO as they come from global memory, for S = Q K^T): a k-step of 16 columns is 32 bytes
//     inside a column block, and the next block starts rows x 128 bytes further;
//   MN-major: its tile's rows are K and its columns M or N (V in P V, dO in P^T dO): a k-step of 16
//     rows is 2048 bytes; the descriptor's leading byte offset is the distance between column blocks.
// A descriptor's address field is its low bits, so a k-step's descriptor is the tile's plus the
// step's byte offset / 16 (one add per wgmma).
//
// Accumulators are flat float arrays of N / 2 per thread (wgmma_sm90.cuh gives the layout: the
// mma.sync C layout of one 16-row m-tile per warp, N / 8 n-tiles of 4).
#pragma once
#include "common.cuh"
#include "tma_sm90.cuh"
#include "wgmma_sm90.cuh"

namespace cuflash {

// Byte offset of k-step kk (16 contraction elements) in a K-major tile of kRows rows.
template <int kRows>
__device__ __forceinline__ constexpr unsigned kmajor_step(int kk) {
    return (kk / 4) * kRows * 128 + (kk % 4) * 32;
}
// Byte offset of k-step kk (16 rows) in an MN-major tile.
__device__ __forceinline__ constexpr unsigned mnmajor_step(int kk) { return kk * 2048; }

template <int N>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], unsigned long long a, unsigned long long b, int scale_d) {
    static_assert(N == 32 || N == 64 || N == 80 || N == 96 || N == 128, "wgmma n of 32, 64, 80, 96 or 128");
    if constexpr (N == 32) wgmma_ss_n32(d, a, b, scale_d);
    else if constexpr (N == 64) wgmma_ss_n64(d, a, b, scale_d, elem_t{});
    else if constexpr (N == 80) wgmma_ss_n80<0>(d, a, b, scale_d);
    else if constexpr (N == 96) wgmma_ss_n96(d, a, b, scale_d);
    else wgmma_ss_n128(d, a, b, scale_d, elem_t{});
}
template <int N>
__device__ __forceinline__ void wgmma_ss_first(float (&d)[N / 2], unsigned long long a, unsigned long long b) {
    static_assert(N == 32 || N == 64 || N == 80 || N == 96 || N == 128, "wgmma n of 32, 64, 80, 96 or 128");
    if constexpr (N == 32) wgmma_ss_n32_first(d, a, b);
    else if constexpr (N == 64) wgmma_ss_n64_first(d, a, b, elem_t{});
    else if constexpr (N == 80) wgmma_ss_n80_first<0>(d, a, b);
    else if constexpr (N == 96) wgmma_ss_n96_first(d, a, b);
    else wgmma_ss_n128_first(d, a, b, elem_t{});
}
template <int N>
__device__ __forceinline__ void wgmma_rs(float* acc, const unsigned (&a)[4], unsigned long long b) {
    static_assert(N == 64 || N == 128, "wgmma n of 64 or 128");
    float(&d)[N / 2] = *reinterpret_cast<float(*)[N / 2]>(acc);
    if constexpr (N == 64) wgmma_rs_n64(d, a, b, elem_t{});
    else wgmma_rs_n128(d, a, b, elem_t{});
}

// acc (64 x N) = A B^T: A = 64 rows of a K-major tile of kARows rows starting at a_tile, B = the N
// rows of a K-major tile of kBRows rows at b_tile; kK contraction columns. acc is only written, or
// with kAccumulate added to (acc += A B^T).
template <int N, int kK, int kARows, int kBRows, bool kAccumulate = false>
__device__ __forceinline__ void gemm_abt_ss(float (&acc)[N / 2], unsigned a_tile, unsigned b_tile) {
    const unsigned long long a = smem_desc(a_tile, 16, 1024), b = smem_desc(b_tile, 16, 1024);
    if constexpr (kAccumulate) wgmma_ss<N>(acc, a, b, 1);
    else wgmma_ss_first<N>(acc, a, b);
#pragma unroll
    for (int kk = 1; kk < kK / 16; ++kk)
        wgmma_ss<N>(acc, a + (kmajor_step<kARows>(kk) >> 4), b + (kmajor_step<kBRows>(kk) >> 4), 1);
}

// acc (64 x N) += A B: A (64 x kK) in registers as kK / 16 A fragments, B the first N columns of an
// MN-major tile of kBRows rows (>= kK) at b_tile. Only k-steps kFrom .. kTo - 1 (16 contraction
// elements each): a product may be issued in two parts, around other work.
template <int N, int kK, int kBRows, int kFrom = 0, int kTo = kK / 16>
__device__ __forceinline__ void gemm_ab_rs(float (&acc)[N / 2], const unsigned (&a)[kK / 16][4], unsigned b_tile) {
    const unsigned long long b = smem_desc(b_tile, kBRows * 128, 1024);
#pragma unroll
    for (int kk = kFrom; kk < kTo; ++kk) wgmma_rs<N>(acc, a[kk], b + (mnmajor_step(kk) >> 4));
}

// acc (64 x N) += A B: A = the 64 rows of a K-major tile (kK columns: one column block), B the
// first N (64 or 128) columns of an MN-major tile of kBRows rows (>= kK) at b_tile.
template <int N, int kK, int kBRows>
__device__ __forceinline__ void gemm_ab_ss(float (&acc)[N / 2], unsigned a_tile, unsigned b_tile) {
    static_assert(kK <= 64, "A is one column block");
    static_assert(N == 64 || N == 128, "wgmma n of 64 or 128");
    const unsigned long long a = smem_desc(a_tile, 16, 1024), b = smem_desc(b_tile, kBRows * 128, 1024);
#pragma unroll
    for (int kk = 0; kk < kK / 16; ++kk) {
        if constexpr (N == 64) wgmma_ss_n64_tb(acc, a + (kmajor_step<64>(kk) >> 4), b + (mnmajor_step(kk) >> 4));
        else wgmma_ss_n128_tb(acc, a + (kmajor_step<64>(kk) >> 4), b + (mnmajor_step(kk) >> 4));
    }
}

// acc (64 x 64) = A B over kK: A^T is 64 columns of an MN-major tile (rows = K) at a_tile, B the
// first 64 columns of an MN-major tile at b_tile (both tiles have kK rows). acc is only written.
template <int kK>
__device__ __forceinline__ void gemm_atb_ss_n64(float (&acc)[32], unsigned a_tile, unsigned b_tile) {
    const unsigned long long a = smem_desc(a_tile, kK * 128, 1024), b = smem_desc(b_tile, kK * 128, 1024);
    wgmma_ss_n64_tt_first(acc, a, b, elem_t{});
#pragma unroll
    for (int kk = 1; kk < kK / 16; ++kk)
        wgmma_ss_n64_tt(acc, a + (mnmajor_step(kk) >> 4), b + (mnmajor_step(kk) >> 4), 1, elem_t{});
}

// acc (64 x N) = A B over kK: A^T is an MN-major tile of kK rows at a_tile (its one column block of
// 64 is A's 64 rows), B the N rows of a K-major tile of kBRows rows at b_tile (N = 80: the query
// rows of a dQ^T = K^T dS^T step). acc is only written.
template <int N, int kK, int kBRows>
__device__ __forceinline__ void gemm_atbt_ss(float (&acc)[N / 2], unsigned a_tile, unsigned b_tile) {
    static_assert(N == 80, "wgmma n of 80");
    const unsigned long long a = smem_desc(a_tile, kK * 128, 1024), b = smem_desc(b_tile, 16, 1024);
    wgmma_ss_n80_first<1>(acc, a, b);
#pragma unroll
    for (int kk = 1; kk < kK / 16; ++kk)
        wgmma_ss_n80<1>(acc, a + (mnmajor_step(kk) >> 4), b + (kmajor_step<kBRows>(kk) >> 4), 1);
}

// Four 8 x 8 matrices of 16-bit elements from registers to shared memory, transposed: register i
// holds matrix i in the mma fragment layout (row lane / 4, columns 2 (lane % 4) + {0, 1}), and
// lanes 8i .. 8i + 7 give the addresses of the 8 stored rows of matrix i (16 bytes each), stored
// row j being the fragment's column j.
__device__ __forceinline__ void stmatrix_x4_trans(unsigned addr, const unsigned (&r)[4]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r[0]),
                 "r"(r[1]), "r"(r[2]), "r"(r[3])
                 : "memory");
}

// A warpgroup's 64 x kCols operand in A fragments (frags[kk]: columns 16 kk .. 16 kk + 15 of the
// warp's 16 rows, the layout of wgmma's accumulators and register A operand) stored transposed into
// a K-major tile of kCols rows x 64 columns (one column block, 128B-swizzled, 1024-byte aligned):
// the tile's row c is the operand's column c. Fragment j of a k-step is the 8 x 8 block of rows
// 16 warp + 8 (j % 2) and columns 16 kk + 8 (j / 2), which lands in 16-byte chunk 2 warp + j % 2 of
// 8 tile rows (chunks XOR-swizzled by row: 8 rows x 16 bytes hit all 32 banks).
template <int kCols>
__device__ __forceinline__ void store_transposed(unsigned tile, const unsigned (&frags)[kCols / 16][4]) {
    const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
    const int j = lane / 8, r = lane % 8;
    const unsigned row = tile + (8 * (j / 2) + r) * 128 + (((2 * warp + j % 2) ^ r) * 16);
#pragma unroll
    for (int kk = 0; kk < kCols / 16; ++kk) stmatrix_x4_trans(row + kk * 16 * 128, frags[kk]);
}

// Zeroes rows first_row .. kRows - 1 of a tile of kColBlocks column blocks, split over the
// consumer warpgroups' threads (128 .. 128 (kConsumers + 1) - 1), then makes the stores visible to
// wgmma and meets at named barrier 1. The 128B swizzle permutes 16-byte chunks only inside a row,
// so a whole row stays where it was. (Varlen tiles that run past their sequence hold the next
// sequence's rows; products that would meet them as 0 * x, NaN when x is, get zeros instead.)
// kBlockPitch and kGroupPitch: the bytes between column blocks and between 8-row groups (a tile in
// row groups, fwd_sm90's kKvRowGroups, has its groups' column blocks side by side).
template <int kRows, int kColBlocks, int kConsumers, int kBlockPitch = kRows * 128, int kGroupPitch = 1024>
__device__ __forceinline__ void zero_tile_rows(unsigned tile, int first_row) {
    const int chunks_per_block = (kRows - first_row) * 8;   // 16-byte chunks, 8 per 128-byte row
    for (int c = threadIdx.x - 128; c < chunks_per_block * kColBlocks; c += 128 * kConsumers) {
        const int blk = c / chunks_per_block, r = first_row + c % chunks_per_block / 8;
        const unsigned addr = tile + blk * kBlockPitch + r / 8 * kGroupPitch + r % 8 * 128 + (c % 8) * 16;
        asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(addr), "r"(0) : "memory");
    }
    fence_proxy_async();   // the generic-proxy stores must be visible to the wgmma that reads the tile
    named_barrier_sync(1, 128 * kConsumers);
}

}  // namespace cuflash

// Types, small math helpers and the element-type switch shared by every kernel family.
#pragma once
// No CUDA headers: the 16-bit types below are plain storage and the conversions are single PTX
// instructions, so NVRTC needs no include path (pip-only installs have no toolkit headers).
namespace cuflash {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

// Floor division that is right for negative numerators (window bounds can start left of 0).
__host__ __device__ constexpr int floor_div(int a, int b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }

// 2^x on the special-function unit; relative error ~2^-22, -inf -> 0, which the online softmax relies on.
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// 1/x and log2(x) on the special-function unit, one instruction each (ftz: a subnormal x reads as
// 0). __fdividef and __log2f add ~5 instructions each to rescale subnormal inputs.
__device__ __forceinline__ float fast_rcp(float x) {
    float y;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ float fast_log2(float x) {
    float y;
    asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// +infinity as a bit pattern (NVRTC without headers has no INFINITY macro).
#define CUFLASH_INF __int_as_float(0x7f800000)

// 16-bit storage types; arithmetic happens in float32.
struct half_t { unsigned short bits; };
struct bfloat16_t { unsigned short bits; };

// Shared-space address (what ldmatrix, cp.async, TMA and wgmma descriptors take).
__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// threadIdx.x / 128 (the warpgroup). kUniform: passed through a shuffle from lane 0, so that the
// compiler knows every lane of a warp holds it and what is computed from it (shared-memory addresses,
// wgmma descriptors) stays in uniform registers instead of being moved there (R2UR) before each wgmma;
// every lane of the warp must then call it. (bwd_sm90 at D = 128 ran 53 R2UR a consumer warp a step
// without it.) BwdSm90Config::kUniformWarpgroup says where it is used.
template <bool kUniform>
__device__ __forceinline__ int warpgroup_index() {
    return kUniform ? __shfl_sync(0xffffffff, threadIdx.x / 128, 0) : static_cast<int>(threadIdx.x / 128);
}

// Element type codes, one numbering for every kernel: CUFLASH_DTYPE, merge's CUFLASH_IN_DTYPE and
// CUFLASH_OUT_DTYPE, and the run-time bias_dtype (cuflash/features.py DTYPE_CODES; a CPU test holds
// the two tables together).
enum DtypeCode : int { kFloat16 = 0, kBFloat16 = 1, kFloat32 = 2, kFloat64 = 3 };

// Element type chosen by -DCUFLASH_DTYPE (a DtypeCode: 0 fp16, 1 bf16, 2 fp32), fixed per module.
#ifndef CUFLASH_DTYPE
#define CUFLASH_DTYPE 1
#endif
#if CUFLASH_DTYPE == 0
typedef half_t elem_t;
#elif CUFLASH_DTYPE == 1
typedef bfloat16_t elem_t;
#else
typedef float elem_t;
#endif

__device__ __forceinline__ float to_float(half_t x) {
    float y;
    asm("cvt.f32.f16 %0, %1;" : "=f"(y) : "h"(x.bits));
    return y;
}
__device__ __forceinline__ float to_float(bfloat16_t x) { return __uint_as_float(unsigned(x.bits) << 16); }
__device__ __forceinline__ float to_float(float x) { return x; }

// Two floats rounded to nearest and packed into one 32-bit register, lo in the low half (the order
// of mma operands and of memory).
template <typename T> __device__ __forceinline__ unsigned pack2(float lo, float hi);
template <> __device__ __forceinline__ unsigned pack2<half_t>(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
template <> __device__ __forceinline__ unsigned pack2<bfloat16_t>(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ half_t from_float<half_t>(float x) {
    return half_t{static_cast<unsigned short>(pack2<half_t>(x, 0.f) & 0xffffu)};
}
template <> __device__ __forceinline__ bfloat16_t from_float<bfloat16_t>(float x) {
    return bfloat16_t{static_cast<unsigned short>(pack2<bfloat16_t>(x, 0.f) & 0xffffu)};
}

// Bias arrays keep the caller's dtype (a run-time DtypeCode: float32, float16 or bfloat16) so that a
// broadcast bias is never converted into a materialised copy.
__device__ __forceinline__ float load_as_float(const void* base, long long index, int dtype_code) {
    if (dtype_code == kFloat32) return static_cast<const float*>(base)[index];
    if (dtype_code == kFloat16) return to_float(static_cast<const half_t*>(base)[index]);
    return to_float(static_cast<const bfloat16_t*>(base)[index]);
}

}  // namespace cuflash

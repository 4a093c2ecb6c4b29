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

// 2^x for x <= 0 on the FMA pipe instead of the special-function unit, which at head dim 64 is as
// busy as the tensor cores (one exp2 per score against 256 FLOPs of matmul); the softmax sends a
// fraction of its exponentials here so that both pipes share the work. x = n + f with n = round(x)
// (adding 1.5 * 2^23 leaves round(x) in the low mantissa bits), 2^f for |f| <= 1/2 by a degree-4
// polynomial (relative error < 3e-6, fitted for this file), times 2^n built in the exponent field.
// x is clamped to -127 first (max.NaN keeps a NaN a NaN), where 2^n is built as +0: -inf (masked
// scores) gives exactly 0, as ex2 does. Results below 2^-126 flush to 0, as ex2.ftz does.
__device__ __forceinline__ float exp2_fma(float x) {
    asm("max.NaN.f32 %0, %0, 0fC2FE0000;" : "+f"(x));   // -127
    const float shifted = x + 12582912.f;              // 1.5 * 2^23: round(x) in the low bits
    const float f = x - (shifted - 12582912.f);
    float p = 0.009582853f;
    p = fmaf(p, f, 0.05590643f);
    p = fmaf(p, f, 0.24024099f);
    p = fmaf(p, f, 0.69312418f);
    p = fmaf(p, f, 1.f);
    // (round(x) + 127) << 23: the bits of 2^round(x) (a NaN's bits give a finite scale, and p is NaN).
    return p * __int_as_float((__float_as_int(shifted) << 23) + 0x3F800000);
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

// Element type chosen by -DCUFLASH_DTYPE (0: fp16, 1: bf16, 2: fp32), fixed per compiled module.
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

// Bias arrays keep the caller's dtype (run-time code: 0 float32, 1 float16, 2 bfloat16) so that a
// broadcast bias is never converted into a materialised copy.
__device__ __forceinline__ float load_as_float(const void* base, long long index, int dtype_code) {
    if (dtype_code == 0) return static_cast<const float*>(base)[index];
    if (dtype_code == 1) return to_float(static_cast<const half_t*>(base)[index]);
    return to_float(static_cast<const bfloat16_t*>(base)[index]);
}

}  // namespace cuflash

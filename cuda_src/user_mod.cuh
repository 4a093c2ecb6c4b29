// What the code generated from a user-written modifier (cuflash/modifiers/cuda.py) calls: its
// arguments' block, array reads that give 0 outside the array, and the integer and NaN rules of the
// grammar (cuflash/modifiers/check.py), so that the kernels and the float64 reference agree.
#pragma once
#include "common.cuh"

namespace cuflash {
namespace user {

constexpr int kMaxArrays = 8;
constexpr int kMaxScalars = 8;

// A modifier's named arguments: arrays by address and element count (their dtypes are compiled in),
// scalars by value (not compiled in: a new value needs no new kernel). Floats are float32, ints and
// bools 64-bit.
struct Args {
    const void* ptr[kMaxArrays];
    long long size[kMaxArrays];
    float f[kMaxScalars];
    long long i[kMaxScalars];
};

// Rounding toward minus infinity, as Python and NumPy do; a zero divisor gives 0.
__device__ __forceinline__ long long floor_div(long long a, long long b) {
    if (b == 0) return 0;
    long long q = a / b;
    if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
    return q;
}
__device__ __forceinline__ long long floor_mod(long long a, long long b) {
    if (b == 0) return 0;
    long long r = a % b;
    if (r != 0 && ((r < 0) != (b < 0))) r += b;
    return r;
}

// min and max that return NaN when either side is NaN (NumPy's minimum and maximum).
__device__ __forceinline__ float nan_min(float a, float b) { return (a != a || b != b) ? a + b : (a < b ? a : b); }
__device__ __forceinline__ float nan_max(float a, float b) { return (a != a || b != b) ? a + b : (a > b ? a : b); }
__device__ __forceinline__ long long int_min(long long a, long long b) { return a < b ? a : b; }
__device__ __forceinline__ long long int_max(long long a, long long b) { return a > b ? a : b; }
__device__ __forceinline__ long long int_abs(long long a) { return a < 0 ? -a : a; }

// Element i of an argument array, 0 outside [0, size).
__device__ __forceinline__ bool inside(const Args& a, int k, long long i) { return i >= 0 && i < a.size[k]; }
__device__ __forceinline__ float read_f16(const Args& a, int k, long long i) {
    return inside(a, k, i) ? to_float(static_cast<const half_t*>(a.ptr[k])[i]) : 0.f;
}
__device__ __forceinline__ float read_bf16(const Args& a, int k, long long i) {
    return inside(a, k, i) ? to_float(static_cast<const bfloat16_t*>(a.ptr[k])[i]) : 0.f;
}
__device__ __forceinline__ float read_f32(const Args& a, int k, long long i) {
    return inside(a, k, i) ? static_cast<const float*>(a.ptr[k])[i] : 0.f;
}
__device__ __forceinline__ float read_f64(const Args& a, int k, long long i) {
    return inside(a, k, i) ? float(static_cast<const double*>(a.ptr[k])[i]) : 0.f;
}
template <typename T>
__device__ __forceinline__ long long read_int(const Args& a, int k, long long i) {
    return inside(a, k, i) ? static_cast<long long>(static_cast<const T*>(a.ptr[k])[i]) : 0ll;
}
__device__ __forceinline__ bool read_bool(const Args& a, int k, long long i) {
    return inside(a, k, i) && static_cast<const unsigned char*>(a.ptr[k])[i] != 0;
}

}  // namespace user
}  // namespace cuflash

// The functions written from a call's modifiers (cuflash/modifiers/cuda.py). A variant that has them
// (CUFLASH_SCORE_MODS bits kModUserScore / kModUserMask, cuda_src/mask.cuh) gets their definitions ahead
// of its source (cuflash/_build/compile.py); the declarations let mask.cuh name them in every variant,
// and a variant without them never calls them (not inline here: an inline function named but never
// defined is an error even in a discarded branch). q_idx and kv_idx are positions in the sequence, h
// the query head; the score is in natural units, after softcap, ALiBi and bias.
__device__ float user_score_mod(float score, long long b, long long h, long long q_idx, long long kv_idx,
                                const cuflash::user::Args& args);
__device__ float user_score_mod_grad(float score, long long b, long long h, long long q_idx, long long kv_idx,
                                     const cuflash::user::Args& args);
__device__ bool user_mask_mod(long long b, long long h, long long q_idx, long long kv_idx,
                              const cuflash::user::Args& args);

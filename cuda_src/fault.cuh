// A call's verdict on its index arrays, as every kernel of the call reads it.
//
// cuda_src/check_indices.cu validates cache_seqlens, block_table and cu_seqlens on the device (the
// host never reads them back) and writes the verdict into a device word; every later kernel of the
// call gets that word and returns at entry when it is non-zero, so bad indices produce no
// out-of-bounds access and no partly written output or cache. Stream order makes the check's
// write visible, and every CTA of a launch reads the same word, so a launch returns as a whole.
#pragma once

namespace cuflash {

// error == nullptr: no check ran for this call.
__device__ __forceinline__ bool call_faulted(const int* error) { return error != nullptr && *error != 0; }

// Kernels that cuflash launches right behind another kernel of the same call may be launched as
// programmatic dependents (sm_90): they start while the kernel ahead is still running, read and
// compute with their own bounds checks, and wait for it (and see its writes) here, before their
// first global write or their first read of what it wrote. Such launches are decode's and
// mla_sm90's behind their index check, which then costs the stream nothing. Launched without the
// attribute, or below sm_90, the wait returns at once.
//
// A kernel ahead lets its dependents start before it ends only by saying so (otherwise they start
// at its end, which saves just the launch): the index check does at its first instruction, since
// its dependents wait for its verdict anyway.
__device__ __forceinline__ void let_dependents_start() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_for_prior_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

}  // namespace cuflash

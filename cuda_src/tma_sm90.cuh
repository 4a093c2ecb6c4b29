// Tensor-memory-accelerator copies and the mbarriers they complete on (sm_90).
//
// A producer thread arms a barrier with the bytes it expects (arrive.expect_tx) and issues bulk
// tensor copies that count those bytes down; consumers wait on the barrier's phase parity. Empty
// barriers count consumer arrivals, so the producer knows when a stage may be overwritten.
#pragma once

namespace cuflash {

// cuTensorMapEncodeTiled's 128-byte descriptor, passed by value as a __grid_constant__ parameter.
struct __align__(64) TmaMap {
    unsigned long long words[16];
};

__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}

// The barrier counts one arrival of this thread once its cp.async copies issued so far have landed
// (.noinc: the barrier's count includes it).
__device__ __forceinline__ void cp_async_arrive_noinc(unsigned bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// Makes barrier initialisation visible to the async proxy (TMA) before first use.
__device__ __forceinline__ void fence_barrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// Spins until the barrier has completed the phase with this parity.
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
    asm volatile(
        "{\n.reg .pred ready;\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 ready, [%0], %1;\n"
        "@!ready bra WAIT_%=;\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}

// Makes this thread's ordinary shared-memory writes visible to the async proxy (wgmma, TMA).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Barrier `id` (1..15; 0 is __syncthreads) for `threads` threads, whole warps.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Arrives at barrier `id` without waiting: the threads that sync there wait for these too.
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// One box of a 4-d tensor map (coordinates innermost first) into shared memory at dst.
// Coordinates past the tensor's extent read as zeros: that is how tails stay out of results.
__device__ __forceinline__ void tma_load_4d(unsigned dst, const TmaMap* map, int c0, int c1, int c2, int c3,
                                            unsigned bar) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(dst),
        "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
        : "memory");
}

// One box of a 5-d tensor map (coordinates innermost first), as tma_load_4d.
__device__ __forceinline__ void tma_load_5d(unsigned dst, const TmaMap* map, int c0, int c1, int c2, int c3, int c4,
                                            unsigned bar) {
    asm volatile(
        "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4, %5, %6}], [%7];\n" ::"r"(dst),
        "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(bar)
        : "memory");
}

// `bytes` contiguous bytes (a multiple of 16, both addresses 16-byte aligned) from global memory
// into shared memory at dst, counted on bar like a tensor copy.
__device__ __forceinline__ void bulk_load(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}

// One box from shared memory at src into a 4-d tensor map; coordinates past the tensor's extent
// are not written. Completion is tracked by bulk groups of the issuing thread (below).
__device__ __forceinline__ void tma_store_4d(const TmaMap* map, unsigned src, int c0, int c1, int c2, int c3) {
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n" ::"l"(map),
                 "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(src)
                 : "memory");
}
// dst[0 .. bytes / 4) += the floats at src (shared memory), by the bulk-copy unit: a reduction that
// costs the issuing thread one instruction. Tracked by bulk groups like the stores above.
__device__ __forceinline__ void bulk_reduce_add(float* dst, unsigned src, unsigned bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst), "r"(src),
                 "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Waits until this thread's bulk stores have finished reading shared memory (it may be reused).
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
// Waits until this thread's bulk stores and reductions are complete: their writes visible (before
// another CTA may add onto them in a fixed order). A CTA about to exit needs only bulk_wait_read:
// what it wrote lands before the kernel ends.
__device__ __forceinline__ void bulk_wait() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

// Adds n to a global counter once this thread's bulk stores and reductions have completed
// (bulk_wait): the proxy fence orders their writes, made by the async proxy, before the release, so
// whoever acquires the count sees them.
__device__ __forceinline__ void release_count(int* counter, int n) {
    asm volatile("fence.proxy.async.global;\n" ::: "memory");
    asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(counter), "r"(n) : "memory");
}

// `bytes` contiguous bytes (a multiple of 16, both addresses 16-byte aligned) from shared memory at src
// into global memory, tracked by this thread's bulk groups like bulk_reduce_add.
__device__ __forceinline__ void bulk_store(float* dst, unsigned src, unsigned bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst), "r"(src), "r"(bytes)
                 : "memory");
}

// A proxy fence over global memory: this thread's async-proxy accesses (bulk copies it has waited for)
// and its generic ones are ordered across it, so that a release after it covers a bulk store before it.
__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;\n" ::: "memory"); }

}  // namespace cuflash

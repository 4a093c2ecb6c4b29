"""Does compute-sanitizer racecheck order shared-memory accesses through a named barrier shared by one
warp of warpgroup 0 and the 128 threads of warpgroup 1 (bar.sync id, 160)? (A version of the 80-row
dQ hand-over with named barriers, docs/decisions.md#bwd-sm90-80-row-hand-over, got 32 racecheck
hazards on the tile index its consumer passed to its writer, though every access pair had a bar.sync
of both sides between them; with mbarriers racecheck was clean.)

Each kernel below passes an int from thread 128 (the "consumer") to the 32 lanes of warp 1 (the
"writer") N times and is race-free by construction; the host checks the sums. Run on an H100/H200:

    compute-sanitizer --tool racecheck python benchmarks/experiments/racecheck_named_barrier_probe.py

A hazard reported for ``sync_sync`` (bar.sync on both sides of both barriers) means racecheck does
not follow such barriers; ``arrive_sync`` is the v1 pattern (bar.arrive one way), ``mbarrier`` the
pattern racecheck accepted. Under ``--tool synccheck`` (H200, 2026-11-30) ``sync_sync`` is reported as
"Barrier error detected. Divergent thread(s) in block", as bwd_sm90's 80-row hand-over is: synccheck
does not take such barriers either.
"""
import cupy

SOURCE = r"""
__device__ __forceinline__ void bsync(int id, int n) { asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void barrive(int id, int n) { asm volatile("bar.arrive %0, %1;" :: "r"(id), "r"(n) : "memory"); }

// MODE 0: sync_sync; MODE 1: arrive_sync (consumer arrives on FULL, writer arrives on EMPTY)
extern "C" __global__ void __launch_bounds__(384) probe(int* out, int n) {
    __shared__ int slot;
    const int warp = threadIdx.x / 32;
    int sum = 0;
    if (warp == 1) {                       // the writer
        if (MODE == 1) barrive(7, 160);    // the slot starts free
        for (int i = 0; i < n; ++i) {
            bsync(5, 160);                 // FULL
            sum += *(volatile int*)&slot;
            if (MODE == 1) barrive(7, 160);                 // EMPTY
            else if (i + 1 < n) bsync(7, 160);
        }
        if (threadIdx.x % 32 == 0) out[blockIdx.x] = sum;
    } else if (threadIdx.x >= 128 && threadIdx.x < 256) {   // the consumer warpgroup
        for (int i = 0; i < n; ++i) {
            if (i > 0 || MODE == 1) bsync(7, 160);          // EMPTY (MODE 1: the writer pre-arrives)
            if (threadIdx.x == 128) slot = i + 1;
            if (MODE == 0) bsync(5, 160); else barrive(5, 160);
        }
        if (MODE == 1) bsync(7, 160);      // the writer's last arrival
    }
}

__device__ __forceinline__ void mbar_init(unsigned long long* b, int count) {
    asm volatile("mbarrier.init.shared.b64 [%0], %1;" :: "r"((unsigned)__cvta_generic_to_shared(b)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned long long* b) {
    asm volatile("{ .reg .b64 st; mbarrier.arrive.shared.b64 st, [%0]; }" :: "r"((unsigned)__cvta_generic_to_shared(b)) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned long long* b, int parity) {
    asm volatile("{ .reg .pred p; W: mbarrier.try_wait.parity.shared.b64 p, [%0], %1; @!p bra W; }"
                 :: "r"((unsigned)__cvta_generic_to_shared(b)), "r"(parity) : "memory");
}

extern "C" __global__ void __launch_bounds__(384) probe_mbarrier(int* out, int n) {
    __shared__ int slot;
    __shared__ unsigned long long full, empty;
    if (threadIdx.x == 0) { mbar_init(&full, 4); mbar_init(&empty, 1); asm volatile("fence.mbarrier_init.release.cluster;"); }
    __syncthreads();
    const int warp = threadIdx.x / 32;
    if (warp == 1 && threadIdx.x % 32 == 0) {   // the writer (one lane)
        int sum = 0;
        for (int i = 0; i < n; ++i) {
            mbar_wait(&full, i & 1);
            sum += *(volatile int*)&slot;
            mbar_arrive(&empty);
        }
        out[blockIdx.x] = sum;
    } else if (threadIdx.x >= 128 && threadIdx.x < 256) {
        for (int i = 0; i < n; ++i) {
            mbar_wait(&empty, (i & 1) ^ 1);
            if (threadIdx.x == 128) slot = i + 1;
            __syncwarp();
            if (threadIdx.x % 32 == 0) mbar_arrive(&full);
        }
    }
}
"""


def main():
    n, blocks = 8, 4
    want = n * (n + 1) // 2
    for name, mode, kernel in (("sync_sync", 0, "probe"), ("arrive_sync", 1, "probe"), ("mbarrier", 0, "probe_mbarrier")):
        module = cupy.RawModule(code=SOURCE, options=("-arch=sm_90a", f"-DMODE={mode}"))
        out = cupy.full(blocks, -1, dtype=cupy.int32)
        module.get_function(kernel)((blocks,), (384,), (out, cupy.int32(n)))
        got = out.get().tolist()
        print(f"{name}: sums {got} (want {want} each): {'ok' if got == [want] * blocks else 'WRONG'}", flush=True)


if __name__ == "__main__":
    main()

// Contract: cuflash_rng_state hands one dropout call captured in a CUDA graph its (seed, offset),
// drawn on the device at every replay of the graph. `generator` is the Generator's state on this
// GPU, (seed, next offset) (cuflash/random.py, Generator.graph_safe); the kernel copies the seed
// and the next offset into `call` (the call's rng_state, which its attention kernels read through
// FwdParams::dropout_state) and advances the generator's offset by one. The advance is atomic: two
// graphs drawing from one generator may replay at once on different streams. The seed is written
// only by the host, between replays. One thread; any launch shape works (one thread acts).
//
// call[1] is the whole 64-bit offset (rng_state as the host's Generator returns it); the Philox
// counter takes its low 32 bits (philox.cuh). Compile-time: none.

namespace cuflash {

__device__ __forceinline__ void draw_rng_state(unsigned long long* call, unsigned long long* generator) {
    const unsigned long long offset = atomicAdd(generator + 1, 1ull);
    call[0] = generator[0];
    call[1] = offset;
}

}  // namespace cuflash

extern "C" __global__ void cuflash_rng_state(unsigned long long* generator, unsigned long long* call) {
    if (blockIdx.x == 0 && threadIdx.x == 0) cuflash::draw_rng_state(call, generator);
}

// Philox4x32-10 counter-based random numbers for dropout (Random123's algorithm and constants).
//
// The keep/drop decision for score element (b, h, i, j) is a pure function of
// (seed, offset, b, h, i, j), independent of tiling, kernel family and GPU, so a backward pass
// regenerates it and the NumPy twin (cuflash/random.py) reproduces it bit for bit:
//
//   key       = (seed & 0xFFFFFFFF, seed >> 32)
//   counter   = (j / 4, i, b * num_heads_q + h, offset & 0xFFFFFFFF)      (each mod 2^32)
//               i, j at the call's origin: i + dropout_row0, j + dropout_col0 (params.cuh)
//   word      = philox4x32_10(counter, key)[j % 4]
//   threshold = min(round(p * 2^32), 2^32 - 1)        computed on the host (dropout_threshold)
//   keep      = word >= threshold;  kept values are scaled by 1 / (1 - p)
//
// NVRTC-compilable: no host headers; only built-in vector types (uint2, uint4) and __umulhi.
#pragma once

namespace cuflash {

// Round multipliers and Weyl key increments of Philox4x32 (Random123).
constexpr unsigned int kPhiloxM0 = 0xD2511F53u;
constexpr unsigned int kPhiloxM1 = 0xCD9E8D57u;
constexpr unsigned int kPhiloxW0 = 0x9E3779B9u;
constexpr unsigned int kPhiloxW1 = 0xBB67AE85u;
constexpr int kPhiloxRounds = 10;

// Four 32-bit words with named fields, so a kernel can keep them in registers.
using Philox4 = uint4;

// One Philox S-box round: two 32x32 -> 64 bit products, then a Feistel-like mix with the key.
__device__ __forceinline__ uint4 philox4x32_round(uint4 c, uint2 key) {
  const unsigned int hi0 = __umulhi(kPhiloxM0, c.x);
  const unsigned int lo0 = kPhiloxM0 * c.x;
  const unsigned int hi1 = __umulhi(kPhiloxM1, c.z);
  const unsigned int lo1 = kPhiloxM1 * c.z;
  uint4 r;
  r.x = hi1 ^ c.y ^ key.x;
  r.y = lo1;
  r.z = hi0 ^ c.w ^ key.y;
  r.w = lo0;
  return r;
}

// Philox4x32-10: ten rounds, the key bumped by (W0, W1) between rounds.
__device__ __forceinline__ uint4 philox4x32_10(uint4 counter, uint2 key) {
#pragma unroll
  for (int round = 0; round < kPhiloxRounds - 1; ++round) {
    counter = philox4x32_round(counter, key);
    key.x += kPhiloxW0;
    key.y += kPhiloxW1;
  }
  return philox4x32_round(counter, key);
}

// The four dropout words for columns 4*j4 .. 4*j4+3 of row i of (batch b, query head h).
// offset is the low 32 bits of the generator offset (the host masks it).
__device__ __forceinline__ uint4 dropout_words(unsigned long long seed, unsigned int offset,
                                               int b, int h, int i, int j4, int num_heads_q) {
  uint2 key;
  key.x = static_cast<unsigned int>(seed);
  key.y = static_cast<unsigned int>(seed >> 32);
  uint4 counter;
  counter.x = static_cast<unsigned int>(j4);
  counter.y = static_cast<unsigned int>(i);
  // Unsigned arithmetic wraps mod 2^32 exactly as the host formula does.
  counter.z = static_cast<unsigned int>(b) * static_cast<unsigned int>(num_heads_q) +
              static_cast<unsigned int>(h);
  counter.w = offset;
  return philox4x32_10(counter, key);
}

// A call's (seed, offset): the values its params carry (a call launched from the host), or, when
// p.dropout_state is not nullptr, the two words there: a call captured in a CUDA graph reads them
// from device memory, where the call's rng_state kernel (cuda_src/rng_state.cu) has written this
// replay's state; a backward given the forward's device rng_state reads that. The words are written
// before the launch and constant during it, so they come through the read-only cache.
// With the call's origin (params.cuh, dropout_row0 / dropout_col0): the call's (i, j) draws the
// counter of (i + row0, j + col0), so a block of a larger matrix draws that matrix's mask.
struct DropoutKey {
  unsigned long long seed;
  unsigned int offset;   // the low 32 bits of the generator offset
  int row0, col4;        // the origin: first row, first Philox block (dropout_col0 / 4)
};

template <class Params>
__device__ __forceinline__ DropoutKey dropout_key(const Params& p) {
  const int col4 = p.dropout_col0 >> 2;
  if (p.dropout_state == nullptr) return {p.dropout_seed, p.dropout_offset, p.dropout_row0, col4};
  return {__ldg(p.dropout_state), static_cast<unsigned int>(__ldg(p.dropout_state + 1)), p.dropout_row0, col4};
}

// i and j4 inside the call; the counter takes them at the call's origin.
__device__ __forceinline__ uint4 dropout_words(DropoutKey key, int b, int h, int i, int j4, int num_heads_q) {
  return dropout_words(key.seed, key.offset, b, h, i + key.row0, j4 + key.col4, num_heads_q);
}

// True if a score whose word is `word` survives dropout with the host-computed threshold.
__device__ __forceinline__ bool dropout_keeps(unsigned int word, unsigned int threshold) {
  return word >= threshold;
}

}  // namespace cuflash

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

}  // namespace cuflash

// Contract: cuflash_append_kv writes a call's new keys and values into its KV cache, ahead of the
// forward kernel that then reads them from there (decode's chunked prefill on fwd_sm90,
// cuflash/_prefill_plan.py). Row t of sequence b's k_new / v_new (every kv head) goes to key position
// pos = cache_seqlens[b] + t of its cache: row pos of batch b of a contiguous cache, or row
// pos % page_size of page block_table[b][pos / page_size]. Nothing else is written or read in the
// caches. Rows are copied in 16-byte chunks (the host passes 16-byte aligned rows, strides in bytes).
// Returns at entry when the call's index check found a bad cache_seqlens or block_table (*error != 0,
// fault.cuh), so a call whose appends do not fit writes nothing.
//
// Grid: (ceil(seqlen_new * heads_k * max(k_chunks, v_chunks) / kAppendThreads), batch); any block size
// (kAppendThreads is the one the host uses). Compile-time: CUFLASH_APPEND_PARAMS_SIZE (the layout).
#include "common.cuh"
#include "fault.cuh"

namespace cuflash {

constexpr int kAppendThreads = 256;

struct AppendParams {
    const void* k_new;
    const void* v_new;
    void* k_cache;
    void* v_cache;
    const int* cache_seqlens;   // (batch,): the keys each sequence holds before the append
    const int* block_table;     // (batch, max_pages); nullptr: a contiguous cache
    const int* error;           // the call's index-check verdict; nullptr: no check ran
    long long k_new_batch_stride, k_new_row_stride, k_new_head_stride;   // bytes, as below
    long long v_new_batch_stride, v_new_row_stride, v_new_head_stride;
    long long k_batch_stride, k_row_stride, k_head_stride;   // contiguous: batch; paged: page
    long long v_batch_stride, v_row_stride, v_head_stride;
    long long block_table_batch_stride;   // elements
    int seqlen_new, heads_k;
    int k_chunks, v_chunks;   // 16-byte chunks of a key row and of a value row
    int page_size;            // paged caches only
};

#ifdef CUFLASH_APPEND_PARAMS_SIZE
static_assert(sizeof(AppendParams) == CUFLASH_APPEND_PARAMS_SIZE,
              "AppendParams differs from cuflash/_runtime/params.py");
#endif

// 16-byte chunk c of the row at byte offset `from_row` of `from` into the row at `to_row` of `to`.
__device__ __forceinline__ void copy_chunk(const void* from, long long from_row, void* to, long long to_row, int c) {
    reinterpret_cast<uint4*>(static_cast<char*>(to) + to_row)[c] =
        reinterpret_cast<const uint4*>(static_cast<const char*>(from) + from_row)[c];
}

__device__ __forceinline__ void append_chunk(const AppendParams& p, int b, int t, int h, int c) {
    const int pos = p.cache_seqlens[b] + t;
    long long slot = b, row = pos;
    if (p.block_table != nullptr) {
        slot = p.block_table[b * p.block_table_batch_stride + pos / p.page_size];
        row = pos % p.page_size;
    }
    if (c < p.k_chunks)
        copy_chunk(p.k_new, b * p.k_new_batch_stride + t * p.k_new_row_stride + h * p.k_new_head_stride, p.k_cache,
                   slot * p.k_batch_stride + row * p.k_row_stride + h * p.k_head_stride, c);
    if (c < p.v_chunks)
        copy_chunk(p.v_new, b * p.v_new_batch_stride + t * p.v_new_row_stride + h * p.v_new_head_stride, p.v_cache,
                   slot * p.v_batch_stride + row * p.v_row_stride + h * p.v_head_stride, c);
}

}  // namespace cuflash

extern "C" __global__ void __launch_bounds__(cuflash::kAppendThreads) cuflash_append_kv(const cuflash::AppendParams p) {
    if (cuflash::call_faulted(p.error)) return;
    const int chunks = max(p.k_chunks, p.v_chunks);
    const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;   // (t, h, c) of sequence b
    if (i >= static_cast<long long>(p.seqlen_new) * p.heads_k * chunks) return;
    const int c = static_cast<int>(i % chunks), h = static_cast<int>(i / chunks % p.heads_k);
    const int t = static_cast<int>(i / chunks / p.heads_k);
    cuflash::append_chunk(p, blockIdx.y, t, h, c);
}

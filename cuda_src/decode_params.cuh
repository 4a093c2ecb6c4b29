// The parameter struct of the decode kernel (cuda_src/decode.cu), passed by value.
//
// Its first member is the forward's FwdParams, of which decode fills only the score-pipeline
// fields (scale, window, softcap, ALiBi, the user modifiers' arguments block), so that mask.cuh's
// rules apply to decode unchanged.
// cuflash/decode.py mirrors this layout as a NumPy structured dtype (align=True) whose size
// arrives as CUFLASH_DECODE_PARAMS_SIZE and is checked below. Order: 8-byte fields, then 4-byte.
#pragma once
#include "params.cuh"

namespace cuflash {

struct DecodeParams {
    FwdParams score;                   // scale, scale_log2, softcap, window_*, alibi_*, user; no tensors
    const void* q;                     // (B, Sq, Hq, D)
    void* k_cache;                     // contiguous (B, S_cache, Hk, D) or paged (pages, page_size, Hk, D)
    void* v_cache;
    const void* k_new;                 // (B, S_new, Hk, D) appended at cache_seqlens; nullptr: none
    const void* v_new;
    void* o;                           // (B, Sq, Hq, out_dim), the dtype of q
    float* lse;                        // (B, Hq, Sq)
    float* o_part;                     // (num_splits, B, Sq, Hq, out_dim) float32, contiguous; num_splits > 1
    float* lse_part;                   // (num_splits, B, Hq, Sq) float32, contiguous; num_splits > 1
    const int* cache_seqlens;          // (B,); nullptr: every sequence holds seqlen_cache keys
    const int* block_table;            // (B, max_pages), paged caches only
    const unsigned char* mask;         // bool, broadcast view of (B, Hq, Sq, mask_keys); nullptr: none
    const int* error;                  // the verdict of the check_indices launch ahead (score.error is not
                                       // read); nullptr: none (no check, or self_check)
    int* report;                       // host-mapped fault record (check_indices.cu), self_check only
    int* split_counters;               // num_splits > 1: (B, Hk, row_blocks) zeroed int32 of the stream, each
                                       // counting the splits done; the last one combines and resets it
    const float* k_scale;              // fp8 caches: float32 scales on the GPU, element h_kv * k_scale_stride;
    const float* v_scale;              // nullptr: k_scale_value / v_scale_value (given on the host)
    const int* cu_seqlens_q;           // (B + 1,) ragged new tokens (attention_varlen over a cache): sequence b's
                                       // queries are rows cu_seqlens_q[b] .. of q, o and lse; nullptr: Sq each
    long long q_batch_stride, q_row_stride, q_head_stride;
    long long k_batch_stride, k_row_stride, k_head_stride;   // paged: the batch stride is the page stride
    long long v_batch_stride, v_row_stride, v_head_stride;
    long long k_new_batch_stride, k_new_row_stride, k_new_head_stride;
    long long v_new_batch_stride, v_new_row_stride, v_new_head_stride;
    long long o_batch_stride, o_row_stride, o_head_stride;
    long long lse_batch_stride, lse_head_stride;            // lse rows (Sq) are contiguous
    long long block_table_batch_stride;
    long long mask_batch_stride, mask_head_stride, mask_row_stride, mask_col_stride;

    int batch, seqlen_q, heads_q, heads_k;
    int group;                         // heads_q / heads_k: query heads packed per kv head
    int head_dim;                      // run-time head dim of q/k rows (multiple of 16 bytes)
    int out_dim;                       // columns of v rows (a value head dim of its own), written to o / o_part;
                                       // MLA: the values are the key rows' first out_dim columns
    int seqlen_cache;                  // keys per sequence when cache_seqlens is null
    int seqlen_new;                    // rows of k_new / v_new (0: nothing appended)
    int page_size;                     // paged caches only
    int num_splits;                    // key ranges per (sequence, kv head, row block)
    int row_blocks;                    // CTAs along the packed rows Sq * group
    int mask_keys;                     // mask columns cover the last mask_keys keys; 0: one column for all
    int num_pages;                     // pages of a paged cache (k_cache.shape[0]); 0 for a contiguous cache
    int max_pages;                     // columns of block_table; 0 for a contiguous cache
    int self_check;                    // 1: index arrays on the GPU and no check_indices launch: the kernel
                                       // checks every length (and page) itself (decode.cu, indices_faulted)
    int k_scale_stride, v_scale_stride;   // fp8: 1 for a scale per kv head, 0 for one per tensor
    float k_scale_value, v_scale_value;   // fp8: the scales when k_scale / v_scale are nullptr
};

#ifdef CUFLASH_DECODE_PARAMS_SIZE
static_assert(sizeof(DecodeParams) == CUFLASH_DECODE_PARAMS_SIZE, "DecodeParams differs from cuflash/decode.py");
#endif

}  // namespace cuflash

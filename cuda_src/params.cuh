// The one parameter struct of the forward kernels, passed by value.
//
// cuflash/_launch.py mirrors this layout field for field as a NumPy structured dtype (align=True);
// the size it computes arrives as CUFLASH_PARAMS_SIZE and is checked below, so the two cannot drift
// silently. Order: 8-byte fields first, then 4-byte fields, so that C and NumPy pad alike.
#pragma once
#include "user_mod.cuh"

namespace cuflash {

struct FwdParams {
    // Tensors. Strides are in elements. Varlen: *_batch_stride is 0 and rows start at cu_seqlens[b].
    const void* q;
    const void* k;
    const void* v;
    void* o;
    float* lse;                        // (B, Hq, Sq) or, varlen, (Hq, total_q)
    const int* cu_seqlens_q;           // nullptr unless varlen
    const int* cu_seqlens_k;
    const float* alibi_slopes;         // nullptr: no ALiBi
    const unsigned char* mask;         // bool; nullptr: none
    const void* bias;                  // float32/float16/bfloat16; nullptr: none
    const unsigned char* block_mask;   // bool; nullptr: none
    // Attention sinks, float32 (Hq,): row (b, h, i)'s softmax denominator gains exp(sinks[h]), and lse
    // with it (online_softmax.cuh, finish); nullptr: none. The backward reads it only for dsinks.
    const float* sinks;
    // Device word written by the check_indices kernel of this call (cuda_src/check_indices.cu);
    // nullptr: no check ran; non-zero: the call's index arrays are bad and the launch writes nothing.
    const int* error;
    // fwd_sm90 over a KV cache (CUFLASH_KV_CACHE: decode's chunked prefill, cuflash/_prefill_plan.py):
    // sequence b's keys are the first seqused_k[b] + seqlen_k_new rows of its cache (nullptr: seqlen_k
    // rows), and with block_table, key j of sequence b is row j % page_size of page
    // block_table[b * block_table_batch_stride + j / page_size] (nullptr: k's batch b holds them).
    const int* block_table;
    const int* seqused_k;
    // The order in which fwd_sm90 takes a (sequence, head)'s m-blocks, or bwd_sm90's CTAs a (sequence,
    // head)'s key blocks: work_order[b * work_order_batch_stride + h * work_order_head_stride + r] is the
    // block taken r-th, longest walk first, from the block mask (cuda_src/work_order.cu); nullptr: the
    // causal order (last m-block first, first key block first). The result does not depend on it.
    const int* work_order;
    // ... and each such tile's bounds, at the same index: (first, end) of the steps (key tiles, query
    // steps) that some True block touches, the window aside. A kernel walks no step outside them, whose
    // blocks are all False (under a document mask: none past its document's end).
    const int2* work_bounds;
    long long q_batch_stride, q_row_stride, q_head_stride;
    long long k_batch_stride, k_row_stride, k_head_stride;
    long long v_batch_stride, v_row_stride, v_head_stride;
    long long o_batch_stride, o_row_stride, o_head_stride;
    long long lse_batch_stride, lse_head_stride;        // lse rows are contiguous
    long long alibi_batch_stride;                       // 0 for slopes of shape (Hq,)
    long long mask_batch_stride, mask_head_stride, mask_row_stride, mask_col_stride;
    long long bias_batch_stride, bias_head_stride, bias_row_stride, bias_col_stride;
    long long block_mask_batch_stride, block_mask_head_stride, block_mask_row_stride, block_mask_col_stride;
    long long block_table_batch_stride;
    // A block mask derived from a MaskMod may carry the MaskMod's answers bit by bit in the same
    // allocation (cuflash/_mask_blocks.py): bit j % 32 of word (b, h, i, j / 32), at mask_bits_offset
    // bytes past block_mask (0: no bits), strides in 32-bit words (0 where broadcast; a (b, h) slice
    // under 2^31 words, rows padded past the queries' and keys' ends). Then a block mask variant masks
    // a tile's partly visible blocks from the bits, with no expression compiled in.
    long long mask_bits_offset, mask_bits_batch_stride, mask_bits_head_stride, mask_bits_row_stride;
    // Dropout's (seed, offset) in device memory, read instead of the two fields below when not
    // nullptr (a call captured in a CUDA graph, whose rng_state kernel writes them at every replay;
    // or a backward given the forward's rng_state as a device array): philox.cuh, dropout_key.
    const unsigned long long* dropout_state;
    unsigned long long dropout_seed;
    // The named arguments of the call's ScoreMod and MaskMod (one block: the mask's slots follow the
    // score's), written per call; read only by variants that compile a user modifier (mask.cuh).
    user::Args user;

    int batch;                         // number of sequences
    int seqlen_q, seqlen_k;            // varlen: the maxima (they size the grid)
    int heads_q, heads_k;
    int head_dim;                      // run-time head dim of q and k (<= kHeadDim; the rest is zero-filled)
    int head_dim_v;                    // run-time head dim of v, out, dout and dv (<= kHeadDimV); decode: unused
    int window_left, window_right;     // -1: unbounded; causal has already become window_right = 0
    int block_q, block_k;              // block_mask block size
    int bias_dtype;                    // see load_as_float
    unsigned int dropout_offset;
    unsigned int dropout_threshold;    // drop iff philox word < threshold; 0: no dropout
    float scale;                       // softmax scale (natural units)
    float scale_log2;                  // scale * log2(e), for the path without score modifiers
    float softcap;                     // 0: none
    float dropout_rescale;             // 1 / (1 - p)
    // Position of the call's element (0, 0) in a larger attention matrix whose dropout mask it draws:
    // the Philox counter takes row i + dropout_row0 and column j + dropout_col0 (philox.cuh). A ring
    // step's chunk pair draws the single-GPU call's mask this way. dropout_col0 % 4 == 0 (the host
    // checks): the kernels take a call's keys in Philox blocks of 4 starting at its column 0.
    int dropout_row0, dropout_col0;
    // fwd_sm90: how many of the last (head, sequence) pairs of the item order have their m-blocks
    // numbered m-block-major (fwd_sm90.cu, WorkItem::of); 0: none. Other kernels ignore it.
    int tail_heads;
    // fwd_sm90 over a KV cache (above): the keys appended by the call (added to every seqused_k[b]), the
    // page size of a paged cache, and the rows of one TMA box (gcd(page_size, keys per tile), which a
    // page holds whole; a contiguous cache: the tile's keys).
    int seqlen_k_new, page_size, kv_box_rows;
    int work_order_batch_stride, work_order_head_stride;   // elements; 0 where the block mask broadcasts
};

#ifdef CUFLASH_PARAMS_SIZE
static_assert(sizeof(FwdParams) == CUFLASH_PARAMS_SIZE, "FwdParams differs from cuflash/_launch.py");
#endif

}  // namespace cuflash

// Contract: cuflash_check_indices validates a call's index arrays (cache_seqlens, block_table,
// cu_seqlens_q/k), which stay on the GPU, and writes the verdict into *error (0: good, else
// non-zero) exactly once per launch, whatever it finds and however many CTAs run in any order. The
// call's other kernels, launched after it on the same stream, get `error` in their params and
// return at entry when it is non-zero (fault.cuh), so bad indices never cause an out-of-bounds
// access nor a partly written output or cache. scratch (2 device ints) must be 0 on entry and is 0
// again on exit, so one buffer serves every launch of a stream. On a fault, report (host-mapped,
// 4 ints) gets one record [code, index, value] (fault codes below), code written last; the kernel
// never clears it. Launch at least one CTA (batch = 0 included: the word is written only by a CTA).
//
// Fault codes (cuflash mirrors them):
//   0  none
//   1  cache_seqlens    index b, value cache_seqlens[b]: not 0 <= len, len + seqlen_new <= capacity
//   2  block_table      index b * max_pages + p, value the entry: a page that sequence b uses
//                       (p < ceil((len + seqlen_new) / page_size)) is not in [0, num_pages)
//   3  cu_seqlens_q     index i, value cu_seqlens_q[i]: cu[0] != 0 (i = 0), cu[i] < cu[i - 1], or
//                       cu[batch] > total_q (i = batch)
//   4  cu_seqlens_k     the same for cu_seqlens_k and total_k
//   5  max_seqlen_q     index b, value cu_seqlens_q[b + 1] - cu_seqlens_q[b] > max_seqlen_q (> 0)
//   6  max_seqlen_k     the same for cu_seqlens_k and max_seqlen_k
// *error is the OR of the codes found: only its being non-zero means something; report holds one
// exact record.
//
// Grid: any number of CTAs of up to 128 threads (whole warps). The scalar rules stride over the
// grid's threads, block_table over CTAs (rows) and their threads (columns). Compile-time: none
// (CUFLASH_CHECK_PARAMS_SIZE checks the layout).
#include "common.cuh"
#include "fault.cuh"

namespace cuflash {

constexpr int kFaultNone = 0;
constexpr int kFaultCacheSeqlens = 1;
constexpr int kFaultBlockTable = 2;
constexpr int kFaultCuSeqlensQ = 3;
constexpr int kFaultCuSeqlensK = 4;
constexpr int kFaultMaxSeqlenQ = 5;
constexpr int kFaultMaxSeqlenK = 6;

constexpr int kCheckThreads = 128;

struct CheckParams {
    const int* cache_seqlens;   // (batch,); nullptr: every sequence holds `capacity` keys, nothing to check
    const int* block_table;     // (batch, max_pages), rows block_table_batch_stride elements apart; nullptr: none
    const int* cu_seqlens_q;    // (batch + 1,); nullptr: not varlen
    const int* cu_seqlens_k;    // (batch + 1,); nullptr: not varlen
    int* error;                 // device word: the call's verdict (0 = good), written once per launch by the last CTA
    int* scratch;               // device, 2 ints, 0 on entry and left 0: [0] OR of the CTAs' fault codes, [1] CTAs done
    int* report;                // host-mapped pinned memory, 4 ints: [code, index, value, 0]; written only on a fault
    long long block_table_batch_stride;
    int batch;
    int capacity;               // keys a sequence's cache holds: seqlen_cache, or max_pages * page_size
    int seqlen_new;             // tokens appended to every sequence
    int page_size;              // > 0 when block_table is given
    int num_pages;              // pages of the paged cache
    int max_pages;              // columns of block_table
    int total_q, total_k;       // rows of the packed q / k (cu_seqlens[batch] may stop short: padding)
    int max_seqlen_q, max_seqlen_k;   // the longest sequence the launches were sized for; 0: no bound
};

static_assert(sizeof(CheckParams) % 8 == 0, "NumPy (align=True) pads the struct to its 8-byte alignment");
#ifdef CUFLASH_CHECK_PARAMS_SIZE
static_assert(sizeof(CheckParams) == CUFLASH_CHECK_PARAMS_SIZE, "CheckParams differs from cuflash's mirror");
#endif

// A thread's findings: the OR of its codes, and the first fault it saw as the record to report.
struct Finding {
    int codes, code, index, value;

    __device__ __forceinline__ void fault(int what, long long where, int got) {
        codes |= what;
        if (code == kFaultNone) {
            code = what;
            index = static_cast<int>(where);
            value = got;
        }
    }
};

// cu_seqlens entry i (0 <= i <= batch): the start of sequence i, and the end of sequence i - 1.
// 64-bit differences: garbage entries must not overflow into a length that passes.
__device__ __forceinline__ void check_cu_seqlens(Finding& f, const int* cu, int i, int batch, int total,
                                                 int max_seqlen, int fault_entry, int fault_length) {
    const int here = __ldg(cu + i);
    if (i == 0 && here != 0) f.fault(fault_entry, i, here);
    if (i == batch && here > total) f.fault(fault_entry, i, here);
    if (i > 0) {
        const long long length = static_cast<long long>(here) - __ldg(cu + i - 1);
        if (length < 0) f.fault(fault_entry, i, here);
        else if (max_seqlen > 0 && length > max_seqlen) f.fault(fault_length, i - 1, static_cast<int>(length));
    }
}

// Keys that sequence b holds after the append; -1: its cache_seqlens entry is itself a fault.
__device__ __forceinline__ long long keys_after_append(const CheckParams& p, int b) {
    if (p.cache_seqlens == nullptr) return static_cast<long long>(p.capacity) + p.seqlen_new;
    const int len = __ldg(p.cache_seqlens + b);
    const long long keys = static_cast<long long>(len) + p.seqlen_new;
    return len < 0 || keys > p.capacity ? -1 : keys;
}

__device__ __forceinline__ void check_indices(const CheckParams& p) {
    Finding f = {};

    // Scalar rules: one sequence (or cu_seqlens entry) per thread of the grid.
    const int thread = blockIdx.x * blockDim.x + threadIdx.x, threads = gridDim.x * blockDim.x;
    for (int i = thread; i <= p.batch; i += threads) {
        if (p.cache_seqlens != nullptr && i < p.batch && keys_after_append(p, i) < 0)
            f.fault(kFaultCacheSeqlens, i, __ldg(p.cache_seqlens + i));
        if (p.cu_seqlens_q != nullptr)
            check_cu_seqlens(f, p.cu_seqlens_q, i, p.batch, p.total_q, p.max_seqlen_q, kFaultCuSeqlensQ, kFaultMaxSeqlenQ);
        if (p.cu_seqlens_k != nullptr)
            check_cu_seqlens(f, p.cu_seqlens_k, i, p.batch, p.total_k, p.max_seqlen_k, kFaultCuSeqlensK, kFaultMaxSeqlenK);
    }

    // block_table: row b by one CTA, the pages that sequence b uses by its threads. Pages past
    // max_pages do not exist (a sequence needing them is a cache_seqlens fault, or, without
    // cache_seqlens, a shape the host has rejected).
    if (p.block_table != nullptr) {
        for (int b = blockIdx.x; b < p.batch; b += gridDim.x) {
            const long long keys = keys_after_append(p, b);
            if (keys < 0) continue;
            const long long page_size = max(p.page_size, 1);   // > 0 by contract; no division by 0 regardless
            const long long used = (keys + page_size - 1) / page_size;
            const int pages = static_cast<int>(min(used, static_cast<long long>(p.max_pages)));
            const int* row = p.block_table + b * p.block_table_batch_stride;
            for (int col = threadIdx.x; col < pages; col += blockDim.x) {
                const int page = __ldg(row + col);
                if (page < 0 || page >= p.num_pages)
                    f.fault(kFaultBlockTable, static_cast<long long>(b) * p.max_pages + col, page);
            }
        }
    }

    // One atomic per faulting warp. The first fault of the launch (the atomicOr that found
    // scratch[0] == 0) is the only one that writes report, so the record is never a mix of two.
    const int warp_codes = __reduce_or_sync(0xffffffffu, f.codes);
    const unsigned faulting = __ballot_sync(0xffffffffu, f.codes != 0);
    if (warp_codes != 0 && threadIdx.x % 32 == __ffs(faulting) - 1) {
        if (atomicOr(&p.scratch[0], warp_codes) == 0) {
            volatile int* report = p.report;
            report[1] = f.index;
            report[2] = f.value;
            __threadfence_system();   // a host that sees the code sees its index and value
            report[0] = f.code;
            __threadfence_system();
        }
    }

    // The last CTA to finish publishes the verdict and resets scratch. The tickets order every
    // CTA's atomicOr before the last CTA's exchange (fence, ticket / ticket, fence), in any
    // scheduling order and without co-resident CTAs.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned ticket = atomicAdd(reinterpret_cast<unsigned*>(&p.scratch[1]), 1u);
        if (ticket == gridDim.x - 1) {
            __threadfence();
            *p.error = atomicExch(&p.scratch[0], 0);
            p.scratch[1] = 0;   // every CTA has taken its ticket
        }
    }
}

}  // namespace cuflash

extern "C" __global__ void __launch_bounds__(cuflash::kCheckThreads) cuflash_check_indices(const cuflash::CheckParams p) {
    cuflash::let_dependents_start();   // decode overlaps the check and waits for its verdict (fault.cuh)
    cuflash::check_indices(p);
}

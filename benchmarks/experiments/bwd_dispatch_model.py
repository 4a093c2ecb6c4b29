"""A model of how bwd_sm90's CTAs fill the GPU, per order of its grid (docs/decisions.md#bwd-causal-tail-pairs).

CTAs start in the order of their linear index, each on the SM that frees first (one CTA per SM:
bwd_sm90 takes ~225 KB of shared memory), and each lasts a fixed cost plus its steps. Under a causal
mask key block x of a head walks the query tiles from its diagonal on, so its step count falls with
x. Printed: the ideal makespan (all work spread evenly) over the modelled one, for the grid read
head by head and with the last ``waves`` waves' worth of heads read key block by key block
(cuflash.kernels.bwd_common.bwd_tail_pairs). No GPU needed: ``python benchmarks/experiments/bwd_dispatch_model.py``.
"""

import heapq

SMS = 132
FIXED_US = 6.0                                   # a CTA's start, K/V load and dK/dV store
STEP_US = {64: 2.5, 128: 2.4, 256: 4.4}          # one query tile of 64 rows (D = 64: scaled to 128)
BLOCK_N = {64: 128, 128: 128, 256: 64}           # keys per CTA
BLOCK_M = {64: 128, 128: 64, 256: 64}            # query rows per step


def makespan(order, duration, sms=SMS):
    free = [0.0] * sms
    end = 0.0
    for cta in order:
        start = heapq.heappop(free)
        end = max(end, start + duration[cta])
        heapq.heappush(free, start + duration[cta])
    return end


def efficiency(head_dim, seqlen, waves, tokens=16384, hidden=2048):
    heads, key_blocks = (tokens // seqlen) * (hidden // head_dim), seqlen // BLOCK_N[head_dim]
    step = STEP_US[head_dim] * BLOCK_M[head_dim] / 64
    duration = {(h, x): FIXED_US + (seqlen - x * BLOCK_N[head_dim]) // BLOCK_M[head_dim] * step
                for h in range(heads) for x in range(key_blocks)}
    tail = min(heads, -(-waves * SMS // key_blocks)) if waves else 0
    order = ([(h, x) for h in range(heads - tail) for x in range(key_blocks)]
             + [(h, x) for x in range(key_blocks) for h in range(heads - tail, heads)])
    return sum(duration.values()) / SMS / makespan(order, duration)


if __name__ == "__main__":
    print("causal, ideal / modelled makespan: head by head, then the last 1 / 2 / 3 waves key block by key block")
    for d in (64, 128, 256):
        for s in (1024, 2048, 4096, 8192, 16384):
            print(f"D {d:3d} seqlen {s:5d}: " + "  ".join(f"{efficiency(d, s, w):.3f}" for w in (0, 1, 2, 3)))

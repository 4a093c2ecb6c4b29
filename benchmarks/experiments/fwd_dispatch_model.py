"""A model of how fwd_sm90's persistent CTAs share a causal call's work items
(docs/decisions.md#fwd-sm90-causal-tail-heads).

One CTA per SM. Items (m-block, head) are handed out in order from a counter, each head's m-blocks
longest first; a CTA claims its next item when it starts one (fwd_sm90.cu, take_item), so the claim
runs an item ahead. An item lasts a fixed cost plus its key tiles; under a causal mask m-block m sees
m + 1 of them. Printed: the ideal makespan (all work spread evenly) over the modelled one, head by
head and with the last ``waves`` waves' worth of heads numbered m-block by m-block
(cuflash.kernels.fwd_sm90.fwd_tail_heads). No GPU needed:
``python benchmarks/experiments/fwd_dispatch_model.py``.
"""

import heapq

SMS = 132
BLOCK_M = 128   # query rows per item (two consumer warpgroups)


def makespan(costs, sms=SMS):
    """CTA c starts item c at 0; whenever a CTA starts an item it claims the next unclaimed one."""
    starts = [(0.0, c) for c in range(min(sms, len(costs)))]
    heapq.heapify(starts)
    claimed, end = len(starts), 0.0
    while starts:
        t, item = heapq.heappop(starts)
        finish = t + costs[item]
        end = max(end, finish)
        if claimed < len(costs):
            heapq.heappush(starts, (finish, claimed))
            claimed += 1
    return end


def efficiency(seqlen, waves, fixed_tiles=2.0, tokens=16384, hidden=2048, head_dim=128):
    heads, m_blocks = (tokens // seqlen) * (hidden // head_dim), seqlen // BLOCK_M
    cost = [fixed_tiles + m + 1 for m in range(m_blocks)]
    tail = min(heads, -(-waves * SMS // m_blocks)) if waves else 0
    order = ([cost[m] for _ in range(heads - tail) for m in reversed(range(m_blocks))]
             + [cost[m] for m in reversed(range(m_blocks)) for _ in range(tail)])
    return sum(order) / SMS / makespan(order)


if __name__ == "__main__":
    print("causal, ideal / modelled makespan: head by head, then the last 1 / 2 / 3 waves m-block by m-block")
    for fixed in (1.0, 3.0):
        for s in (512, 1024, 2048, 4096, 8192, 16384):
            print(f"fixed {fixed:.0f} tiles, seqlen {s:5d}: "
                  + "  ".join(f"{efficiency(s, w, fixed):.3f}" for w in (0, 1, 2, 3)))

"""A transformers training step through cuflash (attn_implementation "cufa") against "sdpa".

One step is a forward and backward (``loss.backward()``, no optimizer) of a random-weight bf16
Llama (``--layers`` layers, hidden 2048, 16 query heads over 4 kv heads, D = 128) on a batch of
``--batch`` x ``--seq`` tokens. Two batches: unpadded (cuflash runs causal attention without a mask)
and right-padded to ``--seq`` from lengths spread over [seq / 4, seq] (cuflash runs varlen; sdpa a
dense boolean mask). The step includes everything else of the model (projections, MLP, norms, the
loss), so the ratio is what a training loop sees, not the attention kernel's ratio.

Timing: CUDA events around one step; each round runs the contenders once each in a new random
order (``_harness.turn_orders``), after an untimed step of the same contender; the median of
``--rounds`` rounds is printed with the ratio sdpa ms / cuflash ms (above 1: cuflash faster).

Examples
--------
    python benchmarks/bench_transformers.py
    python benchmarks/bench_transformers.py --batch 4 --seq 2048 --layers 4 --rounds 11
"""

from __future__ import annotations

import argparse
import statistics
import sys

from _harness import log, turn_orders


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    try:
        import torch
        import transformers
    except ImportError as e:
        print(f"needs torch and transformers ({e})", file=sys.stderr)
        return 0
    if not torch.cuda.is_available():
        print("no CUDA GPU found: nothing to benchmark", file=sys.stderr)
        return 0
    import cuflash.interop.transformers as cft

    cft.register()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                                      num_hidden_layers=args.layers, num_attention_heads=16, num_key_value_heads=4,
                                      max_position_embeddings=max(4096, args.seq), pad_token_id=0)
    model = transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16).train()
    ids = torch.randint(1, config.vocab_size, (args.batch, args.seq), device="cuda")
    lengths = torch.linspace(args.seq // 4, args.seq, args.batch, device="cuda").long()
    real = torch.arange(args.seq, device="cuda")[None, :] < lengths[:, None]
    batches = {"unpadded": (ids, None, ids),
               "right-padded": (ids.masked_fill(~real, 0), real.long(), ids.masked_fill(~real, -100))}
    log(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, transformers {transformers.__version__}; "
        f"Llama {args.layers} layers, hidden 2048, 16/4 heads, D 128, B {args.batch}, S {args.seq}, bf16")

    def step(impl, batch):
        ids, mask, labels = batch
        model.set_attn_implementation(cft.NAME if impl == "cuflash" else impl)
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()

    for name, batch in batches.items():
        for impl in ("cuflash", "sdpa"):   # warm-up: compiles cuflash's kernels, settles the allocator
            step(impl, batch)
        times = {"cuflash": [], "sdpa": []}
        for order in turn_orders(list(times), args.rounds):
            for impl in order:
                step(impl, batch)   # untimed: each timed step follows a step of its own kind
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                step(impl, batch)
                end.record()
                end.synchronize()
                times[impl].append(begin.elapsed_time(end))
        ms = {impl: statistics.median(t) for impl, t in times.items()}
        log(f"training step, {name}: cuflash {ms['cuflash']:.2f} ms, sdpa {ms['sdpa']:.2f} ms, "
            f"sdpa / cuflash = {ms['sdpa'] / ms['cuflash']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A/B of bwd_sm90 variants: each contender's backward timed in settled turns in one process, beside
torch SDPA's cuDNN backend, per call as users call it (``cuflash.attention_backward``, dq/dk/dv given).

This is how the bwd_sm90 entries of ``docs/decisions.md`` are measured. A contender changes what
cuflash plans for each bwd_sm90 call: compile-time defines, constants of ``cuflash.kernels``,
or the kernel's source (a changed copy of ``cuda_src/``)::

    python benchmarks/ab_backward.py build base "tg;CUFLASH_TILE_GUARD=1" new=/tmp/src --shapes 256/8192c
    python benchmarks/ab_backward.py run base "tg;CUFLASH_TILE_GUARD=1" new=/tmp/src \\
        --shapes 256/2048c,256/8192c,128/8192,128/8192cd --rounds 2

A contender is ``NAME[=SRC_DIR][;SETTING...]``. A setting is ``CUFLASH_<DEFINE>=VALUE`` (added to the
variant; ``=-`` removes the define) or ``<CONSTANT>=LITERAL`` (a ``cuflash.kernels`` constant, in
force while the contender plans). A shape is ``D/S`` (batch = tokens / S, heads = hidden / D, Sq = Sk)
with ``c`` for a causal mask, ``d`` for deterministic=True and ``s`` for a softcap of 30 (a featured
variant; cuDNN, which has none, then runs without it); ``D:DV/S`` gives V a head dim of its own
(``192:128/8192c``).

``build`` (no GPU) compiles each contender's bwd_sm90 variant of each shape, from its SRC_DIR (the
installed ``cuda_src/`` without one), prints registers, spills and ptxas's warnings, and writes every
cubin to ``--out``, where ``run`` finds them (it compiles what is missing). Every contender's kernels
thus come from one build and one load path. Give a control (``ctl=<a copy of cuda_src>``) beside
the candidates, and trust no difference under ~2% (``docs/decisions.md#measuring-a-change``): the same
source built on the device and here measured up to 2.5% apart, and byte-identical kernels up to 1.4%
apart by their place in a fixed order of turns (the turns are now in a random order). ``build`` uses
this machine's NVRTC, and a cubin's name holds that version: where ``run``'s machine compiles with another
(13.0 on the GPU machine, 13.5 on the CPU one; one source's D = 256 kernels 4-7% apart,
``docs/decisions.md#compile-nvrtc-versions``), ``run`` compiles every contender there (about 2 s a
variant), which is what users of that machine run.

``run`` (H100/H200, torch) first checks every contender's gradients against the first contender's
(bitwise under deterministic=True), then prints per round each contender's speed as a ratio to
cuDNN's (higher is faster) and cuDNN's TFLOP/s. Each timed run follows an untimed run of the same
contender (``_harness.Timer``: settled turns). Only the ratios of one run compare: between runs a
shape moves by ~0.02-0.04.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import hashlib
import sys
from pathlib import Path

from _harness import N_INPUT_SETS, Timer, log, open_gpu

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the checkout's cuflash, installed or not

from cuflash import kernels  # noqa: E402
from cuflash._build import compile as _compile  # noqa: E402
from cuflash._build.variant import Variant  # noqa: E402

DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


@dataclasses.dataclass
class Contender:
    name: str
    src: Path | None                 # None: the installed cuda_src/
    defines: dict                    # define -> value, or None to remove it
    constants: dict                  # cuflash.kernels constant -> value


def parse_contender(spec: str) -> Contender:
    """``NAME[=SRC_DIR][;SETTING...]`` -> Contender."""
    head, *settings = spec.split(";")
    name, _, src = head.partition("=")
    defines, constants = {}, {}
    for setting in settings:
        key, sep, value = setting.partition("=")
        if not sep:
            raise ValueError(f"{spec!r}: a setting is KEY=VALUE, not {setting!r}")
        if key.startswith("CUFLASH_"):
            defines[key] = None if value == "-" else int(value) if value.lstrip("-").isdigit() else value
        elif kernels.home(key) is not None:
            constants[key] = ast.literal_eval(value)
        else:
            raise ValueError(f"{spec!r}: {key} is neither a CUFLASH_ define nor a cuflash.kernels constant")
    return Contender(name, Path(src).resolve() if src else None, defines, constants)


def _flags(shape: str) -> str:
    return shape[len(shape.rstrip("cds")):]


def parse_shape(shape: str) -> tuple[int, int, bool, bool]:
    """``D[:DV]/S[c][d][s]`` -> (head_dim, seqlen, causal, deterministic); the softcap: shape_softcap,
    V's head dim: shape_head_dim_v."""
    flags = _flags(shape)
    dims, seqlen = shape[:len(shape) - len(flags)].split("/")
    return int(dims.split(":")[0]), int(seqlen), "c" in flags, "d" in flags


def shape_head_dim_v(shape: str) -> int:
    """V's head dim of a shape: after ``:`` in ``D:DV/S``, else D."""
    dims = shape.split("/")[0].split(":")
    return int(dims[-1])


SOFTCAP = 30.0


def shape_softcap(shape: str) -> float:
    """The softcap of a shape's cuflash calls: SOFTCAP with the ``s`` flag, else 0 (none)."""
    return SOFTCAP if "s" in _flags(shape) else 0.0


def with_defines(variant: Variant, defines: dict) -> Variant:
    merged = {**dict(variant.defines), **defines}
    return Variant(variant.family, tuple(sorted((k, v) for k, v in merged.items() if v is not None)))


class Installed:
    """A contender's settings in force: its constants set, and ``kernels.backward.backward_plan`` giving
    its bwd_sm90 variants (the call path asks it for every backward); ``on_variant`` sees each."""

    def __init__(self, contender: Contender, on_variant=None):
        self.contender, self.on_variant, self.plan = contender, on_variant, kernels.backward.backward_plan

    def __enter__(self):
        c, plan, on_variant = self.contender, self.plan, self.on_variant
        self.saved = {k: getattr(kernels.home(k), k) for k in c.constants}
        for k, v in c.constants.items():
            setattr(kernels.home(k), k, v)

        def contender_plan(*args, **kwargs):
            lp = plan(*args, **kwargs)
            if lp.variant.family != "bwd_sm90":
                return lp
            lp = dataclasses.replace(lp, variant=with_defines(lp.variant, c.defines))
            if on_variant is not None:
                on_variant(lp.variant)
            return lp
        kernels.backward.backward_plan = contender_plan
        return self

    def __exit__(self, *exc):
        kernels.backward.backward_plan = self.plan
        for k, v in self.saved.items():
            setattr(kernels.home(k), k, v)


def shape_variant(contender: Contender, dtype_name: str, shape: str) -> Variant:
    """The bwd_sm90 variant the contender plans for a call of ``shape`` (as cuflash/backward.py asks)."""
    head_dim, seqlen, causal, det = parse_shape(shape)
    head_dim_v = shape_head_dim_v(shape)
    head_dim_v = head_dim_v if head_dim_v != head_dim else None   # as the call path: None when square
    mods = ("softcap",) if shape_softcap(shape) else ()
    window = (-1, 0) if causal else (-1, -1)
    with Installed(contender):
        sm90 = kernels.bwd_sm90
        mode = sm90.bwd_sm90_dq_mode(head_dim, bool(mods), det)
        seen = sm90.bwd_all_keys_seen(windowed=causal, varlen=False, featured=bool(mods))
        # As cuflash/_backward_plan.py asks, for one query head a CTA (a full GPU at these sizes).
        persistent = sm90.bwd_sm90_persistent(head_dim, score_mods=mods, dropout=False, deterministic=mode,
                                              varlen=False, head_dim_v=head_dim_v, seqlen_q=seqlen,
                                              seqlen_k=seqlen, window=window)
        first = sm90.bwd_sm90_first_stores_dq(score_mods=mods, dropout=False, deterministic=mode, varlen=False,
                                              seqlen_q=seqlen, seqlen_k=seqlen, window=window)
        return kernels.backward.backward_plan("bwd_sm90", dtype_name, head_dim, dq_pass=False, score_mods=mods,
                                              dropout=False, deterministic=mode, windowed=causal, seqlen_q=seqlen,
                                              all_keys_seen=seen, persistent=persistent,
                                              dq_first_stores=first, head_dim_v=head_dim_v).variant


def cubin_path(out: str, contender: Contender, variant: Variant) -> Path:
    """Named by the variant, the contender's sources and the NVRTC version: a tree edited after ``build``,
    or built by another NVRTC than this machine's, is compiled again."""
    key = repr((sorted(variant.defines), _compile.source_hash(contender.src), _compile._nvrtc_version()))
    digest = hashlib.sha1(key.encode()).hexdigest()[:16]
    return Path(out) / contender.name / f"{variant.family}-{digest}.cubin"


def build(args) -> int:
    contenders = [parse_contender(spec) for spec in args.contenders]
    ok = True
    for c in contenders:
        for variant in dict.fromkeys(shape_variant(c, DTYPES[args.dtype], s) for s in args.shapes.split(",")):
            try:
                result = _compile.compile_cubin(variant, "sm_90a", src_dir=c.src)
            except (RuntimeError, ValueError) as e:
                print(f"{c.name}: FAILED {dict(variant.defines)}\n{e}")
                ok = False
                continue
            path = cubin_path(args.out, c, variant)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(result.cubin)
            settings = {k[len("CUFLASH_"):]: v for k, v in dict(variant.defines).items()
                        if k != "CUFLASH_DTYPE" and not k.endswith(("_SIZE", "SMEM_BYTES"))}
            print(f"{c.name}: {result.registers} registers, spills {result.spill_stores}/{result.spill_loads} B; "
                  f"{settings}" + "".join(f"\n    {w.strip()}" for w in result.log.splitlines() if "arning" in w))
    return 0 if ok else 1


def run(args) -> int:
    import cupy

    import cuflash
    from cuflash import backward
    from cuflash._runtime import memo as _memo

    gpu = open_gpu(cupy, use_torch=True)
    if gpu is None or gpu.torch is None:
        print("run needs a GPU and torch (cuDNN is the yardstick)", file=sys.stderr)
        return 1
    torch, F = gpu.torch, gpu.F
    contenders = [parse_contender(spec) for spec in args.contenders]
    dtype_name = DTYPES[args.dtype]
    torch_dtype = getattr(torch, dtype_name)
    arch, device = _compile.device_arch(), _compile.current_device()
    timer = Timer(cupy, args.repeats, warmup=2, target_ms=args.target_ms)
    log(f"{gpu.device_name} ({gpu.versions}), {dtype_name}, {args.tokens} tokens, hidden {args.hidden}; "
        f"per round: speed / cuDNN's for {', '.join(c.name for c in contenders)} (cuDNN's TFLOP/s)")

    def load_kernel(c: Contender, variant: Variant):
        """Puts the contender's cubin (``build``'s, else compiled now) where get_kernel finds the
        variant's kernel (its own key: the variant carries the marker define CUFLASH_AB_TREE, which
        no source reads)."""
        plain = with_defines(variant, {"CUFLASH_AB_TREE": None})
        path = cubin_path(args.out, c, plain)
        if not path.exists():
            log(f"  compiling {c.name}'s {variant.family} ({path.name}): not built")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(_compile.compile_cubin(plain, arch, src_dir=c.src).cubin)
        module = cupy.RawModule(path=str(path))
        _compile._kernels[(variant, arch, device)] = (module, module.get_function(variant.entry))

    with gpu.stream:
        for shape in args.shapes.split(","):
            head_dim, seqlen, causal, det = parse_shape(shape)
            head_dim_v, softcap = shape_head_dim_v(shape), shape_softcap(shape)
            batch, heads = args.tokens // seqlen, max(1, args.hidden // head_dim)
            sets = [tuple(torch.randn(batch, seqlen, heads, d, device="cuda", dtype=torch_dtype)
                          for d in (head_dim, head_dim, head_dim_v, head_dim_v)) for _ in range(N_INPUT_SETS)]
            inputs = [tuple(cupy.from_dlpack(x) for x in s) for s in sets]
            saved = [cuflash.attention_forward(q, k, v, causal=causal, softcap=softcap)[:2] for q, k, v, _ in inputs]
            grads = tuple(cupy.empty_like(x) for x in inputs[0][:3])

            def contender_call(i, c: Contender):
                # A contender's variants carry the marker define CUFLASH_AB_TREE (no source reads it),
                # so that its kernels have keys of their own in get_kernel's memo.
                marked = dataclasses.replace(c, defines={**c.defines, "CUFLASH_AB_TREE": i})
                memo = {}   # each contender its own plans: a plan holds its kernels

                def call(j):
                    q, k, v, dout = inputs[j]
                    out, lse = saved[j]
                    installed, _memo._memo = _memo._memo, memo
                    try:
                        with Installed(marked, lambda variant: load_kernel(c, variant)), \
                                backward.force_kernel("bwd_sm90"):
                            return cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal,
                                                              softcap=softcap, deterministic=det, dq=grads[0],
                                                              dk=grads[1], dv=grads[2])
                    finally:
                        _memo._memo = installed
                return call

            calls = {c.name: contender_call(i, c) for i, c in enumerate(contenders)}
            first = None
            for name, call in calls.items():
                for g in grads:
                    g.fill(float("nan"))
                got = [x.astype(cupy.float32) for x in call(0)]
                if first is None:
                    first = got
                    continue
                # relative to the largest gradient: a few bf16 roundings apart at most
                diff = max(float(cupy.abs(a - b).max() / cupy.abs(b).max()) for a, b in zip(got, first))
                if (det and diff != 0) or not diff < 1e-2:
                    log(f"  !! {name} at {shape}: gradients differ from {contenders[0].name}'s by {diff:.3g} "
                        "of the largest")

            graphs = []
            for q, k, v, dout in sets:
                leaves = [x.transpose(1, 2).detach().requires_grad_(True) for x in (q, k, v)]
                with gpu.sdpa_kernel(gpu.SDPBackend.CUDNN_ATTENTION):
                    out = F.scaled_dot_product_attention(*leaves, is_causal=causal)
                graphs.append((out, leaves, dout.transpose(1, 2)))

            def cudnn(j):
                out, leaves, dout = graphs[j]
                return torch.autograd.grad(out, leaves, dout, retain_graph=True)
            calls["cudnn"] = cudnn
            flops = 2.5 * 2 * batch * heads * seqlen * seqlen * (head_dim + head_dim_v) / (2 if causal else 1)
            rounds = []
            for _ in range(args.rounds):
                ms = timer.median_ms_each(calls)
                rounds.append(" ".join(f"{c.name} {ms['cudnn'] / ms[c.name]:.3f}" for c in contenders)
                              + f" ({flops / ms['cudnn'] / 1e9:.0f})")
            log(f"{shape:>10}: " + " | ".join(rounds))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="compile each contender's bwd_sm90 variants (no GPU needed)")
    r = sub.add_parser("run", help="time the contenders beside cuDNN (GPU, torch)")
    for sp in (b, r):
        sp.add_argument("contenders", nargs="+", metavar="NAME[=SRC_DIR][;SETTING...]")
        sp.add_argument("--shapes", default="64/4096c,128/2048,128/8192,128/8192c,256/8192c")
        sp.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
        sp.add_argument("--out", default=str(REPO / "bench_out" / "ab_backward"), help="where tree cubins go")
    r.add_argument("--rounds", type=int, default=2)
    r.add_argument("--repeats", type=int, default=7)
    r.add_argument("--target-ms", type=float, default=40.0, help="approximate length of one timed run")
    r.add_argument("--tokens", type=int, default=16384)
    r.add_argument("--hidden", type=int, default=2048)
    args = p.parse_args(argv)
    return build(args) if args.command == "build" else run(args)


if __name__ == "__main__":
    sys.exit(main())

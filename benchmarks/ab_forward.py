"""A/B of fwd_sm90 source trees: one kernel built from several copies of ``cuda_src/``, timed in
turns in one process beside torch SDPA's cuDNN backend.

This is how the fwd_sm90 entries of ``docs/decisions.md`` are measured. Copy ``cuda_src/`` to a
scratch folder, change the copy, then::

    python benchmarks/ab_forward.py build base=cuda_src new=/tmp/new_src      # no GPU needed
    python benchmarks/ab_forward.py build "s4=cuda_src;SM90_STAGES={64: 4, 128: 2, 256: 2}"
    python benchmarks/ab_forward.py run base new --shapes 64/1024,128/8192,128/8192c --check new

``build`` compiles, from each tree, the fwd_sm90 variant without score modifiers or dropout (what
the benchmark grid runs) for each head dim and dtype asked, into ``--out/NAME/<dtype>_<D>.cubin``,
and prints registers, spills and ptxas's performance notes (build on the GPU machine to time what its
users run: its NVRTC differs from the CPU machine's, and ``run`` says so). ``run`` (on an H100/H200) loads those
cubins and times, for each shape, every tree's kernel through ``cuflash.attention`` (the installed
launch path, with the tree's cubin in place of its own) and cuDNN, in turns over rotating inputs,
then prints TFLOP/s, the ratio to cuDNN and each tree's geometric mean of that ratio. ``--check``
first compares the named trees' outputs with cuDNN's (ablations that are wrong on purpose leave it
out). A shape is ``D/S`` with ``c`` for causal: batch = tokens / S, heads = hidden / D, Sq = Sk.

A tree must keep the installed host side's interface (parameters, tensor maps, threads), except
for what its overrides of ``cuflash.kernels`` constants change (after ``;`` in its spec: the
variant's defines and shared memory, used both to compile it and to launch it). Same-run ratios are what compare; between runs the ratio of one shape moves by ~0.02-0.05.
"""

from __future__ import annotations

import argparse
import ast
import math
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _harness import Timer, log, note_other_compiler, nvrtc_label, open_gpu
from bench_forward import DTYPE_NAMES, attention_flops, make_inputs

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the checkout's cuflash, installed or not

from cuflash import kernels  # noqa: E402
from cuflash._build import compile as _compile  # noqa: E402


def sm90_plan(dtype_name: str, head_dim: int, overrides=None):
    """The launch plan of the benchmarked variant, with ``overrides`` ({name: value} of
    ``cuflash.kernels`` constants, e.g. ``{"SM90_STAGES": {64: 4, 128: 2, 256: 2}}``) in force;
    the name ``consumers`` is forward_plan's argument instead (3: three consumer warpgroups)."""
    overrides = dict(overrides or {})
    consumers = overrides.pop("consumers", 2)
    saved = {name: getattr(kernels.home(name), name) for name in overrides}
    try:
        for name, value in overrides.items():
            setattr(kernels.home(name), name, value)
        kernels.forward.forward_plan.cache_clear()
        return kernels.forward.forward_plan("fwd_sm90", dtype_name, head_dim, score_mods=False, dropout=False,
                                        consumers=consumers)
    finally:
        for name, value in saved.items():
            setattr(kernels.home(name), name, value)
        kernels.forward.forward_plan.cache_clear()


def parse_tree(spec: str):
    """``NAME=SRC_DIR[;CONSTANT=LITERAL...]`` -> (name, source dir, overrides)."""
    name, rest = spec.split("=", 1)
    src, *assignments = rest.split(";")
    overrides = {}
    for assignment in assignments:
        constant, literal = assignment.split("=", 1)
        overrides[constant] = ast.literal_eval(literal)
    return name, Path(src).resolve(), overrides


def build(args):
    trees = [parse_tree(spec) for spec in args.trees]
    jobs = [(name, src, overrides, DTYPE_NAMES[dt], int(d))
            for name, src, overrides in trees for dt in args.dtypes.split(",") for d in args.head_dims.split(",")]
    for name, _, overrides in trees:  # run reads them back: the tree's launch plan must match its cubins
        (Path(args.out) / name).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / name / "overrides.txt").write_text(repr(overrides))
        (Path(args.out) / name / "nvrtc.txt").write_text(nvrtc_label())

    def compile_one(job):
        name, src, overrides, dtype_name, head_dim = job
        label = f"{name} {dtype_name} D={head_dim}"
        try:
            result = _compile.compile_cubin(sm90_plan(dtype_name, head_dim, overrides).variant, "sm_90a", src_dir=src)
        except (RuntimeError, ValueError) as e:
            return f"{label}: FAILED\n{e}", False
        out = Path(args.out) / name
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{dtype_name}_{head_dim}.cubin").write_bytes(result.cubin)
        return (f"{label}: {result.registers} registers, spills {result.spill_stores}/{result.spill_loads} B"
                + "".join(f"\n    {w.strip()}" for w in result.warnings)), True

    with ThreadPoolExecutor() as pool:
        results = list(pool.map(compile_one, jobs))
    for text, _ in results:
        print(text)
    return 0 if all(ok for _, ok in results) else 1


def run(args):
    import cupy

    import cuflash

    from cuflash._runtime import memo as _memo
    gpu = open_gpu(cupy, use_torch=True)
    if gpu is None or gpu.torch is None:
        print("run needs a GPU and torch (cuDNN is the yardstick)", file=sys.stderr)
        return 1
    torch, F, sdpa_kernel, SDPBackend = gpu.torch, gpu.F, gpu.sdpa_kernel, gpu.SDPBackend
    dtype_name = DTYPE_NAMES[args.dtype]
    arch = _compile.device_arch()
    timer = Timer(cupy, args.repeats, warmup=2, target_ms=20.0)
    ratios = {name: [] for name in args.trees}
    log(f"{gpu.device_name} ({gpu.versions}), {dtype_name}; TFLOP/s and ratio to cuDNN")
    recorded = {name: Path(args.out) / name / "nvrtc.txt" for name in args.trees}
    note_other_compiler({name: path.read_text() if path.exists() else None for name, path in recorded.items()})
    log(f"{'shape':>10} " + " ".join(f"{name:>16}" for name in args.trees) + f" {'cuDNN':>7}")
    with gpu.stream:
        for shape in args.shapes.split(","):
            causal = shape.endswith("c")
            head_dim, seqlen = (int(x) for x in shape.rstrip("c").split("/"))
            batch, heads = args.tokens // seqlen, args.hidden // head_dim
            inputs = make_inputs(cupy, _cupy_dtype(dtype_name), batch, seqlen, heads, head_dim)
            torch_inputs = [tuple(torch.from_dlpack(x).transpose(1, 2) for x in qkv) for qkv in inputs]
            out = cupy.empty_like(inputs[0][0])
            keys = []

            def tree_kernel(name):
                module = cupy.RawModule(path=str(Path(args.out) / name / f"{dtype_name}_{head_dim}.cubin"))
                loaded = (module, module.get_function("cuflash_fwd_sm90"))
                overrides_file = Path(args.out) / name / "overrides.txt"
                plan = sm90_plan(dtype_name, head_dim,
                                 ast.literal_eval(overrides_file.read_text()) if overrides_file.exists() else None)
                key = (plan.variant, arch)
                keys.append(key)
                installed_plan = kernels.forward.forward_plan
                replays = {}

                def call(i):
                    # get_kernel's memo (cuflash._build.compile) is where the launch path finds its kernel,
                    # and the attention module asks cuflash.kernels for the plan (shared memory, defines).
                    # A plain call's launch is remembered by shapes and options, not by kernel, so
                    # each tree keeps its own memo of launches: with one shared memo every tree would
                    # replay the launch (and kernel) of whichever ran first at this shape.
                    _compile._kernels[key] = loaded
                    kernels.forward.forward_plan = lambda *a, **kw: plan
                    installed_memo, _memo._memo = _memo._memo, replays
                    try:
                        with cuflash.force_kernel("fwd_sm90"):
                            cuflash.attention(*inputs[i], causal=causal, out=out)
                    finally:
                        kernels.forward.forward_plan = installed_plan
                        _memo._memo = installed_memo
                return call

            def cudnn(i):
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(*torch_inputs[i], is_causal=causal)

            contenders = {name: tree_kernel(name) for name in args.trees}
            reference = cupy.from_dlpack(cudnn(0).transpose(1, 2)).astype(cupy.float32)
            for name in args.check:
                out.fill(float("nan"))
                contenders[name](0)
                err = float(cupy.abs(out.astype(cupy.float32) - reference).max())
                if not err < 0.05:
                    log(f"  {name} at {shape}: max|out - cuDNN| = {err:.3g}")
            contenders["cudnn"] = cudnn
            ms = timer.median_ms_each(contenders)
            for key in keys:
                _compile._kernels.pop(key, None)
            flops = attention_flops(batch, heads, seqlen, seqlen, head_dim, causal)
            tflops = {name: flops / (t * 1e-3) / 1e12 for name, t in ms.items()}
            for name in args.trees:
                ratios[name].append(tflops[name] / tflops["cudnn"])
            log(f"{shape:>10} " + " ".join(f"{tflops[n]:8.0f} {tflops[n] / tflops['cudnn']:6.3f} " for n in args.trees)
                + f" {tflops['cudnn']:7.0f}")
    log("geometric mean of the ratio to cuDNN: "
        + "  ".join(f"{n} {math.exp(statistics.mean(math.log(r) for r in ratios[n])):.3f}" for n in args.trees))
    return 0


def _cupy_dtype(dtype_name):
    import numpy as np

    if dtype_name == "bfloat16":
        import ml_dtypes  # CuPy has no bfloat16 of its own (docs/design.md §7)

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype_name)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="compile each tree's fwd_sm90 cubins (no GPU needed)")
    b.add_argument("trees", nargs="+", metavar="NAME=SRC_DIR")
    b.add_argument("--dtypes", default="bf16")
    b.add_argument("--head-dims", default="64,128,256")
    r = sub.add_parser("run", help="time the built trees beside cuDNN (GPU)")
    r.add_argument("trees", nargs="+", metavar="NAME")
    r.add_argument("--shapes", default="64/1024,64/8192,128/1024,128/8192,128/8192c,256/8192")
    r.add_argument("--dtype", default="bf16")
    r.add_argument("--repeats", type=int, default=11)
    r.add_argument("--check", nargs="*", default=[], metavar="NAME")
    r.add_argument("--tokens", type=int, default=16384)
    r.add_argument("--hidden", type=int, default=2048)
    for sp in (b, r):
        sp.add_argument("--out", default=str(REPO / "bench_out" / "ab"), help="where the cubins go")
    args = p.parse_args(argv)
    return build(args) if args.command == "build" else run(args)


if __name__ == "__main__":
    sys.exit(main())

"""What the benchmark scripts share: opening the GPU (and torch beside it), timing with CUDA
events, the measured ceilings (GEMM rate, copy bandwidth), and writing the tables.

The scripts run as ``python benchmarks/bench_*.py``, so this module is found beside them.
"""

from __future__ import annotations

import csv
import math
import random
import statistics
import sys
from types import SimpleNamespace

N_INPUT_SETS = 3  # inputs rotate over this many sets, so L2 (50 MiB on an H100) cannot hold them


def log(msg):
    """Progress lines go to stdout before the table, so a log of the run reads in order."""
    print(msg, flush=True)


def open_gpu(cupy, use_torch: bool):
    """The GPU and, beside it, torch's SDPA when it is usable; None (and a message) without a GPU.

    Returns
    -------
    SimpleNamespace with torch, F, sdpa_kernel, SDPBackend (all None without torch), stream (torch's
    current stream as a CuPy stream, so that CUDA events time cuflash and torch alike; CuPy's own
    without torch), device_name and versions (for the table's first line).
    """
    try:
        n_dev = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError:
        n_dev = 0
    if n_dev == 0:
        print("no CUDA GPU found: nothing to benchmark", file=sys.stderr)
        return None
    gpu = SimpleNamespace(torch=None, F=None, sdpa_kernel=None, SDPBackend=None)
    if use_torch:
        try:
            import torch
            import torch.nn.functional as F
            from torch.nn.attention import SDPBackend, sdpa_kernel
        except ImportError as e:
            log(f"torch not usable ({e}): no torch columns")
        else:
            if torch.cuda.is_available():
                gpu.torch, gpu.F, gpu.sdpa_kernel, gpu.SDPBackend = torch, F, sdpa_kernel, SDPBackend
            else:
                log("torch has no CUDA: no torch columns")
    if gpu.torch is not None:
        from cuflash.interop._cupy_stream import cupy_stream
        gpu.stream = cupy_stream(gpu.torch.cuda.current_stream().cuda_stream)
    else:
        gpu.stream = cupy.cuda.get_current_stream()
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    gpu.device_name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    gpu.versions = f"cupy {cupy.__version__}" + (f", torch {gpu.torch.__version__}" if gpu.torch else "")
    return gpu


class Timer:
    """Milliseconds per call of ``fn(i)`` with CUDA events on CuPy's current stream.

    Each call gets the index of the input set to use, so successive calls rotate over
    ``N_INPUT_SETS`` sets. A timed run is N back-to-back calls, N sized so that a run takes about
    ``target_ms`` (at least ``N_INPUT_SETS``, at most ``max_calls``); the median of ``repeats``
    runs is reported.
    """

    def __init__(self, cupy, repeats, warmup, target_ms, max_calls=200):
        self.cp, self.repeats, self.warmup, self.target_ms = cupy, repeats, warmup, target_ms
        self.max_calls = max_calls

    def _run(self, fn, n, start=0):
        begin, end = self.cp.cuda.Event(), self.cp.cuda.Event()
        begin.record()
        for i in range(n):
            fn((start + i) % N_INPUT_SETS)
        end.record()
        end.synchronize()
        return self.cp.cuda.get_elapsed_time(begin, end) / n

    def _calls_per_run(self, fn):
        """Warms ``fn`` up and sizes its runs."""
        for i in range(self.warmup):
            fn(i % N_INPUT_SETS)
        self.cp.cuda.get_current_stream().synchronize()
        single = self._run(fn, 1)
        return int(min(self.max_calls, max(N_INPUT_SETS, math.ceil(self.target_ms / max(single, 1e-3)))))

    def median_ms(self, fn):
        n = self._calls_per_run(fn)
        return statistics.median(self._run(fn, n, r) for r in range(self.repeats))

    def median_ms_each(self, fns):
        """``{name: median ms per call}`` for ``{name: fn}``, timed in turns: each repeat runs
        every contender once, so drift over the measurement falls on all of them alike. Each timed
        run follows an untimed run of the same contender and length (settled): a heavy kernel
        runs at the power limit, where the clock a run gets depends on what ran just before it.
        In turns without it, whoever followed the most power-hungry contender lost (H200, bf16
        backward D = 128 8k: the same cuflash call 3.7% slower after cuDNN than after itself,
        cuDNN 3% faster after cuflash than after itself; docs/decisions.md#measuring-a-change). Settling
        does not remove all of it, so each repeat takes the contenders in a new random order: in a
        fixed cycle the first one always follows the last (cuDNN, in the scripts), and byte-identical
        kernels measured ~1% apart by their place in it."""
        counts = {name: self._calls_per_run(fn) for name, fn in fns.items()}
        times = {name: [] for name in fns}
        for r, order in enumerate(turn_orders(list(fns), self.repeats)):
            for name in order:
                self._run(fns[name], counts[name], r)
                times[name].append(self._run(fns[name], counts[name], r))
        return {name: statistics.median(t) for name, t in times.items()}


def turn_orders(names, repeats):
    """The order of the contenders in each repeat of a timing in turns: a new random one each time
    (Timer.median_ms_each says why), the same sequence of orders for every run of a script."""
    rng = random.Random(len(names) * 1000 + repeats)
    return [rng.sample(names, len(names)) for _ in range(repeats)]


def gemm_rate(cupy, torch, timer):
    """Measured dense 16-bit GEMM rate (TFLOP/s) of an 8192^3 matmul: the compute ceiling."""
    n = 8192
    if torch is not None:
        a = [torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(N_INPUT_SETS)]
        b = [torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(N_INPUT_SETS)]
        c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
        ms = timer.median_ms(lambda i: torch.matmul(a[i], b[i], out=c))
        label = "torch.matmul bf16"
    else:
        # cupy.matmul has no bfloat16 (docs/design.md §7); fp16 runs on the same tensor cores.
        a = [cupy.random.standard_normal((n, n), dtype=cupy.float32).astype(cupy.float16)
             for _ in range(N_INPUT_SETS)]
        b = [cupy.random.standard_normal((n, n), dtype=cupy.float32).astype(cupy.float16)
             for _ in range(N_INPUT_SETS)]
        c = cupy.empty((n, n), dtype=cupy.float16)
        ms = timer.median_ms(lambda i: cupy.matmul(a[i], b[i], out=c))
        label = "cupy.matmul fp16"
    return 2.0 * n ** 3 / (ms * 1e-3) / 1e12, label


def copy_bandwidth(cupy, timer):
    """Measured device-to-device copy bandwidth (GB/s, read + write): the memory ceiling."""
    nbytes = 1 << 30
    src = [cupy.empty(nbytes // 4, dtype=cupy.float32) for _ in range(2)]
    dst = cupy.empty(nbytes // 4, dtype=cupy.float32)
    for s in src:
        s.fill(1.0)
    ms = timer.median_ms(lambda i: cupy.copyto(dst, src[i % 2]))
    return 2.0 * nbytes / (ms * 1e-3) / 1e9


def missing(x) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def fmt(x, digits=1):
    """A table cell: '-' for a missing value, floats to ``digits`` decimals."""
    if missing(x):
        return "-"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def markdown_table(rows, header, columns, formats=None):
    """``header``, a blank line, then the rows (dicts) as a Markdown table of ``columns``;
    ``formats`` maps a column to its cell function (default :func:`fmt`), called on present values."""
    formats = formats or {}
    out = [header, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        cells = [fmt(r.get(c)) if missing(r.get(c)) or c not in formats else formats[c](r[c]) for c in columns]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def write_results(rows, table, columns, csv_path=None, md_path=None):
    """The rows as CSV (missing cells empty) and the Markdown table, where paths are given."""
    if csv_path:
        with open(csv_path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=columns)
            w.writeheader()
            for r in rows:
                w.writerow({c: "" if r.get(c) is None else r[c] for c in columns})
        log(f"CSV written to {csv_path}")
    if md_path:
        with open(md_path, "w") as f:
            f.write(table + "\n")


def nvrtc_label() -> str:
    """The NVRTC version this process compiles with, as "13.5" (what A/B trees record at build)."""
    from cuflash._build import nvrtc

    return ".".join(str(x) for x in nvrtc.version())


def note_other_compiler(built: dict) -> None:
    """One line for each A/B tree whose cubins another NVRTC built (``built``: {tree: "13.5" or None when
    unknown}) than the one this process compiles with: one source's kernels ran 4-7% apart under 13.0 and
    13.5 (docs/decisions.md#compile-nvrtc-versions), so an A/B decides for this machine's users only when
    its trees were built here."""
    here = nvrtc_label()
    for tree, version in built.items():
        if version != here:
            log(f"tree {tree}: cubins built by NVRTC {version or '(unknown)'}, this machine compiles with {here}: "
                "run build here to time what its users run")


def open_fa4(torch, wanted=True):
    """FlashAttention-4's entry points, or None: without torch, with ``--no-fa4``, or where
    ``flash_attn.cute`` does not import (one line says so; the fa4 cells stay empty). The import and
    its skip are bench_host.py's). Shared by bench_forward, bench_backward and bench_decode."""
    if torch is None or not wanted:
        return None
    try:
        from flash_attn.cute import flash_attn_func, flash_attn_varlen_func
    except Exception as e:  # noqa: BLE001 - FA4 is optional: its column stays empty
        log(f"FA4 not importable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}): no fa4 column")
        return None
    try:
        from importlib.metadata import version
        label = f"flash-attn-4 {version('flash-attn-4')}"
    except Exception:  # noqa: BLE001 - a source tree on PYTHONPATH has no metadata
        label = "flash_attn.cute"
    return SimpleNamespace(flash_attn_func=flash_attn_func, flash_attn_varlen_func=flash_attn_varlen_func,
                           label=label)


def fa4_out(result):
    """FA4's entry points return ``(out, lse)`` (4.0.0b36); a bare tensor is taken as it is."""
    return result[0] if isinstance(result, (tuple, list)) else result


def largest_difference(outputs, names, base="cuflash"):
    """max |out - base's out| over the contenders ``names`` (``outputs``: {name: fn() -> torch tensor}),
    in float32; 0.0 when only ``base`` ran."""
    want = outputs[base]().detach().float()
    return max((float((outputs[n]().detach().float() - want).abs().max()) for n in names if n != base), default=0.0)


def runnable(steps, problem):
    """The contenders of ``steps`` ({name: fn(i)}) that run ``problem`` once without raising; each
    that cannot (a peer without the option, a shape it refuses) is left out with a line saying why."""
    usable = {}
    for name, fn in steps.items():
        try:
            fn(0)
            usable[name] = fn
        except Exception as e:  # noqa: BLE001 - a contender's refusal is reported, not fatal
            why = str(e).splitlines()[0][:100] if str(e) else ""
            log(f"{problem}: {name} left out ({type(e).__name__}: {why})")
    return usable


def open_torch_peers(cupy, args, repeats=None, max_calls=50):
    """What the scripts that time contenders from torch tensors open first: (gpu of :func:`open_gpu`, cuflash's
    torch adapter, FA4 when carried and not ``--no-fa4``, a Timer of :func:`peer_arguments`' options and
    ``repeats``, default ``--repeats``); None, with a line saying why, without a GPU or torch."""
    gpu = open_gpu(cupy, use_torch=True)
    if gpu is None or gpu.torch is None:
        log("needs a GPU and torch")
        return None
    import cuflash.interop.torch as ct

    timer = Timer(cupy, repeats or args.repeats, warmup=2, target_ms=args.target_ms, max_calls=max_calls)
    return gpu, ct, open_fa4(gpu.torch, wanted=not args.no_fa4), timer


def peer_arguments(parser, repeats=7):
    """The options of the scripts that time contenders from torch tensors: --repeats, --target-ms,
    --no-fa4, --md, --csv."""
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--target-ms", type=float, default=100.0)
    parser.add_argument("--no-fa4", action="store_true")
    parser.add_argument("--md")
    parser.add_argument("--csv")
    return parser

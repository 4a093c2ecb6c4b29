"""The FlashAttention-4 column of bench_forward.py, bench_backward.py and bench_decode.py without a GPU
(issue 51, item 1): each script imports FA4 from ``flash_attn.cute`` and, where that fails, says so
in one line and leaves the column empty; FA4 is timed in the same turns as the other contenders,
called as its users call it (torch tensors in (B, S, H, D), no transposes, no ``out=``; the
backward through ``torch.autograd.grad`` of its output; decode on the row's own cache, paged through
``flash_attn_varlen_func(page_table=..., seqused_k=...)``); and the tables carry the fa4 and
cuflash/fa4 columns.

Stand-ins: NumPy arrays for CuPy's, ``T`` for torch tensors (a NumPy array that knows which CuPy
array it views, whether it was transposed and whether it requires grad), a fake ``flash_attn.cute``
module in ``sys.modules`` that logs its calls, and a timer that runs each contender and hands back
set figures."""

import contextlib
import importlib.util
import math
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[1]
SCRIPTS = ("bench_forward", "bench_backward", "bench_decode")


def _load(name):
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def scripts():
    sys.path.insert(0, str(BENCH))   # the scripts import _harness from beside them
    try:
        yield {name: _load(name) for name in SCRIPTS}
    finally:
        sys.path.remove(str(BENCH))


# ----------------------------------------------------------------------------- stand-ins

class T:
    """A torch tensor over a NumPy array: ``src`` is the CuPy (here NumPy) array it views."""

    def __init__(self, a, src=None, transposed=False, requires_grad=False, made_by=None):
        self.a, self.src, self.transposed = a, src, transposed
        self.requires_grad, self.made_by = requires_grad, made_by

    @property
    def shape(self):
        return self.a.shape

    def transpose(self, i, j):
        return T(np.swapaxes(self.a, i, j), self.src, not self.transposed, self.requires_grad, self.made_by)

    def detach(self):
        return T(self.a, self.src, self.transposed)

    def requires_grad_(self, flag=True):
        self.requires_grad = flag
        return self

    def contiguous(self):
        return self

    def repeat_interleave(self, n, dim):
        return T(np.repeat(self.a, n, axis=dim), self.src, self.transposed)


def fake_torch(log):
    def from_dlpack(x):
        assert isinstance(x, np.ndarray), "torch views CuPy arrays"
        return T(x, src=x)

    def grad(outputs, inputs, grad_outputs, retain_graph=False):
        log.append(("torch.autograd.grad", (outputs, tuple(inputs), grad_outputs), {"retain_graph": retain_graph}))
        return tuple(T(np.zeros_like(x.a)) for x in inputs)

    return SimpleNamespace(from_dlpack=from_dlpack, autograd=SimpleNamespace(grad=grad),
                           cuda=SimpleNamespace(empty_cache=lambda: None))


def fake_sdpa(log):
    def sdpa(q, k, v, **kw):
        log.append(("F.scaled_dot_product_attention", (q, k, v), kw))
        return T(q.a.copy(), made_by="sdpa")

    F = SimpleNamespace(scaled_dot_product_attention=sdpa)
    backends = SimpleNamespace(FLASH_ATTENTION="flash", CUDNN_ATTENTION="cudnn", EFFICIENT_ATTENTION="efficient")
    return F, (lambda backend: contextlib.nullcontext()), backends


def fake_fa4_modules(log, fail=False):
    """``flash_attn`` and ``flash_attn.cute`` as FA4 4.0.0b36 has them: both entry points return (out, lse)."""
    def entry(name):
        def fn(q, k, v, **kw):
            log.append((name, (q, k, v), kw))
            if fail:
                raise RuntimeError("FA4 refused this shape")
            return T(q.a.copy(), src=q.src, made_by="fa4"), T(np.zeros(q.shape[:-1]), made_by="fa4 lse")
        return fn

    cute = types.ModuleType("flash_attn.cute")
    cute.flash_attn_func, cute.flash_attn_varlen_func = entry("flash_attn_func"), entry("flash_attn_varlen_func")
    package = types.ModuleType("flash_attn")
    package.__path__ = []
    package.cute = cute
    return package, cute


@pytest.fixture
def fa4_log(monkeypatch):
    """A fake FA4 in sys.modules; yields the list its calls are logged to."""
    log = []
    package, cute = fake_fa4_modules(log)
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    return log


class Turns:
    """Timer stand-in: runs every contender of a turn on two input sets and returns set figures (ms)."""

    def __init__(self, ms):
        self.ms, self.turns = ms, []

    def median_ms_each(self, fns):
        self.turns.append(list(fns))
        for fn in fns.values():
            fn(0)
            fn(1)
        return {name: self.ms[name] for name in fns}


fake_cupy = SimpleNamespace(from_dlpack=lambda t: t.a, abs=np.abs, float32=np.float32, empty_like=np.empty_like,
                            cuda=SimpleNamespace(get_current_stream=lambda: "stream"))


def _fa4_calls(log, name="flash_attn_func"):
    return [entry for entry in log if entry[0] == name]


def _header(table):
    return [c.strip() for c in table.splitlines()[2].strip("|").split("|")]


def _cells(table, row=0):
    return dict(zip(_header(table), (c.strip() for c in table.splitlines()[4 + row].strip("|").split("|"))))


# ----------------------------------------------------------------------------- import and skip

@pytest.mark.parametrize("name", SCRIPTS)
def test_fa4_is_imported_from_flash_attn_cute(scripts, fa4_log, name):
    fa4 = scripts[name].open_fa4(fake_torch([]))
    assert fa4 is not None
    assert fa4.flash_attn_func is sys.modules["flash_attn.cute"].flash_attn_func
    assert fa4.flash_attn_varlen_func is sys.modules["flash_attn.cute"].flash_attn_varlen_func
    assert scripts[name].open_fa4(fake_torch([]), wanted=False) is None   # --no-fa4
    assert scripts[name].open_fa4(None) is None                          # FA4 needs torch


@pytest.mark.parametrize("name", SCRIPTS)
def test_fa4_missing_is_one_line_and_no_column_values(scripts, monkeypatch, capsys, name):
    monkeypatch.setitem(sys.modules, "flash_attn", None)   # import fails as where FA4 is not installed
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
    assert scripts[name].open_fa4(fake_torch([])) is None
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(lines) == 1 and "FA4 not importable" in lines[0], lines


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_offers_no_fa4(name):
    done = subprocess.run([sys.executable, str(BENCH / f"{name}.py"), "--help"], capture_output=True, text=True,
                          timeout=60, cwd=BENCH)
    assert done.returncode == 0, done.stderr
    assert "--no-fa4" in done.stdout


# ----------------------------------------------------------------------------- forward

def _forward_point(bf, fa4, timer, causal=True):
    log = []
    torch = fake_torch(log)
    F, sdpa_kernel, backends = fake_sdpa(log)
    rng = np.random.default_rng(0)
    inputs = [tuple(rng.standard_normal((2, 64, 4, 16)).astype(np.float32) for _ in range(3)) for _ in range(3)]
    def attention(q, k, v, causal):   # cuflash allocates its output, as every contender does
        return q.copy()
    cuflash = SimpleNamespace(attention=attention, force_kernel=lambda name: contextlib.nullcontext())
    fa4_inputs, torch_inputs = bf.torch_views(torch, inputs)
    args = SimpleNamespace(no_naive=True, naive_max_seqlen=0, repeats=1)
    row = bf.bench_point(args, fake_cupy, cuflash, torch, F, sdpa_kernel, backends, timer, inputs, torch_inputs,
                         "bfloat16", 2, 64, 4, 16, causal, 600.0, fa4=fa4, fa4_inputs=fa4_inputs)
    return row, log, inputs


def test_forward_times_fa4_in_the_turns_as_its_users_call_it(scripts, fa4_log):
    bf = scripts["bench_forward"]
    fa4 = bf.open_fa4(fake_torch([]))
    timer = Turns({"cuflash": 1.0, "sm80": 1.5, "flash": 2.0, "cudnn": 1.1, "efficient": 3.0, "fa4": 1.25})
    row, _, inputs = _forward_point(bf, fa4, timer, causal=True)
    assert timer.turns == [["cuflash", "sm80", "flash", "cudnn", "efficient", "fa4"]]   # one timing, all in turns
    calls = _fa4_calls(fa4_log)
    assert len(calls) == 3   # the trial call on set 0, then sets 0 and 1 in the turn
    for (_, (q, k, v), kw), i in zip(calls, (0, 0, 1)):
        assert kw == {"causal": True}   # no out=, FA4's own softmax scale
        for t, x in zip((q, k, v), inputs[i]):
            assert isinstance(t, T) and t.src is x and not t.transposed and t.shape == x.shape   # (B, S, H, D)
    flops = bf.attention_flops(2, 4, 64, 64, 16, True)
    assert row["fa4"] == pytest.approx(flops / 1.25e-3 / 1e12)
    assert row["cuflash/fa4"] == pytest.approx(1.25)   # speed over speed: cuflash 1.0 ms, FA4 1.25 ms
    table = bf.markdown_table([row], "header", bf.COLUMNS, bf.CELL_FORMATS)
    assert {"fa4", "cuflash/fa4"} <= set(_header(table))
    assert _cells(table)["cuflash/fa4"] == "1.25" and _cells(table)["fa4"] != "-"


def test_forward_without_fa4_leaves_its_cells_empty(scripts):
    bf = scripts["bench_forward"]
    timer = Turns({"cuflash": 1.0, "sm80": 1.5, "flash": 2.0, "cudnn": 1.1, "efficient": 3.0})
    row, _, _ = _forward_point(bf, None, timer)
    assert "fa4" not in timer.turns[0] and math.isnan(row["fa4"]) and math.isnan(row["cuflash/fa4"])
    cells = _cells(bf.markdown_table([row], "header", bf.COLUMNS, bf.CELL_FORMATS))
    assert cells["fa4"] == "-" and cells["cuflash/fa4"] == "-" and cells["cudnn"] != "-"


def test_forward_drops_a_refusing_fa4_and_times_the_rest(scripts, monkeypatch):
    bf = scripts["bench_forward"]
    log = []
    package, cute = fake_fa4_modules(log, fail=True)
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    timer = Turns({"cuflash": 1.0, "sm80": 1.5, "flash": 2.0, "cudnn": 1.1, "efficient": 3.0})
    row, _, _ = _forward_point(bf, bf.open_fa4(fake_torch([])), timer)
    assert timer.turns[0] == ["cuflash", "sm80", "flash", "cudnn", "efficient"] and math.isnan(row["fa4"])


# ----------------------------------------------------------------------------- backward

def _backward_point(bb, fa4, timer):
    log = []
    torch = fake_torch(log)
    F, sdpa_kernel, backends = fake_sdpa(log)
    rng = np.random.default_rng(1)
    inputs = [tuple(rng.standard_normal((2, 64, 4, 16)).astype(np.float32) for _ in range(4)) for _ in range(3)]

    def attention_backward(dout, q, k, v, out, lse, causal, deterministic=False):   # no dq=: allocated
        return tuple(np.zeros_like(x.a if isinstance(x, T) else x) for x in (q, k, v))
    cuflash = SimpleNamespace(
        attention_forward=lambda q, k, v, causal: (q.copy(), np.zeros(q.shape[:-1]), None),
        attention_backward=attention_backward,
        plan=lambda *a, **kw: SimpleNamespace(plan=SimpleNamespace(info={"family": "bwd_sm90"})))
    args = SimpleNamespace(family=None, no_deterministic=True)
    row = bb.bench_point(args, fake_cupy, cuflash, torch, F, sdpa_kernel, backends, timer, inputs, "bfloat16",
                         2, 64, 4, 16, True, fa4=fa4)
    return row, log, inputs


def test_backward_times_fa4_through_autograd(scripts, fa4_log):
    bb = scripts["bench_backward"]
    fa4 = bb.open_fa4(fake_torch([]))
    timer = Turns({"cuflash": 1.0, "cuflash_torch": 1.0, "flash": 2.0, "cudnn": 1.2, "fa4": 1.1})
    row, log, inputs = _backward_point(bb, fa4, timer)
    assert timer.turns == [["cuflash", "cuflash_torch", "flash", "cudnn", "fa4"]]
    forwards = _fa4_calls(fa4_log)
    assert len(forwards) == 3   # once per input set, untimed: the figure is the backward's
    for (_, leaves, kw), x in zip(forwards, inputs):
        assert kw == {"causal": True}
        for t, a in zip(leaves, x[:3]):
            assert t.src is a and not t.transposed and t.requires_grad   # (B, S, H, D) leaves
    # every timed FA4 call is torch.autograd.grad of FA4's own output with respect to that call's leaves
    fa4_grads = [e for e in log if e[0] == "torch.autograd.grad" and e[1][0].made_by == "fa4"]
    assert len(fa4_grads) == 3   # the trial call, then sets 0 and 1
    for (_, (out, leaves, dout), kw), i in zip(fa4_grads, (0, 0, 1)):
        assert tuple(leaves) == forwards[i][1] and out.src is inputs[i][0]   # FA4's output of set i
        assert kw == {"retain_graph": True}
        assert dout.src is inputs[i][3] and not dout.transposed
    assert row["cuflash/fa4"] == pytest.approx(1.1)
    table = bb.markdown_table([row], "header", bb.COLUMNS, bb.CELL_FORMATS)
    assert {"fa4", "cuflash/fa4"} <= set(_header(table)) and _cells(table)["cuflash/fa4"] == "1.10"


def test_backward_without_fa4(scripts):
    bb = scripts["bench_backward"]
    timer = Turns({"cuflash": 1.0, "cuflash_torch": 1.0, "flash": 2.0, "cudnn": 1.2})
    row, log, _ = _backward_point(bb, None, timer)
    assert "fa4" not in timer.turns[0] and math.isnan(row["fa4"])
    assert _cells(bb.markdown_table([row], "header", bb.COLUMNS, bb.CELL_FORMATS))["fa4"] == "-"


# ----------------------------------------------------------------------------- decode

def _decode_arrays(bd, batch=2, seqlen=64):
    rng = np.random.default_rng(2)
    q = rng.standard_normal((batch, 1, bd.HEADS_Q, bd.HEAD_DIM)).astype(np.float32)
    k, v = (rng.standard_normal((batch, seqlen, bd.HEADS_K, bd.HEAD_DIM)).astype(np.float32) for _ in range(2))
    pages = batch * seqlen // bd.PAGE_SIZE
    kc, vc = (x.reshape(pages, bd.PAGE_SIZE, bd.HEADS_K, bd.HEAD_DIM) for x in (k, v))
    table = np.arange(pages, dtype=np.int32).reshape(batch, -1)
    lens = np.full(batch, seqlen, dtype=np.int32)
    return q, k, v, kc, vc, table, lens


@pytest.mark.parametrize("layout", ["contiguous", "paged16"])
def test_decode_fa4_on_the_rows_cache(scripts, fa4_log, layout):
    bd = scripts["bench_decode"]
    log = []
    torch = fake_torch(log)
    F, sdpa_kernel, backends = fake_sdpa(log)
    q, k, v, kc, vc, table, lens = _decode_arrays(bd)
    if layout == "contiguous":
        kc, vc, table, lens = k, v, None, None
    peers = bd.peer_contenders(torch, F, sdpa_kernel, backends, bd.open_fa4(torch), q, k, v, layout,
                               kc, vc, table, lens)
    assert set(peers) == {"flash", "cudnn", "fa4"}
    fn, mark = peers["fa4"]
    assert mark == "" and fn().made_by == "fa4"   # its output, not (out, lse)
    (name, (fq, fk, fv), kw), = fa4_log
    assert fq.src is q and fk.src is kc and fv.src is vc
    assert not (fq.transposed or fk.transposed or fv.transposed)
    if layout == "contiguous":
        assert name == "flash_attn_func" and kw == {}
    else:   # FA4's paged KV: the pool of pages, the block table and the lengths, all on the GPU
        assert name == "flash_attn_varlen_func" and set(kw) == {"page_table", "seqused_k"}
        assert kw["page_table"].src is table and kw["seqused_k"].src is lens
    # SDPA stays on the contiguous cache whatever the layout
    peers["cudnn"][0]()
    sdpa = [e for e in log if e[0] == "F.scaled_dot_product_attention"][-1]
    assert sdpa[1][1].src is k and sdpa[1][1].transposed and sdpa[2] == {"enable_gqa": True}


def test_decode_row_times_fa4_in_the_turns(scripts, fa4_log):
    bd = scripts["bench_decode"]
    log = []
    torch = fake_torch(log)
    F, sdpa_kernel, backends = fake_sdpa(log)
    q, k, v, kc, vc, table, lens = _decode_arrays(bd)
    peers = bd.peer_contenders(torch, F, sdpa_kernel, backends, bd.open_fa4(torch), q, k, v, "paged16",
                               kc, vc, table, lens)
    out = np.empty_like(q)

    def no_graph(*args, **kwargs):
        raise RuntimeError("no GPU here")

    def decode(q, kc, vc, cache_seqlens, block_table):   # the plain call allocates its output
        return np.full_like(q, 0.5)
    cuflash = SimpleNamespace(plan=no_graph, decode=decode)
    timer = Turns({"call": 0.1, "flash": 0.2, "cudnn": 0.08, "fa4": 0.4})
    ms, marks, measured = bd.bench_layout(fake_cupy, cuflash, timer, peers, q, kc, vc, table, lens, out,
                                          np.zeros_like(q), "paged16 B=2 L=64")
    assert timer.turns == [["call", "flash", "cudnn", "fa4"]]
    assert measured["maxdiff"] == pytest.approx(0.5)
    cells = bd.decode_cells(ms, marks, bd.kv_bytes_of(2, 64), 4000.0)
    assert cells["fa4 us"] == pytest.approx(400.0) and cells["call/fa4"] == pytest.approx(4.0)
    row = dict(layout="paged16", B=2, L=64, **measured, **cells)
    table_md = bd.markdown_table([row], "header", bd.COLUMNS, bd.CELL_FORMATS)
    assert {"fa4 us", "fa4 GB/s", "call/fa4"} <= set(_header(table_md))
    assert _cells(table_md)["call/fa4"] == "4.00" and _cells(table_md)["cuflash us"] == "-"


def test_decode_cells_without_fa4(scripts):
    bd = scripts["bench_decode"]
    cells = bd.decode_cells({"graph": 0.05, "call": 0.1, "flash": 0.2}, {"flash": "*"}, bd.kv_bytes_of(8, 8192),
                            4000.0, bar=0.8)
    assert "fa4 us" not in cells and "call/fa4" not in cells and cells["flash GB/s"].endswith("*")
    assert cells["bar"].startswith(">=80% ")
    assert bd.peer_contenders(None, None, None, None, None, *[None] * 8) == {}   # no torch: no peers, no FA4

"""Several GPUs in one process (issue 17, part 3).

Every entry point runs on the current device (``with cupy.cuda.Device(i):``) and refuses, with a
ValueError naming the argument and before any launch, an array that lives on another GPU. Kernel setup
is per device: a module is loaded into each device's context (``_compile.get_kernel`` keyed by device),
the shared-memory limit of a kernel needing more than 48 KB is raised on each device where it runs
(``_launch.prepare_kernel`` keyed by function and device), and plans, stream states and workspaces are
never shared between devices.

CPU tests (stand-in arrays and a stand-in CuPy, as in test_faults.py) check the device check of every
entry point and the per-device bookkeeping; GPU tests need two GPUs and skip on one.
"""

import contextlib
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import cuflash
from cuflash import _checks
from cuflash._build import compile as _compile
from cuflash._runtime import launch as _launch, memo as _memo, plan as _plan

REPO = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- CPU: stand-ins

class Arr:
    """A CuPy array as the checks see it (shape, strides, dtype, pointer, device); no memory."""

    def __init__(self, shape, dtype, ptr, device=0, strides=None):
        self.shape = tuple(int(n) for n in shape)
        self.dtype = np.dtype(dtype)
        self.itemsize = self.dtype.itemsize
        dense, step = [], self.itemsize
        for n in reversed(self.shape):
            dense.append(step)
            step *= max(n, 1)
        self.strides = tuple(strides) if strides is not None else tuple(reversed(dense))
        self.ndim, self.size = len(self.shape), int(np.prod(self.shape))
        self.nbytes = self.size * self.itemsize
        self.data = SimpleNamespace(ptr=ptr, device_id=device)
        self.flags = SimpleNamespace(c_contiguous=strides is None)
        self._c_contiguous = strides is None   # what the plan memo reads (cuflash/_runtime/memo.py, lookup)

    def reshape(self, shape):
        extra = len(shape) - self.ndim
        return Arr(shape, self.dtype, self.data.ptr, self.data.device_id, (0,) * extra + self.strides)


class DLPackArr:
    """Anything speaking DLPack, on CUDA device ``device`` (importing it gives the stand-in array)."""

    def __init__(self, array, device):
        self.array, self.device = array, device

    def __dlpack__(self, *args, **kwargs):
        raise AssertionError("imported through __dlpack__ before its device was checked")

    def __dlpack_device__(self):
        return (2, self.device)


class Space:
    """Stand-in arrays at distinct addresses, and a stand-in CuPy whose current device is 0."""

    def __init__(self):
        self.next = 0x7F00_0000_0000
        self.imported = []

    def array(self, shape, dtype, device=0):
        ptr = self.next
        self.next += -(-(int(np.prod(shape)) * np.dtype(dtype).itemsize + 256) // 256) * 256 + 256
        return Arr(shape, dtype, ptr, device)

    def cupy(self):
        def from_dlpack(x):
            self.imported.append(x)
            return x.array

        def broadcast_to(x, shape):
            lead = len(shape) - x.ndim
            strides = [0] * lead + [s if n == m else 0 for n, m, s in zip(x.shape, shape[lead:], x.strides)]
            return Arr(shape, x.dtype, x.data.ptr, x.data.device_id, strides)

        runtime = SimpleNamespace(getDevice=lambda: 0, getDeviceCount=lambda: 2)
        return SimpleNamespace(ndarray=Arr, from_dlpack=from_dlpack, broadcast_to=broadcast_to,
                               ascontiguousarray=lambda x: x, asarray=lambda x: self.array(np.shape(x), np.int32),
                               cuda=SimpleNamespace(runtime=runtime))


@pytest.fixture
def space(monkeypatch):
    space = Space()
    fake = space.cupy()
    monkeypatch.setattr(_checks, "_cupy", lambda: fake)
    monkeypatch.setattr(_plan, "_cp", fake)
    monkeypatch.setattr(_memo, "_cp", fake)
    monkeypatch.setattr(_launch, "current_stream_ptr", lambda device_id=-1: 0)
    launched = []
    monkeypatch.setattr(_launch, "launch", lambda *args, **kw: launched.append(args))
    space.launched = launched
    yield space
    assert launched == [], "a call with an operand on another GPU launched a kernel"


F16, F32, I32, BOOL = np.float16, np.float32, np.int32, np.bool_
B, SQ, SK, HQ, HK, D = 2, 17, 33, 4, 2, 64


def _call(space, entry, wrong, dlpack=False):
    """Call ``entry`` with every array on device 0 except the argument named ``wrong``, on device 1."""
    def a(name, shape, dtype):
        x = space.array(shape, dtype, device=1 if name == wrong else 0)
        return DLPackArr(x, x.data.device_id) if dlpack else x

    qkv = dict(q=a("q", (B, SQ, HQ, D), F16), k=a("k", (B, SK, HK, D), F16), v=a("v", (B, SK, HK, D), F16))
    if entry == "attention":
        return cuflash.attention(**qkv, out=a("out", (B, SQ, HQ, D), F16), mask=a("mask", (SQ, SK), BOOL),
                                 bias=a("bias", (1, HQ, SQ, SK), F32), alibi_slopes=a("alibi_slopes", (HQ,), F32))
    if entry == "attention_forward":
        return cuflash.attention_forward(**qkv, lse=a("lse", (B, HQ, SQ), F32),
                                         block_mask=a("block_mask", (B, HQ, 1, 1), BOOL))
    if entry == "attention_varlen":
        q, k, v = (a(n, (B * s, h, D), F16) for n, s, h in (("q", SQ, HQ), ("k", SK, HK), ("v", SK, HK)))
        return cuflash.attention_varlen(q, k, v, a("cu_seqlens_q", (B + 1,), I32), a("cu_seqlens_k", (B + 1,), I32),
                                        out=a("out", (B * SQ, HQ, D), F16))
    if entry == "attention_backward":
        return cuflash.attention_backward(a("dout", (B, SQ, HQ, D), F16), qkv["q"], qkv["k"], qkv["v"],
                                          a("out", (B, SQ, HQ, D), F16), a("lse", (B, HQ, SQ), F32),
                                          dq=a("dq", (B, SQ, HQ, D), F16), dv=a("dv", (B, SK, HK, D), F16))
    if entry == "attention_varlen_backward":
        q, k, v = (a(n, (B * s, h, D), F16) for n, s, h in (("q", SQ, HQ), ("k", SK, HK), ("v", SK, HK)))
        return cuflash.attention_varlen_backward(
            a("dout", (B * SQ, HQ, D), F16), q, k, v, a("out", (B * SQ, HQ, D), F16), a("lse", (HQ, B * SQ), F32),
            a("cu_seqlens_q", (B + 1,), I32), a("cu_seqlens_k", (B + 1,), I32), dk=a("dk", (B * SK, HK, D), F16))
    if entry == "decode":
        return cuflash.decode(a("q", (B, 1, HQ, D), F16), a("k_cache", (8, 16, HK, D), F16),
                              a("v_cache", (8, 16, HK, D), F16), cache_seqlens=a("cache_seqlens", (B,), I32),
                              block_table=a("block_table", (B, 4), I32), k_new=a("k_new", (B, 1, HK, D), F16),
                              v_new=a("v_new", (B, 1, HK, D), F16), alibi_slopes=a("alibi_slopes", (HQ,), F32),
                              out=a("out", (B, 1, HQ, D), F16))
    if entry == "merge_states":   # a sequence of outs, or one stacked array
        outs = ([a(f"outs[{i}]", (B, SQ, HQ, D), F16) for i in range(3)] if wrong.startswith("outs[")
                else a("outs", (3, B, SQ, HQ, D), F16))
        return cuflash.merge_states(outs, a("lses", (3, B, HQ, SQ), F32), out=a("out", (B, SQ, HQ, D), F16))
    raise AssertionError(entry)


WRONG = [("attention", n) for n in ("q", "k", "v", "out", "mask", "bias", "alibi_slopes")] + [
    ("attention_forward", "lse"), ("attention_forward", "block_mask"),
    ("attention_varlen", "q"), ("attention_varlen", "cu_seqlens_q"), ("attention_varlen", "cu_seqlens_k"),
    ("attention_varlen", "out"),
    ("attention_backward", "dout"), ("attention_backward", "v"), ("attention_backward", "out"),
    ("attention_backward", "lse"), ("attention_backward", "dq"), ("attention_backward", "dv"),
    ("attention_varlen_backward", "dout"), ("attention_varlen_backward", "lse"),
    ("attention_varlen_backward", "cu_seqlens_k"), ("attention_varlen_backward", "dk"),
    ("decode", "q"), ("decode", "k_cache"), ("decode", "v_cache"), ("decode", "cache_seqlens"),
    ("decode", "block_table"), ("decode", "k_new"), ("decode", "v_new"), ("decode", "alibi_slopes"),
    ("decode", "out"),
    ("merge_states", "outs[1]"), ("merge_states", "lses"), ("merge_states", "out")]


@pytest.mark.parametrize("entry, wrong", WRONG)
@pytest.mark.parametrize("dlpack", [False, True], ids=["cupy", "dlpack"])
def test_an_operand_on_another_gpu_is_refused_before_any_launch(space, entry, wrong, dlpack):
    with pytest.raises(ValueError, match=rf"^{re.escape(wrong)} is on CUDA device 1, but the current device is 0"):
        _call(space, entry, wrong, dlpack)
    # A DLPack operand is checked before it is imported (its __dlpack__ would raise): only the
    # arguments checked before it were imported.
    assert all(x.device == 0 for x in space.imported)


def test_operands_on_the_current_device_pass_the_check(space):
    x = space.array((2, 3), F16)
    assert _checks.as_cuda_array(x, "q") is x
    assert _checks.as_cuda_array(DLPackArr(x, 0), "q") is x
    with pytest.raises(ValueError, match="^k is on CUDA device 3, but the current device is 0"):
        _checks.as_cuda_array(DLPackArr(space.array((2, 3), F16, device=3), 3), "k")

    class Managed(DLPackArr):   # kDLCUDAManaged: reachable from every device, not checked
        def __dlpack_device__(self):
            return (13, self.device)

    assert _checks.as_cuda_array(Managed(x, 5), "q") is x


def test_repeat_calls_key_plans_by_device(monkeypatch):
    """A plan is remembered under each operand's device and the current device, so a repeat call with an
    operand elsewhere (or from another current device) never replays it: it takes the checked path."""
    keys = set()
    monkeypatch.setattr(_launch, "current_stream_ptr", lambda device_id=-1: 0)
    for device, current in ((0, 0), (1, 0), (1, 1), (0, 1)):
        runtime = SimpleNamespace(getDevice=lambda current=current: current)
        fake = SimpleNamespace(ndarray=Arr, cuda=SimpleNamespace(runtime=runtime))
        monkeypatch.setattr(_plan, "_cp", fake)
        monkeypatch.setattr(_memo, "_cp", fake)
        x = Arr((2, 3), F16, 0x7F00_0000_0000, device)
        plan, key, where = _memo.lookup("probe", (x, None), ())
        assert plan is None and key is not None and where == (current, 0)
        keys.add(key)
    assert len(keys) == 4


# ----------------------------------------------------------------------------- CPU: per-device setup

class FakeKernel:
    """A cupy.RawKernel as prepare_kernel sees it: one function per device (the current one's), and
    attributes set on that function."""

    def __init__(self, gpu, base=0x1000):
        self.gpu, self.base, self.limits = gpu, base, {}

    @property
    def kernel(self):
        return SimpleNamespace(ptr=self.base + self.gpu.current)

    @property
    def max_dynamic_shared_size_bytes(self):
        return self.limits.get(self.gpu.current, 48 * 1024)

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, value):
        self.limits[self.gpu.current] = value


@pytest.fixture
def two_fake_gpus(monkeypatch):
    gpu = SimpleNamespace(current=0)

    class Device:
        def __init__(self, i):
            self.i = i

        def __enter__(self):
            self.saved, gpu.current = gpu.current, self.i

        def __exit__(self, *exc):
            gpu.current = self.saved

    fake = SimpleNamespace(cuda=SimpleNamespace(runtime=SimpleNamespace(getDevice=lambda: gpu.current),
                                                Device=Device))
    monkeypatch.setattr(_launch, "_cupy", lambda: fake)
    monkeypatch.setattr(_launch, "_prepared", {})
    monkeypatch.setattr(_launch, "relaxed_capture_mode", contextlib.nullcontext)
    return gpu


def test_shared_memory_limit_is_raised_on_each_device(two_fake_gpus):
    gpu = two_fake_gpus
    kernel = FakeKernel(gpu)
    smem = 100 * 1024
    gpu.current = 1   # first used on device 1
    assert _launch.prepare_kernel(kernel, smem, 1) == 0x1001
    assert kernel.limits == {1: smem}
    gpu.current = 0
    assert _launch.prepare_kernel(kernel, smem, 0) == 0x1000
    assert kernel.limits == {1: smem, 0: smem}
    # Asked for another device than the current one: set up there, and the current device restored.
    kernel2 = FakeKernel(gpu, 0x2000)
    assert _launch.prepare_kernel(kernel2, smem, 1) == 0x2001
    assert kernel2.limits == {1: smem} and gpu.current == 0
    # Once per (function, device): no second attribute call.
    kernel.limits.clear()
    _launch.prepare_kernel(kernel, smem, 0)
    assert kernel.limits == {}


MERGE = cuflash.kernels.merge.merge_plan("float32", "float32").variant


def test_kernels_are_loaded_per_device(tmp_path, monkeypatch):
    """get_kernel loads a module into each device's context on that device's first call (finding, or
    rebuilding, the cubin then), rather than letting one RawKernel load itself lazily elsewhere."""
    import tempfile

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("CUFLASH_CACHE_DIR", raising=False)
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    gpu = SimpleNamespace(current=0, loaded=[])

    class FakeModule:
        def __init__(self, path):
            with open(path, "rb") as f:
                assert f.read(4) == b"\x7fELF"
            gpu.loaded.append((gpu.current, path))

        def get_function(self, name):
            return ("kernel", name, gpu.current)

    driver = SimpleNamespace(CUDADriverError=RuntimeError)
    monkeypatch.setitem(sys.modules, "cupy", SimpleNamespace(RawModule=FakeModule,
                                                            cuda=SimpleNamespace(driver=driver)))
    monkeypatch.setattr(_compile, "device_arch", lambda device=None: "sm_80")
    monkeypatch.setattr(_compile, "current_device", lambda: gpu.current)
    monkeypatch.setattr(_compile, "_kernels", {})
    assert _compile.get_kernel(MERGE) == ("kernel", MERGE.entry, 0)
    path = gpu.loaded[0][1]
    Path(path).unlink()   # gone before device 1's first call: rebuilt, not a load failure
    gpu.current = 1
    assert _compile.get_kernel(MERGE) == ("kernel", MERGE.entry, 1)
    gpu.current = 0
    assert _compile.get_kernel(MERGE) == ("kernel", MERGE.entry, 0)
    assert [d for d, _ in gpu.loaded] == [0, 1]


# ----------------------------------------------------------------------------- GPU: two devices

def _device_count():
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # no CuPy, no driver, no device
        return 0


needs_two_gpus = pytest.mark.skipif(_device_count() < 2, reason="needs two CUDA GPUs")


def _host(x):
    import cupy

    return np.asarray(cupy.asnumpy(x), dtype=np.float64)


def _on(device, make, call):
    """``call(*make())`` with ``device`` current; the results on the host (and checked to be on it)."""
    import cupy

    with cupy.cuda.Device(device):
        args = make()
        results = call(*args)
        results = results if isinstance(results, tuple) else (results,)
        for r in results:
            if isinstance(r, cupy.ndarray):
                assert r.device.id == device
        host = tuple(_host(r) if r is not None else None for r in results)
        extra = tuple(_host(x) for x in args if isinstance(x, cupy.ndarray))   # inputs written in place
        cupy.cuda.Device().synchronize()
    return host, extra


def _same(a, b, exact=True):
    for x, y in zip(a, b):
        if exact:
            np.testing.assert_array_equal(x, y)
        else:
            np.testing.assert_allclose(x, y, rtol=2e-2, atol=2e-3)


def _fwd_families():
    from cuflash._build.compile import device_arch

    sm90 = all(device_arch(i) == "sm_90a" for i in (0, 1))
    return [f for f in ("fwd_sm90", "fwd_sm80", "fwd_simt") if sm90 or f != "fwd_sm90"]


def _random(shape, dtype, seed):
    import cupy

    import cuflash.testing as tt
    return tt.random_qkv(shape, dtype, seed, xp=cupy)


SHAPE = dict(B=2, Sq=77, Sk=200, Hq=4, Hk=2, D=128)


@pytest.mark.parametrize("family", ["fwd_sm90", "fwd_sm80", "fwd_simt"])
@pytest.mark.parametrize("options", [dict(causal=True), dict(window=(32, 8), softcap=30.0, dropout_p=0.1)],
                         ids=["causal", "window-softcap-dropout"])
@pytest.mark.gpu
@needs_two_gpus
def test_forward_on_each_gpu(family, options):
    if family not in _fwd_families():
        pytest.skip("fwd_sm90 needs sm_90a GPUs")
    import cuflash.testing as tt
    from cuflash import reference

    dtype = "float32" if family == "fwd_simt" else "bfloat16"
    results = []
    for device in (1, 0):   # device 1 first: its kernels are set up before device 0's
        def call(q, k, v):
            with cuflash.force_kernel(family):
                out, lse, rng_state = cuflash.attention_forward(q, k, v, generator=cuflash.Generator(7), **options)
            ref_out, _ = reference.attention_forward(q, k, v, rng_state=rng_state, **options)
            base = tt.baseline_attention(q, k, v, rng_state=rng_state, **options) if dtype != "float32" else None
            tt.assert_attention_close(out, ref_out, base, dtype=dtype)
            return out, lse

        results.append(_on(device, lambda: _random(SHAPE, dtype, 0), call)[0])
    _same(*results)


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("family", ["bwd_sm90", "bwd_sm80", "bwd_simt"])
def test_backward_on_each_gpu(family):
    if family == "bwd_sm90" and "fwd_sm90" not in _fwd_families():
        pytest.skip("bwd_sm90 needs sm_90a GPUs")
    import cupy

    from cuflash import backward as bw

    dtype = "float32" if family == "bwd_simt" else "bfloat16"

    def make():
        q, k, v = _random(SHAPE, dtype, 1)
        dout = _random(dict(SHAPE, Sk=SHAPE["Sq"], Hk=SHAPE["Hq"]), dtype, 2)[0]
        return dout, q, k, v

    for deterministic in (True, False):
        results = []
        for device in (1, 0):
            def call(dout, q, k, v):
                out, lse, _ = cuflash.attention_forward(q, k, v, causal=True)
                with bw.force_kernel(family):
                    return cuflash.attention_backward(dout, q, k, v, out, lse, causal=True,
                                                      deterministic=deterministic)

            results.append(_on(device, make, call)[0])
        _same(*results, exact=deterministic)
    del cupy


@pytest.mark.gpu
@needs_two_gpus
def test_varlen_on_each_gpu():
    import cupy

    cu_q, cu_k = [0, 77, 277, 278], [0, 200, 277, 282]

    def make():
        q, k, v = _random(dict(B=1, Sq=278, Sk=282, Hq=4, Hk=2, D=64), "float16", 3)
        dout = _random(dict(B=1, Sq=278, Sk=278, Hq=4, Hk=4, D=64), "float16", 4)[0]
        return (q[0], k[0], v[0], dout[0], cupy.array(cu_q, cupy.int32), cupy.array(cu_k, cupy.int32))

    def call(q, k, v, dout, cq, ck):
        out, lse = cuflash.attention_varlen(q, k, v, cq, ck, max_seqlen_q=200, max_seqlen_k=200, causal=True,
                                            return_lse=True, check=True)
        grads = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cq, ck, max_seqlen_q=200,
                                                  max_seqlen_k=200, causal=True, deterministic=True, check=True)
        return (out, lse, *grads)

    _same(_on(1, make, call)[0], _on(0, make, call)[0])


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_on_each_gpu(paged, splits):
    import cupy

    Bd, Hq, Hk, Dd, cap, page = 2, 8, 2, 128, 200, 16

    def make():
        rng = np.random.default_rng(5)
        f = lambda *s: cupy.asarray(rng.standard_normal(s, dtype=np.float32).astype(np.float16))  # noqa: E731
        q, k_new, v_new = f(Bd, 2, Hq, Dd), f(Bd, 2, Hk, Dd), f(Bd, 2, Hk, Dd)
        if paged:
            pages = Bd * (cap // page + 1)
            kc, vc = f(pages, page, Hk, Dd), f(pages, page, Hk, Dd)
            table = cupy.asarray(rng.permutation(pages).astype(np.int32).reshape(Bd, -1))
        else:
            kc, vc, table = f(Bd, cap, Hk, Dd), f(Bd, cap, Hk, Dd), None
        return q, kc, vc, k_new, v_new, cupy.array([77, 150], cupy.int32), table

    def call(q, kc, vc, k_new, v_new, lens, table):
        return cuflash.decode(q, kc, vc, cache_seqlens=lens, block_table=table, k_new=k_new, v_new=v_new,
                              num_splits=splits, return_lse=True, check=True)

    one, zero = _on(1, make, call), _on(0, make, call)
    _same(one[0], zero[0], exact=False)
    _same(one[1], zero[1])   # the caches after the append


@pytest.mark.gpu
@needs_two_gpus
def test_merge_on_each_gpu():
    import cupy

    def make():
        rng = np.random.default_rng(6)
        outs = cupy.asarray(rng.standard_normal((3, 2, 70, 4, 64), dtype=np.float32))
        lses = cupy.asarray(rng.standard_normal((3, 2, 4, 70), dtype=np.float32))
        lses[0, :, :, :5] = -np.inf
        return outs, lses

    _same(_on(1, make, cuflash.merge_states)[0], _on(0, make, cuflash.merge_states)[0])


BIG_SMEM = textwrap.dedent("""
    import sys
    import cupy, numpy as np
    import cuflash, cuflash.testing as tt
    from cuflash import kernels, reference
    from cuflash._build import compile as _compile
    from cuflash._runtime import launch as _launch

    family, dtype = sys.argv[1], sys.argv[2]
    plan = kernels.forward.forward_plan(family, dtype, 128, score_mods=(), dropout=False)
    assert plan.smem_bytes > 48 * 1024, plan.smem_bytes
    shape = dict(B=1, Sq=150, Sk=300, Hq=4, Hk=2, D=128)
    outs = []
    for device in (1, 0):   # a fresh process: the kernel's first use is on device 1
        with cupy.cuda.Device(device):
            q, k, v = tt.random_qkv(shape, dtype, 0, xp=cupy)
            with cuflash.force_kernel(family):
                out = cuflash.attention(q, k, v, causal=True)
            ref, _ = reference.attention_forward(q, k, v, causal=True)
            base = tt.baseline_attention(q, k, v, causal=True) if dtype != "float32" else None
            tt.assert_attention_close(out, ref, base, dtype=dtype)
            outs.append(cupy.asnumpy(out.astype(cupy.float32)))
            assert _compile.get_kernel(plan.variant).max_dynamic_shared_size_bytes >= plan.smem_bytes
    np.testing.assert_array_equal(outs[0], outs[1])
    raised = {key[1] for key, value in _launch._prepared.items()
              if isinstance(key[0], int) and value >= plan.smem_bytes}
    assert raised == {0, 1}, raised
    print("ok", plan.smem_bytes)
""")


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("family", ["fwd_sm90", "fwd_sm80", "fwd_simt"])
def test_kernel_with_large_shared_memory_first_used_on_device_1(family):
    if family not in _fwd_families():
        pytest.skip("fwd_sm90 needs sm_90a GPUs")
    dtype = "float32" if family == "fwd_simt" else "bfloat16"
    done = subprocess.run([sys.executable, "-c", BIG_SMEM, family, dtype], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0 and done.stdout.startswith("ok"), done.stdout + done.stderr


@pytest.mark.gpu
@needs_two_gpus
def test_operands_on_two_gpus_are_refused():
    import cupy

    shape = dict(B=1, Sq=64, Sk=96, Hq=4, Hk=2, D=64)
    with cupy.cuda.Device(0):
        q0, k0, v0 = _random(shape, "float16", 7)
        out0 = cupy.full(q0.shape, np.nan, q0.dtype)
    with cupy.cuda.Device(1):
        q1, k1, v1 = _random(shape, "float16", 7)
        out1 = cupy.full(q1.shape, np.nan, q1.dtype)
    with cupy.cuda.Device(0):
        expected = cuflash.attention(q0, k0, v0)   # plans this layout on device 0
        for args, kw, name in (((q0, k1, v0), {}, "k"), ((q1, k1, v1), {}, "q"), ((q0, k0, v0), {"out": out1}, "out"),
                               ((q0, k0, v1), {"out": out0}, "v")):
            with pytest.raises(ValueError, match=f"^{name} is on CUDA device"):
                cuflash.attention(*args, **kw)
        assert bool(cupy.isnan(out0).all())
        with cupy.cuda.Device(1):
            assert bool(cupy.isnan(out1).all())
        # The same layout from device 1: planned there, same result.
        with cupy.cuda.Device(1):
            got = cuflash.attention(q1, k1, v1, out=out1)
            assert got is out1
            np.testing.assert_array_equal(cupy.asnumpy(out1), cupy.asnumpy(expected))
            with pytest.raises(ValueError, match="^q is on CUDA device 0, but the current device is 1"):
                cuflash.attention(q0, k0, v0)
        with pytest.raises(ValueError, match="^k_cache is on CUDA device 1"):
            cuflash.decode(q0[:, :1], k1, v1)
        with pytest.raises(ValueError, match=r"^outs\[1\] is on CUDA device 1"):
            cuflash.merge_states([q0, q1], [cupy.zeros((1, 4, 64), cupy.float32)] * 2)


@pytest.mark.gpu
@needs_two_gpus
def test_plans_and_stream_states_are_per_device():
    import cupy

    shape = dict(B=1, Sq=64, Sk=96, Hq=4, Hk=2, D=64)
    plans = []
    for device in (0, 1):
        with cupy.cuda.Device(device):
            q, k, v = _random(shape, "bfloat16", 8)
            plans.append(cuflash.plan(cuflash.attention, q, k, v, causal=True))
            plans[-1](q, k, v)
            cuflash.attention(q, k, v, causal=True)
            cupy.cuda.Device().synchronize()
    assert plans[0].plan is not plans[1].plan
    assert plans[0].plan.steps[-1].func != plans[1].plan.steps[-1].func   # one function per device
    with cupy.cuda.Device(1):
        q, k, v = _random(shape, "bfloat16", 8)
        with pytest.raises(ValueError):
            plans[0](q, k, v)   # planned on device 0
    states = {key[0]: state for key, state in _launch._states.items()}
    assert {0, 1} <= set(states)
    for device, state in states.items():
        assert state._words.device.id == device and state._counters.device.id == device


@pytest.mark.gpu
@needs_two_gpus
def test_torch_tensors_on_another_gpu():
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() < 2:
        pytest.skip("torch sees fewer than two GPUs")
    import cupy

    q, k, v = (torch.randn(1, 64, 4, 64, device="cuda:1", dtype=torch.float16) for _ in range(3))
    with cupy.cuda.Device(0):
        with pytest.raises(ValueError, match="^q is on CUDA device 1, but the current device is 0"):
            cuflash.attention(q, k, v)
    with cupy.cuda.Device(1):
        out = cuflash.attention(q, k, v)
        assert out.device.id == 1
    import cuflash.interop.torch as ct   # runs on the inputs' device, whatever the current one

    with cupy.cuda.Device(0):
        got = ct.attention(q, k, v)
    assert got.device == q.device
    torch.testing.assert_close(got, torch.from_dlpack(out))

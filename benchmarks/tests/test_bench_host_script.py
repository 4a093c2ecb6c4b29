"""benchmarks/bench_host.py without a GPU: its arguments, that its registry names every row and
calls every contender as its users call it (no ``out=`` for cuflash unless the row says so, SDPA on
transposed views, the backward through autograd), the timing loop's arithmetic (one untimed call,
the synchronisation inside the clock, every contender once a round), the check and fallback logic,
and the ratio and bar columns from synthetic numbers.

The contenders are built against a recording stand-in for CuPy, torch, JAX and cuflash: every
attribute is another recorder and every call is logged with its arguments, so the test reads what
each contender would send without running it."""

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[1]
SCRIPT = BENCH / "bench_host.py"


@pytest.fixture(scope="module")
def bh():
    sys.path.insert(0, str(BENCH))   # the script imports _harness from beside it
    try:
        spec = importlib.util.spec_from_file_location("bench_host", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module   # dataclasses look their module up by name
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCH))
        sys.modules.pop("bench_host", None)


class Rec:
    """Any attribute is a Rec; a call is logged as (path, args, kwargs) and returns a Rec."""

    def __init__(self, path, log):
        self._path, self._log = path, log

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return Rec(f"{self._path}.{name}", self._log)

    def __call__(self, *args, **kwargs):
        self._log.append((self._path, args, kwargs))
        return Rec(f"{self._path}()", self._log)

    def __getitem__(self, index):
        return Rec(f"{self._path}[]", self._log)


class NoDecode(Rec):
    """cuflash.interop.torch before it has ``decode``."""

    def __getattr__(self, name):
        if name == "decode":
            raise AttributeError(name)
        return super().__getattr__(name)


def fake_env(log, ct_cls=Rec):
    def grad(f, argnums):
        assert argnums == (0, 1, 2)
        return f

    jax = SimpleNamespace(jit=lambda f: f, grad=grad, random=Rec("jax.random", log), nn=Rec("jax.nn", log),
                          block_until_ready=Rec("jax.block_until_ready", log))
    return SimpleNamespace(cp=Rec("cp", log), np=np, bf16="bf16", cuflash=Rec("cuflash", log), torch=Rec("torch", log),
                           F=Rec("F", log), sdpa_kernel=Rec("sdpa_kernel", log), SDPBackend=Rec("SDPBackend", log),
                           ct=ct_cls("ct", log), fa4=Rec("fa4", log), jax=jax, jnp=Rec("jnp", log), cj=Rec("cj", log),
                           device_sync=lambda: None)


# What each cuflash front end must call, by its row's name.
FRONT_END_PATH = {"cuflash.attention (CuPy)": "cuflash.attention",
                  "cuflash.attention (CuPy, out=)": "cuflash.attention",
                  "ct.attention": "ct.attention", "ct.ops.attention": "ct.ops.attention",
                  "ct.attention_varlen": "ct.attention_varlen", "cuflash.decode (CuPy)": "cuflash.decode",
                  "ct.decode": "ct.decode", "ct.ops.decode": "ct.ops.decode", "cuflash.interop.jax": "cj.attention"}


def _front_end_calls(log):
    """Calls of a cuflash entry point itself (not of a method on something it returned)."""
    return [(path, kw) for path, _, kw in log
            if path.split(".")[0] in ("cuflash", "ct", "cj") and "(" not in path and "[" not in path]


def test_registry_names_every_row(bh):
    log = []
    registry = bh.make_registry(fake_env(log), list(bh.CALLS))
    expected = {(call, name) for call, entries in bh.REGISTRY.items() for name, _ in entries}
    assert set(registry) == expected
    # the calls the issue asks for, each with its peers
    for call in ("forward", "forward+backward", "varlen forward", "decode"):
        assert {"SDPA cuDNN", "SDPA flash", "FA4"} <= {name for c, name in registry if c == call}, call
    for call in ("jax forward", "jax forward+backward"):
        assert {name for c, name in registry if c == call} == {"cuflash.interop.jax", "jax cuDNN"}
    assert ("forward", "cuflash.attention (CuPy, out=)") in registry   # the labelled extra
    # every bar belongs to a row, and every front end has its expected entry point
    front_ends = {key for key in expected if bh.is_cuflash(*key)}
    assert set(bh.BARS) <= front_ends
    assert {name for _, name in front_ends} == set(FRONT_END_PATH)
    rows = bh.host_rows({}, list(bh.CALLS))
    assert {(r["call"], r["front end"]) for r in rows} == front_ends
    assert all(r["bar"] in (None, "not run") for r in rows)


def test_no_out_unless_the_row_says_so(bh):
    log = []
    registry = bh.make_registry(fake_env(log), list(bh.CALLS))
    for (call, name), c in registry.items():
        if call == bh.FLOOR:
            continue
        log.clear()
        c.fn()
        if bh.is_cuflash(call, name):
            calls = _front_end_calls(log)
            assert [path for path, _ in calls] == [FRONT_END_PATH[name]], (call, name, calls)
            assert ("out" in calls[0][1]) == ("out=" in name), (call, name, calls[0][1])
        else:   # the peers allocate their outputs too
            assert not [entry for entry in log if "out" in entry[2]], (call, name)
        if call in ("forward+backward",):
            assert [e for e in log if e[0] == "torch.autograd.grad"], (call, name)   # a real autograd step
        if call.startswith("jax"):
            assert c.sync is not None and not c.events   # JAX's work is waited for, and not timed by events


def test_peers_are_called_as_their_users_call_them(bh):
    log = []
    registry = bh.make_registry(fake_env(log), list(bh.CALLS))
    for call in ("forward", "forward+backward", "varlen forward", "decode"):
        for peer in ("SDPA cuDNN", "SDPA flash"):
            log.clear()
            registry[(call, peer)].fn()
            sdpa = [e for e in log if e[0] == "F.scaled_dot_product_attention"]
            assert len(sdpa) == 1
            # BHSD views of the BSHD inputs, made inside the call
            assert all(isinstance(a, Rec) and a._path.endswith(".transpose()") for a in sdpa[0][1]), sdpa
            assert [e[1] for e in log if e[0].endswith(".transpose")].count((1, 2)) >= 4   # in, and the output back
            if call == "decode":
                assert sdpa[0][2] == {"is_causal": False, "enable_gqa": True}
            else:
                assert sdpa[0][2] == {"is_causal": True}
            assert registry[(call, peer)].context is not bh.contextlib.nullcontext   # the backend chosen
    log.clear()
    registry[("jax forward", "jax cuDNN")].fn()
    assert [e[2] for e in log if e[0] == "jax.nn.dot_product_attention"] == [{"is_causal": True,
                                                                              "implementation": "cudnn"}]


def test_missing_parties_leave_their_rows_out(bh):
    log = []
    env = fake_env(log, ct_cls=NoDecode)
    env.fa4 = env.cj = None
    registry = bh.make_registry(env, list(bh.CALLS))
    assert ("decode", "ct.decode") not in registry and ("decode", "ct.ops.decode") in registry
    assert not [key for key in registry if key[1] in ("FA4", "cuflash.interop.jax")]
    assert ("jax forward", "jax cuDNN") in registry
    env.jax = env.torch = env.ct = None
    registry = bh.make_registry(env, list(bh.CALLS))
    assert set(registry) == {(bh.FLOOR, "empty kernel (CuPy)"), ("forward", "cuflash.attention (CuPy)"),
                             ("forward", "cuflash.attention (CuPy, out=)"), ("decode", "cuflash.decode (CuPy)")}


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_timing_loop(bh):
    clock = FakeClock()
    ran, entered = [], []

    def contender(name, cost_us, sync_us):
        def fn():
            clock.t += cost_us * 1e-6
            ran.append(name)
            return name

        def sync(result):
            assert result == name
            clock.t += sync_us * 1e-6

        class Ctx:
            def __enter__(self):
                entered.append(name)

            def __exit__(self, *exc):
                return False

        return bh.Contender(fn, context=Ctx, sync=sync)

    calls, rounds = 30, 7
    registry = {("a", "x"): contender("a", 2.0, 30.0), ("b", "y"): contender("b", 5.0, 0.0),
                ("c", "z"): contender("c", 1.0, 60.0)}
    samples = bh.host_samples(registry, rounds, calls, clock)
    # per call: the call's cost, plus the one synchronisation inside the clock shared by the burst
    assert samples[("a", "x")] == pytest.approx([2.0 + 30.0 / calls] * rounds)
    assert samples[("b", "y")] == pytest.approx([5.0] * rounds)
    assert samples[("c", "z")] == pytest.approx([1.0 + 60.0 / calls] * rounds)
    assert len(ran) == len(registry) * rounds * (calls + 1)   # one untimed call before each burst
    assert len(entered) == len(registry) * rounds             # the context once per burst, never per call
    first = [entered[i * 3:(i + 1) * 3] for i in range(rounds)]
    assert all(sorted(r) == ["a", "b", "c"] for r in first)   # every contender once a round
    assert len({tuple(r) for r in first}) > 1                 # in changing orders
    med = bh.medians({"k": [3.0, 1.0, 2.0, 10.0, 2.5], "empty": []})
    assert med == {"k": 2.5}


def test_prepare_checks_and_falls_back(bh):
    env = SimpleNamespace(np=np)
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((1, 4, 2, 8)).astype(np.float32)

    def refused():
        raise RuntimeError("no GQA here")

    registry = {
        ("forward", "SDPA cuDNN"): bh.Contender(lambda: ref, sync=lambda r: None),
        ("forward", "ct.attention"): bh.Contender(lambda: ref + 2.0**-10, sync=lambda r: None),
        ("forward", "ct.ops.attention"): bh.Contender(lambda: ref + 0.5, sync=lambda r: None),
        ("forward", "FA4"): bh.Contender(lambda: (ref, None), sync=lambda r: None, outputs=bh._fa4_first),
        ("forward", "SDPA flash"): bh.Contender(refused, sync=lambda r: None, fallback=lambda: ref,
                                                fallback_note="expanded"),
        ("decode", "SDPA cuDNN"): bh.Contender(refused, sync=lambda r: None),
    }
    checks = bh.prepare(env, registry, warmup=1)
    assert ("decode", "SDPA cuDNN") not in registry   # refused, no fallback: not timed
    assert registry[("forward", "SDPA flash")].note == "expanded"
    assert registry[("forward", "SDPA flash")].fn() is ref
    assert checks[("forward", "ct.attention")][1] and checks[("forward", "FA4")][1]
    assert checks[("forward", "ct.ops.attention")] == (pytest.approx(0.5), False)
    # gradients get the looser tolerance
    assert bh.tolerance("forward+backward", 4.0) > bh.tolerance("forward", 4.0)


def test_ratios_and_bars(bh):
    host = {("forward", "SDPA cuDNN"): 50.0, ("forward", "SDPA flash"): 45.0,
            ("forward", "cuflash.attention (CuPy)"): 29.0,        # 0.58 <= 0.6
            ("forward", "cuflash.attention (CuPy, out=)"): 20.0,  # the extra: no bar
            ("forward", "ct.attention"): 51.0,                    # 1.02 > 1.0
            ("forward", "ct.ops.attention"): 62.0,                # 1.24 <= 1.25
            ("decode", "ct.ops.decode"): 20.0,                    # no cuDNN in this run
            ("jax forward", "cuflash.interop.jax"): 30.0, ("jax forward", "jax cuDNN"): 40.0}
    rows = {(r["call"], r["front end"]): r for r in bh.host_rows(host, ["forward", "decode", "jax forward"])}
    assert rows[("forward", "cuflash.attention (CuPy)")]["x cuDNN"] == pytest.approx(0.58)
    assert rows[("forward", "cuflash.attention (CuPy)")]["bar"] == "<= 0.60x pass"
    assert rows[("forward", "cuflash.attention (CuPy, out=)")]["bar"] is None
    assert rows[("forward", "ct.attention")]["bar"] == "<= 1.00x FAIL"
    assert rows[("forward", "ct.ops.attention")]["bar"] == "<= 1.25x pass"
    assert rows[("forward", "ct.attention")]["SDPA flash"] == 45.0   # the call's peers on each of its rows
    assert rows[("decode", "ct.ops.decode")]["bar"] == "<= 1.25x: no cuDNN"
    assert rows[("decode", "ct.decode")]["bar"] == "not run"
    assert rows[("jax forward", "cuflash.interop.jax")]["x cuDNN"] == pytest.approx(0.75)   # against JAX's cuDNN
    assert rows[("jax forward", "cuflash.interop.jax")]["bar"] is None
    summary = bh.bar_summary(list(rows.values()))
    assert summary.startswith("bars: 2/6 pass") and "forward / ct.attention" in summary
    assert bh.bar_verdict(1.0, 1.0) == "<= 1.00x pass"


def test_arguments(bh):
    args = bh.parse_args([])
    assert (args.calls, args.runs, args.kernel_runs) == (30, 41, 5)
    assert args.selected == list(bh.CALLS)
    assert bh.parse_args(["--quick"]).runs == 5
    assert bh.parse_args(["--only", "forward, decode"]).selected == [bh.FLOOR, "forward", "decode"]
    assert not [c for c in bh.parse_args(["--no-jax"]).selected if c.startswith("jax")]
    assert bh.parse_args(["--parts", "host"]).selected == list(bh.CALLS)   # the old spelling still works
    for bad in (["--only", "backward"], ["--parts", "host,decode"], ["--calls", "0"]):
        with pytest.raises(SystemExit):
            bh.parse_args(bad)


def test_help_needs_no_gpu():
    done = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "--json" in done.stdout and "--quick" in done.stdout

#!/usr/bin/env python
"""Run FlashAttention-2's own test file against cuflash, through the ``flash_attn`` shim beside it.

    python tests/compat/fa2/run_fa2_suite.py --tests .devrun/fa2/test_flash_attn.py \
        [--sample N] [--seed S] [--timeout-s T] [--log FILE] [--select TEXT] [--dry-run] [-- PYTEST_ARGS...]

What it does:

1. puts ``tests/compat/fa2`` first on ``sys.path``, so ``import flash_attn`` finds the shim (and
   refuses to run if it finds another ``flash_attn``); if ``einops`` (which FA2's tests import) is
   missing, uses a wheel from ``.devrun/wheels`` when there is one;
2. fills a kernel cache for every variant the suite can reach (:mod:`warm_cache`, in parallel,
   compiling only what is missing) and points ``CUFLASH_CACHE_DIR`` at it;
3. runs plain pytest (no xdist) on the test file with a plugin that keeps a deterministic random
   sample of at most N parametrizations of each test function (chosen from the sorted test ids
   with ``random.Random(f"{seed}:{function}")``), runs the functions' cases interleaved (so a
   time budget cut shortens every function alike), stops starting tests when the budget is spent,
   and classifies every case: passed, failed (assertion or error), skipped by FA2's own
   conditions, not supported (the shim raised ``flash_attn.NotSupported``), not run (budget);
4. prints a table per test function, the totals, the first failure messages and the reasons of the
   unsupported cases. Exit status 1 if any case failed, else 0.

``--dry-run`` only collects (pretending to be an sm_90 GPU when torch has no CUDA, which FA2's
file asks for at import) and prints how many cases each function has and how many are sampled.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]

DEFAULT_SAMPLE = 12
DEFAULT_TIMEOUT_S = 270.0
OUTCOMES = ("passed", "failed", "fa2-skip", "not-supported", "not-run")


def _function_of(nodeid: str) -> str:
    return nodeid.split("[", 1)[0].split("::")[-1]


class FA2Plugin:
    """Sampling, ordering, time budget and outcome classes for one pytest session."""

    def __init__(self, sample: int, seed: int, deadline: float | None, log=None, not_supported=(), select=()):
        self.sample = sample
        self.select = tuple(select)
        self.seed = seed
        self.deadline = deadline
        self.log = log
        self.not_supported_types = tuple(not_supported)
        self.totals = collections.Counter()          # function -> parametrizations before sampling
        self.selected = collections.Counter()        # function -> sampled cases
        self.outcome = {}                            # nodeid -> one of OUTCOMES
        self.seconds = collections.Counter()         # function -> seconds spent in its cases
        self.messages = {}                           # nodeid -> short failure / not-supported text
        self.order = []                              # nodeids in run order
        self.sampled_early = False
        self.current = None                          # the case running now (for the watchdog)
        self.emptied = set()                         # functions left with no case by --select

    # -- sampling ------------------------------------------------------------------------------
    def _choose(self, function: str, ids: list[str]) -> list[int]:
        """Indices (into ``ids``) of the cases kept for ``function``: deterministic in the seed."""
        self.totals[function] += len(ids)
        if self.sample <= 0 or len(ids) <= self.sample:
            return list(range(len(ids)))
        order = sorted(range(len(ids)), key=lambda i: ids[i])
        rng = random.Random(f"{self.seed}:{function}")
        return sorted(order[i] for i in rng.sample(range(len(ids)), self.sample))

    @pytest.hookimpl(hookwrapper=True)
    def pytest_generate_tests(self, metafunc):
        # Around pytest's own parametrization: sample its calls before items are created (the
        # full product, ~500k cases, would take minutes just to collect). metafunc._calls is
        # private; without it the items are sampled after collection instead.
        yield
        calls = getattr(metafunc, "_calls", None)
        if not isinstance(calls, list) or not calls:
            return
        name = metafunc.function.__name__
        if self.select:
            calls = [c for c in calls if any(x in f"{name}[{c.id}]" for x in self.select)]
        keep = self._choose(name, [c.id for c in calls])
        metafunc._calls = [calls[i] for i in keep]
        if not keep:   # pytest would then make one unparametrized item: drop it at collection
            self.emptied.add(name)
        self.sampled_early = True

    def pytest_collection_modifyitems(self, session, config, items):
        groups = collections.OrderedDict()
        for item in items:
            if _function_of(item.nodeid) not in self.emptied:
                groups.setdefault(_function_of(item.nodeid), []).append(item)
        if not self.sampled_early:   # pytest without metafunc._calls: sample the items instead
            if self.select:
                for function in list(groups):
                    groups[function] = [it for it in groups[function]
                                        if any(x in it.nodeid.split("::")[-1] for x in self.select)]
            for function, group in groups.items():
                keep = self._choose(function, [it.nodeid for it in group])
                groups[function] = [group[i] for i in keep]
        for function in self.emptied:
            self.selected[function] = 0
        for function, group in groups.items():
            self.selected[function] = len(group)
            if function not in self.totals:
                self.totals[function] = len(group)
        # Round robin over the functions: a budget cut then shortens each one alike.
        ordered, queues = [], [list(g) for g in groups.values()]
        while any(queues):
            for queue in queues:
                if queue:
                    ordered.append(queue.pop(0))
        kept = {id(it) for it in ordered}
        deselected = [it for it in items if id(it) not in kept]
        if deselected:
            config.hook.pytest_deselected(items=deselected)
        items[:] = ordered
        self.order = [it.nodeid for it in ordered]

    # -- running -------------------------------------------------------------------------------
    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item):
        self.current = item.nodeid
        if self.deadline is not None and time.monotonic() > self.deadline:
            self.outcome[item.nodeid] = "not-run"
            pytest.skip("cuflash FA2 runner: time budget spent")

    def pytest_runtest_teardown(self, item):
        # torch and CuPy each keep a caching allocator; hand the pools back between cases so that
        # memory cached by one never makes a later large case (128k-key caches) run out.
        cupy = sys.modules.get("cupy")
        torch = sys.modules.get("torch")
        try:
            if cupy is not None:
                cupy.get_default_memory_pool().free_all_blocks()
            if torch is not None and torch.cuda.is_available():
                torch.cuda.empty_cache()
        except Exception:   # noqa: BLE001 - housekeeping only
            pass

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        report = outcome.get_result()
        excinfo = call.excinfo
        if (report.failed and excinfo is not None and self.not_supported_types
                and excinfo.errisinstance(self.not_supported_types)):
            message = str(excinfo.value)
            self.outcome[item.nodeid] = "not-supported"
            self.messages[item.nodeid] = message
            report.outcome = "skipped"
            report.longrepr = (str(item.path), item.location[1], f"NOT SUPPORTED: {message}")

    def pytest_runtest_logreport(self, report):
        nodeid = report.nodeid
        self.seconds[_function_of(nodeid)] += getattr(report, "duration", 0.0)
        current = self.outcome.get(nodeid)
        if current in ("not-run", "not-supported", "failed"):
            return
        if report.failed:
            self.outcome[nodeid] = "failed"
            crash = getattr(report.longrepr, "reprcrash", None)
            text = crash.message if crash is not None else str(report.longrepr)
            first = (text.strip().splitlines() or [""])[0]
            self.messages[nodeid] = f"[{report.when}] {first[:300]}"
            if self.log is not None:
                self.log.write(f"\n===== FAILED {nodeid} ({report.when})\n{report.longreprtext}\n")
        elif report.skipped:
            self.outcome[nodeid] = "fa2-skip"
            if report.when == "setup" and self.log is not None:
                self.log.write(f"SKIP {nodeid}: {report.longrepr}\n")
        elif report.when == "call":
            self.outcome[nodeid] = "passed"
        if self.log is not None and report.when == "call":
            self.log.write(f"{self.outcome[nodeid].upper():8s} {nodeid} {report.duration:.2f}s\n")
            self.log.flush()

    # -- report --------------------------------------------------------------------------------
    def table(self, dry_run: bool = False) -> str:
        functions = [f for f in (list(self.selected) or list(self.totals)) if self.selected[f] or self.totals[f]]
        lines = []
        if dry_run:
            lines.append(f"{'function':40s} {'cases':>8s} {'sampled':>8s}")
            for f in functions:
                lines.append(f"{f:40s} {self.totals[f]:8d} {self.selected[f]:8d}")
            lines.append(f"{'TOTAL':40s} {sum(self.totals.values()):8d} {sum(self.selected.values()):8d}")
            return "\n".join(lines)
        counts = {f: collections.Counter() for f in functions}
        for nodeid in self.order:
            counts[_function_of(nodeid)][self.outcome.get(nodeid, "not-run")] += 1
        widths = [max(8, len(o)) for o in OUTCOMES]
        lines.append(f"{'function':36s} {'cases':>7s} {'sampled':>7s} "
                     + " ".join(f"{o:>{w}s}" for o, w in zip(OUTCOMES, widths)) + "     sec")

        def row(name, cases, sampled, counter, seconds):
            return (f"{name:36s} {cases:7d} {sampled:7d} "
                    + " ".join(f"{counter[o]:{w}d}" for o, w in zip(OUTCOMES, widths)) + f" {seconds:7.1f}")

        total = collections.Counter()
        for f in functions:
            total.update(counts[f])
            lines.append(row(f, self.totals[f], self.selected[f], counts[f], self.seconds[f]))
        lines.append(row("TOTAL", sum(self.totals.values()), sum(self.selected.values()), total,
                         sum(self.seconds.values())))
        self.total = total
        return "\n".join(lines)

    def failures(self, limit: int) -> list[str]:
        out = [f"{n}: {self.messages.get(n, '?')}" for n in self.order if self.outcome.get(n) == "failed"]
        return out[:limit] + ([f"... and {len(out) - limit} more"] if len(out) > limit else [])

    def unsupported(self) -> list[str]:
        reasons = collections.Counter(self.messages[n] for n in self.order if self.outcome.get(n) == "not-supported")
        return [f"{count:4d} x {reason}" for reason, count in reasons.most_common()]


# ----------------------------------------------------------------------------- environment

def _use_shim():
    """Make ``import flash_attn`` find the shim and ``import cuflash`` this checkout's package (not
    some other installed copy); refuse a real FlashAttention."""
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(HERE))
    for name in [m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn.")]:
        del sys.modules[name]
    import flash_attn

    if Path(flash_attn.__file__).resolve().parent != HERE / "flash_attn":
        raise SystemExit(f"flash_attn resolves to {flash_attn.__file__}, not the cuflash shim in {HERE}")
    return flash_attn


def _ensure_einops():
    import importlib

    try:
        importlib.import_module("einops")
        return "installed"
    except ImportError:
        pass
    for wheel in sorted(glob.glob(str(REPO / ".devrun" / "wheels" / "einops-*.whl"))):
        sys.path.append(wheel)     # a pure-Python wheel is an importable zip
        try:
            importlib.import_module("einops")
            return f"from {wheel}"
        except ImportError:
            sys.path.remove(wheel)
    raise SystemExit("FA2's tests import einops: install it (pip install einops) or put its wheel in .devrun/wheels")


def _pretend_gpu_for_collection():
    """FA2's file asks torch for the GPU's compute capability at import; without CUDA (dry runs on
    a CPU machine) answer sm_90 so that collection sees the H100/H200 parametrization."""
    import torch

    if not torch.cuda.is_available():
        torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
        return True
    return False


class _CompileCounter:
    """Counts cuflash's on-demand compiles during the tests (a warm cache makes it 0)."""

    def __init__(self):
        self.count, self.seconds, self.families = 0, 0.0, collections.Counter()
        try:
            from cuflash._build import compile as _compile
        except Exception:
            return
        original = _compile.compile_cubin

        def counted(variant, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(variant, *args, **kwargs)
            finally:
                self.count += 1
                self.seconds += time.perf_counter() - t0
                self.families[variant.family] += 1

        _compile.compile_cubin = counted

    def line(self):
        fams = ", ".join(f"{f} {n}" for f, n in sorted(self.families.items()))
        return f"kernels compiled during the tests: {self.count} ({self.seconds:.0f} s){': ' + fams if fams else ''}"


def _versions():
    parts = []
    for name in ("torch", "cupy", "cuflash", "pytest"):
        try:
            module = __import__(name)
            where = f" at {Path(module.__file__).parent}" if name == "cuflash" else ""
            parts.append(f"{name} {getattr(module, '__version__', '?')}{where}")
        except Exception as err:   # noqa: BLE001 - report, do not fail
            parts.append(f"{name} unavailable ({type(err).__name__})")
    try:
        import torch

        if torch.cuda.is_available():
            parts.append(torch.cuda.get_device_name())
    except Exception:
        pass
    return ", ".join(parts)


def _give_up(plugin, args, out):
    """Watchdog: a case hangs past the budget. Print what is known and leave at once.

    ``out`` is a duplicate of the original stdout: pytest captures file descriptor 1 while a test
    runs, so this thread writes past its capture.
    """
    if plugin.current is not None:
        plugin.outcome[plugin.current] = "failed"
        plugin.messages[plugin.current] = "hung: abandoned by the runner's watchdog"
    lines = [f"\ncuflash FA2 runner: {plugin.current} still running {args.grace_s:.0f} s after the time budget; "
             "abandoned (counted as failed)", plugin.table(), "first failures:",
             *(f"  {line}" for line in plugin.failures(args.failures)),
             "fa2-compat: " + ", ".join(f"{plugin.total[o]} {o}" for o in OUTCOMES)]
    out.write("\n".join(lines) + "\n")
    out.flush()
    os._exit(3)


# ----------------------------------------------------------------------------- main

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Run FlashAttention-2's test file against cuflash.")
    parser.add_argument("--tests", required=True, help="path of FA2's tests/test_flash_attn.py")
    parser.add_argument("--sample", type=int, default=DEFAULT_SAMPLE,
                        help=f"at most this many parametrizations per test function (0 = all; default {DEFAULT_SAMPLE})")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sample (default 0)")
    parser.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S,
                        help=f"wall-clock budget from start, warm-up included; no test starts after it "
                             f"(default {DEFAULT_TIMEOUT_S:.0f}; 0 = none)")
    parser.add_argument("--select", action="append", default=[], metavar="TEXT",
                        help="keep only cases whose 'function[id]' contains TEXT (repeatable), before sampling; "
                             "e.g. --select 'test_flash_attn_output[0.0-0.0-113-203-32' to rerun one failure")
    parser.add_argument("--dry-run", action="store_true", help="collect and print the sampled counts only")
    parser.add_argument("--list", action="store_true", help="with --dry-run: also print the sampled test ids")
    parser.add_argument("--log", help="write one line per case and full failure tracebacks to this file")
    parser.add_argument("--cache-dir", default=str(REPO / ".devrun" / "cuflash-cache"),
                        help="kernel cache the warm-up fills and the tests read (CUFLASH_CACHE_DIR)")
    parser.add_argument("--no-warm", action="store_true", help="skip the warm-up (compile on first use)")
    parser.add_argument("--grace-s", type=float, default=90.0,
                        help="a case still running this long after the budget is abandoned: the table so far "
                             "is printed and the process exits with status 3 (default 90)")
    parser.add_argument("--failures", type=int, default=8, help="how many failure messages to print")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args(argv)

    start = time.monotonic()
    tests = Path(args.tests).resolve()
    if not tests.is_file():
        raise SystemExit(f"no test file at {tests}")
    einops_from = _ensure_einops()
    shim = _use_shim()

    source = tests.parent / "SOURCE"
    print(f"FA2 tests: {tests}" + (f" ({source.read_text().strip()})" if source.is_file() else ""))
    print(f"shim: {Path(shim.__file__).parent}; einops {einops_from}; {_versions()}")
    pretend = False
    if args.dry_run:
        pretend = _pretend_gpu_for_collection()
    elif not args.no_warm:
        sys.path.insert(0, str(HERE))
        import warm_cache

        warm_cache.warm(args.cache_dir, threads=os.cpu_count(), log=sys.stdout)
        os.environ["CUFLASH_CACHE_DIR"] = str(Path(args.cache_dir).resolve())
    sys.stdout.flush()

    deadline = start + args.timeout_s if args.timeout_s and not args.dry_run else None
    log = open(args.log, "w") if args.log else None
    from flash_attn import NotSupported

    plugin = FA2Plugin(args.sample, args.seed, deadline, log, not_supported=(NotSupported,), select=args.select)
    counter = None if args.dry_run else _CompileCounter()
    watchdog = None
    if deadline is not None:
        real_stdout = os.fdopen(os.dup(sys.stdout.fileno()), "w")
        watchdog = threading.Timer(max(0.0, deadline - time.monotonic()) + args.grace_s, _give_up,
                                   (plugin, args, real_stdout))
        watchdog.daemon = True
        watchdog.start()
    with tempfile.TemporaryDirectory() as tmp:
        ini = Path(tmp) / "pytest.ini"
        ini.write_text("[pytest]\n")
        pytest_args = [str(tests), "-c", str(ini), "--rootdir", str(tests.parent), "--confcutdir",
                       str(tests.parent), "-p", "no:cacheprovider", "--tb=no", "-q", "--disable-warnings",
                       *args.pytest_args]
        if args.dry_run:
            pytest_args += ["--collect-only", "-qq"]
        t0 = time.monotonic()
        code = pytest.main(pytest_args, plugins=[plugin])
        elapsed = time.monotonic() - t0
    if watchdog is not None:
        watchdog.cancel()
    if log is not None:
        log.close()

    print()
    print(f"cuflash FA2 suite: sample <= {args.sample} per function, seed {args.seed}"
          + (" (collection pretended sm_90: no CUDA here)" if pretend else ""))
    print(plugin.table(dry_run=args.dry_run))
    if args.dry_run:
        if args.list:
            print("\n".join(plugin.order))
        return 0 if code in (0, 5) else int(code)
    print(f"pytest {elapsed:.0f} s, whole run {time.monotonic() - start:.0f} s; {counter.line()}")
    failures = plugin.failures(args.failures)
    if failures:
        print("first failures:")
        for line in failures:
            print(f"  {line}")
    unsupported = plugin.unsupported()
    if unsupported:
        print("not supported:")
        for line in unsupported:
            print(f"  {line}")
    total = plugin.total
    print(f"fa2-compat: {total['passed']} passed, {total['failed']} failed, {total['fa2-skip']} skipped, "
          f"{total['not-supported']} not supported, {total['not-run']} not run")
    if code not in (0, 1, 5):   # pytest itself broke (usage, internal or collection error)
        print(f"pytest exited with status {int(code)}")
        return int(code)
    return 1 if total["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())

"""benchmarks/sanitize_all.py, without a GPU: its case list covers every public entry point and kernel
family with the options that change code shape, and its driver attributes sanitizer reports to cases,
goes on after a process that dies, and fails the run on any report."""

import importlib
import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import cuflash

# cuflash.attention is the function; the modules by name.
attention = importlib.import_module("cuflash.attention")
backward = importlib.import_module("cuflash.backward")

SCRIPT = Path(__file__).resolve().parents[1] / "sanitize_all.py"

# Public names that launch nothing of their own.
NOT_ENTRY_POINTS = {"force_kernel", "Generator", "default_generator", "manual_seed", "precompile", "plan", "Plan",
                    "check_errors", "ScoreMod", "MaskMod", "clear_mask_cache"}


def _load():
    spec = importlib.util.spec_from_file_location("sanitize_all", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def listed():
    done = subprocess.run([sys.executable, str(SCRIPT), "--list"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1].endswith("cases")
    rows = [line.split(None, 2) for line in lines[2:-1]]
    assert int(lines[-1].split()[0]) == len(rows)
    return rows


def test_every_entry_point_and_family_is_run(listed):
    entries = {row[0] for row in listed}
    public = {name for name in cuflash.__all__ if name not in NOT_ENTRY_POINTS}
    assert public <= entries, f"not in benchmarks/sanitize_all.py: {sorted(public - entries)}"
    families = {row[1] for row in listed}
    assert {*attention.FAMILIES, *backward.FAMILIES, "decode", "merge", "check_indices"} <= families


def _options(listed, family=None, entry=None):
    return [row[2] for row in listed if (family is None or row[1] == family) and (entry is None or row[0] == entry)]


@pytest.mark.parametrize("family", attention.FAMILIES)
def test_every_forward_option_is_run_on_every_forward_family(listed, family):
    text = " | ".join(_options(listed, family, "attention_forward"))
    for word in ("causal", "window", "softcap", "alibi", "mask", "bias", "block_mask", "dropout", "GQA", "D64",
                 "D128"):
        assert word in text, f"{family}: no case with {word}"
    dtypes = ("fp32",) if family == "fwd_simt" else ("fp16", "bf16")
    assert all(dt in text for dt in dtypes)
    assert _options(listed, family, "attention") and _options(listed, family, "attention_varlen")


@pytest.mark.parametrize("family", backward.FAMILIES)
def test_every_backward_family_runs_dense_varlen_and_deterministic(listed, family):
    dense = " | ".join(_options(listed, family, "attention_backward"))
    assert "deterministic" in dense and "causal" in dense and "GQA" in dense
    assert _options(listed, family, "attention_varlen_backward")
    if family != "bwd_sm90":   # bwd_sm90 runs no score modifiers or dropout (yet)
        for word in ("dropout", "alibi", "mask", "bias", "dbias", "softcap", "window", "block_mask"):
            assert word in dense, f"{family}: no case with {word}"


def test_decode_merge_and_bad_indices_are_run(listed):
    decode = " | ".join(_options(listed, None, "decode"))
    for word in ("contiguous", "paged", "page 7", "no append", "append 2", "splits 1", "splits 3",
                 "splits heuristic", "lens on host", "check_indices launch", "fp16", "bf16", "fp32", "mask",
                 "return_lse", "bad indices"):
        assert word in decode, f"decode: no case with {word}"
    merge = " | ".join(_options(listed, "merge"))
    for word in ("list", "stacked", "out/lse given", "fp16+fp32"):
        assert word in merge
    for entry in ("decode", "attention_varlen", "attention_varlen_backward"):
        assert any("bad indices" in o for o in _options(listed, None, entry)), entry


def test_only_selects_cases():
    done = subprocess.run([sys.executable, str(SCRIPT), "--list", "--only", "merge_states"], capture_output=True,
                          text=True, timeout=120)
    rows = done.stdout.splitlines()[2:-1]
    assert rows and all(row.startswith("merge_states") for row in rows)
    assert done.stdout.splitlines()[-1].startswith(f"{len(rows)} cases of ")


def test_no_sanitizer_is_exit_status_2(monkeypatch, capsys):
    module = _load()
    monkeypatch.setattr(module, "find_sanitizer", lambda: None)
    assert module.main(["--tool", "racecheck", "--only", "merge"]) == 2
    assert "compute-sanitizer not found" in capsys.readouterr().err


FAKE_INNER = textwrap.dedent("""
    # Stands in for `sanitize_all.py --inner` under a sanitizer: case 1 gets a memcheck error and a
    # warning, case 2 kills the process (as a sticky CUDA error does); every other case is clean.
    import sys
    cases = [int(i) for i in sys.argv[sys.argv.index("--cases") + 1].split(",")]
    for i in cases:
        print(f"@@sanitize_all begin {i}", flush=True)
        if i == 1:
            print("========= Invalid __global__ read of size 4 bytes", flush=True)
            print("=========     at cuflash_decode+0x120", flush=True)
            print("========= Warning: Race reported (a warning)", flush=True)
        if i == 2:
            print("========= Invalid __global__ write of size 16 bytes", flush=True)
            sys.exit(1)
        status = "skip" if i == 3 else "ok"
        print(f"@@sanitize_all end {i} {status} 0.5 {'needs sm_90a' if i == 3 else ''}".rstrip(), flush=True)
    print("========= ERROR SUMMARY: 1 error", flush=True)
""")


def test_reports_are_put_on_their_cases_and_a_dead_process_is_restarted(tmp_path, capsys):
    module = _load()
    fake = tmp_path / "inner.py"
    fake.write_text(FAKE_INNER)
    outcomes, summaries, codes = module.run_all([sys.executable, str(fake)], None, [0, 1, 2, 3, 4], "memcheck")
    assert outcomes[0].status == "ok" and outcomes[0].errors == 0
    assert outcomes[1].status == "ok" and (outcomes[1].errors, outcomes[1].warnings) == (1, 1)
    assert outcomes[1].first_report.startswith("Invalid __global__ read")
    assert outcomes[2].status == "crashed" and outcomes[2].errors == 1
    assert outcomes[3].status == "skip" and outcomes[4].status == "ok"   # run by a second process
    assert codes == [1, 0]
    assert any("ERROR SUMMARY: 1 error" in line for line in summaries)
    assert "1 memcheck error" in module.result_text(outcomes[1], "memcheck")
    assert module.result_text(outcomes[0], "memcheck") == "clean"
    assert module.result_text(outcomes[3], "memcheck").startswith("skipped")

"""benchmarks/ab_backward.py without a GPU: how it reads contenders and shapes, that a contender's
settings reach the plans the backward asks for (and leave with it), and that ``build`` compiles
each contender's variant, a source tree's into the output folder."""

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

from cuflash import kernels
from cuflash._build import compile as _compile

BENCH = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ab():
    sys.path.insert(0, str(BENCH))   # the script imports _harness from beside it
    try:
        spec = importlib.util.spec_from_file_location("ab_backward", BENCH / "ab_backward.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module   # dataclasses look their module up by name
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCH))
        sys.modules.pop("ab_backward", None)


def test_contenders_and_shapes(ab):
    c = ab.parse_contender("tg;CUFLASH_TILE_GUARD=1;CUFLASH_ALL_KEYS_SEEN=-;BWD_SM90_WIDE_MIN_ROWS=0")
    assert (c.name, c.src) == ("tg", None)
    assert c.defines == {"CUFLASH_TILE_GUARD": 1, "CUFLASH_ALL_KEYS_SEEN": None}
    assert c.constants == {"BWD_SM90_WIDE_MIN_ROWS": 0}
    tree = ab.parse_contender("new=/tmp/src")
    assert tree.name == "new" and tree.src == Path("/tmp/src").resolve() and not tree.defines
    for bad in ("x;CUFLASH_TILE_GUARD", "x;NOT_A_CONSTANT=1"):
        with pytest.raises(ValueError, match="x;"):
            ab.parse_contender(bad)
    assert ab.parse_shape("128/8192") == (128, 8192, False, False)
    assert ab.parse_shape("256/2048cd") == (256, 2048, True, True)
    assert ab.parse_shape("64/512d") == (64, 512, False, True)
    assert ab.parse_shape("64/8192cs") == (64, 8192, True, False)
    assert ab.shape_softcap("64/8192cs") == ab.SOFTCAP > 0 and ab.shape_softcap("64/8192c") == 0


def test_settings_reach_the_plan_and_leave_with_it(ab):
    planned = kernels.backward.backward_plan
    wide = kernels.bwd_sm90.BWD_SM90_WIDE_MIN_ROWS
    seen = []
    c = ab.parse_contender("c;CUFLASH_TILE_GUARD=1;CUFLASH_ALL_KEYS_SEEN=-;BWD_SM90_WIDE_MIN_ROWS=0")
    with ab.Installed(c, seen.append):
        lp = kernels.backward.backward_plan("bwd_sm90", "bfloat16", 128, dq_pass=False, score_mods=(), dropout=False,
                                       deterministic=False, windowed=False, seqlen_q=512, all_keys_seen=True)
        defines = dict(lp.variant.defines)
        assert defines["CUFLASH_TILE_GUARD"] == 1 and "CUFLASH_ALL_KEYS_SEEN" not in defines
        assert defines["CUFLASH_BLOCK_M"] == 80   # the constant: 80 rows at every length
        assert seen == [lp.variant]
        sm80 = kernels.backward.backward_plan("bwd_sm80", "bfloat16", 128, dq_pass=True, score_mods=(), dropout=False)
        assert "CUFLASH_TILE_GUARD" not in dict(sm80.variant.defines)   # bwd_sm90's variants only
    assert kernels.backward.backward_plan is planned and kernels.bwd_sm90.BWD_SM90_WIDE_MIN_ROWS == wide
    base = ab.shape_variant(ab.parse_contender("base"), "bfloat16", "128/512")
    assert dict(base.defines)["CUFLASH_BLOCK_M"] == 64


def test_shape_variant_is_the_planners(ab):
    # What cuflash/_backward_plan.py takes for these calls: persistent CTAs at D = 64 under a causal
    # mask, dQ tiles stored by their first writer at D = 128 causal up to 2k keys.
    variant = lambda shape: dict(ab.shape_variant(ab.parse_contender("base"), "bfloat16", shape).defines)
    assert variant("64/1024c").get("CUFLASH_BWD_PERSISTENT") == 1
    assert "CUFLASH_BWD_PERSISTENT" not in variant("64/1024")
    assert variant("128/1024c").get("CUFLASH_BWD_DQ_FIRST_STORES") == 1
    assert "CUFLASH_BWD_DQ_FIRST_STORES" not in variant("128/4096c")
    assert "CUFLASH_BWD_DQ_FIRST_STORES" not in variant("128/1024")


def test_build_compiles_each_contender(ab, tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(_compile._find_cuda_src(), src)
    out = tmp_path / "out"
    assert ab.main(["build", "base", "tg;CUFLASH_TILE_GUARD=1", f"tree={src}", "--shapes", "128/4096c",
                    "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines if not line.startswith(" ")] == ["base", "tg", "tree"]
    assert all("spills 0/0 B" in line for line in lines if not line.startswith(" "))
    # every contender's cubin, the installed tree's too: all of a run's kernels from one compiler
    for spec in ("base", "tg;CUFLASH_TILE_GUARD=1", f"tree={src}"):
        c = ab.parse_contender(spec)
        cubin = ab.cubin_path(str(out), c, ab.shape_variant(c, "bfloat16", "128/4096c"))
        assert cubin.read_bytes().startswith(b"\x7fELF"), spec
    # an edit of the tree after build names other cubins (run compiles them instead of using stale ones)
    tree = ab.parse_contender(f"tree={src}")
    before = ab.cubin_path(str(out), tree, ab.shape_variant(tree, "bfloat16", "128/4096c"))
    with open(src / "bwd_sm90.cu", "a") as f:
        f.write("\n// edited\n")
    assert ab.cubin_path(str(out), tree, ab.shape_variant(tree, "bfloat16", "128/4096c")) != before


def test_a_value_head_dim_of_its_own(ab):
    assert ab.parse_shape("192:128/8192c") == (192, 8192, True, False)
    assert (ab.shape_head_dim_v("192:128/8192c"), ab.shape_head_dim_v("128/512")) == (128, 128)
    defines = dict(ab.shape_variant(ab.parse_contender("base"), "bfloat16", "192:128/8192c").defines)
    assert (defines["CUFLASH_HEAD_DIM"], defines["CUFLASH_HEAD_DIM_V"]) == (192, 128)

"""benchmarks/ab_decode.py without a GPU: the variants it builds are the ones cuflash.decode plans for
its problems, and ``build`` compiles a source tree's into one file per tree that ``run`` reads."""

import pickle
import shutil

from cuflash._build import compile as _compile

SCRIPT = "ab_decode"


def test_variants_cover_the_problems(bench):
    """Each cache dtype and layout's variant, and the 16-bit caches' short-tile ones that (32, 4k) takes
    (fp8 caches have none: theirs are the usual ones)."""
    found = bench.variants()
    assert len(set(found)) == len(found) == len(bench.KV_DTYPES) * len(bench.LAYOUTS) + len(bench.LAYOUTS)
    assert {dict(v.defines).get("CUFLASH_PAGED") for v in found} == {0, 1}
    assert {dict(v.defines).get("CUFLASH_KV_FP8", 0) for v in found} == {0, 1}
    assert all(v.family == "decode" and dict(v.defines).get("CUFLASH_KEYS_AS_M") == 1 for v in found)


def test_build_compiles_a_tree(bench, tmp_path):
    tree = tmp_path / "cuda_src"
    shutil.copytree(_compile.CUDA_SRC, tree)
    assert bench.main(["--out", str(tmp_path / "out"), "build", f"copy={tree}"]) == 0
    cubins = pickle.loads((tmp_path / "out" / "copy.pkl").read_bytes())
    assert set(cubins) == set(bench.variants())
    assert all(cubin[:4] == b"\x7fELF" for cubin in cubins.values())

"""The tables of cuflash/features.py against the kernels' side of them, and what reads them."""

import re
from pathlib import Path

import numpy as np
import pytest

from cuflash import _checks, features

CUDA_SRC = Path(__file__).resolve().parents[2] / "cuda_src"


def _enum(header: str, name: str) -> dict:
    text = (CUDA_SRC / header).read_text()
    body = re.search(rf"enum {name}\s*:\s*int\s*\{{(.*?)\}};", text, flags=re.S).group(1)
    return {key: int(value) for key, value in re.findall(r"(k\w+)\s*=\s*(\d+)", body)}


def test_dtype_codes_match_common_cuh():
    codes = _enum("common.cuh", "DtypeCode")
    assert codes == {"kFloat16": features.DTYPE_CODES["float16"], "kBFloat16": features.DTYPE_CODES["bfloat16"],
                     "kFloat32": features.DTYPE_CODES["float32"], "kFloat64": features.DTYPE_CODES["float64"]}


def test_score_mod_bits_match_mask_cuh():
    bits = _enum("mask.cuh", "ScoreMod")
    by_name = {"kModSoftcap": "softcap", "kModAlibi": "alibi", "kModBias": "bias", "kModMask": "mask",
               "kModBlockMask": "block_mask"}
    assert {by_name[key]: bit for key, bit in bits.items() if key in by_name} == \
        {m.name: m.bit for m in features.MODIFIERS}
    assert len({m.bit for m in features.MODIFIERS}) == len(features.MODIFIERS)


def test_bias_codes_are_the_dtype_codes():
    for dtype, code in _checks.BIAS_DTYPE_CODES.items():
        assert features.DTYPE_CODES[np.dtype(dtype).name] == code


@pytest.mark.parametrize("names", [features.SCORE_MODS, features.DECODE_SCORE_MODS])
def test_score_mod_bits(names):
    every = features.score_mod_bits(True, names)
    for m in features.MODIFIERS:
        if m.name in names:
            assert features.score_mod_bits([m.name], names) == m.bit
            assert features.score_mod_bits([m.keyword], names) == m.bit
        else:
            with pytest.raises(ValueError, match=m.name):
                features.score_mod_bits([m.name], names)
    assert features.score_mod_bits(names[:2], names) == every   # two or more share the variant with all
    assert features.score_mod_sets(names) == [0, *(features.score_mod_bits([n], names) for n in names), every]

"""Decode's keys-as-M variants (cuda_src/decode.cu, keys_m_warp_tile: S^T = K Q^T with the keys as the
mma's M and at most 8 packed rows as its N), through every decode test of the 16-row variants.

The variants run when ``cuflash.kernels.decode.DECODE_KEYS_AS_M_BY_DEFAULT`` is on and a call packs at
most 8 rows (Sq_new * Hq / Hk): this module switches it on for its tests and collects the tests of
test_decode.py, test_decode_fp8.py, test_modifiers_decode.py and test_sinks_decode.py again under it
(their cases of up to 8 packed rows take the keys-as-M variants, the others the 16-row ones, as a
user's calls would). Plans are remembered per call shape, so the memo is cleared on the way in and
out. test_calls_of_few_rows_take_keys_as_m checks that the switch reaches the planner.

Run: ``python -m pytest -q tests/gpu/test_decode_keys_as_m.py`` (skipped without a GPU).
"""

import numpy as np
import pytest

from tests.gpu._hardware import gpu_available as _gpu_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _gpu_available(), reason="no CUDA GPU found by CuPy")]

from cuflash.kernels import decode as kdecode  # noqa: E402
from cuflash._runtime import memo  # noqa: E402

# The 16-row variants' tests, collected again here (module-level names starting with test_).
from tests.gpu.test_decode import (test_empty_sequences, test_forced_splits_agree,  # noqa: E402,F401
                                   test_generation_loop_appends_token_by_token, test_gqa_rows_past_one_block,
                                   test_long_cache_100k, test_lse_buffer_is_written_in_place,
                                   test_misaligned_cache_is_copied_and_written_back, test_shapes_pages_lengths_splits,
                                   test_tree_mask, test_with_options)
from tests.gpu.test_decode_fp8 import (test_every_byte_converts_exactly,  # noqa: E402,F401
                                       test_fp8_decode_matches_the_reference, test_appended_nan_and_saturation_bytes)
from tests.gpu.test_modifiers_decode import (  # noqa: E402,F401
    test_a_modifier_that_hides_every_key_gives_empty_rows, test_appended_tokens_see_each_other_at_their_positions,
    test_decode_modifiers_against_the_reference, test_the_arrays_are_read_at_each_call)
from tests.gpu.test_sinks_decode import (test_decode_sinks_against_the_reference,  # noqa: E402,F401
                                         test_empty_sequences_give_zero_and_the_sink,
                                         test_sinks_with_window_softcap_and_alibi)
from tests.gpu.test_decode import build_case, run_case  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def keys_as_m():
    saved = kdecode.DECODE_KEYS_AS_M_BY_DEFAULT
    kdecode.DECODE_KEYS_AS_M_BY_DEFAULT = True
    memo.clear_memo()
    yield
    kdecode.DECODE_KEYS_AS_M_BY_DEFAULT = saved
    memo.clear_memo()


@pytest.mark.parametrize("heads, seqlen_q, expected", [((8, 8), 1, True), ((32, 8), 2, True), ((64, 8), 1, True),
                                                       ((32, 8), 3, False), ((16, 1), 1, False)])
def test_calls_of_few_rows_take_keys_as_m(monkeypatch, heads, seqlen_q, expected):
    """cuflash.decode plans the keys-as-M variant exactly when Sq * Hq / Hk <= 8 (and the call
    matches the reference, run_case's checks)."""
    asked = []
    plan = kdecode.decode_plan

    def recording(*args, **kwargs):
        asked.append(kwargs.get("keys_as_m", False))
        return plan(*args, **kwargs)

    monkeypatch.setattr(kdecode, "decode_plan", recording)
    memo.clear_memo()
    hq, hk = heads
    case = build_case(dtype="bfloat16", B=2, Hq=hq, Hk=hk, D=64, Sq=seqlen_q, lens=[300, 171], page_size=16,
                      append=True, seed=int(np.random.default_rng().integers(1 << 30)))
    run_case(case, dtype="bfloat16")
    assert asked == [expected]

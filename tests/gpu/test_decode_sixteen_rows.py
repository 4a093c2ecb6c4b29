"""Decode's 16-row tile (cuda_src/decode.cu: 16 packed rows as the mma's M) for calls of a few rows,
through every decode test of the default path.

Calls of at most 8 packed rows (Sq_new * Hq / Hk) take the keys-as-M tile by default
(``cuflash.kernels.decode.DECODE_KEYS_AS_M_BY_DEFAULT``); switched off, they take the 16-row tile, the
A/B's other side. This module switches it off and collects the tests of test_decode.py,
test_decode_fp8.py, test_modifiers_decode.py and test_sinks_decode.py again under it. Plans are
remembered per call shape, so the memo is cleared on the way in and out.

Run: ``python -m pytest -q tests/gpu/test_decode_sixteen_rows.py`` (skipped without a GPU).
"""

import pytest

from tests.gpu._hardware import gpu_available as _gpu_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _gpu_available(), reason="no CUDA GPU found by CuPy")]

from cuflash.kernels import decode as kdecode  # noqa: E402
from cuflash._runtime import memo  # noqa: E402

# The default path's tests, collected again here (module-level names starting with test_).
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


@pytest.fixture(autouse=True, scope="module")
def sixteen_rows():
    saved = kdecode.DECODE_KEYS_AS_M_BY_DEFAULT
    kdecode.DECODE_KEYS_AS_M_BY_DEFAULT = False
    memo.clear_memo()
    yield
    kdecode.DECODE_KEYS_AS_M_BY_DEFAULT = saved
    memo.clear_memo()

"""The README's chunked-prefill example (issue 53, item 6) gives what the float64 reference gives.

The README's blocks run in order up to that one, as a reader would run them (tests/cpu/test_readme.py
runs them all); here the chunk's output is then checked against cuflash.reference.decode by the
accuracy rule (the same-dtype baseline, cuflash.testing), on the caches after the call with the same
appends (rewriting the same rows), and the appended rows against the chunk's keys and values.
"""

import re
from pathlib import Path

import numpy as np
import pytest

from tests.gpu._hardware import gpu_available as _gpu_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _gpu_available(), reason="no CUDA GPU found by CuPy")]

import cuflash.testing as tt  # noqa: E402
from cuflash import reference  # noqa: E402

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_chunked_prefill_matches_the_reference():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    last = next(i for i, b in enumerate(blocks) if "out_chunk = cuflash.decode(" in b)
    ns = {}
    for i, block in enumerate(blocks[:last + 1]):
        if re.search(r"^\s*import (torch|jax)\b", block, flags=re.M):
            continue
        exec(compile(block, f"README.md block {i}", "exec"), ns)   # noqa: S102 - our own README
    cp = ns["cp"]
    cp.cuda.Device().synchronize()
    host = {name: cp.asnumpy(ns[name]) for name in ("q_chunk", "k_chunk", "v_chunk", "k_pages", "v_pages", "table",
                                                   "lens", "out_chunk")}
    chunk = ns["chunk"]
    before = host["lens"] - chunk
    args = dict(cache_seqlens=before, block_table=host["table"], k_new=host["k_chunk"], v_new=host["v_chunk"])
    want, _ = reference.decode(host["q_chunk"], host["k_pages"], host["v_pages"], **args)
    problems, _, _ = reference._decode._decode_sequences(host["q_chunk"], host["k_pages"], host["v_pages"], **args)
    base = np.concatenate([tt.baseline_attention(p["q"], p["k"], p["v"], **p["options"]) for p in problems])
    tt.assert_attention_close(host["out_chunk"], want, base, dtype="bfloat16", name="out_chunk")
    page_size = host["k_pages"].shape[1]
    for b, n in enumerate(before):
        pos = n + np.arange(chunk)
        rows = host["table"][b, pos // page_size], pos % page_size
        assert np.array_equal(host["k_pages"][rows].view(np.uint16), host["k_chunk"][b].view(np.uint16))
        assert np.array_equal(host["v_pages"][rows].view(np.uint16), host["v_chunk"][b].view(np.uint16))

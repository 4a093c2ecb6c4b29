"""Host-side pieces of the call pipeline that need no GPU: the fault messages of the device index
check, the stream key of per-thread default streams, the ``check`` flag, and a pinned plan's
refusal of options at call time. (The GPU side is tests/test_host_path_gpu.py.)"""

import threading

import numpy as np
import pytest

from cuflash import _checks, _launch, _pipeline

# What cuflash/decode.py hands the index check (and so the plan's info) for a paged cache of 9 pages
# of 16 keys, 4 pages per sequence, 2 tokens appended.
DECODE_INFO = dict(block_table_batch_stride=4, batch=2, capacity=64, seqlen_new=2, page_size=16, num_pages=9,
                   max_pages=4)
VARLEN_INFO = dict(batch=3, total_q=95, total_k=130, max_seqlen_q=45, max_seqlen_k=50)


def _plan(entry, info):
    plan = _pipeline.Plan(entry, 11)
    plan.info.update(info)
    return plan


def test_cache_seqlens_fault_message_is_complete():
    message = _pipeline.fault_message(1, 0, 65, _plan("decode", DECODE_INFO))
    assert message.startswith("cache_seqlens[0] = 65")
    assert "64" in message
    assert "?" not in message, f"a field of the message was not filled in: {message!r}"


def test_block_table_fault_message_names_row_and_column():
    message = _pipeline.fault_message(2, 1 * 4 + 0, -5, _plan("decode", DECODE_INFO))
    assert message.startswith("block_table[1, 0] = -5")
    assert "0 .. 8" in message        # the pages of the cache
    message = _pipeline.fault_message(2, 0 * 4 + 3, 9, _plan("decode", DECODE_INFO))
    assert message.startswith("block_table[0, 3] = 9")


@pytest.mark.parametrize("code, name", [(3, "cu_seqlens_q"), (4, "cu_seqlens_k"), (5, "max_seqlen_q"),
                                        (6, "max_seqlen_k")])
def test_varlen_fault_messages_name_the_argument(code, name):
    message = _pipeline.fault_message(code, 2, 25, _plan("attention_varlen", VARLEN_INFO))
    assert message.startswith(name)
    assert "2" in message


def test_fault_message_without_a_plan():
    assert "cache_seqlens[3] = 7" in _pipeline.fault_message(1, 3, 7, None)


def test_a_fault_is_raised_once_naming_the_entry_point():
    plan = _plan("decode", DECODE_INFO)

    class State:   # the host side of a stream's fault report
        def __init__(self):
            self.fault = (1, 0, 65, plan)

        def take_fault(self, slot):
            fault, self.fault = self.fault, None
            return fault

    state = State()
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\] = 65.*decode"):
        _pipeline._raise_fault(state, _launch.REPORT_SLOTS["decode"])
    _pipeline._raise_fault(state, _launch.REPORT_SLOTS["decode"])   # taken: nothing left


def test_report_slots_cover_the_entry_points_with_index_arrays():
    assert set(_launch.REPORT_SLOTS) == {"decode", "attention_varlen", "attention_varlen_backward"}
    assert len(set(_launch.REPORT_SLOTS.values())) == 3


def test_per_thread_default_stream_is_keyed_by_thread():
    keys = {}
    both_alive = threading.Barrier(2)   # (a finished thread's identifier may be given to the next one)

    def record(name):
        keys[name] = (_launch.stream_key(0, 2), _launch.stream_key(0, 0x7F00), _launch.stream_key(0, 0))
        both_alive.wait()

    threads = [threading.Thread(target=record, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert keys["a"][0] != keys["b"][0], "two threads' per-thread default streams share state"
    assert keys["a"][1] == keys["b"][1] and keys["a"][2] == keys["b"][2], "one real stream, two states"


def test_check_flag(monkeypatch):
    monkeypatch.setattr(_checks, "_CHECK_DEFAULT", False)
    assert _checks.check_flag(None) is False
    monkeypatch.setattr(_checks, "_CHECK_DEFAULT", True)
    assert _checks.check_flag(None) is True
    assert _checks.check_flag(False) is False
    assert _checks.check_flag(np.bool_(True)) is True
    for bad in (1, "yes", 0.0):
        with pytest.raises(TypeError, match="check"):
            _checks.check_flag(bad)


def test_pinned_plan_refuses_options_at_call_time():
    seen = []

    def fn(x, *, opt=1, other=2):
        seen.append((x, opt, other))
        return x

    plan = _pipeline.PinnedPlan(fn, plan=None, key=None, options={"opt": 3})
    assert plan(5) == 5 and seen[-1] == (5, 3, 2)
    for value in (4, 3):   # another value, or the same one again
        with pytest.raises(TypeError):
            plan(5, opt=value)
    assert len(seen) == 1, "a refused call reached the function"

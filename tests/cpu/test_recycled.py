"""A small output without out= handed out again only once nothing else refers to it
(cuflash/_runtime/recycled.py): real CuPy arrays over made-up device addresses (CuPy builds them
without a device), the memory kind it keeps standing in for CuPy's pool."""

from types import SimpleNamespace

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from cuflash._runtime import recycled  # noqa: E402


@pytest.fixture
def call(monkeypatch):
    allocations = []

    def alloc(nbytes):
        allocations.append(nbytes)
        memory = cupy.cuda.UnownedMemory(0x7F00_0000_0000 + 0x10_0000 * len(allocations), nbytes, None, 0)
        return cupy.cuda.MemoryPointer(memory, 0)

    monkeypatch.setattr(recycled, "_pooled", cupy.cuda.UnownedMemory)   # stands in for PooledMemory
    monkeypatch.setattr(recycled, "_free", None)
    fake = SimpleNamespace(ndarray=cupy.ndarray, cuda=SimpleNamespace(alloc=alloc, memory=cupy.cuda.memory))
    spare = recycled.spares()

    def run():
        return recycled.output(spare, fake, (4, 8), np.float32, 128)

    run.allocations = allocations
    return run


def test_a_loop_that_drops_its_previous_result_reuses_two_arrays(call):
    seen = set()
    result = None
    for _ in range(6):
        result = call()   # the previous result is held during the call, dropped after it
        seen.add(id(result))
        assert result.shape == (4, 8) and result.dtype == np.float32
    assert len(call.allocations) == 2 and len(seen) == 2


@pytest.mark.parametrize("hold", ["array", "view", "pointer", "memory"])
def test_an_output_still_referred_to_is_never_handed_out(call, hold):
    first = call()
    kept = {"array": lambda x: [x], "view": lambda x: x[1:], "pointer": lambda x: x.data,
            "memory": lambda x: x.data.mem}[hold](first)
    ptr = first.data.ptr
    del first
    others = [call() for _ in range(4)]   # held too: each call must make a new one
    assert all(x.data.ptr != ptr for x in others), f"an output was handed out while its {hold} was held"
    assert kept is not None and len(call.allocations) == 5


def test_a_framework_allocation_is_not_kept(call, monkeypatch):
    monkeypatch.setattr(recycled, "_pooled", type(None))   # nothing counts as CuPy's pool
    ids = {id(call()) for _ in range(4)}
    assert len(call.allocations) == 4 and len(ids) >= 1


def test_an_output_reshaped_in_place_is_not_handed_out_again(call):
    first = call()
    first.shape = (32,)   # allowed on a contiguous array
    ptr = first.data.ptr
    del first
    second = call()
    third = call()
    assert second.shape == third.shape == (4, 8) and ptr not in (second.data.ptr, third.data.ptr)

"""Index faults: the check of a call's index arrays on the GPU that runs first in its plan
(cuda_src/check_indices.cu), and the faults it (or a decode kernel checking itself) reports to the
stream's words, raised as ValueError by the next call on the stream or by :func:`check_errors`."""

from __future__ import annotations

from cuflash import kernels
from cuflash._build import compile as _compile
from cuflash._runtime import launch as _launch, params as _params
from cuflash._runtime.step import Step


def check_step(plan, fields: dict, device_id: int):
    """The index check that runs first in a plan: its fields (index-array pointers as
    ``("operand", i)``, sizes), its launch over ``batch`` CTAs, and the stream's words."""
    fields = dict(fields)
    slots = {"error": plan.index("error"), "scratch": plan.index("scratch"), "report": plan.index("report")}
    for name in ("cache_seqlens", "block_table", "cu_seqlens_q", "cu_seqlens_k"):
        value = fields.pop(name, None)
        if value is not None:
            slots[name] = value[1]
    plan.info.update(fields)
    template = _params.Template(_params.CHECK, fields, slots)
    kernel = _compile.get_kernel(kernels.check_indices.check_indices_variant())
    func = _launch.prepare_kernel(kernel, 0, device_id)
    ctas = max(1, min(fields.get("batch", 1), kernels.check_indices.CHECK_MAX_CTAS))
    return Step(func, (ctas, 1, 1), kernels.check_indices.CHECK_THREADS, 0, (("struct", template),))


_FAULTS = {
    1: "cache_seqlens[{i}] = {v} does not fit the cache: it must be in [0, {capacity} - {new}] ({capacity} keys "
       "per sequence, {new} appended)",
    2: "block_table[{b}, {p}] = {v} is not a page of the cache (0 .. {last_page}) and sequence {b} uses it",
    3: "cu_seqlens_q is not a valid offset array at position {i} (value {v}): it must start at 0, never "
       "decrease and end at most at the total number of rows",
    4: "cu_seqlens_k is not a valid offset array at position {i} (value {v}): it must start at 0, never "
       "decrease and end at most at the total number of rows",
    5: "max_seqlen_q is smaller than sequence {i}'s length: it must be at least the longest query sequence",
    6: "max_seqlen_k is smaller than sequence {i}'s length: it must be at least the longest key sequence",
}


def fault_message(code: int, index: int, value: int, plan) -> str:
    info = dict(plan.info) if plan is not None else {}
    max_pages = max(1, info.get("max_pages", 1))
    info["new"] = info.get("seqlen_new", "?")
    info.setdefault("capacity", "?")
    info.setdefault("new", "?")
    info["last_page"] = info.get("num_pages", 0) - 1
    text = _FAULTS.get(code, "index fault code {code} at {i} (value {v})")
    return text.format(i=index, v=value, b=index // max_pages, p=index % max_pages, code=code, **info)


def _raise_fault(state, slot):
    fault = state.take_fault(slot)
    if fault is not None:
        code, index, value, plan = fault
        entry = plan.entry if plan is not None else "an entry point"
        raise ValueError(f"{fault_message(code, index, value, plan)} (found on the GPU by a {entry} call on "
                         "this stream; that call wrote nothing)")


def check_errors() -> None:
    """Raise the index fault that an earlier call found on the GPU, if any.

    Index arrays on the GPU (``cache_seqlens`` and ``block_table`` of :func:`decode`,
    ``cu_seqlens_q``/``cu_seqlens_k`` and ``max_seqlen_*`` of the varlen entry points) are never read
    back: a kernel checks them before the call writes anything. With ``check=False`` (the default)
    a bad value makes that call write nothing, and the fault is raised by the next call of that
    entry point on the same stream, or by this function.

    Raises
    ------
    ValueError
        The fault, naming the argument, the index and the value (for example ``cache_seqlens[3] = 70
        does not fit the cache ...``) and the entry point whose call found it. Each fault is raised
        once.
    RuntimeError
        When CuPy or a usable CUDA GPU is missing.

    Notes
    -----
    Waits first for the current device, and every device cuflash ran on, to finish: a host
    synchronisation, for a checkpoint rather than every step.

    Examples
    --------
    >>> out = cuflash.decode(q, k_cache, v_cache, cache_seqlens=lens_on_gpu)   # returns at once
    >>> cuflash.check_errors()          # ValueError here if a length did not fit the cache
    """
    cupy = _launch._cupy()
    states = _launch.all_stream_states()
    for device in sorted({cupy.cuda.runtime.getDevice()} | {state.device_id for state in states}):
        with cupy.cuda.Device(device):
            cupy.cuda.runtime.deviceSynchronize()
    for state in states:
        for slot in _launch.REPORT_SLOTS.values():
            _raise_fault(state, slot)

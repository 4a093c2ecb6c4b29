"""The memo of plans: a repeat call of an entry point with operands of a remembered layout finds
its :class:`~cuflash._runtime.plan.Plan` by a key made of everything the checks and the planning looked at
except the data pointers (each operand's type, shape, strides, dtype and device, the options, the
forced kernel family and the current device), and hands over only the pointers.

torch tensors are read directly (``data_ptr()``, ``stride()``; :mod:`cuflash.interop._torch_tensors`,
torch is never imported here) when torch's current stream is CuPy's current stream, which is all
that DLPack's stream handshake would have ordered; otherwise, and for any other DLPack producer, the
call takes the full path through ``cupy.from_dlpack``.
"""

from __future__ import annotations

from cuflash._runtime import launch as _launch
from cuflash._build.cuda_status import import_cupy
from cuflash._runtime.plan import _MEMO_ENTRIES, _pinned, _planning
from cuflash.interop._torch_tensors import _torch_types, is_torch_tensor, torch_operand, torch_stream

_memo: dict = {}
_cp = None   # the cupy module, bound at the first call (cuflash imports no CUDA library at import)


def _cupy():
    global _cp
    if _cp is None:
        _cp = import_cupy()   # a missing CuPy says which extra to install
    return _cp


def lookup(entry: str, operands, options):
    """The remembered plan of a call, the operands' pointers and where the call runs, or (None, key,
    where) when there is none.

    Returns
    -------
    (plan, ptrs, where) on a hit; (None, key, where) on a miss (``key`` is None when the call
    cannot be remembered: an operand of another kind, an unhashable option). ``where``: (device,
    stream) of the call, CuPy's current ones, for :meth:`Plan.run`; None when the operands did not
    allow a lookup (then ``key`` is None too).
    """
    cupy = _cp or _cupy()
    ndarray = cupy.ndarray
    descriptors, ptrs = [], []
    describe, point = descriptors.append, ptrs.append
    # CuPy's current device and stream are asked once the operands allow a lookup (a host array
    # must still get its TypeError on a machine without a GPU), and only once: Plan.run takes them.
    torch_device = None
    bits = 0   # the OR of the pointers: 16-byte alignment is checked operand by operand only if it has low bits
    for x in operands:
        if x is None:
            describe(None)
            point(0)
            continue
        kind = type(x)
        if kind is ndarray:
            memory = x.data
            # A C-contiguous array's strides follow from its shape, except along axes of length 1,
            # where no address depends on them: the flag stands for them (0.2 us a call per array).
            describe((x.shape, x._c_contiguous or x.strides, x.dtype, memory.device_id))
            ptr = memory.ptr
            point(ptr)
            bits |= ptr
        elif kind in _torch_types or is_torch_tensor(x):
            descriptor, ptr = torch_operand(x)
            device = descriptor[4]
            if device != torch_device:
                if torch_device is not None or device < 0:
                    return None, None, None
                torch_device = device
            describe(descriptor)
            point(ptr)
            bits |= ptr
        else:
            return None, None, None
    current_device = cupy.cuda.runtime.getDevice()
    stream = _launch.current_stream_ptr(current_device)
    if torch_device is not None and torch_stream(torch_device) != stream:
        return None, None, None   # the full path's DLPack import orders torch's stream before CuPy's
    where = (current_device, stream)
    key = (entry, options, tuple(descriptors), current_device)
    pinned = _pinned.get()
    if pinned is not None:
        plan = pinned.plan
        if key != pinned.key:
            raise ValueError(f"the arguments do not match this plan's shapes, strides, dtypes, options or device "
                             f"(planned for {pinned.describe()})")
    else:
        try:
            plan = _memo.get(key)
        except TypeError:   # an unhashable option (e.g. a window given as a list): not remembered
            return None, None, where
        if plan is None:
            return None, key, where
    record = _planning.get()
    if record is not None:
        record["key"] = key
    if bits & 15:
        for i in plan.aligned:
            if ptrs[i] % 16:
                return None, None, where
    return plan, ptrs, where


def remember(key, plan) -> None:
    """Keep ``plan`` for repeats of the call ``key`` names (None: a call that must not be replayed,
    e.g. one whose operands were copied)."""
    record = _planning.get()
    if record is not None:
        record["key"] = key
    if key is None:
        return
    if len(_memo) >= _MEMO_ENTRIES:
        _memo.clear()
    _memo[key] = plan


def clear_memo() -> None:
    _memo.clear()


class Pointers(list):
    """Data pointers of a call's kernel-ready arrays, holding the arrays: copies made for the call
    (uploaded index arrays, padded operands) must outlive the launches that read them, or the pool
    could hand their memory to the call's own outputs."""

    def __init__(self, arrays):
        super().__init__(0 if x is None else x.data.ptr for x in arrays)
        self.keep = tuple(arrays)


def pointers(arrays) -> Pointers:
    return Pointers(arrays)


def temp_array(plan, temps, i):
    """Temporary ``i`` of a call as a CuPy array (from the workspace, or a view of the call's one
    allocation)."""
    import cupy

    if isinstance(temps, list):
        return temps[i]
    buffer = plan.temps[i]
    return cupy.ndarray(buffer.shape, dtype=buffer.dtype, memptr=temps + plan._temp_offsets[i])


def _pointer_of(x) -> int | None:
    import cupy

    if type(x) is cupy.ndarray:
        return x.data.ptr
    if is_torch_tensor(x):
        return x.data_ptr()
    return None


def in_place(operands, kernel_operands) -> bool:
    """Whether the kernels use every operand in place (no copy was made): only then may a repeat
    call with new operands of the same layout replay the plan with their pointers."""
    for x, y in zip(operands, kernel_operands):
        if (x is None) != (y is None):
            return False
        if x is not None and _pointer_of(x) != y.data.ptr:
            return False
    return True


def nothing_to_plan() -> None:
    """Called by an entry point whose call launches nothing: under :func:`planned` that is an error."""
    if _planning.get() is not None:
        raise ValueError("an empty problem launches nothing: there is nothing to plan")

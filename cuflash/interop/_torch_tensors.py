"""torch tensors read without importing torch: whether an operand is one, what the memo keys it
by, and torch's current stream. Used by the memo's fast path (:mod:`cuflash._runtime.memo`), which takes a
tensor's layout and pointer directly when torch's stream is CuPy's."""

from __future__ import annotations

import sys


def torch_stream(device_index: int):
    """torch's current stream on the device (its handle), or None when torch is not imported."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        return torch._C._cuda_getCurrentRawStream(device_index)
    except AttributeError:  # other torch builds
        return torch.cuda.current_stream(device_index).cuda_stream


_torch_types = set()   # the torch tensor classes seen (torch is never imported here)


def is_torch_tensor(x) -> bool:
    t = type(x)
    if t in _torch_types:
        return True
    if t.__name__ in ("Tensor", "Parameter") and t.__module__ in ("torch", "torch.nn.parameter"):
        _torch_types.add(t)
        return True
    return False


def torch_operand(x):
    """A tensor's memo descriptor ("torch", shape, strides, dtype, device; the device -1 on the host)
    and its data pointer. A C-contiguous tensor's strides follow from its shape, except along axes of
    length 1, where no address depends on them: the flag stands for them, as for CuPy arrays."""
    return ("torch", x.shape, x.is_contiguous() or x.stride(), x.dtype, x.get_device()), x.data_ptr()

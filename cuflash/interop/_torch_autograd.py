"""``torch.autograd.Function.apply`` without its Python layer when that layer has nothing to do.

``Function.apply`` is a Python classmethod in front of torch's C++ apply: it binds default
arguments for Functions that define ``setup_context``, and when a functorch transform (``vmap``,
``torch.func.grad``, ``jvp``) is active it routes the call through that transform; otherwise it
unwraps tensors that outlived a transform and calls the C++ apply. cuflash's Functions define no
``setup_context`` and are given tensors from ordinary torch code, so outside a transform the layer
only costs time: 9.0 -> 6.0 us per apply of a five-argument Function on a CPU, more on an H200's
slower host, paid once per forward of every autograd step. :func:`direct_apply` keeps the layer
for calls made under a transform.
"""

from __future__ import annotations

import torch

__all__ = ["direct_apply"]

_c_apply = torch._C._FunctionBase.__dict__["apply"]   # the C++ classmethod behind Function.apply
_functorch_active = torch._C._are_functorch_transforms_active


def direct_apply(function):
    """``function.apply`` for a ``torch.autograd.Function`` subclass without ``setup_context``:
    torch's C++ apply directly, or the full ``apply`` while a functorch transform is active."""
    c_apply = _c_apply.__get__(None, function)
    python_apply = function.apply

    def apply(*args):
        if _functorch_active():
            return python_apply(*args)
        return c_apply(*args)

    return apply

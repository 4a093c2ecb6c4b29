"""How cuflash's torch ops are defined, and the eager route past torch's dispatcher.

The ops (:mod:`cuflash.interop._torch_ops`) are defined on ``torch.library``'s lower layer
(``Library.define`` / ``impl``) by :class:`_Op`, which also gives the module's functions a way to
run, in eager calls on plain tensors, the Python kernels the dispatcher would pick without its hops
(:meth:`_Op.__call__`, :func:`direct`; docs/decisions.md#torch-eager-calls-without-the-dispatchers-hops).
"""

import inspect
from typing import Optional

import torch
from torch import Tensor

__all__ = ["LIB", "RANDOM", "compiling", "direct", "op", "backward_op", "records_grad", "below_autograd"]

# The ops are defined on torch.library's lower layer (Library.define / impl) rather than with
# torch.library.custom_op, whose eager path runs Python layers at every call (defaults filled from
# the schema, an aliasing check, a Python autograd wrapper; the host time it cost is in
# docs/decisions.md#torch-ops-on-torchlibrarys-lower-layer). What custom_op added is written here:
# the schema inferred from the kernel's annotations, one kernel for every device type, the fake,
# version counters bumped for mutated arguments, and the forwards' autograd as
# torch.autograd.Functions registered at the Autograd key.
LIB = torch.library.Library("cuflash", "DEF")

# The forwards draw dropout's random numbers; the tag keeps compilers from folding or reordering them
# as if they were pure.
RANDOM = (torch.Tag.nondeterministic_seeded,)

# What runs below autograd, and below the version-counter layer, inside an op's own kernels (the
# same guards torch.library's register_autograd and custom_op use).
below_autograd = torch._C._AutoDispatchBelowAutograd
_AFTER_INPLACE_OR_VIEW = torch._C._after_ADInplaceOrView_keyset
_dispatch_modes = torch._C._len_torch_dispatch_stack
_jit_tracing = torch._C._get_tracing_state
_functorch_active = torch._C._are_functorch_transforms_active
compiling = torch.compiler.is_compiling   # Dynamo folds it to True while tracing


def direct(args) -> bool:
    """Whether a call may run what the dispatcher would run without it: every tensor a plain
    ``torch.Tensor`` (no fake, functional or other subclass), no TorchDispatchMode, no functorch
    transform and no ``torch.jit`` trace active. The dispatcher would then pick the same Python
    kernels (the op's kernel is registered for CPU and CUDA alike), each a Python hop later: ~8 us
    of host time per hop on an H200 host (a no-op op with these argument lists: 17.1 us with one
    hop, 25.1 with two)."""
    if _dispatch_modes() or _functorch_active() or _jit_tracing() is not None:
        return False
    for x in args:
        kind = type(x)
        if kind in _PLAIN_TYPES:
            continue
        if kind is list:   # a Tensor[] argument (a modifier's arrays)
            if not direct(x):
                return False
        elif isinstance(x, Tensor):   # a subclass: fake, functional, ...
            return False
    return True


# Argument types that need no further look in direct(): one set lookup each (the ops take ~20 arguments).
_PLAIN_TYPES = frozenset((Tensor, type(None), bool, int, float, str))


class _Op:
    """``torch.ops.cuflash.<name>`` defined from ``kernel``'s annotated signature, ``kernel``
    registered for the CPU and CUDA keys (it picks cuflash's kernels, or a test's, by device)."""

    def __init__(self, name: str, kernel, mutates_args=(), tags=()):
        self.name = name
        self.kernel = kernel
        LIB.define(name + _schema(kernel, mutates_args), tags=tags)
        for key in ("CPU", "CUDA"):
            LIB.impl(name, kernel, key)
        self.default = getattr(torch.ops.cuflash, name).default
        self._autograd = None
        names = list(inspect.signature(kernel).parameters)
        self._mutated = tuple(names.index(n) for n in mutates_args)
        if mutates_args:
            self._bump_versions(kernel, mutates_args)

    def __call__(self, *args):
        """The op as the functions of :mod:`cuflash.interop._torch_ops` call it (every argument
        positional). Eagerly on plain tensors (:func:`direct`, not while ``torch.compile`` traces) it runs what the
        dispatcher would, without it: the Autograd kernel; for an op without one, the version bumps
        of the tensors it mutates and the kernel (or the dispatcher, whose autograd fallback has its
        say, when an input requires a gradient). Otherwise the dispatcher (``torch.ops.cuflash.*``)."""
        if compiling() or not direct(args):
            return self.default(*args)
        if self._autograd is not None:
            return self._autograd(*args)
        if torch.is_grad_enabled() and any(isinstance(x, Tensor) and x.requires_grad for x in args):
            return self.default(*args)
        for index in self._mutated:
            if index < len(args) and args[index] is not None:
                torch.autograd.graph.increment_version(args[index])
        return self.kernel(*args)

    def below_autograd(self, *args):
        """The op called from its Autograd kernel (or an autograd.Function) with every argument
        positional: its kernel directly when :func:`direct` allows, else a dispatch below autograd."""
        if direct(args):
            return self.kernel(*args)
        with below_autograd():
            return self.default(*args)

    def register_fake(self, fake):
        torch.library.register_fake(f"cuflash::{self.name}", fake, lib=LIB)
        return fake

    def register_autograd(self, kernel):
        """``kernel`` (the op's signature) runs at the Autograd key: it applies a
        torch.autograd.Function, or calls the op below autograd when nothing needs a gradient."""
        LIB.impl(self.name, kernel, "Autograd")
        self._autograd = kernel
        return kernel

    def _bump_versions(self, kernel, mutates_args):
        """Mutated tensors get their version counter bumped, as torch's own in-place ops do (so
        autograd notices a saved tensor that was written since)."""
        names = list(inspect.signature(kernel).parameters)
        where = [(names.index(n), n) for n in mutates_args]
        op, bump = self.default, torch.autograd.graph.increment_version

        def inplace_or_view(keyset, *args, **kwargs):
            for index, name in where:
                x = args[index] if index < len(args) else kwargs.get(name)
                if x is not None:
                    bump(x)
            if not kwargs and direct(args):
                return kernel(*args)
            return op.redispatch(keyset & _AFTER_INPLACE_OR_VIEW, *args, **kwargs)

        LIB.impl(self.name, inplace_or_view, "ADInplaceOrView", with_keyset=True)


# An optional list of tensors ("Tensor[]?" in a schema), which infer_schema does not write: a
# modifier's arrays (cuflash.modifiers.spec), None without one.
_OPTIONAL_TENSORS = Optional[list[Tensor]]


def _schema(kernel, mutates_args) -> str:
    """The schema of ``kernel`` from its annotations (torch.library.infer_schema), parameters annotated
    ``Optional[list[Tensor]]`` (default None) written as ``Tensor[]?``."""
    signature = inspect.signature(kernel)
    lists = [p.name for p in signature.parameters.values() if p.annotation == _OPTIONAL_TENSORS]
    if not lists:
        return torch.library.infer_schema(kernel, mutates_args=mutates_args)
    prototype = lambda *args, **kwargs: None  # noqa: E731
    prototype.__signature__ = signature.replace(parameters=[
        p.replace(annotation=Optional[Tensor]) if p.name in lists else p for p in signature.parameters.values()])
    schema = torch.library.infer_schema(prototype, mutates_args=mutates_args)
    for name in lists:
        schema = schema.replace(f"Tensor? {name}=None", f"Tensor[]? {name}=None")
    return schema


def op(name: str, *, mutates_args=(), tags=()):
    return lambda kernel: _Op(name, kernel, mutates_args, tags)


def backward_op(op, *args):
    """A backward op called from an autograd.Function's backward. With ``create_graph=True`` (grad
    mode on) it goes through the dispatcher, whose autograd fallback says that the op has no
    derivative of its own; otherwise its kernel runs directly when :func:`direct` allows."""
    if not torch.is_grad_enabled() and direct(args):
        return op.kernel(*args)
    return op.default(*args)


def records_grad(*tensors) -> bool:
    """Whether autograd must record a call: grad mode on and an input that requires grad."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


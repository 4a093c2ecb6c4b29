"""Adapters from cuflash to deep-learning frameworks, kept out of the core.

cuflash itself imports no framework: it works on CuPy arrays and on anything that speaks DLPack.
Each submodule here imports its framework and wraps cuflash's forward and backward in that
framework's autograd:

- :mod:`cuflash.interop.torch`: ``attention`` and ``attention_varlen`` as
  ``torch.autograd.Function`` s (zero-copy through DLPack, on torch's current stream), and
  ``cuflash.interop.torch.ops``: the ``torch.library`` custom ops ``torch.ops.cuflash.*``
  (:mod:`cuflash.interop._torch_ops`) for ``torch.compile``, ``torch.export`` and CUDA graphs.
- :mod:`cuflash.interop.jax`: ``attention``, ``attention_varlen`` (``jax.custom_vjp``), ``decode``
  and ``merge_states`` as JAX functions for ``jax.jit``, run on XLA's stream in XLA's buffers
  through ``jax.experimental.buffer_callback`` (docs/jax.md).

Import the submodule you need (``import cuflash.interop.torch``); importing this package imports
no framework.
"""

__all__ = ["jax", "torch"]

"""Tools for testing attention implementations against cuflash's float64 reference.

Public, for anyone fuzzing their own attention code (cuflash's own tests use them):

- hypothesis strategies for shapes and options that straddle tile edges
  (:func:`head_dims`, :func:`seqlens`, :func:`gqa_heads`, :func:`attention_shapes`,
  :func:`attention_options`, :func:`problems`, :func:`varlen_seqlens`);
- :func:`random_qkv`: fresh normal data for NumPy or CuPy, any supported dtype;
- :func:`baseline_attention`: a plain same-dtype attention (matmul, softmax, matmul, rounded to
  the dtype where a naive kernel rounds), the yardstick of the accuracy rule;
- :func:`assert_attention_close`: the accuracy rule.

The accuracy rule
-----------------
For float16/bfloat16, an output passes if ``max|out - ref| <= 2 * max|baseline - ref| + atol``
(``ref`` the float64 reference, ``baseline`` the same-dtype naive attention on the same inputs):
an exact kernel may be at most twice as far from the truth as the textbook computation in that
dtype. For float32 (and float64): ``||out - ref||_F <= rtol * ||ref||_F + atol * sqrt(n)`` with
``rtol = 1e-5``. NaN must appear exactly where the reference has NaN, and infinities (``lse = -inf``
of rows that see no key) must match exactly.

Hypothesis is imported only when a strategy is built, so the rest works without it.
"""

from ._arrays import _dtype  # noqa: F401  (tests name dtypes as cuflash's do)
from .accuracy import DEFAULT_ATOL, FLOAT32_RTOL, assert_attention_close  # noqa: F401
from .baseline import _round_to, baseline_attention, baseline_attention_backward, baseline_attention_varlen  # noqa: F401
from .data import (DECODE_ARRAYS, bias_with_hidden_infinities, decode_case, decode_kwargs, decode_on,  # noqa: F401
                   normal_data, random_qkv, score_tile_operand)
from .strategies import (ALL_OPTIONS, COMMON_HEAD_DIMS, TILE_EDGE_SEQLENS, VARLEN_OPTIONS, as_device_options,
                         attention_options, attention_shapes, gqa_heads, head_dims, problems, seqlens,  # noqa: F401
                         varlen_seqlens)

__all__ = [
    "ALL_OPTIONS",
    "DEFAULT_ATOL",
    "VARLEN_OPTIONS",
    "as_device_options",
    "assert_attention_close",
    "attention_options",
    "attention_shapes",
    "baseline_attention",
    "baseline_attention_backward",
    "baseline_attention_varlen",
    "decode_case",
    "decode_kwargs",
    "decode_on",
    "gqa_heads",
    "head_dims",
    "problems",
    "normal_data",
    "random_qkv",
    "seqlens",
    "varlen_seqlens",
]


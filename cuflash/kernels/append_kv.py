"""append_kv (cuda_src/append_kv.cu): a call's new keys and values written into its KV cache ahead of
the forward kernel that reads them there (decode's chunked prefill on fwd_sm90)."""

from __future__ import annotations

from .._build.variant import Variant
from .._runtime.params import APPEND_PARAMS

APPEND_THREADS = 256


def append_kv_variant() -> Variant:
    """The one variant: any dtype (rows move as 16-byte chunks), any cache layout."""
    return Variant("append_kv", {"CUFLASH_APPEND_PARAMS_SIZE": APPEND_PARAMS.itemsize})

"""merge (cuda_src/merge.cu): the combination of partial attention states (o, lse) over disjoint
key sets: split-KV decode's partials and :func:`cuflash.merge_states`."""

from __future__ import annotations

from dataclasses import dataclass

from .._runtime.params import MERGE_PARAMS
from .._build.variant import Variant
from ..features import DTYPE_CODES

MERGE_DTYPES = ("float16", "bfloat16", "float32", "float64")
MERGE_ROWS_PER_BLOCK = 8   # a warp a row (cuda_src/merge.cu)


@dataclass(frozen=True)
class MergePlan:
    variant: Variant
    rows_per_block: int

    @property
    def threads(self) -> int:
        """Per block: a warp for each of its rows."""
        return 32 * self.rows_per_block

    def grid(self, rows: int) -> int:
        return -(-rows // self.rows_per_block)


def merge_plan(in_dtype_name: str, out_dtype_name: str) -> MergePlan:
    """The merge variant (partials in ``in_dtype_name``, result in ``out_dtype_name``) and its
    launch shape: a warp a row, :data:`MERGE_ROWS_PER_BLOCK` rows a block, for every head dim."""
    for name in (in_dtype_name, out_dtype_name):
        if name not in MERGE_DTYPES:
            raise ValueError(f"merge runs float16, bfloat16, float32 or float64, not {name}")
    defines = {
        "CUFLASH_IN_DTYPE": DTYPE_CODES[in_dtype_name],
        "CUFLASH_OUT_DTYPE": DTYPE_CODES[out_dtype_name],
        "CUFLASH_MERGE_PARAMS_SIZE": MERGE_PARAMS.itemsize,
        "CUFLASH_MERGE_ROWS": MERGE_ROWS_PER_BLOCK,
    }
    return MergePlan(Variant("merge", tuple(sorted(defines.items()))), MERGE_ROWS_PER_BLOCK)

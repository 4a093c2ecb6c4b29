"""rng_state (cuda_src/rng_state.cu): the draw of a captured dropout call's (seed, offset) on the
GPU, from its generator's graph state, at each replay."""

from __future__ import annotations

from .._build.variant import Variant


def rng_state_variant() -> Variant:
    """The dropout state draw that runs first in a dropout call captured in a CUDA graph; one thread."""
    return Variant("rng_state")

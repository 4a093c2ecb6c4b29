"""The JAX GPU tests' fixture that poisons every output buffer cuflash is to write (NaN bytes before the
launch: an element the kernels never write fails the comparison). Import it into a test module that
already skipped without JAX: ``from tests.gpu._jax_outputs import poisoned_outputs  # noqa: F401``."""

import pytest

from cuflash.interop import _jax_buffers


@pytest.fixture(autouse=True)
def poisoned_outputs():
    _jax_buffers.POISON = True
    yield
    _jax_buffers.POISON = False

"""Nothing here is collected by the project's test suite (``python -m pytest tests``).

This directory holds the ``flash_attn`` shim and the runner that executes FlashAttention-2's own
test file against cuflash; that suite runs only through ``run_fa2_suite.py`` (see README.md).
"""

collect_ignore_glob = ["*"]

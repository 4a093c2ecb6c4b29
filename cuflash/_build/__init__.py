"""Building kernels: NVRTC (nvrtc.py) compiles a variant (variant.py: a family and its defines) for
one architecture (arch.py) into a cubin, kept in the on-disk cache (cache.py); compile.py loads and
memoises them and precompiles many; cuda_status.py tells a missing or broken CUDA setup apart and
says what to install; progress.py is what a build of many variants prints. Private: the public
face is :func:`cuflash.precompile` and ``python -m cuflash``."""

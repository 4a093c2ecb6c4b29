"""cuflash's version: the one place it is written (setup.cfg reads it, ``cuflash.__version__``
re-exports it)."""

__version__ = "0.1.0"

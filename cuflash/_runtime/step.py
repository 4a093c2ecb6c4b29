"""A kernel launch's arguments laid out once (:class:`Step`), and the arrays a plan allocates per
call (:class:`Buffer`)."""

from __future__ import annotations

import operator
import struct
import threading

import numpy as np

from cuflash._runtime import launch as _launch, tma as _tma


class Step:
    """One kernel launch of a plan, its arguments laid out once.

    ``args`` are the kernel's parameters in order: ``("struct", Template)``, ``("map", value index,
    TensorMapSpec)`` or ``("pointer", value index)`` (a pointer passed by value). They are laid out in
    one block, the argument pointer array first (``kernelParams``), then each parameter's bytes (at
    8-byte aligned offsets). A tensor map's bytes are encoded here, at a stand-in address that each
    call replaces (:func:`cuflash._runtime.tma.address_patchable`; where the driver's layout does not allow
    it, each call encodes its maps instead).

    Each thread that launches the step has its own copy of the block, at a fixed address, its
    pointer array filled in once. A call writes only what changes per call into it (64-bit words:
    the template's pointer slots, the maps' addresses, pointer parameters; other slots by
    ``pack_into``, one per run of adjacent fields), so every other byte stays what the plan packed,
    and launches it. The driver has copied the arguments when the launch returns, so the thread's
    next call may write the block again.
    """

    __slots__ = ("func", "grid", "threads", "smem", "args", "dependent", "block", "offsets", "words", "writes",
                 "maps", "_local")

    def __init__(self, func: int, grid, threads: int, smem: int, args, dependent: bool = False):
        self.func, self.grid, self.threads, self.smem = func, tuple(int(g) for g in grid), threads, smem
        self.args = tuple(args)
        self.dependent = dependent   # a programmatic dependent of the plan's previous step (_launch.launch)
        words, writes, maps, offsets = [], [], [], []
        block = bytearray(8 * len(self.args))
        for arg in self.args:
            block += bytes(-len(block) % 8)
            position = len(block)
            offsets.append(position)
            if arg[0] == "struct":
                block += arg[1].data
                for offset, fmt, keys in arg[1].runs():
                    if fmt == "<" + "Q" * len(keys) and (position + offset) % 8 == 0:
                        words += [((position + offset) // 8 + i, key) for i, key in enumerate(keys)]
                    else:
                        writes.append((position + offset, struct.Struct(fmt), operator.itemgetter(*keys),
                                       len(keys) == 1))
            elif arg[0] == "map":
                if _tma.address_patchable(arg[2]):
                    block += _tma.template(arg[2])
                    words.append((position // 8, arg[1]))   # bytes 0..7: the global address
                else:
                    block += bytes(128)
                    maps.append((position, arg[1], arg[2]))
            else:
                block += bytes(8)
                words.append((position // 8, arg[1]))
        block += bytes(-len(block) % 8)
        self.block, self.offsets = bytes(block), tuple(offsets)
        self.words, self.writes, self.maps = tuple(words), tuple(writes), tuple(maps)
        self._local = threading.local()

    def _thread_block(self):
        """The calling thread's block: (bytearray, its 64-bit words, its address), made at its first
        launch (the words' memoryview pins the bytearray, so its address never changes)."""
        block = bytearray(self.block)
        base = _launch.address(block)
        struct.pack_into(f"<{len(self.offsets)}Q", block, 0, *[base + offset for offset in self.offsets])
        mine = self._local.block = (block, memoryview(block).cast("Q"), base)
        return mine

    def launch(self, values, stream: int) -> None:
        """Launch with the call's ``values`` (see :class:`Plan`) on ``stream``."""
        base = self.write(values)
        _launch.launch(self.func, self.grid, self.threads, self.smem, base, stream, self.dependent)

    def argv(self) -> int:
        """The address of the calling thread's argument pointer array (fixed for the thread)."""
        try:
            return self._local.block[2]
        except AttributeError:
            return self._thread_block()[2]

    def write(self, values) -> int:
        """Write the call's ``values`` into the calling thread's block; returns its argument pointer
        array's address."""
        try:
            block, words, base = self._local.block
        except AttributeError:
            block, words, base = self._thread_block()
        for index, key in self.words:
            words[index] = values[key]   # native byte order: little-endian on every CUDA host
        for offset, packer, get, single in self.writes:
            if single:
                packer.pack_into(block, offset, get(values))
            else:
                packer.pack_into(block, offset, *get(values))
        for offset, key, spec in self.maps:
            block[offset:offset + 128] = _tma.encode_at(values[key], spec)
        return base


class Buffer:
    """An array a plan allocates per call (or owns, for a pinned plan): shape, dtype, and whether
    each call zeroes it first (temporaries only)."""

    __slots__ = ("shape", "dtype", "zero", "nbytes")

    def __init__(self, shape, dtype, zero: bool = False):
        self.shape, self.dtype, self.zero = tuple(int(n) for n in shape), np.dtype(dtype), zero
        self.nbytes = self.dtype.itemsize * int(np.prod(self.shape))

    def make(self):
        import cupy

        return cupy.empty(self.shape, dtype=self.dtype)

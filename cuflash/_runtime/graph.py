"""A plan's kernels launched as one CUDA graph: one driver launch per call instead of one per kernel.

A kernel launch costs the host 2-5 us in the driver (cuLaunchKernel), whatever the kernel. A plan of
several kernels (the backward's preprocess, main pass and conversion; a varlen call's index check
and kernel) is instantiated once as a graph of kernel nodes, in the plan's order, a programmatic
edge where a step is its predecessor's programmatic dependent. Each call then writes its arguments
into the steps' argument blocks as before, hands each node its block (cuGraphExecKernelNodeSetParams
copies the bytes, 1.5 us a node on a slow host) and launches the graph once (cuGraphLaunch, 3 us
there): the backward's three launches cost 8.3 us instead of 14.6, a whole backward call 8-9 us
less (docs/decisions.md#host-cuda-graphs).

An executable graph holds its nodes' arguments and runs its launches one after another, so each
thread keeps its own per (device, stream), built on the thread's argument blocks (whose addresses
never change). Not under stream capture: there the steps are launched one by one, as the capture
records them.
"""

from __future__ import annotations

import ctypes
import functools

__all__ = ["KernelGraph"]

class _KernelNodeParams(ctypes.Structure):
    """CUDA_KERNEL_NODE_PARAMS_v2 (cuda.h 13.0): the function, grid and block sizes, dynamic shared
    memory, the argument pointer array, extra, kernel and context (NULL: the function's)."""

    _fields_ = ([("func", ctypes.c_void_p)]
                + [(name, ctypes.c_uint) for name in ("grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z",
                                                      "smem")]
                + [("kernel_params", ctypes.c_void_p), ("extra", ctypes.c_void_p), ("kern", ctypes.c_void_p),
                   ("ctx", ctypes.c_void_p)])


# CUgraphEdgeData of a programmatic dependency: from CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC (1), to
# port 0, type CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC (1), five reserved zero bytes.
_PROGRAMMATIC_EDGE = (ctypes.c_ubyte * 8)(1, 0, 1, 0, 0, 0, 0, 0)


@functools.lru_cache(maxsize=1)
def _driver():
    lib = ctypes.CDLL("libcuda.so.1")
    p, size = ctypes.c_void_p, ctypes.c_size_t
    signatures = {
        "cuGraphCreate": [ctypes.POINTER(p), ctypes.c_uint],
        "cuGraphAddKernelNode_v2": [ctypes.POINTER(p), p, p, size, p],
        "cuGraphAddDependencies_v2": [p, p, p, p, size],
        "cuGraphInstantiateWithFlags": [ctypes.POINTER(p), p, ctypes.c_ulonglong],
        "cuGraphExecDestroy": [p],
        "cuGraphDestroy": [p],
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return lib


@functools.lru_cache(maxsize=1)
def _set_params():
    """cuGraphExecKernelNodeSetParams_v2 without argtypes: each call passes ctypes objects that its
    graph made once, which ctypes hands over as they are (0.25 us of Python a call; converting
    through argtypes costs 0.5)."""
    fn = _driver().cuGraphExecKernelNodeSetParams_v2
    fn.restype = ctypes.c_int
    return fn


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed with CUresult {rc}")


class KernelGraph:
    """The executable graph of a plan's steps on one thread's argument blocks.

    Parameters
    ----------
    steps : sequence of cuflash._runtime.step.Step
        In launch order; a step with ``dependent`` set gets a programmatic edge from the one before.
    argvs : sequence of int
        Each step's argument pointer array (the thread's block, see Step), read at every launch.
    """

    def __init__(self, steps, argvs):
        driver = _driver()
        self._driver = driver
        self._graph, self._exec = ctypes.c_void_p(), ctypes.c_void_p()
        _check(driver.cuGraphCreate(ctypes.byref(self._graph), 0), "cuGraphCreate")
        self._nodes, self._params = [], []
        for step, argv in zip(steps, argvs):
            params = _KernelNodeParams(step.func, *step.grid, step.threads, 1, 1, step.smem, argv, None, None, None)
            node = ctypes.c_void_p()
            before = self._nodes[-1:] if not step.dependent else []
            deps = (ctypes.c_void_p * 1)(*before) if before else None
            _check(driver.cuGraphAddKernelNode_v2(ctypes.byref(node), self._graph, deps, len(before),
                                                  ctypes.byref(params)), "cuGraphAddKernelNode")
            if step.dependent and self._nodes:
                # Starts once every CTA of the previous node has let it (griddepcontrol.launch_dependents).
                _check(driver.cuGraphAddDependencies_v2(self._graph, ctypes.byref(self._nodes[-1]), ctypes.byref(node),
                                                        _PROGRAMMATIC_EDGE, 1), "cuGraphAddDependencies")
            self._nodes.append(node)
            self._params.append(params)
        _check(driver.cuGraphInstantiateWithFlags(ctypes.byref(self._exec), self._graph, 0), "cuGraphInstantiate")
        set_params = _set_params()
        self._updates = tuple((set_params, self._exec, node, ctypes.byref(params))
                              for node, params in zip(self._nodes, self._params))
        import cupy

        # The runtime's cudaGraphLaunch takes the driver's graph (the handle types are one) through
        # CuPy's compiled binding: ~0.4 us less Python than a ctypes call.
        self._launch, self._exec_handle = cupy.cuda.runtime.graphLaunch, self._exec.value

    def launch(self, stream: int) -> None:
        """Launch the graph on ``stream`` with the arguments now in the steps' blocks."""
        for set_params, exe, node, params in self._updates:
            rc = set_params(exe, node, params)
            if rc != 0:
                raise RuntimeError(f"cuGraphExecKernelNodeSetParams failed with CUresult {rc}")
        self._launch(self._exec_handle, stream)

    def __del__(self):
        try:
            if self._exec:
                self._driver.cuGraphExecDestroy(self._exec)
            if self._graph:
                self._driver.cuGraphDestroy(self._graph)
        except Exception:  # interpreter shutdown: the driver may be gone already
            pass

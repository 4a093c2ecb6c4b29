"""Pinned plans: a call's plan fixed once (:func:`planned`, public as :func:`cuflash.plan`), run
with no planning on temporaries it owns, so that its launches can be captured in a CUDA graph."""

from __future__ import annotations

from cuflash._runtime import launch as _launch, now as _now, plan as _plan
from cuflash._runtime.plan import Plan, PlanningDone, _pinned, _planning


class PinnedPlan:
    """A call's plan fixed once for a serving or training loop; made by :func:`cuflash.plan`.

    Calling it runs the entry point with arguments of the same shapes, strides, dtypes and options,
    with no planning at all, on temporaries it owns (one set per stream, made at the first call on
    that stream), so that its launches can be captured in a CUDA graph. Not made directly: use
    :func:`cuflash.plan`, which also makes the graph state of a dropout forward's generator on the
    current GPU (:meth:`cuflash.Generator.graph_safe`).

    Parameters
    ----------
    fn : callable
        The entry point the plan runs (:func:`cuflash.attention`, :func:`cuflash.decode`, ...).
    plan : cuflash._runtime.plan.Plan
        The call's launches, as planned.
    key : tuple
        What the call was planned for (entry point, options, operand shapes, strides, dtypes,
        device); every call must match it.
    options : dict
        The keyword options fixed by the plan, passed to ``fn`` at every call.

    Notes
    -----
    ``p(*arrays, **array_keywords)`` returns what ``fn`` returns. Pass the arrays only: an option
    fixed by the plan passed again is a TypeError, and arrays whose shapes, strides, dtypes or
    device differ from the planned ones are a ValueError (before any launch).
    ``repr(p)`` names the entry point, the operand shapes and the number of launches.

    Examples
    --------
    >>> step = cuflash.plan(cuflash.decode, q, k_cache, v_cache, cache_seqlens=lens, k_new=k_new,
    ...                     v_new=v_new, out=out)
    >>> step(q, k_cache, v_cache, cache_seqlens=lens, k_new=k_new, v_new=v_new, out=out)
    """

    def __init__(self, fn, plan: Plan, key, options: dict):
        self.fn, self.plan, self.key, self.options = fn, plan, key, options
        self._workspaces = {}

    def workspace(self, device_id: int, stream_ptr: int):
        key = _launch.stream_key(device_id, stream_ptr)
        temps = self._workspaces.get(key)
        if temps is None:
            with _now.done_now(device_id):   # also at a first call inside a capture
                temps = self._workspaces[key] = [b.make() for b in self.plan.temps]
        return temps

    def describe(self) -> str:
        name = getattr(self.fn, "__name__", "?")
        shapes = [tuple(d[1]) if d and d[0] == "torch" else (d[0] if d else None) for d in self.key[2]]
        return f"{name} with operand shapes {shapes}"

    def __call__(self, *args, **kwargs):
        for name in kwargs:
            if name in self.options:
                raise TypeError(f"{name} is fixed by the plan; pass only arrays when calling it")
        token = _pinned.set(self)
        try:
            return self.fn(*args, **self.options, **kwargs)
        finally:
            _pinned.reset(token)

    def __repr__(self):
        return f"<cuflash plan of {self.describe()}, {len(self.plan.steps)} launches>"


def planned(fn, *args, **kwargs) -> PinnedPlan:
    """Plan ``fn(*args, **kwargs)`` without launching anything, for a loop or a CUDA graph.

    Array arguments fix the layout (shapes, strides, dtypes, device); the other keyword arguments
    are options fixed in the plan. The returned :class:`Plan` runs the call with no planning on
    temporaries it owns, so that its launches can be captured.

    Parameters
    ----------
    fn : callable
        An entry point: :func:`cuflash.attention`, :func:`cuflash.attention_forward`,
        :func:`cuflash.attention_varlen`, :func:`cuflash.attention_backward`,
        :func:`cuflash.attention_varlen_backward`, :func:`cuflash.decode` or
        :func:`cuflash.merge_states`.
    *args, **kwargs
        A call's arguments, as ``fn`` takes them: CuPy arrays or torch tensors on torch's current
        stream, used in place (no copies), index arrays on the GPU; and its options.

    Returns
    -------
    Plan
        Call it with the arrays only: ``p(q, k, v, out=out)``.

    Raises
    ------
    ValueError
        If the call launches nothing (an empty problem), or cannot be planned: an operand that is
        not a CuPy array or a torch tensor on torch's current stream, one that needs a copy (a
        misaligned or non-contiguous last axis, a head dim that is not a multiple of 8), or an
        index array given on the host.
    TypeError, ValueError, RuntimeError
        Any error of ``fn`` for these arguments.

    Notes
    -----
    CUDA graphs (``cupy.cuda.Stream.begin_capture``, ``torch.cuda.graph``): every entry point can be
    captured, through its plan or as a plain call, on these terms.

    - No warm-up on the capturing stream is needed: the stream's words, the plan's workspace
      there and the generator's graph state are made at the first call, inside a capture too
      (:mod:`cuflash._runtime.now`).
    - The graph reads and writes the arrays the captured call was given or returned (outputs,
      ``rng_state``): write new inputs into the same arrays, and keep the returned ones as long as the
      graph is replayed. Temporaries are kept by the plan (or the stream) for the graph.
    - Graphs captured on one stream share that stream's words and temporaries: run them one after
      the other; capture the graphs that are to run at the same time on different streams.
    - Dropout: each replay draws its (seed, offset) on the GPU from the generator's graph state
      (:meth:`cuflash.Generator.graph_safe`; made here for a forward with dropout), and the returned
      ``rng_state`` is a device array holding each replay's state, which
      :func:`cuflash.attention_backward` reads on the GPU.
    - A call that needs copies of its operands, ``check=True``, or ``return_dbias=True`` cannot be
      captured: RuntimeError, before any of its kernels is recorded (end the capture and drop its
      graph). Index arrays are checked on the GPU at every replay: a bad one makes the replay write
      nothing and is raised by the next call on the stream or by :func:`cuflash.check_errors`.

    Examples
    --------
    >>> import cupy as cp
    >>> import cuflash
    >>> q, k, v = (cp.random.standard_normal((8, 1024, 16, 128), dtype=cp.float32).astype(cp.float16)
    ...            for _ in range(3))
    >>> out = cp.empty_like(q)
    >>> step = cuflash.plan(cuflash.attention, q, k, v, causal=True, out=out)
    >>> stream = cp.cuda.Stream(non_blocking=True)
    >>> with stream:
    ...     stream.begin_capture()
    ...     step(q, k, v, out=out)
    ...     graph = stream.end_capture()
    >>> q[...] = next_q                        # new inputs into the same arrays, then replay
    >>> graph.launch(stream)
    """
    record = {}
    token = _planning.set(record)
    try:
        fn(*args, **kwargs)
    except PlanningDone as done:
        plan = done.plan
    else:
        raise ValueError(f"{getattr(fn, '__name__', fn)} launches nothing for these arguments (an empty "
                         "problem): there is nothing to plan")
    finally:
        _planning.reset(token)
    if record.get("key") is None:
        raise ValueError("this call cannot be planned: an operand is not a CuPy array or a torch tensor on "
                         "torch's current stream, needs a copy (a misaligned or non-contiguous last axis, a "
                         "head dim that is not a multiple of 8), or is an index array given on the host")
    options = {name: value for name, value in kwargs.items() if value is not None and not _is_array(value)}
    if plan.dropout is not None and plan.entry in ("attention", "attention_varlen"):
        # Its runs may be captured: their dropout then draws from the generator's graph state,
        # which a capture cannot make.
        (kwargs.get("generator") or _plan._default_generator()).graph_safe()
    return PinnedPlan(fn, plan, record["key"], options)


def _is_array(x) -> bool:
    return hasattr(x, "__dlpack__") or hasattr(x, "__cuda_array_interface__") or isinstance(x, (list, tuple)) \
        and any(hasattr(v, "__dlpack__") for v in x)

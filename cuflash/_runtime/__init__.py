"""Running kernels: a call's plan (plan.py: Plan and Plan.run) of launches (step.py) with their
parameters packed once (params.py) and TMA maps (tma.py), remembered by layout (memo.py) or pinned
for a loop or a CUDA graph (pinned.py); per-stream state and the launch itself (launch.py), plans
of several kernels as one CUDA graph (graph.py), what a captured call needs (capture.py), and index
faults found on the GPU (faults.py). Private: docs/internals.md maps it."""

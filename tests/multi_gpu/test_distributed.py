"""Ring attention over NCCL on 2, 4 and 8 GPUs (cuflash.distributed), one process per GPU.

The test spawns ``world`` processes from Python (multiprocessing, start method "spawn": no torchrun,
no mpirun); process ``r`` computes on GPU ``r``. Two communicators:

- CuPy: ``cupy.cuda.nccl.NcclCommunicator`` made from one ``nccl.get_unique_id()`` that the test
  draws and passes to every process; the processes call ``cuflash.distributed.ring_attention`` and
  ``ring_attention_backward`` on their zigzag shard;
- torch: ``torch.distributed.init_process_group("nccl")`` over a FileStore; the processes call
  ``cuflash.interop.torch.ring_attention`` and ``backward()`` (the autograd function).

Every process builds the same problem from one seed and keeps its shard; rank 0 also runs one
single-GPU ``cuflash.attention_forward`` / ``attention_backward`` over the whole sequence on its GPU.
Each writes its results to an .npz file; the test puts the shards back in sequence order and
compares them with the single-GPU call, with the tolerances of test_distributed_gpu.py (float32:
relative error 1e-5 forward, 1e-4 gradients; bfloat16: max error 2e-2 * max). Cases: causal and not,
MHA and GQA (only the kv heads travel), bfloat16 and float32, chunks of 48 rows (not a tile multiple).

Skipped unless the machine has ``world`` GPUs and the communicator's NCCL (CuPy's ``nccl.available``;
torch's ``dist.is_nccl_available()``).
"""

import os
import traceback

import numpy as np
import pytest

from cuflash import distributed as cd

pytestmark = pytest.mark.gpu

WORLDS = [2, 4, 8]
CASES = [(causal, heads, dtype) for causal in (False, True) for heads in ((4, 4), (8, 2))
         for dtype in ("bfloat16", "float32")]
B, CHUNK, D = 2, 48, 64
TIMEOUT_S = 600


def _device_count():
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # no CuPy, no driver, no device
        return 0


def _needs(world):
    count = _device_count()
    if count < world:
        pytest.skip(f"needs {world} GPUs, found {count}")


def _problem(world, heads, seed):
    """The whole problem in float32 on the host, the same in every process."""
    rng = np.random.default_rng(seed)
    S = 2 * world * CHUNK
    q, dout = (rng.standard_normal((B, S, heads[0], D), dtype=np.float32) for _ in range(2))
    k, v = (rng.standard_normal((B, S, heads[1], D), dtype=np.float32) for _ in range(2))
    return q, k, v, dout


def _name(case):
    causal, (hq, hk), dtype = case
    return f"{'causal' if causal else 'full'}_{hq}x{hk}_{dtype}"


def _save(path, rank, results):
    np.savez(os.path.join(path, f"rank{rank}.npz"), **results)


def _report_failure(path, rank):
    with open(os.path.join(path, f"rank{rank}.err"), "w") as f:
        f.write(traceback.format_exc())


# ----------------------------------------------------------------------------- the processes

def _cupy_rank(rank, world, unique_id, path):
    try:
        import cupy
        import ml_dtypes
        from cupy.cuda import nccl

        import cuflash

        cupy.cuda.Device(rank).use()
        comm = nccl.NcclCommunicator(world, unique_id, rank)
        results = {}
        for i, case in enumerate(CASES):
            causal, heads, dtype = case
            cast = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}[dtype]
            full = [cupy.asarray(x).astype(cast) for x in _problem(world, heads, seed=i)]
            q, k, v, dout = (cd.shard(x, world)[rank] for x in full)
            out, lse = cd.ring_attention(q, k, v, group=comm, causal=causal)
            grads = cd.ring_attention_backward(dout, q, k, v, out, lse, group=comm, causal=causal)
            for key, x in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads)):
                results[f"{_name(case)}/{key}"] = x.astype(cupy.float32).get()
            if rank == 0:   # the single-GPU call on this GPU
                q, k, v, dout = full
                out, lse, _ = cuflash.attention_forward(q, k, v, causal=causal)
                grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal)
                for key, x in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads)):
                    results[f"{_name(case)}/single/{key}"] = x.astype(cupy.float32).get()
        cupy.cuda.Device().synchronize()
        _save(path, rank, results)
    except BaseException:
        _report_failure(path, rank)
        raise


def _torch_rank(rank, world, store, path):
    try:
        import torch
        import torch.distributed as dist

        import cuflash.interop.torch as ct

        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", store=dist.FileStore(store, world), rank=rank, world_size=world)
        results = {}
        for i, case in enumerate(CASES):
            causal, heads, dtype = case
            cast = getattr(torch, dtype)
            host = _problem(world, heads, seed=i)
            full = [torch.from_numpy(x).to("cuda").to(cast) for x in host]
            mine = [torch.from_numpy(cd.shard(x, world)[rank]).to("cuda").to(cast) for x in host]
            q, k, v = (x.requires_grad_(True) for x in mine[:3])
            out, lse = ct.ring_attention(q, k, v, causal=causal, return_lse=True)
            out.backward(mine[3])
            for key, x in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, q.grad, k.grad, v.grad)):
                results[f"{_name(case)}/{key}"] = x.detach().float().cpu().numpy()
            if rank == 0:
                q, k, v = (x.requires_grad_(True) for x in full[:3])
                out = ct.attention(q, k, v, causal=causal)
                out.backward(full[3])
                for key, x in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad)):
                    results[f"{_name(case)}/single/{key}"] = x.detach().float().cpu().numpy()
        torch.cuda.synchronize()
        _save(path, rank, results)
        dist.destroy_process_group()
    except BaseException:
        _report_failure(path, rank)
        raise


# ----------------------------------------------------------------------------- the test side

def _spawn(target, world, args, path):
    import multiprocessing

    spawn = multiprocessing.get_context("spawn")
    ranks = [spawn.Process(target=target, args=(r, world, *args, str(path))) for r in range(world)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(TIMEOUT_S)
    hung = [r for r, p in enumerate(ranks) if p.is_alive()]
    for r in hung:
        ranks[r].kill()
    errors = [(path / f"rank{r}.err").read_text() for r in range(world) if (path / f"rank{r}.err").exists()]
    assert not errors, "a rank failed:\n" + "\n".join(errors)
    assert not hung, f"ranks {hung} did not finish in {TIMEOUT_S} s"
    assert [p.exitcode for p in ranks] == [0] * world
    return [dict(np.load(path / f"rank{r}.npz")) for r in range(world)]


def _compare(results, world, keys):
    for case in CASES:
        dtype = case[2]
        for key in keys:
            axis = 2 if key == "lse" else 1
            got = cd.unshard([r[f"{_name(case)}/{key}"] for r in results], axis=axis).astype(np.float64)
            want = results[0][f"{_name(case)}/single/{key}"].astype(np.float64)
            where = f"world {world}, {_name(case)}, {key}"
            assert got.shape == want.shape and np.isfinite(got).all(), where
            if key == "lse":
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4, err_msg=where)
            elif dtype == "float32":
                rtol = 1e-5 if key == "out" else 1e-4
                assert np.linalg.norm(got - want) <= rtol * np.linalg.norm(want), where
            else:
                assert np.abs(got - want).max() <= 2e-2 * np.abs(want).max(), where


@pytest.mark.parametrize("world", WORLDS)
def test_cupy_nccl_ring(world, tmp_path):
    _needs(world)
    from cupy.cuda import nccl
    if not nccl.available:
        pytest.skip("CuPy finds no NCCL library")
    results = _spawn(_cupy_rank, world, (nccl.get_unique_id(),), tmp_path)
    _compare(results, world, ("out", "lse", "dq", "dk", "dv"))


@pytest.mark.parametrize("world", WORLDS)
def test_torch_nccl_ring(world, tmp_path):
    _needs(world)
    torch = pytest.importorskip("torch")
    import torch.distributed as dist
    if not torch.cuda.is_available() or torch.cuda.device_count() < world:
        pytest.skip(f"torch sees fewer than {world} GPUs")
    if not dist.is_available() or not dist.is_nccl_available():
        pytest.skip("torch.distributed has no NCCL backend")
    results = _spawn(_torch_rank, world, (str(tmp_path / "store"),), tmp_path)
    _compare(results, world, ("out", "dq", "dk", "dv"))

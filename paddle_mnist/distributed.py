"""The distributed environment: every call into paddle.distributed lives here."""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass

import numpy as np
import paddle
import paddle.distributed as dist

GPU_FLAG = re.compile(r"^--(selected_gpus|gpus|devices)(=.*)?$")


class LaunchError(RuntimeError):
    """The job was launched in a way this build of Paddle cannot honour."""


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_size: int
    backend: str  # "gloo", "nccl" or "none" for one process
    device: str  # "cpu" or "gpu:N"

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _parent_gpu_request(ppid: int) -> str | None:
    """The GPU flag the parent launcher was given, if any ("--selected_gpus=0,1,2,3")."""
    try:
        with open(f"/proc/{ppid}/cmdline", "rb") as f:
            args = f.read().decode(errors="replace").split("\0")
    except OSError:
        return None
    if not any("paddle.distributed.launch" in a for a in args):
        return None
    for i, arg in enumerate(args):
        if GPU_FLAG.match(arg):
            return arg if "=" in arg else f"{arg} {args[i + 1] if i + 1 < len(args) else ''}".strip()
    return None


def check_gpu_request() -> None:
    """Refuse a GPU launch on a CPU-only build instead of training with fewer workers than asked.

    Paddle's legacy launcher, given --selected_gpus on a build without CUDA, starts a single CPU
    process and says little about it; this finds the flag on the parent's command line.
    """
    if paddle.is_compiled_with_cuda():
        return
    flag = _parent_gpu_request(os.getppid())
    if flag is None:
        return
    ids = [x for x in re.split(r"[=\s,]+", flag)[1:] if x]
    n = max(len(ids), 1)
    raise LaunchError(
        f"launched with {flag}, but this Paddle build has no CUDA, so the launcher started "
        f"{int(os.environ.get('PADDLE_TRAINERS_NUM', '1'))} CPU process instead of {n} GPU workers. "
        "On a GPU machine install requirements-gpu.txt (paddlepaddle-gpu); to train on CPU run: "
        f"python -m paddle.distributed.launch --nproc_per_node {n} --log_dir log train.py"
    )


def gpu_shortfall(local_workers: int, visible_gpus: int) -> str | None:
    """Why this node cannot give each local worker its own GPU, or None when it can."""
    if local_workers <= visible_gpus:
        return None
    return (
        f"{local_workers} workers were started on this node but only {visible_gpus} GPU(s) are visible; "
        f"start at most {visible_gpus} (--gpus {','.join(map(str, range(max(visible_gpus, 1))))}) "
        "or check CUDA_VISIBLE_DEVICES"
    )


def _env_int(*names: str, default: int) -> int:
    for name in names:
        value = os.environ.get(name, "")
        if value.strip():
            return int(value)
    return default


def launched_workers() -> int:
    """The job's world size as the launcher set it (1 without a launcher or with an unreadable value)."""
    try:
        return _env_int("PADDLE_TRAINERS_NUM", "PADDLE_GLOBAL_SIZE", default=1)
    except ValueError:
        return 1


def setup() -> DistEnv:
    """Check the launch, join the process group (for more than one worker) and pick the device."""
    check_gpu_request()
    world = _env_int("PADDLE_TRAINERS_NUM", "PADDLE_GLOBAL_SIZE", default=1)
    # ParallelEnv().local_rank is the global rank; the launchers export the rank within the node
    local_rank = _env_int("PADDLE_LOCAL_RANK", "PADDLE_RANK_IN_NODE", default=0)
    endpoints = os.environ.get("PADDLE_TRAINER_ENDPOINTS", "x").split(",")
    local_size = min(_env_int("PADDLE_LOCAL_SIZE", default=len(endpoints)), world)
    use_gpu = paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0
    if use_gpu and (problem := gpu_shortfall(local_size, paddle.device.cuda.device_count())):
        raise LaunchError(problem)
    if world > 1:
        dist.init_parallel_env()
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank = 0
    # the launcher sets FLAGS_selected_gpus for each worker; ParallelEnv reads it back
    device = f"gpu:{dist.ParallelEnv().device_id}" if use_gpu else "cpu"
    paddle.set_device(device)
    backend = "none" if world == 1 else os.environ.get("PADDLE_DISTRI_BACKEND") or ("nccl" if use_gpu else "gloo")
    return DistEnv(rank, world, local_rank, local_size, backend, device)


def sync_bn_problem(env: DistEnv) -> str | None:
    """Why --sync-bn cannot be honoured here, or None."""
    if env.device == "cpu" and env.world_size > 1:
        return (
            "--sync-bn: Paddle has no CPU kernel for SyncBatchNorm (sync_batch_norm), so it works on GPUs only; "
            "drop --sync-bn on CPU (each worker then normalises its own shard of the batch)"
        )
    return None


def convert_sync_bn(model: paddle.nn.Layer, env: DistEnv) -> paddle.nn.Layer:
    """Batch norm layers become SyncBatchNorm (same parameters), normalising over the whole global batch.

    One worker already sees the whole batch, so there is nothing to convert. Check sync_bn_problem first.
    """
    return paddle.nn.SyncBatchNorm.convert_sync_batchnorm(model) if env.world_size > 1 else model


# Gradient buckets in MB. Smaller than Paddle's defaults (25, 1) so that the all-reduce of the last layers'
# gradients starts while backward still runs through the first ones; the reasoning is in docs/performance.md.
COMM_BUFFER_MB, LAST_COMM_BUFFER_MB = 2, 0.25


def wrap(model: paddle.nn.Layer, env: DistEnv) -> paddle.nn.Layer:
    """DataParallel for more than one worker: it broadcasts rank 0's weights, then averages gradients."""
    if env.world_size == 1:
        return model
    return paddle.DataParallel(model, comm_buffer_size=COMM_BUFFER_MB, last_comm_buffer_size=LAST_COMM_BUFFER_MB)


def gradient_sync(model: paddle.nn.Layer, sync: bool):
    """A context for one backward pass: all-reduce its gradients (sync) or keep them local (DataParallel.no_sync)."""
    if sync or not isinstance(model, paddle.DataParallel):
        return contextlib.nullcontext()
    return model.no_sync()


def all_reduce_gradients(model: paddle.nn.Layer) -> None:
    """Average the gradients over workers by hand, for a backward pass run under no_sync (so it can be timed).

    Like DataParallel, the gradients are packed into one buffer per dtype, scaled by 1/world size and summed.
    """
    if not isinstance(model, paddle.DataParallel):
        return
    grads: dict[str, list[paddle.Tensor]] = {}
    for p in model.parameters():
        if p.grad is not None:
            grads.setdefault(str(p.grad.dtype), []).append(p.grad)
    for group in grads.values():
        _average_in_place(group)


def average_running_statistics(model: paddle.nn.Layer, env: DistEnv) -> None:
    """Average the state that is not trained (batch norm running mean and variance) over workers, in place.

    Without SyncBatchNorm each worker keeps running statistics of its own shards; averaging them before every
    evaluation makes all ranks hold the model rank 0 saves, so the reported accuracy is that model's. Paddle
    keeps these statistics as parameters with stop_gradient set, so those are averaged along with any buffers.
    Frozen weights are averaged too: they stay equal on all ranks (unchanged when the world size is a power of
    two; otherwise they may move by a rounding step).
    """
    if env.world_size == 1:
        return
    groups: dict[str, list[paddle.Tensor]] = {}
    for t in _untrained(model):
        groups.setdefault(str(t.dtype), []).append(t)
    for group in groups.values():
        _average_in_place(group)


def _untrained(model: paddle.nn.Layer) -> list[paddle.Tensor]:
    net = unwrap(model)
    state = [p for p in net.parameters() if p.stop_gradient] + list(net.buffers())
    return [t for t in state if t.is_floating_point()]


def gather_untrained(model: paddle.nn.Layer, env: DistEnv) -> list[np.ndarray]:
    """Every rank's untrained state (batch norm running statistics), one flat float64 vector per rank.

    The checkpoint of a stop (SIGTERM) keeps them all instead of their average, so a resumed run continues each
    rank's statistics exactly where they were: averaging at a step the uninterrupted run does not average at
    would change the final statistics in the last bits. float64 holds float32, float16 and bfloat16 exactly.
    """
    tensors = _untrained(model)
    if not tensors:
        return []
    flat = paddle.concat([t.astype("float64").reshape([-1]) for t in tensors])
    if env.world_size == 1:
        return [flat.numpy()]
    gathered: list[paddle.Tensor] = []
    dist.all_gather(gathered, flat)
    return [t.numpy() for t in gathered]


def set_untrained(model: paddle.nn.Layer, by_rank: list[np.ndarray], env: DistEnv) -> None:
    """Restore this rank's entry of gather_untrained (their mean when the world size changed)."""
    tensors = _untrained(model)
    if not by_rank or not tensors:
        return
    flat = by_rank[env.rank] if len(by_rank) == env.world_size else np.mean(by_rank, axis=0)
    offset = 0
    for t in tensors:
        n = int(t.size)
        value = paddle.to_tensor(flat[offset : offset + n].reshape(t.shape)).astype(t.dtype)
        paddle.assign(value, output=t)
        offset += n


def _average_in_place(tensors: list[paddle.Tensor]) -> None:
    """Pack same-dtype tensors into one buffer, scale by 1/world size, sum over workers, copy back."""
    flat = paddle.concat([t.reshape([-1]) for t in tensors])
    flat.scale_(1.0 / dist.get_world_size())
    dist.all_reduce(flat)
    offset = 0
    for t in tensors:
        n = int(t.size)
        paddle.assign(flat[offset : offset + n].reshape(t.shape), output=t)
        offset += n


def device_sync(env: DistEnv):
    """A function that waits for the device's queued work: CUDA kernels run asynchronously, CPU ones do not."""
    if env.device.startswith("gpu"):
        return paddle.device.cuda.synchronize
    return lambda: None


def unwrap(model: paddle.nn.Layer) -> paddle.nn.Layer:
    return model._layers if isinstance(model, paddle.DataParallel) else model


def _all_reduce(values: np.ndarray, env: DistEnv, op) -> np.ndarray:
    values = np.asarray(values, dtype=np.float64)
    if env.world_size == 1:
        return values
    t = paddle.to_tensor(values, dtype="float64")
    dist.all_reduce(t, op=op)
    return t.numpy()


def all_reduce_sum(values: np.ndarray, env: DistEnv) -> np.ndarray:
    """Sum a small float64 vector over all workers (exact for counts below 2**53)."""
    return _all_reduce(values, env, dist.ReduceOp.SUM)


def all_reduce_max_values(values: np.ndarray, env: DistEnv) -> np.ndarray:
    """Element-wise maximum of a small float64 vector over all workers."""
    return _all_reduce(values, env, dist.ReduceOp.MAX)


def all_reduce_max(value: float, env: DistEnv) -> float:
    return float(all_reduce_max_values([value], env)[0])


def job_store():
    """The job-wide TCP key-value store that init_parallel_env() set up (counters via add())."""
    return paddle.base.core.create_or_get_global_tcp_store()


def barrier(env: DistEnv) -> None:
    if env.world_size > 1:
        dist.barrier()


def cpu_threads(requested: int, local_size: int) -> int:
    """Threads per worker: the cores divided among this node's workers, at least one."""
    if requested:
        return requested
    return max(1, (os.cpu_count() or 1) // max(local_size, 1))


def apply_cpu_threads(n: int) -> None:
    paddle.base.core.set_num_threads(n)

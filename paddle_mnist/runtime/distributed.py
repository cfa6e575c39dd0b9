"""The distributed environment: joining the process group, and every call into paddle.distributed."""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import paddle
import paddle.distributed as dist

from paddle_mnist.files import safeload
from paddle_mnist.runtime import local_sum, preflight
from paddle_mnist.runtime.launch import (
    LaunchError,
    check_gpu_kernels,
    check_gpu_request,
    gpu_flag,
    gpu_request_problem,
    gpu_shortfall,
    launch_layout,
    parent_args,
)


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_size: int
    backend: str  # "gloo", "nccl" or "none" for one process
    device: str  # "cpu" or "gpu:N"
    carrier: local_sum.Carrier = field(default_factory=local_sum.Carrier, compare=False, repr=False)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup() -> DistEnv:
    """Check the launch, join the process group (for more than one worker) and pick the device."""
    check_gpu_request()
    layout = launch_layout(os.environ)
    world, local_rank, local_size = layout.world, layout.local_rank, layout.local_size
    use_gpu = paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0
    if use_gpu:
        args = parent_args(os.getppid())
        problem = gpu_request_problem(gpu_flag(args), args, local_size) or gpu_shortfall(
            local_size, paddle.device.cuda.device_count()
        )
        if problem:
            raise LaunchError(problem)
    if world > 1:
        if not use_gpu and (problem := preflight.startup_problem(os.environ)):
            raise LaunchError(problem)  # gloo would fail to connect, after a timeout on some machines
        with _flags_banner_dropped(os.environ):
            dist.init_parallel_env()
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank = 0
    # the launcher sets FLAGS_selected_gpus for each worker; ParallelEnv reads it back
    device = f"gpu:{dist.ParallelEnv().device_id}" if use_gpu else "cpu"
    paddle.set_device(device)
    if use_gpu:
        check_gpu_kernels(device)
    backend = "none" if world == 1 else os.environ.get("PADDLE_DISTRI_BACKEND") or ("nccl" if use_gpu else "gloo")
    return DistEnv(rank, world, local_rank, local_size, backend, device)


BANNER = "======================= Modified FLAGS detected"  # init_parallel_env's, on stderr, then one line a flag


class _BannerFilter:
    """sys.stderr while init_parallel_env runs: its banner of every FLAGS_* that differs from its default is held
    back, and written only if it names a flag the user set; everything else passes straight through."""

    def __init__(self, out, user_flags: set[str]):
        self.out, self.user_flags, self.held = out, user_flags, None

    def write(self, text: str) -> int:
        if self.held is None and not text.startswith(BANNER):
            return self.out.write(text)
        self.held = (self.held or "") + text
        if self.held.count("\n") > 1 and self.held.endswith("=\n"):  # the closing rule: the banner is whole
            self.release()
        return len(text)

    def release(self) -> None:
        banner, self.held = self.held or "", None
        if any(f"name='{flag}'" in banner for flag in self.user_flags):
            self.out.write(banner)

    def __getattr__(self, name: str):
        return getattr(self.out, name)


@contextlib.contextmanager
def _flags_banner_dropped(environ: Mapping[str, str]):
    """Paddle's init_parallel_env lists, in every worker's log, the FLAGS_* whose values differ from their
    defaults; Paddle 3 sets one of them itself (FLAGS_enable_pir_in_executor), so the banner came with every run.
    It is kept when it names a flag the user set (a FLAGS_* variable other than the launcher's FLAGS_selected_*)."""
    user = {k for k in environ if k.startswith("FLAGS_") and not k.startswith("FLAGS_selected_")}
    real = sys.stderr
    sys.stderr = filtered = _BannerFilter(real, user)
    try:
        yield
    finally:
        sys.stderr = real
        if filtered.held is not None:  # cut short: show what there was
            real.write(filtered.held)


def convert_sync_bn(model: paddle.nn.Layer, env: DistEnv) -> paddle.nn.Layer:
    """Batch norm layers become SyncBatchNorm (same parameters), normalising over the whole global batch.

    One worker already sees the whole batch, so there is nothing to convert. GPUs only: CPU workers have
    network/batchnorm.py.
    """
    return paddle.nn.SyncBatchNorm.convert_sync_batchnorm(model) if env.world_size > 1 else model


def plain_batch_norm(model: paddle.nn.Layer, plain: paddle.nn.Layer) -> paddle.nn.Layer:
    """model for export: when convert_sync_bn gave it SyncBatchNorm layers, plain (the same network freshly built,
    with plain batch norm) holding its weights and statistics, since sync_batch_norm has GPU kernels only and a
    CPU predictor could not run it. A model without SyncBatchNorm is returned as it is."""
    if not any(isinstance(layer, paddle.nn.SyncBatchNorm) for layer in model.sublayers()):
        return model
    plain.set_state_dict(model.state_dict())  # the conversion keeps every name: the keys match one to one
    return plain


# Gradient buckets in MB for NCCL. Smaller than Paddle's defaults (25, 1) so that the all-reduce of the last layers'
# gradients starts while backward still runs through the first ones; the reasoning is in docs/gpu.md.
COMM_BUFFER_MB, LAST_COMM_BUFFER_MB = 2, 0.25


def buckets(model: paddle.nn.Layer, env: DistEnv) -> tuple[float, float]:
    """DataParallel's (comm_buffer_size, last_comm_buffer_size). Gloo runs each all-reduce in the calling thread,
    to its end, so a bucket's all-reduce overlaps nothing on the CPU and only adds a point mid-backward where the
    ranks wait for each other: there, one bucket that holds every gradient (docs/performance.md)."""
    if env.backend != "gloo":
        return COMM_BUFFER_MB, LAST_COMM_BUFFER_MB
    size = sum(math.prod(p.shape) * p.element_size() for p in model.parameters() if not p.stop_gradient)
    whole = float(math.ceil(size / 2**20) + 1)
    return whole, whole


def wrap(model: paddle.nn.Layer, env: DistEnv, cpu_sums: str = "shared-memory", width: int = 4) -> paddle.nn.Layer:
    """DataParallel for more than one worker: it broadcasts rank 0's weights, then averages gradients. On CPU
    within one machine (cpu_sums "shared-memory") the sums go through shared memory instead (open_local_sum), for
    a gradient of width bytes a value; DataParallel then never all-reduces (gradient_sync, average_gradients)."""
    if env.world_size == 1:
        return model
    comm, last = buckets(model, env)
    wrapped = paddle.DataParallel(model, comm_buffer_size=comm, last_comm_buffer_size=last)
    if env.backend == "gloo" and env.carrier.local is None:
        trainable = sum(math.prod(p.shape) for p in model.parameters() if not p.stop_gradient)
        open_local_sum(env, cpu_sums, max(trainable * width, SMALL_SUM_BYTES))
    return wrapped


SMALL_SUM_BYTES = 64 * 1024  # the least a slot holds: the step's and epoch's small sums, an evaluation's counts


def open_local_sum(env: DistEnv, cpu_sums: str, capacity: int) -> None:
    """local_sum.open_on for this job: every rank must call it (it gathers over gloo)."""
    local_sum.open_on(env.carrier, env.rank, env.world_size, env.local_size, cpu_sums, capacity, _gather(env))


def _gather(env: DistEnv) -> Callable[[object], list]:
    return lambda obj: gather_objects(obj, env)


def gradient_sync(model: paddle.nn.Layer, env: DistEnv, sync: bool):
    """A context for one backward pass: DataParallel all-reduces its gradients (sync, where shared memory does not
    carry the sums) or keeps them local (DataParallel.no_sync)."""
    if not isinstance(model, paddle.DataParallel) or (sync and env.carrier.local is None):
        return contextlib.nullcontext()
    return model.no_sync()


def average_gradients(model: paddle.nn.Layer, env: DistEnv) -> None:
    """Where shared memory carries the sums: every gradient averaged over the workers in place
    (local_sum.average). Elsewhere DataParallel did it in the backward pass: nothing to do."""
    if env.carrier.local is None or not isinstance(model, paddle.DataParallel):
        return
    grads = [p.grad for p in model.parameters() if not p.stop_gradient and p.grad is not None]
    local_sum.average(env.carrier.local, grads, env.world_size)


def sum_over_workers(model: paddle.nn.Layer, env: DistEnv) -> Callable[[paddle.Tensor], None]:
    """What sums a tensor over the workers in place: through shared memory or an all-reduce where DataParallel
    wraps the model (more than one worker), else nothing."""
    if not isinstance(model, paddle.DataParallel):
        return lambda t: None
    return lambda t: _sum_in_place(t, env)


def sum_each_over_workers(model: paddle.nn.Layer, env: DistEnv) -> SumEach | None:
    """What sums each of a list of tensors over the workers in place, where DataParallel wraps the model (more
    than one worker), else None."""
    if not isinstance(model, paddle.DataParallel):
        return None
    return SumEach(env)


class SumEach:
    """Called with a list of tensors, sums each over the workers in place: through shared memory the sums land in
    the tensors' own memory; elsewhere they travel as one buffer, copied back."""

    def __init__(self, env: DistEnv) -> None:
        self.env = env

    def __call__(self, tensors: list[paddle.Tensor]) -> None:
        local = self.env.carrier.local
        if local is not None and local.fits(sum(t.size * t.element_size() for t in tensors)):
            views = [local_sum.numpy_view(t) for t in tensors]
            if all(v is not None for v in views):
                local.sum_into(views)
                return
        flat = paddle.concat([t.reshape([-1]) for t in tensors])
        _sum_in_place(flat, self.env)
        local_sum.write_back(tensors, flat.numpy())

    def rounded(self, sums: list[paddle.Tensor], targets: list[paddle.Tensor]) -> bool:
        """local_sum.sum_rounded over the job's shared memory: float64 sums into float32 targets, or False."""
        return local_sum.sum_rounded(self.env.carrier.local, sums, targets)


def _sum_in_place(t: paddle.Tensor, env: DistEnv) -> None:
    local = env.carrier.local
    if local is None or not local.fits(t.size * t.element_size()):
        dist.all_reduce(t)
    elif (view := local_sum.numpy_view(t)) is not None:
        local.sum_into([view])
    else:
        paddle.assign(paddle.to_tensor(local.sum(t.numpy())), output=t)


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
    for t in _running_statistics(model):
        groups.setdefault(str(t.dtype), []).append(t)
    for group in groups.values():
        _average_in_place(group, env)


def _running_statistics(model: paddle.nn.Layer) -> list[paddle.Tensor]:
    """The floating-point state that training does not update by gradients: batch norm's running mean and
    variance (and any frozen weights)."""
    net = unwrap(model)
    state = [p for p in net.parameters() if p.stop_gradient] + list(net.buffers())
    return [t for t in state if t.is_floating_point()]


def gather_running_statistics(model: paddle.nn.Layer, env: DistEnv) -> list[np.ndarray]:
    """Every rank's running statistics (batch norm's, _running_statistics), one flat float64 vector per rank.

    The checkpoint of a stop (SIGTERM) keeps them all instead of their average, so a resumed run continues each
    rank's statistics exactly where they were: averaging at a step the uninterrupted run does not average at
    would change the final statistics in the last bits. float64 holds float32, float16 and bfloat16 exactly.
    """
    tensors = _running_statistics(model)
    if not tensors:
        return []
    flat = paddle.concat([t.astype("float64").reshape([-1]) for t in tensors])
    if env.world_size == 1:
        return [flat.numpy()]
    gathered: list[paddle.Tensor] = []
    dist.all_gather(gathered, flat)
    return [t.numpy() for t in gathered]


def set_running_statistics(model: paddle.nn.Layer, by_rank: list[np.ndarray], env: DistEnv) -> None:
    """Restore this rank's entry of gather_running_statistics (their mean when the world size changed)."""
    tensors = _running_statistics(model)
    if not by_rank or not tensors:
        return
    flat = by_rank[env.rank] if len(by_rank) == env.world_size else np.mean(by_rank, axis=0)
    offset = 0
    for t in tensors:
        n = int(t.size)
        value = paddle.to_tensor(flat[offset : offset + n].reshape(t.shape)).astype(t.dtype)
        paddle.assign(value, output=t)
        offset += n


def gather_objects(obj: object, env: DistEnv) -> list:
    """obj from every rank, in rank order: pickled, sent as bytes, read back by the checkpoint's restricted
    unpickler (so only what a checkpoint may hold: RNG states, arrays, plain values). Every rank must call it."""
    data = pickle.dumps(obj)
    if env.world_size == 1:
        return [safeload.loads(data, safeload.CHECKPOINT)]
    lengths: list[paddle.Tensor] = []
    dist.all_gather(lengths, paddle.to_tensor([len(data)], dtype="int64"))
    sizes = [int(t.numpy()[0]) for t in lengths]
    padded = np.zeros(max(sizes), dtype=np.uint8)  # all_gather needs one shape on every rank
    padded[: len(data)] = np.frombuffer(data, dtype=np.uint8)
    gathered: list[paddle.Tensor] = []
    dist.all_gather(gathered, paddle.to_tensor(padded))
    return [safeload.loads(t.numpy()[:n].tobytes(), safeload.CHECKPOINT) for t, n in zip(gathered, sizes)]


def _average_in_place(tensors: list[paddle.Tensor], env: DistEnv) -> None:
    """Pack same-dtype tensors into one buffer, scale by 1/world size, sum over workers, copy back."""
    flat = paddle.concat([t.reshape([-1]) for t in tensors])
    flat.scale_(1.0 / env.world_size)
    _sum_in_place(flat, env)
    local_sum.write_back(tensors, flat.numpy())


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
    local = env.carrier.local
    if local is not None and local.fits(values.nbytes):
        return local.sum(values) if op == dist.ReduceOp.SUM else local.max(values)
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


class Counters:
    """A TCP key-value store's counters, one call at a time. Paddle's client is one connection that does not lock:
    two threads adding at once read each other's replies or reset the connection (3 threads adding to their own
    keys: a count jumped from 3 to 768, then "Connection reset by peer"). A caller that must not hang with a store
    that stops answering calls from a thread it can give up on; the lock makes the others wait behind it."""

    def __init__(self, store):
        self._store = store
        self._lock = threading.Lock()

    def add(self, key: str, n: int) -> int:
        """Add n to the counter (0 reads it); its new value."""
        with self._lock:
            return self._store.add(key, n)


_job_counters: Counters | None = None


def job_store() -> Counters:
    """The job-wide TCP key-value store that init_parallel_env() set up, shared by every thread of this process."""
    global _job_counters
    if _job_counters is None:
        _job_counters = Counters(paddle.base.core.create_or_get_global_tcp_store())
    return _job_counters


def barrier(env: DistEnv) -> None:
    if env.world_size > 1:
        dist.barrier()

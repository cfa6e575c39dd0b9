"""The distributed environment: every call into paddle.distributed lives here."""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import paddle
import paddle.distributed as dist

from . import preflight, safeload

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


def gpu_index(device: str) -> int | None:
    """N of "gpu:N" (among the visible GPUs, as FLAGS_selected_gpus counts them), None for "cpu"."""
    return int(device.split(":")[1]) if device.startswith("gpu:") else None


def _parent_args(ppid: int) -> list[str]:
    """The command line of this worker's paddle.distributed.launch, or [] when the parent is something else."""
    try:
        with open(f"/proc/{ppid}/cmdline", "rb") as f:
            args = f.read().decode(errors="replace").split("\0")
    except OSError:
        return []
    return args if any("paddle.distributed.launch" in a for a in args) else []


def _gpu_flag(args: list[str]) -> str | None:
    """The GPU flag in a launcher's command line, if any ("--selected_gpus=0,1,2,3")."""
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
    flag = _gpu_flag(_parent_args(os.getppid()))
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
        f"start at most {visible_gpus} (list at most {visible_gpus} of the visible GPUs' labels in --gpus, the "
        "labels of CUDA_VISIBLE_DEVICES where it is set) or check CUDA_VISIBLE_DEVICES"
    )


def _env_int(*names: str, default: int, environ: Mapping[str, str] | None = None) -> int:
    environ = os.environ if environ is None else environ
    for name in names:
        value = environ.get(name, "")
        if value.strip():
            return int(value)
    return default


def launched_workers() -> int:
    """The job's world size as the launcher set it (1 without a launcher or with an unreadable value)."""
    try:
        return _env_int("PADDLE_TRAINERS_NUM", "PADDLE_GLOBAL_SIZE", default=1)
    except ValueError:
        return 1


@dataclass(frozen=True)
class Layout:
    """Where a worker stands in its job, as the launcher's environment variables say."""

    world: int
    local_rank: int
    local_size: int  # workers on this node


def _host(endpoint: str) -> str:
    return endpoint.strip().rsplit(":", 1)[0]


def launch_layout(environ: Mapping[str, str]) -> Layout:
    """The layout from a worker's environment, under either launcher or none.

    paddle.distributed.launch sets PADDLE_LOCAL_SIZE. The legacy fleet.launch (--selected_gpus without --master)
    does not, and its PADDLE_TRAINER_ENDPOINTS lists the workers of every machine: this node's are those on the
    host of PADDLE_CURRENT_ENDPOINT. ParallelEnv().local_rank is the global rank; the launchers export the rank
    within the node as PADDLE_LOCAL_RANK or PADDLE_RANK_IN_NODE.
    """
    world = _env_int("PADDLE_TRAINERS_NUM", "PADDLE_GLOBAL_SIZE", default=1, environ=environ)
    local_rank = _env_int("PADDLE_LOCAL_RANK", "PADDLE_RANK_IN_NODE", default=0, environ=environ)
    endpoints = [e for e in environ.get("PADDLE_TRAINER_ENDPOINTS", "").split(",") if e.strip()]
    current = environ.get("PADDLE_CURRENT_ENDPOINT", "")
    on_node = [e for e in endpoints if _host(e) == _host(current)] if current.strip() else endpoints
    local_size = _env_int("PADDLE_LOCAL_SIZE", default=max(len(on_node), 1), environ=environ)
    return Layout(world, local_rank, min(local_size, world))


def gpu_request_problem(flag: str | None, launcher_args: list[str], local_size: int) -> str | None:
    """Why the workers started on this node differ from the GPUs the launcher was asked for, or None.

    With --master, Paddle's launcher leaves legacy mode before it reads --selected_gpus (Context.is_legacy_mode
    in paddle/distributed/launch/context/__init__.py): the flag is dropped and every visible GPU gets a worker.
    """
    if flag is None:
        return None
    asked = len([x for x in re.split(r"[=\s,]+", flag)[1:] if x])
    if asked == local_size:
        return None
    master = any(a == "--master" or a.startswith("--master=") for a in launcher_args)
    why = (
        "with --master, Paddle's launcher ignores --selected_gpus and starts a worker on every visible GPU; "
        f"pass --gpus {','.join(str(i) for i in range(max(asked, 1)))} instead"
        if master and flag.startswith("--selected_gpus")
        else "check the launcher's flags and CUDA_VISIBLE_DEVICES"
    )
    return f"the launcher was given {flag} ({asked} GPU(s)) but started {local_size} worker(s) on this node: {why}"


def setup() -> DistEnv:
    """Check the launch, join the process group (for more than one worker) and pick the device."""
    check_gpu_request()
    layout = launch_layout(os.environ)
    world, local_rank, local_size = layout.world, layout.local_rank, layout.local_size
    use_gpu = paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0
    if use_gpu:
        args = _parent_args(os.getppid())
        problem = gpu_request_problem(_gpu_flag(args), args, local_size) or gpu_shortfall(
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


def sync_bn_problem(env: DistEnv) -> str | None:
    """Why --sync-bn cannot be honoured here, or None."""
    if env.device == "cpu" and env.world_size > 1:
        return (
            "--sync-bn: Paddle has no CPU kernel for SyncBatchNorm (sync_batch_norm), so it works on GPUs only; "
            "drop --sync-bn on CPU (each worker then normalises its own shard of the batch)"
        )
    return None


def amp_problem(amp: str, device: str, capability: tuple[int, int] | None) -> str | None:
    """Why --amp cannot be honoured on this device, or None. capability: the GPU's (major, minor), None on CPU.

    Below these compute capabilities paddle.amp.auto_cast turns itself off with only a UserWarning and the run
    is float32 (_is_gpu_float16_supported and _is_gpu_bfloat16_supported in paddle/amp/auto_cast.py).
    """
    if amp != "off" and device == "cpu":
        # on CPU auto_cast leaves the network's outputs in float32 for bf16 too (tests/test_recipes.py checks it)
        return (
            f"--amp {amp} needs a GPU: on CPU Paddle's auto_cast leaves the network in float32, so the run "
            "would be a float32 run under an amp label; drop --amp (or use --amp off) on CPU"
        )
    if capability is None or amp == "off":
        return None
    need = {"fp16": (7, 0), "bf16": (8, 0)}[amp]
    if tuple(capability) >= need:
        return None
    return (
        f"--amp {amp} needs a GPU of compute capability {need[0]}.{need[1]} or higher, and {device} has "
        f"{capability[0]}.{capability[1]}: Paddle would silently train in float32; "
        + ("use --amp fp16 or --amp off" if amp == "bf16" and tuple(capability) >= (7, 0) else "use --amp off")
    )


def device_capability(env: DistEnv) -> tuple[int, int] | None:
    """This worker's GPU's compute capability, None on CPU."""
    if not env.device.startswith("gpu"):
        return None
    return tuple(paddle.device.cuda.get_device_capability(env.device))


def convert_sync_bn(model: paddle.nn.Layer, env: DistEnv) -> paddle.nn.Layer:
    """Batch norm layers become SyncBatchNorm (same parameters), normalising over the whole global batch.

    One worker already sees the whole batch, so there is nothing to convert. Check sync_bn_problem first.
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

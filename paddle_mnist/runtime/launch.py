"""How this worker was started and what its device can run: the launcher's layout and GPU flags, and the
settings a device cannot honour, all checked before any process group exists.

Run as a program, it is Paddle's launcher with a check first:

    python -m paddle_mnist.launch --nnodes 2 --master 10.0.0.1:8090 --host 10.0.0.2 ... train.py ...

takes paddle.distributed.launch's arguments unchanged, stops at once with one line where this machine would
leave the job hanging or failing (preflight.launch_problems: a hostname on loopback without --host or
GLOO_SOCKET_IFNAME), and otherwise becomes `python -m paddle.distributed.launch` with the same arguments.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

import paddle

GPU_FLAG = re.compile(r"^--(selected_gpus|gpus|devices)(=.*)?$")


class LaunchError(RuntimeError):
    """The job was launched in a way this build of Paddle cannot honour."""


def gpu_index(device: str) -> int | None:
    """N of "gpu:N" (among the visible GPUs, as FLAGS_selected_gpus counts them), None for "cpu"."""
    return int(device.split(":")[1]) if device.startswith("gpu:") else None


def parent_args(ppid: int) -> list[str]:
    """The command line of this worker's paddle.distributed.launch, or [] when the parent is something else."""
    try:
        with open(f"/proc/{ppid}/cmdline", "rb") as f:
            args = f.read().decode(errors="replace").split("\0")
    except OSError:
        return []
    return args if any("paddle.distributed.launch" in a for a in args) else []


def gpu_flag(args: list[str]) -> str | None:
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
    flag = gpu_flag(parent_args(os.getppid()))
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


def no_kernel_problem(error: BaseException, name: str, capability: tuple[int, int] | None) -> str | None:
    """The one-line message for a Paddle build that has no GPU code for this card, or None for other errors.

    PyPI's paddlepaddle-gpu 2.6.2 carries machine code for compute capability 6.1 to 8.6 and no PTX, so on a 9.0
    card (H100, H200) its first kernel fails with CUDA error 209 (docs/results.md, the GPU section)."""
    text = str(error)
    if "no kernel image" not in text and "error(209)" not in text:
        return None
    card = f"{name} (compute capability {capability[0]}.{capability[1]})" if capability else name
    return (
        f"this Paddle build ({paddle.__version__}) has no GPU code for {card}: CUDA answered 'no kernel image'; "
        "install a paddlepaddle-gpu build that lists this card's architecture, from Paddle's own package index "
        "(https://www.paddlepaddle.org.cn/install, CUDA 12 builds include 9.0), or train on the CPU with "
        "CUDA_VISIBLE_DEVICES= set empty"
    )


def check_gpu_kernels(device: str, probe=None, card=None) -> None:
    """Start one tiny kernel on `device` now, so that a build without code for this card stops at once with
    one line instead of a C++ trace at the first layer. probe (the kernel) and card (the card's name and compute
    capability) are Paddle's unless given."""
    try:
        (probe or (lambda: (paddle.ones([2]) + 1).numpy()))()
    except Exception as error:  # Paddle raises OSError on 2.6 and RuntimeError kinds on 3.x
        name, capability = (card or (lambda d: (paddle.device.cuda.get_device_name(d), device_capability(d))))(device)
        problem = no_kernel_problem(error, name, capability)
        if problem:
            raise LaunchError(problem) from error
        raise


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


def device_capability(device: str) -> tuple[int, int] | None:
    """The compute capability of a GPU ("gpu:N"), None for "cpu"."""
    if not device.startswith("gpu"):
        return None
    return tuple(paddle.device.cuda.get_device_capability(device))


HELP = """usage: python -m paddle_mnist.launch [LAUNCHER OPTIONS] train.py [OPTIONS]

Paddle's launcher with a check first: it takes the arguments of
python -m paddle.distributed.launch unchanged and becomes that launcher with them.
For a job on several machines (--nnodes 2 or more, and a --master neither on
loopback nor etcd://), it first checks what would leave this machine hanging or
failing: --master is IP:PORT; --host, if given, is an address of this machine;
without --host, the hostname resolves neither to loopback nor, on the master's
machine, to another address than --master's; and for CPU workers (no --gpus,
--devices or --selected_gpus), GLOO_SOCKET_IFNAME names an interface of this
machine or, unset, the hostname's address, which gloo advertises, is not loopback.
Each problem is one line on stderr with its fix; then it exits with status 1 and
starts no worker. python -m paddle_mnist.preflight checks a machine in full.

Paddle's launcher's options (python -m paddle.distributed.launch --help):
"""


def asks_for_help(argv: list[str]) -> bool:
    """-h or --help among the launcher's options, before the training script (whose own flags follow it)."""
    for arg in argv:
        if arg.endswith(".py") and not arg.startswith("-"):
            return False
        if arg in ("-h", "--help"):
            return True
    return False


def main(argv: list[str] | None = None) -> int:
    """Check this machine for the launcher's command line, then replace this process with Paddle's launcher."""
    import sys

    from paddle_mnist.runtime import preflight

    argv = sys.argv[1:] if argv is None else argv
    if asks_for_help(argv):  # this command's own paragraph, then Paddle's launcher prints its options
        print(HELP, flush=True)
        os.execv(sys.executable, [sys.executable, "-m", "paddle.distributed.launch", "--help"])
    problems = preflight.launch_problems(argv, os.environ)
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr, flush=True)
    if problems:
        print(
            "paddle_mnist.launch: paddle.distributed.launch not started (python -m paddle_mnist.preflight checks "
            "a machine in full)",
            file=sys.stderr,
        )
        return 1
    os.execv(sys.executable, [sys.executable, "-m", "paddle.distributed.launch", *argv])
    return 0  # not reached: execv replaced this process


if __name__ == "__main__":
    raise SystemExit(main())

"""The run's configuration from the command line (and its --config file) or from Python, and train(): a run in the
calling process, for a notebook or a script."""

from __future__ import annotations

import argparse
import contextlib
import json
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import paddle

from paddle_mnist.config import Config, ConfigError, parse_args
from paddle_mnist.datasets import augment
from paddle_mnist.files import dashboard, options, report
from paddle_mnist.files.log import get_logger
from paddle_mnist.ops import onednn
from paddle_mnist.runtime import cpu, distributed
from paddle_mnist.runtime.launch import LaunchError
from paddle_mnist.runtime.lock import RunLock
from paddle_mnist.runtime.preempt import Preempted, StopSignals
from paddle_mnist.training import outputs
from paddle_mnist.training.trainer import train_and_evaluate


def configure(argv: Sequence[str] | None = None, values: dict[str, object] | None = None) -> Config:
    """The run's configuration, every option checked before any worker starts: the command line argv (None:
    sys.argv's) over its --config file, or train()'s options (values, already checked by options.check). Then the
    checks that ask a room above the configuration (the mirror policy for --tta, the dashboard's package)."""
    if values is None:
        pre = argparse.ArgumentParser(add_help=False)
        pre.add_argument("--config")
        path = pre.parse_known_args(argv)[0].config
        values = options.read(path) if path else {}
        cfg = parse_args(None if argv is None else list(argv), values)
    else:
        cfg = parse_args([], values)
    if cfg.tta and (problem := augment.tta_problem(cfg.dataset, cfg.flip)):
        raise ConfigError(problem)
    if cfg.visualdl and (problem := dashboard.missing()):
        raise ConfigError(problem)
    return cfg


@dataclass(frozen=True)
class Result:
    """What train() returns: the test score, the report's figures and where the run's files are."""

    output_dir: Path
    test_acc: float
    test_loss: float
    results: dict  # OUTPUT_DIR/results.json: steps, world size, wall time, peak memory, the best epoch, ...
    report: dict  # OUTPUT_DIR/report/report.json: accuracy by class, the most confused pairs, top-k
    weights: Path  # the last weights, model.pdparams
    best_weights: Path | None  # the best validation epoch's, model_best.pdparams (None: the run never evaluated)
    inference: Path  # the exported model's prefix, for python -m paddle_mnist.predict --model

    @classmethod
    def of(cls, out: Path, result: dict) -> Result:
        best = out / outputs.BEST_WEIGHTS
        return cls(
            output_dir=out,
            test_acc=result["test_acc"],
            test_loss=result["test_loss"],
            results=result,
            report=json.loads((out / report.FOLDER / report.REPORT_FILE).read_text()),
            weights=out / outputs.WEIGHTS,
            best_weights=best if best.is_file() else None,
            inference=out / "inference",
        )


Callback = Callable[[int, dict], object]


def _epoch_hooks(callbacks: Iterable[object]) -> list[Callback]:
    """Each callback's on_epoch_end (a plain function is one); TypeError for anything else, before training."""
    hooks = []
    for callback in callbacks:
        hook = getattr(callback, "on_epoch_end", None) or (callback if callable(callback) else None)
        if hook is None:
            raise TypeError(f"a callback has on_epoch_end(epoch, metrics) or is such a function; got {callback!r}")
        hooks.append(hook)
    return hooks


def train(*, callbacks: Iterable[object] = (), **values: object) -> Result:
    """Train in this process with the trainer's options as keyword arguments (the flags' names with underscores:
    train(dataset="folder", data_dir="photos", epochs=3, output_dir="run")), as python train.py would with the
    same flags, to the same weights; a run under paddle.distributed.launch trains on every worker as the command
    does. Each callback's on_epoch_end(epoch, metrics) runs on every worker after each epoch's checkpoint, with the
    epoch (from 1) and its metrics.jsonl row; a true return from any of them ends the run there, with the test
    score, the weights and the export, and resume="auto" later trains on from that epoch.

    Raises ConfigError (paddle_mnist.config) with the command line's one-line message for a bad option or
    combination; the trainer's other errors (DataError, Diverged, LearnedNothing, ...) as themselves."""
    hooks = _epoch_hooks(callbacks)
    cfg = configure(values=options.check(values, "train()"))
    cpu.prefer_fast_kernels()  # no effect once MKL has started (a notebook that trained before): then as it is
    try:
        convolutions = onednn.prepare(cfg.conv_backend)
        env = distributed.setup()
    except onednn.Unavailable as e:
        raise ConfigError(f"conv_backend onednn: {e}; or pass conv_backend='auto'") from None
    except LaunchError as e:
        raise ConfigError(str(e)) from None
    log = get_logger(env.rank, env.world_size)
    lock = RunLock(cfg.output_dir)
    command = f"paddle_mnist.train({_arguments(values)})"
    stop = StopSignals(log)
    # Ctrl-C (and SIGTERM) stop at the next step every rank agrees on, after a checkpoint, as on the command line;
    # signals can be taken over only in the main thread
    main = threading.current_thread() is threading.main_thread()
    try:
        # a fresh name for every layer and parameter, as in a new process: the checkpoint's optimizer state is keyed
        # by them, and a second run in one process would otherwise name its first convolution conv2d_4
        with stop.installed() if main else contextlib.nullcontext(), paddle.utils.unique_name.guard():
            result = train_and_evaluate(cfg, env, log, lock, stop, convolutions, hooks=hooks, command=command)
    except Preempted as e:  # its text ends with the command line to resume with, which train() has not
        said = str(e).split("; continue with:")[0]
        raise Preempted(e.signum, f"{said}; continue with train(the same options, resume='auto')", e.took) from None
    finally:
        lock.release()
    return Result.of(Path(cfg.output_dir), result)


def _arguments(values: dict[str, object]) -> str:
    return ", ".join(f"{key}={value!r}" for key, value in values.items())

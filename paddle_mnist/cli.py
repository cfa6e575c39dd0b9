"""The command line: parse the flags, set up the worker, run the trainer, and turn what ended it into an exit
status and one line."""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import traceback

from paddle_mnist.config import Config, ConfigError
from paddle_mnist.datasets import data
from paddle_mnist.files import checkpoint, events
from paddle_mnist.files.log import get_logger
from paddle_mnist.ops import onednn
from paddle_mnist.runtime import cpu, distributed, launch, waiting
from paddle_mnist.runtime.launch import LaunchError
from paddle_mnist.runtime.local_sum import SumTimeout
from paddle_mnist.runtime.lock import RunLock
from paddle_mnist.runtime.preempt import Preempted, StopSignals, exit_code, signal_name
from paddle_mnist.training import chance, engine
from paddle_mnist.training.api import configure
from paddle_mnist.training.outputs import WriteFailed
from paddle_mnist.training.trainer import ExportFailed, train_and_evaluate


def _point_to_summary(log: logging.Logger) -> None:
    log_dir = os.environ.get("PADDLE_LOG_DIR")  # set by paddle.distributed.launch
    if log_dir:
        log.info(f"every worker's status and the first failure: python -m paddle_mnist.logs {log_dir}")


def main(argv: list[str] | None = None) -> int:
    code = _run_command(argv)
    if code and launch.launched_workers() > 1:
        # The launcher reports the first worker's exit status and SIGTERMs the others as soon as one ends. Python
        # puts the default action back for signals it handles when it starts shutting down, so a worker still
        # tearing Paddle down (a second or more on a busy machine) would die of that SIGTERM, and the job would end
        # with -15 rather than this status. An ignored signal stays ignored through the shutdown. Ending at once
        # (os._exit) is no cure: a peer still joining the process group then fails before logging its own error.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return code


def parse_command(argv: list[str] | None = None) -> Config:
    """The command line (over its --config file) as a Config, every flag checked on every rank before any worker
    starts (api.configure)."""
    return configure(argv)


def _run_command(argv: list[str] | None) -> int:
    cpu.prefer_fast_kernels()  # first: MKL reads its settings at the first matmul or convolution
    cpu.steady_malloc()  # before the data and the network are allocated
    # A worker killed by SIGBUS, SIGSEGV, SIGFPE or SIGABRT writes "Fatal Python error: <signal>" and every
    # thread's Python stack to its log, then Paddle's handler (installed by its import, which this one hands on to)
    # prints the C++ side. Paddle's handler is not async-signal-safe (it allocates and unwinds the stack), and a
    # worker has been seen to hang in it without printing a line: then this line is all the log says of the signal.
    faulthandler.enable(all_threads=True)
    stop = StopSignals().install()  # then take SIGTERM/SIGINT over: Paddle's import installed handlers that abort
    stop.watch_launcher()  # and a SIGTERM if the launcher dies: its workers run in sessions of their own
    try:
        cfg = parse_command(argv)
        # before the process group: a first build (seconds to a minute) must not hold peers in a collective
        convolutions = onednn.prepare(cfg.conv_backend)
        env = distributed.setup()
    except (ConfigError, LaunchError) as e:
        return _refused(str(e))
    except onednn.Unavailable as e:
        return _refused(f"--conv-backend onednn: {e}; or pass --conv-backend auto")
    log = get_logger(env.rank, env.world_size)
    stop.log = log
    lock = RunLock(cfg.output_dir)
    stop.on_abort.append(lock.release)
    try:
        train_and_evaluate(cfg, env, log, lock, stop, convolutions)
    except Preempted as e:
        log.warning(str(e))
        cause = events.SIGNAL_ECHO if e.took is not None else events.SIGNAL
        events.stop("signalled", str(e), cause, signal=signal_name(e.signum), took=e.took)
        return exit_code(e.signum)
    except (WriteFailed, waiting.PeerLost) as e:
        log.error(f"error: {e}")
        return _failed(log, 1, str(e))
    except SumTimeout as e:
        message = (
            f"{e}; ending this worker. Rerun the same command with --resume auto to continue from the last checkpoint"
        )
        log.error(f"error: {message}")
        if e.gone:  # the echo of that rank's end: the reader looks at its log first
            events.stop("error", message, events.PEER_GONE)
        else:
            events.stop("error", message, events.WATCHDOG, quiet=e.ranks)
        _point_to_summary(log)
        return 1
    except (ConfigError, data.DataError, engine.Diverged, chance.LearnedNothing, checkpoint.CheckpointError) as e:
        log.error(f"error: {e}")
        return _failed(log, 2, str(e), CAUSES.get(type(e)))
    except ExportFailed as e:
        log.error(f"error: {e}", exc_info=e.__cause__)
        return _failed(log, 1, str(e), trace=e.__cause__)
    except Exception as e:
        log.exception("error: the run failed")
        return _failed(log, 1, "the run failed", trace=e)
    finally:
        lock.release()
    events.stop("finished", "finished")
    return 0


# the trainer's own failures that python -m paddle_mnist.logs names (files/events.py)
CAUSES = {engine.Diverged: events.DIVERGED, chance.LearnedNothing: events.LEARNED_NOTHING}


def _refused(message: str) -> int:
    """Before the log exists: the one line on stderr."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    events.stop("error", message)
    return 2


def _failed(
    log: logging.Logger, code: int, message: str, cause: str | None = None, trace: BaseException | None = None
) -> int:
    """After the error line: record the stop (a crash, with its traceback), point to the summary; the exit status."""
    if trace is None:
        events.stop("error", message, cause)
    else:
        events.stop("crashed", "".join(traceback.format_exception(type(trace), trace, trace.__traceback__)).strip())
    _point_to_summary(log)
    return code

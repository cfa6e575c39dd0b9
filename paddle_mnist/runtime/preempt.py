"""Preemption: SIGTERM and SIGINT end the job at a step every rank agrees on, after a checkpoint."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shlex
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from paddle_mnist.files import events
from paddle_mnist.runtime.orphan import Launcher

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# Paddle's launcher passes SIGTERM on up to three times, 0.2 s apart (further apart on a loaded machine: a run
# was seen with them more than 1 s apart), and Ctrl-C can reach both the launcher and the workers: signals this
# close together are one request. A later one means "now".
SAME_REQUEST_S = 2.0


def exit_code(signum: int) -> int:
    """128 + the signal number: what shells and schedulers read as "ended by this signal"."""
    return 128 + signum


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class Preempted(Exception):
    """Every rank agreed to stop after a signal; the message is the one line each worker logs."""

    def __init__(self, signum: int, message: str, took: int | None = None):
        super().__init__(message)
        self.signum = signum
        self.took = took  # the rank that took the signal, where another did: this rank stops with it


def _ignore(signum, frame) -> None:
    """Python's handler does nothing: the C-level handler has already written the signal to the wakeup fd."""


class StopSignals:
    """Takes SIGTERM and SIGINT over from Paddle (which aborts the process on them) and records the first.

    The C-level part of Python's signal handling writes each signal's number to a socket (set_wakeup_fd) even
    while the main thread waits inside a C++ collective; a thread reads it at once. So the first signal only
    sets `signum`, which the training loop reads at its next step boundary, and a second one ends the process
    immediately, wherever the main thread is.
    """

    def __init__(self, log: logging.Logger | None = None):
        self.signum = 0
        self.log = log
        self.on_abort: list[Callable[[], None]] = []
        self.launcher: Launcher | None = None
        self._first_at: float | None = None
        self._explained = False
        self._reader, self._writer = socket.socketpair()
        self._writer.setblocking(False)

    def install(self) -> StopSignals:
        """Call from the main thread, after importing paddle (its import installs the handlers this replaces)."""
        for s in STOP_SIGNALS:
            signal.signal(s, _ignore)
        signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
        threading.Thread(target=self._listen, name="stop-signals", daemon=True).start()
        return self

    @contextlib.contextmanager
    def installed(self):
        """install() for a while, in a process that goes on afterwards (train() in a notebook): then the handlers
        and wakeup fd found before are put back and the listening thread ends."""
        before = {s: signal.getsignal(s) for s in STOP_SIGNALS}
        self.install()
        try:
            yield self
        finally:
            signal.set_wakeup_fd(-1)
            for s, handler in before.items():
                signal.signal(s, handler)
            self._writer.close()  # the listener reads the end of the stream and returns

    def watch_launcher(self) -> StopSignals:
        """A SIGTERM when the launcher that started this worker dies, logged as such (orphan.py). After install()."""
        launcher = Launcher()
        _launcher_command()  # while the launcher lives: the resume command names it
        if launcher.end_with_it():
            self.launcher = launcher
        return self

    def _listen(self) -> None:
        while received := self._reader.recv(64):
            for signum in received:
                if signum in STOP_SIGNALS:
                    self._received(signum, time.monotonic())

    def _received(self, signum: int, now: float) -> None:
        if self._first_at is None:
            self._first_at, self.signum = now, signum
            if signum == signal.SIGTERM:
                self.explain()
        elif now - self._first_at > SAME_REQUEST_S:
            self._abort(signum)

    def explain(self) -> None:
        """Say once that the launcher went away, when it did: from the signal's own arrival, or when the ranks
        agree to stop, since a peer's SIGTERM from the same death can stop this worker before its own is read."""
        if self.launcher is not None and not self._explained and self.launcher.gone():
            self._explained = True
            message = self.launcher.describe()
            events.emit(events.LAUNCHER_GONE, message=message)
            self._say(message)

    def _say(self, message: str) -> None:
        """One warning line in this worker's log (on stderr before the log exists), written out at once."""
        if self.log is not None:
            self.log.warning(message)
            for handler in self.log.handlers:
                handler.flush()
        else:
            print(message, file=sys.stderr, flush=True)

    def _abort(self, signum: int) -> None:
        message = (
            f"stopped at once by a second {signal_name(signum)} while stopping after {signal_name(self.signum)}; "
            f"the newest complete checkpoint is intact (a write under way is dropped); continue with "
            f"{resume_command()}"
        )
        self._say(message)
        events.stop("signalled", message, events.SIGNAL, signal=signal_name(signum))
        for release in self.on_abort:
            try:
                release()
            except Exception:  # ending now matters more than tidying up
                pass
        os._exit(exit_code(signum))


@functools.cache  # read once, at start-up (watch_launcher): a launcher that died has no command line to read
def _launcher_command() -> list[str] | None:
    """The command line of the paddle.distributed.launch that started this worker, if one did."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            args = f.read().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return None
    return args if "paddle.distributed.launch" in args else None


def resume_command() -> str:
    """The command that started this job, with --resume auto: what a user (or a requeued job) runs to continue."""
    args = _launcher_command() or [Path(sys.executable).name, *sys.argv]
    out, after_resume = [], False
    for arg in args:
        if after_resume and arg in ("no", "yes", "auto"):
            after_resume = False
            continue
        after_resume = arg == "--resume"  # its value, if it has one, follows
        if after_resume:
            continue
        if arg.startswith("--resume="):
            continue
        out.append(arg)
    return shlex.join([*out, "--resume", "auto"])


MEET_INTERVAL_S = 0.25  # how often the ranks agree on a stop: its cost (~1 ms) stays under 0.5% of training time
MAX_STEPS_BETWEEN = 100


class Cadence:
    """At which steps the ranks meet to agree on a stop: about every MEET_INTERVAL_S of training.

    Every rank must reach the same meeting steps, so the next one is planned from a figure all ranks share: the
    slowest rank's seconds per step since the last meeting, carried by the meeting's own all-reduce.
    """

    def __init__(self):
        self.next_step = 0
        self._step = 0
        self._time = time.perf_counter()

    def due(self, step: int) -> bool:
        return step >= self.next_step

    def seconds_per_step(self, step: int) -> float:
        """Since the last meeting; 0 when no step was trained since (at start-up, or twice at one step)."""
        return (time.perf_counter() - self._time) / (step - self._step) if step > self._step else 0.0

    def plan(self, step: int, slowest_per_step: float) -> None:
        self._step, self._time = step, time.perf_counter()
        every = int(MEET_INTERVAL_S / slowest_per_step) if slowest_per_step > 0 else 1  # unknown: meet next step
        self.next_step = step + max(1, min(MAX_STEPS_BETWEEN, every))

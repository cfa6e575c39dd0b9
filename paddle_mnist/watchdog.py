"""No silent hangs: end a worker whose job stopped making progress, naming the ranks that went quiet.

Each worker runs a thread that bumps a heartbeat counter in Paddle's job-wide TCP store every second and
publishes its step. Paddle releases the GIL inside collectives, so the thread keeps running while the
main thread waits in an all-reduce for a worker that was stopped (SIGSTOP), hung or cut off. When the
main thread has made no progress for --collective-timeout seconds, the thread reads every rank's
heartbeat twice, names the ranks whose heartbeat stood still, logs one error line and exits the process,
so the launcher ends the job instead of waiting forever.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

from .distributed import DistEnv, job_store

PREFIX = "paddle_mnist/watchdog"
EXIT_CODE = 3


class Watchdog:
    def __init__(self, env: DistEnv, timeout: float, log: logging.Logger, interval: float = 1.0):
        self.env, self.timeout, self.log, self.interval = env, timeout, log, interval
        self.step = 0
        self._published = 0
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._store = None

    def __enter__(self) -> Watchdog:
        if self.env.world_size > 1 and self.timeout > 0:
            self._store = job_store()
            self._last = time.monotonic()
            self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def progress(self, step: int) -> None:
        """Called by the training loop whenever it gets past a point all workers must reach."""
        self.step = step
        self._last = time.monotonic()

    def _key(self, what: str, rank: int) -> str:
        return f"{PREFIX}/{what}/{rank}"

    def _beats(self) -> list[int]:
        return [self._store.add(self._key("beat", r), 0) for r in range(self.env.world_size)]

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._store.add(self._key("beat", self.env.rank), 1)
            step = self.step
            if step != self._published:  # the store holds counters: publish the step as a difference
                self._store.add(self._key("step", self.env.rank), step - self._published)
                self._published = step
            if time.monotonic() - self._last > self.timeout:
                self._give_up()

    def _give_up(self) -> None:
        before = self._beats()
        time.sleep(3 * self.interval)
        after = self._beats()
        quiet = [r for r in range(self.env.world_size) if after[r] == before[r] and r != self.env.rank]
        steps = {r: self._store.add(self._key("step", r), 0) for r in quiet}
        if quiet:
            who = ", ".join(f"rank {r} (last at step {steps[r]})" for r in quiet)
            cause = f"{who} stopped responding (stopped, hung or cut off)"
        else:
            cause = "every rank is alive but the job is stuck in a collective"
        self.log.error(
            f"error: no progress for {self.timeout:.0f} s (--collective-timeout) at step {self.step}: {cause}; "
            "ending this worker. Rerun the same command with --resume auto to continue from the last checkpoint"
        )
        for handler in self.log.handlers:
            handler.flush()
        sys.stdout.flush()
        os._exit(EXIT_CODE)

"""No silent hangs: end a worker whose job stopped making progress, naming the ranks that went quiet.

Each worker runs a thread that bumps a heartbeat counter in Paddle's job-wide TCP store every second and
publishes its step and a count of its work (steps and evaluated layers). Paddle releases the GIL inside
collectives, so the thread keeps running while the main thread waits in an all-reduce for a worker that was
stopped (SIGSTOP), hung or cut off. When the main thread has made no progress for --collective-timeout seconds, a
second thread reads every rank's counters twice. A rank whose work count moved is only slower (a busy machine
evaluating its shard): this rank waits on for it, up to a limit (a few seconds short of gloo's abort on CPU).
Otherwise it names the ranks whose heartbeat stood still, logs one error line and exits the process, so the
launcher ends the job instead of waiting forever.

The default timeout follows the backend. On CPU, gloo ends a collective that waited 30 s by aborting the process
(SIGABRT, naming no rank), and Paddle gives no way to change that: ProcessGroupGloo.create takes no timeout and
the gloo context it builds keeps gloo's default. So on gloo the watchdog must act first: after 15 s, it names the
quiet rank 18 to 20 s after the last progress. NCCL (GPU) waits without end (PADDLE_PG_TIMEOUT only makes
Paddle's optional task tracer log): there the watchdog is the only end, after 300 s.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time

from paddle_mnist.files import events
from paddle_mnist.runtime.distributed import DistEnv, job_store

PREFIX = "paddle_mnist/watchdog"
EXIT_CODE = 3
GLOO_TIMEOUT_S = 30.0  # gloo's kTimeoutDefault (gloo/context.cc), which Paddle never changes
# Acting takes up to an interval, naming the quiet rank 3 more, and a store that hangs (rank 0 stopped) 3 more
# before rank 0 is blamed: 15 s puts the verdict 18 to 22 s after the last progress, 8 s or more ahead of gloo.
GLOO_DEFAULT_S = 15.0
NCCL_DEFAULT_S = 300.0
ASK_INTERVALS = 3  # how long the verdict may wait for the store before blaming rank 0, which hosts it
GLOO_MARGIN_S = 4.0  # a rank at work is waited for until this long before gloo's abort


def period_for_tests(name: str, default: float) -> float:
    """default, or the seconds in the environment variable name: a period the tests shorten so that they wait for
    what it times in a second or two, not for its product value (tests/README.md lists these variables). A run never
    sets them; read once, when the module that holds the period is imported."""
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"{name}={text!r}: a test's period must be a number of seconds above 0 (default {default:g})")
    return seconds


INTERVAL_S = period_for_tests("PADDLE_MNIST_WATCHDOG_INTERVAL_S", 1.0)  # how often a rank beats and its judge looks


def patience_for(timeout: float, backend: str) -> float:
    """How long a rank waits, in all, for another that is still at work (its work count moving)."""
    return GLOO_TIMEOUT_S - GLOO_MARGIN_S if backend == "gloo" else 2 * timeout


def timeout_for(requested: float | None, backend: str) -> float:
    """--collective-timeout as given, or the backend's default when it was not."""
    if requested is not None:
        return requested
    return GLOO_DEFAULT_S if backend == "gloo" else NCCL_DEFAULT_S


def timeout_problem(timeout: float, backend: str) -> str | None:
    """Why this --collective-timeout cannot name a stalled rank on this backend, or None."""
    if backend != "gloo" or 0 < timeout <= GLOO_DEFAULT_S + 5:
        return None
    asked = "0 (wait forever)" if timeout == 0 else f"{timeout:g}"
    return (
        f"warning: --collective-timeout {asked}: on CPU gloo aborts a collective that waited {GLOO_TIMEOUT_S:.0f} s "
        f"(SIGABRT, naming no rank) and Paddle cannot change that, so a stopped worker ends the job that way "
        f"before the watchdog names it; leave the default ({GLOO_DEFAULT_S:.0f} s) or pass at most "
        f"{GLOO_DEFAULT_S + 5:.0f}"
    )


class Watchdog:
    def __init__(
        self, env: DistEnv, timeout: float | None, log: logging.Logger, interval: float = INTERVAL_S, store=None
    ):
        """store: the ranks' counters (distributed.Counters); by default the job's, set up by init_parallel_env()."""
        self.env, self.log, self.interval = env, log, interval
        self.timeout = timeout_for(timeout, env.backend)
        self.step = 0
        self._published = 0
        self._work = 0  # progress() and alive() calls, published as the rank's work count
        self._work_published = 0
        self._waiting_for: str | None = None  # the busy ranks already logged as waited for
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._store = store

    def __enter__(self) -> Watchdog:
        problem = timeout_problem(self.timeout, self.env.backend)
        if problem and self.env.world_size > 1 and self.env.is_main:
            self.log.warning(problem)
        if self.env.world_size > 1 and self.timeout > 0:
            self._store = job_store() if self._store is None else self._store
            self._last = time.monotonic()
            for target in (self._heartbeat, self._judge):
                thread = threading.Thread(target=target, name=f"watchdog{target.__name__}", daemon=True)
                thread.start()
                self._threads.append(thread)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()

    def progress(self, step: int) -> None:
        """Called by the training loop whenever it gets past a point all workers must reach."""
        self.step = step
        self._work += 1
        self._last = time.monotonic()
        self._waiting_for = None

    def alive(self, *_) -> None:
        """Called inside long work every rank does alike (an evaluation, after each layer's forward: a forward
        post-hook, hence the ignored arguments): progress, though no step was trained."""
        self._work += 1
        self._last = time.monotonic()

    def _key(self, what: str, rank: int) -> str:
        return f"{PREFIX}/{what}/{rank}"

    def _heartbeat(self) -> None:
        """Beat once an interval and publish the step (the store holds counters: add the difference)."""
        try:
            while not self._stop.wait(self.interval):
                self._store.add(self._key("beat", self.env.rank), 1)
                step = self.step
                if step != self._published:
                    self._store.add(self._key("step", self.env.rank), step - self._published)
                    self._published = step
                work = self._work
                if work != self._work_published:
                    self._store.add(self._key("work", self.env.rank), work - self._work_published)
                    self._work_published = work
        except Exception as e:  # the store lives in rank 0's process: it is gone, and so is the job
            self._exit(f"the job's key-value store stopped answering ({e}); rank 0 has probably exited")

    def _judge(self) -> None:
        """Separate from the heartbeat, so a store that hangs (rank 0 stopped) cannot hang the verdict too."""
        patience = patience_for(self.timeout, self.env.backend)
        while not self._stop.wait(self.interval):
            silent = time.monotonic() - self._last
            if silent > self.timeout:
                found: list[str] = []
                busy: list[int] = []
                quiet: list[int] = []
                asked_at = self._last
                asking = threading.Thread(target=self._who_is_quiet, args=(found, busy, quiet), daemon=True)
                asking.start()
                asking.join((3 + ASK_INTERVALS) * self.interval)
                if self._last != asked_at:  # the collective returned while the verdict was asked: none is due
                    continue
                if busy and time.monotonic() - self._last < patience:
                    self._wait_for(busy)
                    continue
                if busy:
                    quiet = []  # the verdict is the busy ranks
                    ranks = ", ".join(f"rank {r}" for r in busy)
                    limit = f"gloo ends one at {GLOO_TIMEOUT_S:.0f} s" if self.env.backend == "gloo" else "too long"
                    cause = (
                        f"{ranks} still at work after {silent:.0f} s while this rank waited for it in a collective "
                        f"({limit}): the ranks' shares of the work take too different times (a busy machine); "
                        "lower --eval-batch-size, or give each worker its own cores"
                    )
                elif found:
                    cause = found[0]
                else:
                    cause, quiet = "rank 0, which hosts the job's key-value store, stopped answering", [0]
                why = f"no progress for {self.timeout:.0f} s (--collective-timeout) at step {self.step}: {cause}"
                self._exit(why, quiet)

    def _wait_for(self, busy: list[int]) -> None:
        """Log once, for each set of busy ranks, that this rank waits for them."""
        ranks = ", ".join(f"rank {r}" for r in busy)
        if ranks != self._waiting_for:
            self._waiting_for = ranks
            self.log.info(f"waiting for {ranks}, still at work (no progress here for {self.timeout:.0f} s)")

    def _who_is_quiet(self, found: list[str], busy: list[int], quiet_ranks: list[int]) -> None:
        """Append the verdict to found: which ranks' heartbeats stood still over three intervals (to quiet_ranks,
        those ranks); and to busy, the other ranks whose work count moved meanwhile."""

        def counts(what: str) -> list[int]:
            return [self._store.add(self._key(what, r), 0) for r in range(self.env.world_size)]

        before, work_before = counts("beat"), counts("work")
        time.sleep(3 * self.interval)
        after, work_after = counts("beat"), counts("work")
        others = [r for r in range(self.env.world_size) if r != self.env.rank]
        busy.extend(r for r in others if work_after[r] != work_before[r])
        quiet = [r for r in others if after[r] == before[r]]
        quiet_ranks.extend(quiet)
        if not quiet:
            found.append("every rank is alive but the job is stuck in a collective")
            return
        # published once an interval, so up to a second behind; the ranks step together, so a quiet rank got at least
        # as far as this one's last step
        steps = {r: max(self._store.add(self._key("step", r), 0), self.step) for r in quiet}
        who = ", ".join(f"rank {r} (last seen at step {steps[r]})" for r in quiet)
        found.append(f"{who} stopped responding (stopped, hung or cut off)")

    def _exit(self, why: str, quiet: list[int] | None = None) -> None:
        """quiet: the ranks the verdict found silent, where it is the verdict (not a store that went away)."""
        message = (
            f"{why}; ending this worker. Rerun the same command with --resume auto to continue from the last checkpoint"
        )
        self.log.error(f"error: {message}")
        if quiet is None:
            events.stop("error", message)
        else:
            events.stop("error", message, events.WATCHDOG, quiet=quiet)
        for handler in self.log.handlers:
            handler.flush()
        sys.stdout.flush()
        os._exit(EXIT_CODE)

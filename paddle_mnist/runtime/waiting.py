"""Uneven work before training (one worker per machine decodes a folder for minutes): the ranks meet in the job's
key-value store, each waiting with its own progress and limit, not in a collective that gloo aborts after 30 s."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from paddle_mnist.runtime.distributed import DistEnv, job_store
from paddle_mnist.runtime.preempt import Preempted, signal_name
from paddle_mnist.runtime.watchdog import period_for_tests

PREFIX = "paddle_mnist/meeting"
BEAT_S = 1.0  # how often a working rank shows it is alive
POLL_S = 0.25  # how often a waiting rank looks
REPORT_S = period_for_tests("PADDLE_MNIST_MEETING_REPORT_S", 15.0)  # how often a waiting rank logs what it waits for
QUIET_S = 60.0  # a rank whose heartbeat stood still this long has stopped, hung or been cut off
STALL_S = 900.0  # a rank that is alive but reports no progress this long is stuck (a hung read, a full disk)


class PeerLost(Exception):
    """A rank went away or stopped making progress while the others waited for it; the message names it."""


class Meeting:
    """One meeting of every rank, after work of uneven length: `with Meeting(...) as m: work(report=m.report)`,
    then `failed = m.finish(ok)`.

    While its work runs each rank beats in the store (a thread) and publishes report(done, total); finish() marks
    the rank done and waits until every rank is, logging the slowest rank's progress every REPORT_S. It ends with
    PeerLost, naming the rank, when a rank's heartbeat stands still for QUIET_S or its progress for STALL_S, and
    with Preempted when this worker gets SIGTERM or SIGINT meanwhile. One process (world size 1) waits for none.
    """

    def __init__(
        self, name: str, what: str, env: DistEnv, log: logging.Logger, stopped: Callable[[], int], unit: str = ""
    ):
        self.name, self.what, self.env, self.log, self.stopped, self.unit = name, what, env, log, stopped, unit
        self._store = job_store() if env.world_size > 1 else None
        self._stop = threading.Event()
        self._beater: threading.Thread | None = None
        self._reported = 0

    def _key(self, what: str, rank: int) -> str:
        return f"{PREFIX}/{self.name}/{what}/{rank}"

    def _add(self, what: str, rank: int, n: int) -> int:
        return self._store.add(self._key(what, rank), n)

    def __enter__(self) -> Meeting:
        if self._store is not None:
            self._beater = threading.Thread(target=self._beat, name=f"meeting-{self.name}", daemon=True)
            self._beater.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._beater is not None:
            self._beater.join()

    def _beat(self) -> None:
        try:
            while not self._stop.wait(BEAT_S):
                self._add("beat", self.env.rank, 1)
        except Exception:  # the store lives in rank 0's process: the waiting side names that
            pass

    def report(self, done: int, total: int) -> None:
        """This rank's progress through its work (images decoded): what the waiting ranks log."""
        if self._store is None:
            return
        if not self._reported:
            self._add("total", self.env.rank, total)
        self._add("done", self.env.rank, done - self._reported)
        self._reported = done

    def finish(self, ok: bool) -> int:
        """Say this rank's work is over (ok: it succeeded) and wait for every rank; how many ranks failed."""
        if self._store is None:
            return 0 if ok else 1
        try:
            if not ok:
                self._add("failed", self.env.rank, 1)
            self._add("finished", self.env.rank, 1)
            return self._wait()
        except (PeerLost, Preempted):
            raise
        except Exception as e:  # the store's host, rank 0, is gone
            raise PeerLost(
                f"rank 0, which hosts the job's key-value store, went away while the ranks waited for {self.what} "
                f"({type(e).__name__}); its log says why"
            ) from None

    def _wait(self) -> int:
        ranks = range(self.env.world_size)
        started = time.monotonic()
        beats = {r: (self._add("beat", r, 0), started) for r in ranks}  # (count, when it last changed)
        moved = {r: (0, started) for r in ranks}  # (progress, when it last changed)
        logged = started - REPORT_S  # the first look says what this rank waits for
        while True:
            waiting = [r for r in ranks if not self._add("finished", r, 0)]
            if not waiting:
                failed = sum(self._add("failed", r, 0) for r in ranks)
                self._leave()
                return failed
            if signum := self.stopped():
                raise Preempted(
                    signum,
                    f"stopped by {signal_name(signum)} while waiting for {self.what}; nothing was trained: "
                    "run the same command again",
                )
            now = time.monotonic()
            for r in waiting:
                beat, done = self._add("beat", r, 0), self._add("done", r, 0)
                if beat != beats[r][0]:
                    beats[r] = (beat, now)
                if done != moved[r][0]:
                    moved[r] = (done, now)
                if now - beats[r][1] > QUIET_S:
                    raise PeerLost(
                        f"rank {r} stopped responding while the others waited for {self.what} (no heartbeat for "
                        f"{QUIET_S:.0f} s: stopped, hung or cut off); its log says why"
                    )
                if now - moved[r][1] > STALL_S:
                    raise PeerLost(
                        f"rank {r} made no progress with {self.what} for {STALL_S / 60:.0f} minutes "
                        f"(at {self._progress(r)}); its log says where it stands"
                    )
            if now - logged >= REPORT_S:
                logged = now
                slowest = min(waiting, key=lambda r: self._fraction(r))
                self.log.info(
                    f"waiting for {self.what}: rank {slowest} at {self._progress(slowest)} "
                    f"({now - started:.0f} s so far)"
                )
            time.sleep(POLL_S)

    def _leave(self) -> None:
        """Say this rank has read the outcome; rank 0, whose process hosts the store, waits until every rank has,
        so that a rank that failed there and exits at once does not take the store away from one still reading."""
        self._add("read", 0, 1)
        deadline = time.monotonic() + QUIET_S  # a rank that died meanwhile never reads: go on without it
        while self.env.rank == 0 and self._add("read", 0, 0) < self.env.world_size and time.monotonic() < deadline:
            time.sleep(POLL_S / 5)

    def _fraction(self, rank: int) -> float:
        total = self._add("total", rank, 0)
        return self._add("done", rank, 0) / total if total else 0.0

    def _progress(self, rank: int) -> str:
        total, done = self._add("total", rank, 0), self._add("done", rank, 0)
        return f"{done} of {total} {self.unit}".rstrip() if total else "its start"

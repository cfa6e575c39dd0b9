"""Where a worker's step time goes: phase timings sampled every few steps, cheap enough to leave on."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator

SAMPLED = ("forward", "backward", "optimizer")  # timed on sampled steps only
EVERY_STEP = ("input_wait", "logging")  # host-side waits: two clock reads per step
PHASES = (*SAMPLED, *EVERY_STEP, "other")
LABELS = {
    "forward": "forward",
    "backward": "backward",  # and DataParallel's all-reduce, which it overlaps, where there are several workers
    "optimizer": "optimizer",
    "input_wait": "input wait",
    "logging": "logging/checkpoints",
    "other": "other",
}


class StepTimer:
    """Sums each phase's seconds over one epoch.

    On a sampled step the device is synchronised at every phase boundary (a no-op on CPU, where kernels run as
    they are called) and nothing else changes: the gradient all-reduce stays inside backward, where DataParallel
    overlaps it with the computation, so it is timed as part of backward. Other steps are not touched, which keeps
    the cost to a few syncs every `every` steps.

    Every step's compute (from its batch in hand to its update made, which holds the sampled phases) is timed too,
    and the sampled steps' own: the phases are shares of the sampled steps' compute, never of an average step's,
    which a sampled step can outlast (its syncs, a busy machine) by more than "other" holds.
    """

    def __init__(self, every: int, sync: Callable[[], None]):
        self.every = every
        self._sync = sync
        self.seconds = dict.fromkeys(SAMPLED + EVERY_STEP, 0.0)
        self.samples = 0
        self.compute = 0.0  # every step's
        self.sampled_compute = 0.0  # the sampled steps' alone

    def wants(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def sampling(self, step: int) -> StepTimer | Untimed:
        """What times step's phases: this timer on a sampled step, else UNTIMED, whose phases time nothing."""
        return self if self.wants(step) else UNTIMED

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Adds the time inside to the phase's, the device synchronised on the way in and out; the optimizer's phase
        ends a sampled step."""
        self._sync()
        begun = time.perf_counter()
        yield
        self._sync()
        self.seconds[name] += time.perf_counter() - begun
        if name == SAMPLED[-1]:
            self.samples += 1

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] += seconds

    def add_compute(self, seconds: float, sampled: bool) -> None:
        """One step's compute: a span that holds its sampled phases, if it was sampled."""
        self.compute += seconds
        if sampled:
            self.sampled_compute += seconds


class Untimed:
    """An unsampled step's timer: its phases are contexts that do nothing."""

    def phase(self, name: str) -> contextlib.nullcontext:
        return contextlib.nullcontext()


UNTIMED = Untimed()


def shares(
    seconds: dict[str, float], elapsed: float, compute: float, sampled_compute: float
) -> dict[str, float | None]:
    """Each phase's share of the epoch's step time (elapsed): input wait and logging as timed on every step, the
    sampled phases as their share of the sampled steps' compute applied to every step's compute.

    The spans are nested (phases inside a step's compute, compute, input wait and logging side by side inside the
    epoch), so the shares add up to 1 and "other" (metric bookkeeping, the scheduler, Python) is never negative.
    The sampled phases and "other" are None when no step was sampled.
    """
    if elapsed <= 0:
        return dict.fromkeys(PHASES)
    out: dict[str, float | None] = {p: seconds[p] / elapsed for p in EVERY_STEP}
    scale = compute / elapsed / sampled_compute if sampled_compute > 0 else None
    for p in SAMPLED:
        out[p] = seconds[p] * scale if scale is not None else None
    # max: only the last bits of rounding could take it below zero
    out["other"] = max(0.0, 1.0 - sum(out.values())) if scale is not None else None
    return {p: out[p] for p in PHASES}


def describe(shares: dict[str, float | None], step_ms: float, samples: int, workers: int = 1) -> str:
    labels = {**LABELS, "backward": "backward+all-reduce"} if workers > 1 else LABELS
    parts = [f"{labels[p]} {100 * v:.1f}%" for p, v in shares.items() if v is not None]
    return f"step {step_ms:.1f} ms: " + ", ".join(parts) + f" ({samples} sampled steps)"


def _process_start(pid: int | str) -> float | None:
    """The Unix time at which a process started, from /proc (Linux); None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, after the command name
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def _command_start() -> float:
    """When the user's command started: the launcher's start for a worker it started, else this process's."""
    launched = "PADDLE_TRAINER_ID" in os.environ or "PADDLE_TRAINER_ENDPOINTS" in os.environ
    for pid in ([os.getppid()] if launched else []) + ["self"]:
        if (t := _process_start(pid)) is not None:
            return t
    return time.time()


COMMAND_START = _command_start()


def since_command_start() -> float:
    return time.time() - COMMAND_START


ESTIMATE_AFTER = 20  # timed steps before the run's time is estimated: enough that one slow step does not sway it
EVAL_COST = 1 / 3  # an evaluated image's time over a trained one's until an evaluation is timed: forward only


class RunClock:
    """A session's steps and epoch ends, timed as they go, for an early estimate of when the run ends.

    A step is timed from the previous step's end (or epoch end) to its own, so its checkpoints and meetings and
    its epoch's start count; the session's first step, which pays one-off costs (kernel choice, memory), does
    not. An epoch end (statistics, evaluation, checkpoint) is timed from its last step's end.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self.started = clock()
        self._last: float | None = None
        self.step_seconds, self.steps = 0.0, 0
        self.end_seconds, self.ends = 0.0, 0

    def step(self) -> None:
        now = self._clock()
        if self._last is not None:
            self.step_seconds, self.steps = self.step_seconds + now - self._last, self.steps + 1
        self._last = now

    def epoch_end(self) -> None:
        now = self._clock()
        if self._last is not None:
            self.end_seconds, self.ends = self.end_seconds + now - self._last, self.ends + 1
        self._last = now

    def so_far(self) -> float:
        return self._clock() - self.started


def epoch_ends_left(batch_in_epoch: int, batches_per_epoch: int, steps_left: int) -> int:
    """Epoch ends still to come during an epoch (its own included) when steps_left steps remain to be trained."""
    in_this = batches_per_epoch - batch_in_epoch
    return 1 + max(0, -(-(steps_left - in_this) // batches_per_epoch))


def duration_text(seconds: float) -> str:
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"


def step_text(seconds: float) -> str:
    return f"{1000 * seconds:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def clock_text(when: float, now: float) -> str:
    """A local time of day, with its day when that is not today's."""
    at, today = time.localtime(when), time.localtime(now)
    same_day = (at.tm_year, at.tm_yday) == (today.tm_year, today.tm_yday)
    return time.strftime("%H:%M" if same_day else "%a %d %b %H:%M", at)

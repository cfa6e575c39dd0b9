"""Where a worker's step time goes: phase timings sampled every few steps, cheap enough to leave on."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

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
    """

    def __init__(self, every: int, sync: Callable[[], None]):
        self.every = every
        self._sync = sync
        self.seconds = dict.fromkeys(SAMPLED + EVERY_STEP, 0.0)
        self.samples = 0
        self._t = 0.0

    def wants(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def begin(self) -> None:
        self._sync()
        self._t = time.perf_counter()

    def mark(self, phase: str) -> None:
        """Close the phase that began at the last begin() or mark()."""
        self._sync()
        now = time.perf_counter()
        self.seconds[phase] += now - self._t
        self._t = now
        if phase == SAMPLED[-1]:
            self.samples += 1

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] += seconds


def shares(seconds: dict[str, float], samples: int, steps: int, elapsed: float) -> dict[str, float | None]:
    """Each phase's share of the mean step time; sampled phases use the mean over the sampled steps.

    The sampled phases are None when no step was sampled; "other" (metric bookkeeping, the scheduler, Python) is
    what the named phases leave of the step and is None then too.
    """
    if steps <= 0 or elapsed <= 0:
        return dict.fromkeys(PHASES)
    step = elapsed / steps
    out: dict[str, float | None] = {p: seconds[p] / steps / step for p in EVERY_STEP}
    for p in SAMPLED:
        out[p] = seconds[p] / samples / step if samples else None
    out["other"] = 1.0 - sum(out.values()) if samples else None
    return {p: out[p] for p in PHASES}


def describe(share: dict[str, float | None], step_ms: float, samples: int, workers: int = 1) -> str:
    labels = {**LABELS, "backward": "backward+all-reduce"} if workers > 1 else LABELS
    parts = [f"{labels[p]} {100 * v:.1f}%" for p, v in share.items() if v is not None]
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

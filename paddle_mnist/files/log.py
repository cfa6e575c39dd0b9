"""Rank-tagged logging: every worker writes its own lines, to its own launcher log (workerlog.N)."""

from __future__ import annotations

import logging
import os
import resource
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for annotations only: this module loads without Paddle (config and download use it)
    from paddle_mnist.runtime.distributed import DistEnv


def get_logger(env: DistEnv) -> logging.Logger:
    logger = logging.getLogger("paddle_mnist")
    logger.handlers.clear()
    logger.propagate = False
    handler = logging.StreamHandler(sys.stdout)
    tag = f"rank {env.rank}/{env.world_size}"
    handler.setFormatter(logging.Formatter(f"%(asctime)s [{tag}] %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return logger


class ProgressBar:
    """A one-line bar on stderr, drawn only by rank 0 and only when stderr is a terminal."""

    def __init__(self, env: DistEnv, total: int, label: str):
        self.enabled = env.is_main and sys.stderr.isatty()
        self.total, self.label = total, label

    def update(self, done: int, text: str = "") -> None:
        if not self.enabled or (done % 5 and done != self.total):
            return
        filled = 30 * done // max(self.total, 1)
        sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (30 - filled)}] {done}/{self.total} {text}")
        if done == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def memory_mb() -> tuple[float, float]:
    """(current, peak) resident memory of this process in MiB."""
    try:
        with open("/proc/self/statm") as f:
            current = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:  # not Linux: only the peak is known
        current = float("nan")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return current, peak

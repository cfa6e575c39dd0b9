"""Rank-tagged logging: every worker writes its own lines, to its own launcher log (workerlog.N), without Paddle's
start-up notes. Loads without Paddle (config and download use it)."""

from __future__ import annotations

import logging
import os
import resource
import sys
import warnings
from collections.abc import MutableMapping

# Python warnings Paddle gives every run, which say nothing about it
PADDLE_NOTES = (
    "No ccache found",  # about building C++ extensions, which training never does
    "When training, we now always track global mean and variance",  # each batch norm layer, at its first step
)


def quiet_paddle(environ: MutableMapping[str, str] = os.environ) -> None:
    """Hide glog's INFO lines (the key-value store's "create libuv server", "Successfully connected to ...") and
    Paddle's notes, before Paddle loads. Warnings, errors and fatal messages still print. GLOG_v (verbose logs,
    written at INFO level) or a GLOG_minloglevel of the user's leaves the level alone."""
    if "GLOG_minloglevel" not in environ and "GLOG_v" not in environ:
        environ["GLOG_minloglevel"] = "1"
    for note in PADDLE_NOTES:
        warnings.filterwarnings("ignore", message=note)


def get_logger(rank: int, world_size: int) -> logging.Logger:
    logger = logging.getLogger("paddle_mnist")
    logger.handlers.clear()
    logger.propagate = False
    handler = logging.StreamHandler(sys.stdout)
    tag = f"rank {rank}/{world_size}"
    handler.setFormatter(logging.Formatter(f"%(asctime)s [{tag}] %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return logger


class ProgressBar:
    """A one-line bar on stderr, drawn only by rank 0 (is_main) and only when stderr is a terminal."""

    def __init__(self, is_main: bool, total: int, label: str):
        self.enabled = is_main and sys.stderr.isatty()
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

"""Summarise a launcher's log directory: each rank's progress and status, and the first failure's traceback.

python -m paddle_mnist.logs log
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

PROGRESS = re.compile(r"\[rank (\d+)/(\d+)\] epoch (\d+) step (\d+)/(\d+)")
EPOCH_DONE = re.compile(r"\[rank (\d+)/(\d+)\] epoch (\d+)/(\d+) done")
TAG = re.compile(r"\[rank (\d+)/\d+\]")
WORKERLOG = re.compile(r"^workerlog\.(\d+)$")


@dataclass(frozen=True)
class RankReport:
    log: Path
    rank: int | None  # global rank from the lines' tags; None if the worker died before logging
    status: str  # "finished", "error", "crashed" (traceback), "signalled" (SIGTERM/SIGINT, checkpoint saved),
    # or "stopped" (no end: killed or still running)
    where: str  # the last progress the worker reported
    message: str  # the error line or traceback, if any
    mtime: float


def read_rank(path: Path) -> RankReport:
    text = path.read_text(errors="replace")
    lines = text.splitlines()
    ranks = [int(m.group(1)) for m in map(TAG.search, lines) if m]
    where = "before the first step"
    for line in lines:
        if m := PROGRESS.search(line):
            where = f"epoch {m.group(3)}, step {m.group(4)} of {m.group(5)}"
        elif m := EPOCH_DONE.search(line):
            where = f"end of epoch {m.group(3)} of {m.group(4)}"
    status, message = "stopped", ""
    errors = [line for line in lines if "] error: " in line or line.startswith("error: ")]
    signalled = [line for line in lines if "] stopped by SIG" in line or "] stopped at once by a second SIG" in line]
    if signalled:
        status, message = "signalled", signalled[-1].split("] ", 1)[1]
    elif "Traceback (most recent call last):" in text:
        status, message = "crashed", text[text.rindex("Traceback (most recent call last):") :].strip()
    elif errors:
        status, message = "error", errors[-1].split("error: ", 1)[1]
    elif any("] finished: " in line for line in lines):
        status = "finished"
    return RankReport(path, ranks[-1] if ranks else None, status, where, message, path.stat().st_mtime)


def summarise(log_dir: Path) -> str:
    paths = sorted((p for p in Path(log_dir).iterdir() if WORKERLOG.match(p.name)), key=lambda p: int(p.suffix[1:]))
    if not paths:
        return f"{log_dir}: no workerlog.N files; pass the launcher's --log_dir"
    reports = [read_rank(p) for p in paths]
    out = []
    for r in reports:
        who = f"rank {r.rank}" if r.rank is not None else "rank ?"
        out.append(f"{who:8} {r.status:9} {r.where:32} {r.log.name}")
    unfinished = [r for r in reports if r.status != "finished"]
    if unfinished:
        first = min(unfinished, key=lambda r: r.mtime)  # the log that fell silent first
        out += ["", f"first to stop: rank {first.rank} ({first.log}), at {first.where}:"]
        out.append(
            first.message
            or "it ended without an error message: killed from outside (SIGKILL, out of memory) or still running"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not Path(args[0]).is_dir():
        print("usage: python -m paddle_mnist.logs LOG_DIR (the launcher's --log_dir)", file=sys.stderr)
        return 2
    print(summarise(Path(args[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Each worker's events (start, progress, checkpoint, stop and its cause) as JSON lines in eventlog.N, beside the
launcher's workerlog.N: the facts python -m paddle_mnist.logs reads, so that rewording a log line for people cannot
change its diagnosis.

One object a line, each with "event" and "t" (seconds since the epoch):
  start       rank, world, pid, clock (the HH:MM:SS of the run's "started:" line, which pairs the two files' runs)
  progress    epoch, step (within the epoch), steps (in the epoch), memory_mb
  epoch       epoch, epochs, max_steps (set when --max-steps ended training within this epoch), memory_mb
  checkpoint  step, path
  launcher_gone  message (this worker's launcher died: the SIGTERM that follows is its doing)
  stop        status (finished, error, crashed, signalled), cause, message; a signalled stop also has signal and
              took (the rank that took the signal, where another did); the watchdog's also has quiet (the ranks it
              found silent)

Written only by a worker of paddle.distributed.launch (or its legacy fleet.launch), whose output goes to a
workerlog.N file; anything else has no events and logs.py reads its English lines instead. Writing never raises:
a full disk must not turn a diagnosis into a second failure.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path

WORKERLOG = re.compile(r"^workerlog\.(\d+)$")

# the causes a stop event names, and logs.py's Failure for each
DIVERGED, LEARNED_NOTHING, WATCHDOG = "diverged", "learned_nothing", "watchdog"
SIGNAL, SIGNAL_ECHO = "signal", "signal_echo"  # this rank took the stop signal; another rank did
LAUNCHER_GONE = "launcher_gone"  # an event of its own, before the stop its SIGTERM brings
PEER_GONE = "peer_gone"  # another rank's process ended while this one waited for it in a sum (runtime/local_sum)

# One event log a process, like its logger: the writers (cli, the watchdog, the stop signals, the engine, the
# checkpoint writer) each record their own fact without a handle passed through every call between them.
_lock = threading.Lock()  # the watchdog and the stop-signal thread write beside the main thread
_file = None


def path_beside(workerlog: Path) -> Path:
    """eventlog.N for workerlog.N."""
    return workerlog.with_name(workerlog.name.replace("workerlog", "eventlog", 1))


def _own_workerlog() -> Path | None:
    """The workerlog.N file this process's output goes to (the launcher opened it as our stdout), if it does."""
    try:
        target = Path(os.readlink("/proc/self/fd/1"))
    except OSError:  # not Linux, or no stdout
        return None
    return target if WORKERLOG.match(target.name) and target.is_file() else None


def begin(rank: str, world: str, clock: str) -> None:
    """Open this worker's event log (appending, as the launcher appends to a reused --log_dir) and write its start.
    Does nothing outside a launcher's worker."""
    global _file
    workerlog = _own_workerlog()
    if workerlog is None:
        return
    try:
        _file = open(path_beside(workerlog), "a", encoding="utf-8")  # noqa: SIM115 (open for the process's life)
    except OSError:
        return
    emit("start", rank=int(rank), world=int(world) if world.isdigit() else None, pid=os.getpid(), clock=clock)


def emit(event: str, **fields) -> None:
    """One event, written out at once: the process may be killed the next moment."""
    if _file is None:
        return
    line = json.dumps({"event": event, "t": round(time.time(), 3), **fields}, default=str)
    with _lock:
        try:
            _file.write(line + "\n")
            _file.flush()
        except (OSError, ValueError):  # full disk, or closed at shutdown
            pass


def stop(status: str, message: str, cause: str | None = None, **fields) -> None:
    emit("stop", status=status, cause=cause, message=message, **fields)


def read(path: Path) -> list[dict]:
    """The events of a file; a line cut short by a kill (the last) or otherwise unreadable is skipped."""
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and isinstance(event.get("event"), str):
            out.append(event)
    return out


def last_run(events: list[dict], clock: str | None) -> list[dict] | None:
    """The events of the run whose "started:" line has this clock time: those from its start event on. None when
    the file has no such run (a run that could not write it, or logs from before this file existed)."""
    starts = [i for i, e in enumerate(events) if e["event"] == "start"]
    if not starts or clock is None or events[starts[-1]].get("clock") != clock:
        return None
    return events[starts[-1] :]

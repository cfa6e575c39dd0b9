"""Summarise a job's worker logs: each rank's progress and status, the first failure, its likely cause and fix.

python -m paddle_mnist.logs log [launcher.out]
python -m paddle_mnist.logs log-0 log-1 [launcher-0.out launcher-1.out]    # one --log_dir per machine

A pure reader, like plots.py: it reads the workerlog.N files (and, if given, the launcher's own output, where
Paddle prints exit codes and ABORT!!! lines) and imports nothing from training. The trainer's own facts (a rank's
progress, its stop and the cause) come from each worker's events (eventlog.N, files/events.py), so that rewording a
line for people changes no diagnosis; logs without them (an older trainer's) are read by their English lines.
Paddle's and the system's failures are read by their words either way. Every machine numbers its files
from workerlog.0, so ranks are told apart by the global rank in their lines' tags, never by the file's number.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from paddle_mnist.files import events

PROGRESS = re.compile(r"\[rank (\d+)/(\d+)\] epoch (\d+) step (\d+)/(\d+)")
EPOCH_DONE = re.compile(r"\[rank (\d+)/(\d+)\] epoch (\d+)/(\d+) done")
# the last epoch of a run that --max-steps ended mid-epoch (evaluated like any other)
EPOCH_CUT = re.compile(r"\[rank (\d+)/(\d+)\] epoch (\d+)/(\d+) stopped at --max-steps (\d+)")
TAG = re.compile(r"\[rank (\d+)/(\d+)\]")  # global rank / world size
CLOCK = re.compile(r"^(\d\d):(\d\d):(\d\d) \[rank ")  # the time of day the trainer's lines begin with
WORKERLOG = re.compile(r"^workerlog\.(\d+)$")
MEMORY = re.compile(r"memory (\d+) MiB")
# A run's first line in a worker log (start.announce), before Paddle loads; in logs from before it, the first line
# of training. The launcher appends a run to the files of an earlier one when --log_dir is reused.
RUN_START = re.compile(r"^\S+ \[rank \d+/\S+\] started: ")
OLD_RUN_START = re.compile(r"\[rank \d+/\d+\] rank \d+ of world size \d+ ")
MASTER = re.compile(r"^PADDLE_MASTER=(.+)$", re.M)  # in the launcher's envlog.N, one block a run
# the legacy launcher (paddle.distributed.fleet.launch) on its stdout: rank=[1] or rank=[0, 1]
PY_TRACEBACK = re.compile(r"^Traceback \(most recent call last\):$", re.M)  # not Paddle's "C++ Traceback ..."
# The last words of a process that C++ or a signal ends: Paddle's handler, an uncaught C++ exception, the
# trainer's faulthandler ("Fatal Python error: Bus error")
FATAL = re.compile(r"^(FatalError: |terminate called |  what\(\): |Fatal Python error: )|Assertion `.*' failed")
# paddle.distributed.launch; its rank is the worker's index on that machine (workerlog.N's N), the log its file
CONTAINER = re.compile(r"Container rank (\d+) status (\w+) cmd .* code (-?\d+)(?: log (\S+))?")
ABORT = re.compile(r"ABORT!!! Out of all \d+ trainers, the trainer process with rank=\[([\d, ]*)\] was aborted")


def _any(*patterns: str) -> re.Pattern[str]:
    return re.compile("|".join(f"(?:{p})" for p in patterns))


@dataclass(frozen=True)
class Failure:
    """One failure the reader knows: the facts or lines that show it, what it means in plain words, what to do."""

    name: str  # a few words, for the table
    what: str
    pattern: re.Pattern[str] | None  # Paddle's or the system's words, searched line by line in every worker's log
    fix: str
    echo: bool = False  # usually the echo of another rank's failure (a peer vanished): look at the others first
    detail: re.Pattern[str] | None = None  # more lines worth showing once the pattern matched
    told: str | None = None  # the trainer's own failure: the cause its stop event names (files/events.py)
    prose: re.Pattern[str] | None = None  # and its English line, read only from a log without events


# In order: the first that matches a log names its failure. The texts are Paddle's own (3.3.1 and 2.6 where they
# differ) and the trainer's; tests/test_logs.py produces each for real where a CPU machine can.
DIVERGED = Failure(
    "diverged",
    "the loss diverged: it became NaN or infinite, so training stopped before saving bad weights",
    None,
    "lower --lr (or warm up with --warmup-epochs), then rerun with --resume auto: it continues from the last "
    "checkpoint, which was saved before the loss diverged",
    told=events.DIVERGED,
    prose=_any(r"the (training loss|weights) became NaN or infinite"),
)
LEARNED_NOTHING = Failure(
    "learned nothing",
    "the model learned nothing: its training loss stayed at chance level, or its test accuracy was no better than "
    "chance; the weights, results and checkpoints were written before the run stopped",
    None,
    "start afresh (--overwrite) with a lower --lr or a warmup (--warmup-epochs 1); if the training loss fell while "
    "the test accuracy stayed at chance, the labels do not match the images: check that each class folder holds "
    "only images of its class",
    told=events.LEARNED_NOTHING,
    prose=_any(r": the model learned nothing; "),
)
WATCHDOG = Failure(
    "peer went quiet",
    "a worker stopped making progress, so the watchdog ended the job instead of letting it hang",
    None,
    "look at the rank the verdict names: stopped (SIGSTOP, a debugger), hung on a disk or a lock, or cut off from "
    "the network; if it was only slow (a long evaluation, a busy machine), raise --collective-timeout; then rerun "
    "with --resume auto",
    echo=True,
    told=events.WATCHDOG,
    prose=_any(r"no progress for \d+ s \(--collective-timeout\)"),
)
PORT = Failure(
    "port in use",
    "a port the job needs was already taken, by another job or a leftover worker of an earlier run",
    # 2.6: "Bind network on IP_ANY:PORT failed"; 3.3.1's libuv store aborts inside TCPServer::create instead, on a
    # libuv assertion while it tears down the server that could not listen; the C++ traceback naming
    # TCPServer::create follows only when Paddle's signal handler gets to print it
    _any(
        r"Address already in use",
        r"EADDRINUSE",
        r"Bind network on \S+:\d+ failed",
        r"TCPServer::create\(",
        r"uv__finish_close: Assertion",
    ),
    "find who holds it (ss -ltnp | grep PORT) and end it, or choose another port: --master IP:PORT for several "
    "nodes, --start_port or FLAGS_FIXED_PORT when fixing the workers' ports",
    detail=re.compile(r"create libuv server at port: \d+|Address already in use"),
)
SHARED_MEMORY = Failure(
    "bus error (shm)",
    "a bus error: most often the shared memory (/dev/shm) is too small or full",
    # DataLoader's worker: "ERROR: Unexpected BUS error encountered in DataLoader worker. This might be caused by
    # insufficient shared memory (shm) ..."; Paddle's signal handler names SIGBUS "Access to an undefined portion
    # of a memory object"
    _any(
        r"Unexpected BUS error",
        r"insufficient shared (memory|storage)",
        r"\bBus error\b",
        r"\*\*\* SIGBUS",
        r"`Access to an undefined portion of a memory object`",
    ),
    "check it with df -h /dev/shm; in Docker start the container with --shm-size=8g (or --ipc=host), on Kubernetes "
    "mount an emptyDir with medium: Memory at /dev/shm; with paddle.io.DataLoader use fewer num_workers or "
    "use_shared_memory=False",
)
OUT_OF_MEMORY = Failure(
    "out of memory",
    "an allocation failed: the process ran out of memory",
    _any(r"\bMemoryError\b", r"ResourceExhaustedError", r"Out of memory error on", r"std::bad_alloc"),
    "lower --batch-size or --eval-batch-size, run fewer workers per machine, or give the job more memory",
)
NCCL = Failure(
    "NCCL error",
    "NCCL, the library that carries the GPUs' collectives, failed",
    _any(r"NCCL error", r"\bnccl\w*Error\b", r"unhandled (system|cuda) error"),
    "rerun with NCCL_DEBUG=INFO to see the call that failed; across nodes set NCCL_SOCKET_IFNAME to the interface "
    "the nodes share and open the ports between them; 'unhandled cuda error' usually means mismatched driver, CUDA "
    "and NCCL versions or a GPU used by another process (nvidia-smi)",
)
CONNECTION = Failure(
    "connection lost",
    "the connection between the workers failed (gloo, the CPU collectives, or the job's key-value store)",
    _any(
        r"gloo::\w*Exception",
        r"gloo/transport/\S+\] (TIMEOUT|Read error|Write error|Connect)",
        r"Connection reset by peer",
        r"Connection refused",
        r"Connection closed by peer",
        r"TCP receive error",
        r"Timed out waiting",
    ),
    "it is usually the echo of another worker's end: read the log of the rank that stopped first; across nodes "
    "check that every node reaches --master and the workers' ports (firewall) and that all run the same command",
    echo=True,
)
PEER_GONE = Failure(
    "peer exited",
    "another worker's process ended while this one waited for it in a sum over the workers",
    None,
    "read the log of the rank this line names: it ended first, and its log or the launcher's says how",
    echo=True,
    told=events.PEER_GONE,
    prose=_any(r"exited while the others waited for it in a sum"),
)
SIGNALLED = Failure(
    "signal",
    "stopped by SIGTERM or SIGINT: a user, the scheduler (preemption, a time limit) or the launcher ended the job",
    # Paddle's own handler ("FatalError: `Termination signal` is detected by the operating system") when the signal
    # came before the trainer took SIGTERM over, during start-up; else the trainer's stop
    _any(r"`(Termination signal|Interrupt)` is detected"),
    "nothing is broken: continue with --resume auto (the stop line gives the whole command); a stop during start-up "
    "had nothing to save, so just run the command again",
    told=events.SIGNAL,
    prose=_any(r"\] stopped (at once )?by (a second )?SIG(TERM|INT)"),
)
LAUNCHER_GONE = Failure(
    "launcher gone",
    "this machine's launcher went away (killed or crashed), so its workers stopped, each with a checkpoint",
    None,
    "find out what ended the launcher (a kill by a user or the scheduler, the out-of-memory killer: dmesg -T), then "
    "start every machine's command again with --resume auto",
    told=events.LAUNCHER_GONE,
    prose=_any(r"its launcher (\(pid \d+\) )?went away"),
)
# a rank that stopped with the job where another took the signal: its stop line says so (session.meet)
SIGNAL_ECHO = Failure(
    "another's signal",
    "stopped with the job because another rank took a stop signal",
    None,
    "read the log of the rank this line names",
    echo=True,
    told=events.SIGNAL_ECHO,
    prose=_any(r"\] stopped by SIG\w+ at step \d+ \(.*; rank \d+ took the signal"),
)
# The failures in the order they are tried, the first that matches naming the cause. SHARED_MEMORY (a bus error)
# comes before WATCHDOG: a worker whose signal handler hung after the bus error (see cli.py) can be ended later by
# its own watchdog, and the bus error is the cause.
KNOWN = (DIVERGED, LEARNED_NOTHING, SHARED_MEMORY, WATCHDOG, PORT, OUT_OF_MEMORY, NCCL, CONNECTION, PEER_GONE)
KNOWN += (LAUNCHER_GONE, SIGNAL_ECHO, SIGNALLED)
KILLED = Failure(
    "killed",
    "killed from outside without a word: most likely the kernel's out-of-memory killer (SIGKILL)",
    # the launcher's output: "Container rank 1 status failed ... code -9", "Exit code -9"; a shell's "Killed", 137
    _any(r"\bcode -9\b", r"[Ee]xit code (-9|137)\b", r"\bKilled\b", r"killed by signal: Killed"),
    "confirm with dmesg -T | grep -iE 'out of memory|killed process' (or the container's OOMKilled status); then "
    "lower --batch-size or --eval-batch-size, run fewer workers per machine, or give the job more memory; continue "
    "with --resume auto",
)


class LogsError(ValueError):
    """Logs that cannot be read as one job's: the message names the files and what to pass instead."""


@dataclass(frozen=True)
class RankReport:
    log: Path
    rank: int | None  # global rank from the lines' tags; None if the worker died before logging
    status: str  # "finished", "error", "crashed" (traceback), "signalled" (SIGTERM/SIGINT, checkpoint saved),
    # or "stopped" (no end: killed or still running)
    where: str  # the last progress the worker reported
    message: str  # the error line or traceback, if any
    mtime: float
    failure: Failure | None = None  # the first known failure its lines show
    evidence: tuple[str, ...] = ()  # those lines
    memory_mb: int | None = None  # the last memory figure it logged
    last_line: str = ""
    earlier_runs: int = 0  # runs before the last in the same file, left unread
    world: int | None = None  # the job's world size from the lines' tags
    source: str = ""  # how the summary names the file: workerlog.N, or DIR/workerlog.N when several DIRs are read
    fallback_rank: int | None = None  # the rank assumed when no line carries one (see read_rank)
    stopped_at: float | None = None  # when its stop (a signal) was written, if it has one
    quiet: tuple[int, ...] | None = None  # the ranks its watchdog's verdict found silent, from its events
    checkpoint: tuple[int, str] | None = None  # the step and path of the last checkpoint it wrote, from its events


def known_failure(lines: list[str], told: dict[str, str] | None = None) -> tuple[Failure | None, tuple[str, ...]]:
    """The first failure of KNOWN that a log shows, and its evidence. told: the trainer's own causes its events
    name, each with its message; None for a log without events, whose English lines are read for them instead."""
    for kind in KNOWN:
        if told is not None and kind.told in told:
            return kind, (told[kind.told],)
        said = (kind.pattern,) if told is not None else (kind.pattern, kind.prose)
        found = [line.strip() for line in lines if any(p and p.search(line) for p in said)]
        if found:
            more = [line.strip() for line in lines if kind.detail and kind.detail.search(line)]
            return kind, tuple(dict.fromkeys(more + found[:3]))
    return None, ()


def last_run(text: str) -> tuple[str, int]:
    """The last run's part of a worker log, and how many runs came before it in the file."""
    lines = text.splitlines(keepends=True)
    for marker in (RUN_START, OLD_RUN_START):
        starts = [i for i, line in enumerate(lines) if marker.search(line)]
        if starts:
            return "".join(lines[starts[-1] :]), len(starts) - 1
    return text, 0


def clock_time(line: str, mtime: float) -> float | None:
    """The time a trainer's line was written (its HH:MM:SS, on the day of the file's last write, or the day before
    where that would put it after the write), to the second; None for a line without one."""
    if not (m := CLOCK.match(line)):
        return None
    written = datetime.fromtimestamp(mtime)
    at = written.replace(hour=int(m.group(1)), minute=int(m.group(2)), second=int(m.group(3)), microsecond=0)
    return at.timestamp() - (86400 if at.timestamp() > mtime + 60 else 0)


def read_rank(path: Path, source: str | None = None) -> RankReport:
    """One worker log's last run: its facts from its events (eventlog.N) where the run wrote them, else from its
    English lines. source names the file when several machines' directories are read: every machine numbers its
    files from 0, so the file's number is then no guess at its rank."""
    text, earlier = last_run(path.read_text(errors="replace").replace("\0", ""))
    lines = text.splitlines()
    mtime = path.stat().st_mtime
    facts = _events_of(path, lines)
    report = _from_events(facts, text, lines) if facts is not None else _from_lines(text, lines, mtime)
    fatal = [line.strip() for line in lines if FATAL.search(line)]
    if fatal and report["status"] == "stopped":
        report.update(status="crashed", message="\n".join(fatal))  # Paddle's C++ aborts and signals: no traceback
    if report["status"] == "finished":
        report.update(failure=None, evidence=())
    last = next((line.strip() for line in reversed(lines) if line.strip()), "")
    return RankReport(
        path,
        mtime=mtime,
        last_line=last,
        earlier_runs=earlier,
        source=source or path.name,
        fallback_rank=_number(path) if source is None else None,
        **report,
    )


def _events_of(path: Path, lines: list[str]) -> list[dict] | None:
    """The events of the log's last run, if its eventlog.N holds that run."""
    eventlog = events.path_beside(path)
    if not eventlog.is_file():
        return None
    started = next((line for line in lines if RUN_START.search(line)), None)
    return events.last_run(events.read(eventlog), started.split(" ", 1)[0] if started else None)


def _from_events(facts: list[dict], text: str, lines: list[str]) -> dict:
    start, stop = facts[0], next((e for e in reversed(facts) if e["event"] == "stop"), None)
    message = stop["message"] if stop and stop["status"] != "finished" else ""
    where, memory, checkpoint = "before the first step", None, None
    for e in facts:
        if e["event"] == "progress":
            where = f"epoch {e['epoch']}, step {e['step']} of {e['steps']}"
        elif e["event"] == "epoch":
            cut = e.get("max_steps")
            of = f"epoch {e['epoch']} of {e['epochs']}"
            where = f"--max-steps {cut} in {of}" if cut else f"end of {of}"
        elif e["event"] == "checkpoint":
            checkpoint = (e["step"], e["path"])
        memory = e.get("memory_mb", memory)
    told = {e["event"]: e.get("message", "") for e in facts if e["event"] == events.LAUNCHER_GONE}
    if stop is not None and stop.get("cause"):
        told[stop["cause"]] = stop["message"]
    failure, evidence = known_failure(lines, told)
    status = stop["status"] if stop else "stopped"
    if stop is None and PY_TRACEBACK.search(text):  # an exception the trainer did not catch
        status, message = "crashed", text[list(PY_TRACEBACK.finditer(text))[-1].start() :].strip()
    return {
        "rank": start["rank"],
        "world": start.get("world"),
        "status": status,
        "where": where,
        "message": message,
        "failure": failure,
        "evidence": evidence,
        "memory_mb": memory,
        "stopped_at": stop["t"] if stop and status == "signalled" else None,
        "quiet": tuple(stop["quiet"]) if stop and "quiet" in stop else None,
        "checkpoint": checkpoint,
    }


def _from_lines(text: str, lines: list[str], mtime: float) -> dict:
    """The same facts from the trainer's English lines: logs from before events, or from a process that could not
    write them."""
    tags = [m for m in map(TAG.search, lines) if m]
    where = "before the first step"
    for line in lines:
        if m := PROGRESS.search(line):
            where = f"epoch {m.group(3)}, step {m.group(4)} of {m.group(5)}"
        elif m := EPOCH_DONE.search(line):
            where = f"end of epoch {m.group(3)} of {m.group(4)}"
        elif m := EPOCH_CUT.search(line):
            where = f"--max-steps {m.group(5)} in epoch {m.group(3)} of {m.group(4)}"
    status, message = "stopped", ""
    errors = [line for line in lines if "] error: " in line or line.startswith("error: ")]
    signalled = [line for line in lines if "] stopped by SIG" in line or "] stopped at once by a second SIG" in line]
    if signalled:
        status, message = "signalled", signalled[-1].split("] ", 1)[1]
    elif PY_TRACEBACK.search(text):
        status, message = "crashed", text[list(PY_TRACEBACK.finditer(text))[-1].start() :].strip()
    elif errors:
        status, message = "error", errors[-1].split("error: ", 1)[1]
    elif any("] finished: " in line for line in lines):
        status = "finished"
    failure, evidence = known_failure(lines) if status != "finished" else (None, ())
    memory = [int(m.group(1)) for m in map(MEMORY.search, lines) if m]
    return {
        "rank": int(tags[-1].group(1)) if tags else None,
        "world": int(tags[-1].group(2)) if tags else None,
        "status": status,
        "where": where,
        "message": message,
        "failure": failure,
        "evidence": evidence,
        "memory_mb": memory[-1] if memory else None,
        "stopped_at": clock_time(signalled[-1], mtime) if signalled else None,
    }


def _number(workerlog: Path) -> int:
    return int(workerlog.name.rsplit(".", 1)[1])


def first_failure(reports: list[RankReport], launcher: list[str]) -> tuple[RankReport, list[str]]:
    """The rank whose failure came first, and the launcher's lines that point at it.

    A rank with a cause of its own (an error, a crash, a kill from outside) beats one whose end echoes another's
    (a lost connection, the watchdog's verdict, the launcher's SIGTERM). Among those, the ranks an ABORT!!! line
    names come first: it names the processes that ended first, which may be only the echo of a rank that hung
    before it ended. A stop by signal logged after another rank's echo ended is the launcher answering that end (it
    stops the other workers with SIGTERM), so the echo comes first. Then the log that fell silent first wins."""
    unfinished = [r for r in reports if r.status != "finished"]
    pointers = [line.strip() for line in launcher if ABORT.search(line)]
    named = {int(k) for line in pointers for k in ABORT.search(line).group(1).replace(" ", "").split(",") if k}
    own = [r for r in unfinished if not (r.failure and (r.failure.echo or r.failure is SIGNALLED))]
    candidates = own or unfinished
    candidates = [r for r in candidates if _rank_of(r) in named] or candidates
    if not own:
        # (a rank that stopped with another's signal echoes that signal, not an end the launcher answered)
        ends = [r.mtime for r in candidates if r.failure and r.failure.echo and r.failure is not SIGNAL_ECHO]
        echo_end = min(ends, default=None)
        if echo_end is not None:  # the stop's time (from a stop line, its second, floored: if after the echo's end,
            # surely after), or for Paddle's own handler, which ends the process as it writes, the log's last write
            answers = [r for r in candidates if r.failure is SIGNALLED and _stop_time(r) > echo_end]
            candidates = [r for r in candidates if r not in answers] or candidates
        candidates = [r for r in candidates if not (r.failure and r.failure.echo)] or candidates
    return min(candidates, key=lambda r: r.mtime), pointers


def _stop_time(r: RankReport) -> float:
    return r.stopped_at if r.stopped_at is not None else r.mtime


def _rank_of(r: RankReport) -> int | None:
    return r.rank if r.rank is not None else r.fallback_rank


def _who(r: RankReport) -> str:
    n = _rank_of(r)
    return f"rank {n}" if n is not None else "rank ?"


def _short(line: str) -> str:
    """The launcher's line for a failed worker holds its whole command: keep the rank, status and exit code."""
    if m := CONTAINER.search(line):
        return f"Container rank {m.group(1)} status {m.group(2)} ... code {m.group(3)}"
    return line.strip()


def _about(line: str, r: RankReport) -> bool:
    """Whether a launcher line may be about this worker: a Container line names the worker's index on its machine
    and its log file, which tells the machines apart by the directory's name (the same file here, or a copy)."""
    m = CONTAINER.search(line)
    if not m:
        return True
    if int(m.group(1)) != _number(r.log):
        return False
    if m.group(4) is None:
        return True
    named = Path(m.group(4))
    if named.exists() and r.log.exists():
        return named.resolve() == r.log.resolve()
    return named.parts[-2:] == r.log.resolve().parts[-2:]


def cause(first: RankReport, reports: list[RankReport], launcher: list[str]) -> tuple[Failure, list[str]] | None:
    """The known failure behind the first rank's end, and its evidence (lines, each with where it came from)."""
    if first.failure is PORT:
        return PORT, [f"{first.source}: {line}" for line in first.evidence] + _ports(first)
    if first.failure is not None:
        return first.failure, [f"{first.source}: {line}" for line in first.evidence]
    if first.status not in ("stopped", "crashed"):
        return None
    # silent: another rank's watchdog may have seen it go quiet; otherwise something killed it from outside
    if (n := _rank_of(first)) is not None:
        # the verdict names a quiet rank by its last step, or rank 0 as the host of the store it stopped answering
        quiet = re.compile(
            rf"rank {n} \(last seen at step \d+\)"
            + (r"|rank 0, which hosts the job's key-value store" if n == 0 else "")
        )
        for r in reports:
            if r.failure is not WATCHDOG:
                continue
            named = n in r.quiet if r.quiet is not None else any(quiet.search(line) for line in r.evidence)
            if named:
                return WATCHDOG, [f"{r.source}: {line}" for line in r.evidence]
    if first.status == "stopped":
        said = [f"launcher: {_short(line)}" for line in launcher if KILLED.pattern.search(line) and _about(line, first)]
        return KILLED, [f"{first.source} ends with: {first.last_line}", *said[-2:]]
    return None


def _ports(first: RankReport) -> list[str]:
    """The key-value store's address that the launcher gave the worker's last run, from its envlog.N: Paddle 3
    names the port only in an INFO line, which the trainer hides (log.quiet_paddle)."""
    envlog = first.log.with_name(first.log.name.replace("workerlog", "envlog"))
    found = MASTER.findall(envlog.read_text(errors="replace")) if envlog.is_file() else []
    named = first.source.replace("workerlog", "envlog")
    return [f"{named}: PADDLE_MASTER={found[-1]} (rank 0's key-value store)"] if found else []


def read_dirs(log_dirs: list[Path]) -> list[RankReport]:
    """Every worker log in these directories (one per machine), in the order of their global ranks."""
    several = len(log_dirs) > 1
    reports = []
    for log_dir in log_dirs:
        paths = sorted((p for p in log_dir.iterdir() if WORKERLOG.match(p.name)), key=_number)
        if not paths:
            raise LogsError(f"{log_dir}: no workerlog.N files; pass the launcher's --log_dir of each machine")
        reports += [read_rank(p, f"{log_dir}/{p.name}" if several else None) for p in paths]
    return sorted(reports, key=lambda r: (_rank_of(r) is None, _rank_of(r) or 0))


def check_job(reports: list[RankReport], several: bool) -> str | None:
    """Refuse logs of different jobs; say which of the job's ranks have no log here (they ran on machines whose
    directories were not given), or None if every rank has one."""
    sized = [r for r in reports if r.world is not None]
    if other := [r for r in sized if r.world != sized[0].world]:
        a, b = sized[0], other[0]
        fix = (
            "these directories hold different jobs; pass the log directories of one job, one per machine"
            if several
            else "a file left in a reused --log_dir by an earlier job of another size? move it away"
        )
        raise LogsError(f"{a.source} is from a job of {a.world} workers but {b.source} from one of {b.world}: {fix}")
    claimed: dict[int, RankReport] = {}
    for r in reports:
        if r.rank is not None and (twin := claimed.setdefault(r.rank, r)) is not r:
            raise LogsError(
                f"{twin.source} and {r.source} both hold global rank {r.rank}: the same machine's logs given twice, "
                "or directories of different runs; pass each machine's --log_dir of one job once"
            )
    if not sized or len(reports) >= sized[0].world:
        return None
    world, here = sized[0].world, "these directories hold" if several else "this directory holds"
    missing = _spans(sorted(set(range(world)) - set(claimed)))
    return (
        f"the job has {world} ranks but {here} the logs of {len(reports)} ({missing} missing): the others ran on "
        "other machines, whose log directories were not given, and the first rank to stop may be among them; pass "
        "every machine's --log_dir: python -m paddle_mnist.logs DIR1 DIR2 ..."
    )


def _spans(ranks: list[int]) -> str:
    """[1, 2, 3, 5] -> "ranks 1-3, 5"."""
    runs: list[list[int]] = []
    for n in ranks:
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    text = ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)
    return f"{'ranks' if len(ranks) > 1 else 'rank'} {text}"


def summarise(log_dirs: Path | list[Path], launcher_output: list[Path] | None = None) -> str:
    """The summary of a job's logs: a launcher's --log_dir, or one per machine of a multi-machine job."""
    dirs = [Path(log_dirs)] if isinstance(log_dirs, (str, Path)) else [Path(d) for d in log_dirs]
    dirs = list({d.resolve(): d for d in dirs}.values())  # a directory named twice (log log/) is read once
    reports = read_dirs(dirs)
    missing = check_job(reports, len(dirs) > 1)
    launcher = [line for p in launcher_output or [] for line in p.read_text(errors="replace").splitlines()]
    out = []
    if appended := [r.source for r in reports if r.earlier_runs]:
        runs = max(r.earlier_runs for r in reports)
        out.append(
            f"{', '.join(appended)} also hold {runs} earlier run{'s' if runs > 1 else ''} (the launcher appends to a "
            "reused --log_dir): ignored, only the last run of each file is read"
        )
    out += [missing] if missing else []
    for r in reports:
        named = f"  {r.failure.name}" if r.failure else ""
        out.append(f"{_who(r):8} {r.status:9} {r.where:32} {r.source}{named}")
    if all(r.status == "finished" for r in reports):
        return "\n".join(out)
    first, pointers = first_failure(reports, launcher)
    out.append("")
    out += [f"the launcher: {line[line.index('ABORT!!!') :]}" for line in pointers[-1:]]
    at = first.where if first.where.startswith("before") else f"at {first.where}"
    among = " of the ranks given (the job's first may be among the missing, see above)" if missing else ""
    out.append(f"first to stop{among}: {_who(first)} ({first.log}), {at}:")
    out.append(
        first.message
        or "it ended without an error message: killed from outside (SIGKILL, out of memory) or still running"
    )
    found = cause(first, reports, launcher)
    if found is not None:
        kind, evidence = found
        memory = ""
        if kind in (KILLED, OUT_OF_MEMORY) and first.memory_mb is not None:
            memory = f"; it last reported {first.memory_mb} MiB of memory"
        out += ["", f"cause: {kind.what}{memory}", "evidence:", *(f"  {line}" for line in evidence)]
        out.append(f"fix: {kind.fix}")
    if saved := max((r.checkpoint for r in reports if r.checkpoint), default=None):
        out.append(f"last checkpoint written: {saved[1]} (step {saved[0]})")
    return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m paddle_mnist.logs",
        usage="%(prog)s LOG_DIR [LOG_DIR ...] [LAUNCHER_OUTPUT ...]",
        description=(
            "Summarise a job's logs: each rank's progress and status, the first worker to\n"
            "stop, its likely cause with the lines that show it and the fix, and the last\n"
            "checkpoint written. It reads files only (each worker's workerlog.N and the\n"
            "facts the trainer writes beside it), during a job or after it."
        ),
        epilog=(
            "examples:\n"
            "  python -m paddle_mnist.logs log launcher.out\n"
            "  python -m paddle_mnist.logs log-0 log-1 launcher-0.out launcher-1.out\n"
            "(the second: a job on two machines, one --log_dir and launcher output each)"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "paths",
        nargs="*",
        metavar="PATH",
        help="in any order: LOG_DIR, the launcher's --log_dir (one per machine for a job on several), and "
        "LAUNCHER_OUTPUT, a file holding what the launcher itself printed (its exit codes and ABORT!!! lines)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv).paths
    paths = [Path(a) for a in args]
    if lost := [a for a, p in zip(args, paths) if not p.exists()]:
        print(
            f"error: {lost[0]} not found; pass the launcher's --log_dir (one per machine) and its output files",
            file=sys.stderr,
        )
        return 2
    dirs, files = [p for p in paths if p.is_dir()], [p for p in paths if not p.is_dir()]
    if not dirs:
        parser.print_usage(sys.stderr)
        print("error: pass the launcher's --log_dir, the folder of its workerlog.N files", file=sys.stderr)
        return 2
    try:
        print(summarise(dirs, files))
    except LogsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

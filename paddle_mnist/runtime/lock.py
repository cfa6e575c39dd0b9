"""One run per output directory: rank 0 holds a lock file naming the job for the job's whole life."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

LOCK_NAME = "run.lock"


def _me() -> dict:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "job": os.environ.get("PADDLE_JOB_ID", ""),
    }


def _describe(holder: dict) -> str:
    return (
        f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}, started {holder.get('started', '?')} "
        f"({holder.get('command', '?')})"
    )


class RunLock:
    """An exclusive flock on OUTPUT_DIR/run.lock, whose text names the holder (host, pid, start time, command).

    The kernel drops a flock when its process ends however it ends, so a lock file whose flock is free was left
    by a run that no longer exists on this machine, and is taken over. A file naming another host is respected
    whatever its flock says: flock does not reach across machines on every shared file system.
    """

    def __init__(self, output_dir: str | Path):
        self.path = Path(output_dir) / LOCK_NAME
        self.taken_over: str | None = None  # the previous holder, when its lock was left behind
        self._fd: int | None = None

    def acquire(self) -> str | None:
        """None when this process now holds the lock (or the folder cannot be made: output_dir_problem says
        why); otherwise the line that refuses the run."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError:
            return None
        for _ in range(5):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                return f"cannot create the lock {self.path} ({e.strerror}); pass a writable --output-dir"
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                return self._refusal(self._read_holder(wait=True))
            if not self._same_file(fd):  # the holder removed it between our open and flock: try the new one
                os.close(fd)
                continue
            previous = self._read_holder(wait=False)
            if previous and previous.get("host") != socket.gethostname():
                os.close(fd)
                return self._refusal(previous)
            self._fd = fd
            if previous:
                self.taken_over = _describe(previous)
            return self._write_me()
        return f"could not take the lock {self.path}: other runs keep replacing it; pass another --output-dir"

    def _same_file(self, fd: int) -> bool:
        try:
            return os.fstat(fd).st_ino == os.stat(self.path).st_ino
        except FileNotFoundError:
            return False

    def _read_holder(self, wait: bool) -> dict:
        """The holder's details; a run that has just taken the lock may not have written them yet."""
        for _ in range(10 if wait else 1):
            try:
                text = self.path.read_text()
                if text.strip():
                    return json.loads(text)
            except (OSError, ValueError):
                pass
            if wait:
                time.sleep(0.1)
        return {}

    def _refusal(self, holder: dict) -> str:
        if holder.get("host", socket.gethostname()) != socket.gethostname():
            return (
                f"--output-dir {self.path.parent} is in use by another run: {_describe(holder)}; this machine cannot "
                f"tell whether that run is still alive: if it has ended, delete {self.path} and start again, "
                "otherwise pass another --output-dir"
            )
        who = _describe(holder) if holder else "its details are not written yet"
        return (
            f"--output-dir {self.path.parent} is in use by another run: {who}; wait for it to end, "
            "or pass another --output-dir"
        )

    def _write_me(self) -> str | None:
        text = json.dumps(_me(), indent=2) + "\n"
        try:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, text.encode(), 0)
            os.fsync(self._fd)
        except OSError as e:
            self.release()
            return f"cannot write the lock {self.path} ({e.strerror}); pass a writable --output-dir"
        return None

    def release(self) -> None:
        """Remove the file, then drop the flock (in that order, so no other run can lock a file on its way out)."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            self.path.unlink()
        os.close(self._fd)
        self._fd = None

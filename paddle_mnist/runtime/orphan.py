"""No orphans: a worker whose launcher dies receives SIGTERM, so it stops as after any SIGTERM (checkpoint, exit).

Paddle's launcher starts each worker in a session of its own (os.setsid in launch/utils/process_context.py), so
a launcher that is killed (SIGKILL, a crash, an OOM kill) takes nobody with it and its workers train on unseen.
Linux can tell a process when its parent dies: prctl(PR_SET_PDEATHSIG, SIGTERM). A launcher that died before the
worker asked is caught by looking at the parent once the request is in place.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Mapping

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
LAUNCHERS = ("paddle.distributed.launch", "paddle.distributed.fleet.launch")


def is_launcher(pid: int) -> bool:
    """pid runs one of Paddle's launchers (python -m paddle.distributed.launch or its legacy fleet.launch)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().decode(errors="replace").split("\0")
    except OSError:
        return False
    return any(launcher in args for launcher in LAUNCHERS)


class Launcher:
    """The paddle.distributed.launch that started this worker, as it stood at start-up."""

    def __init__(self, environ: Mapping[str, str] | None = None):
        environ = os.environ if environ is None else environ
        ppid = os.getppid()
        self.pid = ppid if is_launcher(ppid) else None
        # the launcher sets PADDLE_LOG_DIR for every worker it starts (launch/controllers/controller.py): with it
        # and no launcher for a parent, the launcher died before this worker looked
        self.expected = "PADDLE_LOG_DIR" in environ

    def gone(self) -> bool:
        """The launcher has exited: this worker was handed to another parent (init or a subreaper)."""
        if self.pid is None:
            return self.expected
        return os.getppid() != self.pid

    def end_with_it(self) -> bool:
        """Ask Linux for SIGTERM when the launcher dies; SIGTERM now if it already has. False where this cannot be
        asked (not Linux, or no launcher started this worker)."""
        if not sys.platform.startswith("linux") or not (self.pid or self.expected):
            return False
        if self.pid is not None:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
                return False
        if self.gone():  # it died before the request was in place: nobody will send the signal
            os.kill(os.getpid(), signal.SIGTERM)
        return True

    def describe(self) -> str:
        """The one line a worker logs when the signal came from its launcher's death."""
        who = f"its launcher (pid {self.pid})" if self.pid else "its launcher"
        return (
            f"warning: {who} went away (killed, or crashed), and a worker left alone would train on unseen; "
            "stopping as after SIGTERM: at the next step every rank agrees on, with a checkpoint"
        )

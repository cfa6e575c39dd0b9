"""Rerun a launcher command while it fails, a bounded number of times: one machine's restart loop.

    python -m scripts.relaunch --attempts 5 --delay 30 -- \\
        python -m paddle.distributed.launch ... train.py --resume auto

Each attempt runs the command as given and logs one line when it starts and one when it ends (exit status,
duration). A zero exit ends the loop; a failure waits --delay seconds and runs the command again, up to
--attempts in all; the loop exits with the last attempt's status. With --resume auto the same command serves the
first start and every restart. SIGTERM or SIGINT to the loop (a preemption, scancel, a pod's eviction) is passed
to the command and ends the loop once the command has stopped: a job stopped on purpose is not restarted.

The delay is a rule, not a tuning: after a failure every machine's launcher must be gone before any machine
starts a new one, or a new launcher may find the old master still serving and join the job that is ending. A
worker notices a lost peer at once when its connections are reset (a killed process) and within 22 s through
the watchdog when they are not (a machine that lost power or its network: --collective-timeout 15 s on gloo,
then naming the quiet rank); its launcher ends a few seconds later. 30 s covers both. On GPUs, where the
watchdog's default is 300 s, pass --delay above your --collective-timeout plus 10.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

DEFAULT_ATTEMPTS = 5
DEFAULT_DELAY_S = 30.0


def log(message: str) -> None:
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} relaunch: {message}", file=sys.stderr, flush=True)


def _signal_name(number: int) -> str | None:
    try:
        return signal.Signals(number).name
    except ValueError:
        return None


def describe(code: int) -> str:
    """An exit status as the loop logs it, naming the signal where one ended the command: a negative code (the
    command itself killed), 128 + N (a shell's way of passing a signal on) or 256 - N (Paddle's launcher exits
    with a worker's negative return code, which the system takes modulo 256: a worker's SIGKILL reads 247)."""
    if code < 0:
        return f"killed by {_signal_name(-code) or f'signal {-code}'}"
    if 128 < code <= 128 + 64 and (name := _signal_name(code - 128)):
        return f"exit {code} = 128 + {name}"
    if 256 - 64 < code < 255 and (name := _signal_name(256 - code)):  # not 255: sys.exit(-1) gives that
        return f"exit {code} = 256 - {name}: a worker's signal, as Paddle's launcher reports it"
    return f"exit {code}"


class Loop:
    """Runs the command up to `attempts` times while it fails; a stop request ends it after the current one."""

    def __init__(self, command: Sequence[str], attempts: int, delay: float):
        self.command, self.attempts, self.delay = list(command), attempts, delay
        self.child: subprocess.Popen | None = None
        self.stopping = threading.Event()

    def stop(self, signum: int, _frame=None) -> None:
        """A signal handler: pass the signal to the running command, and start no other."""
        if not self.stopping.is_set():
            log(f"{signal.Signals(signum).name} received: passed to the command; no further attempt")
        self.stopping.set()
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signum)

    def run(self) -> int:
        code = 0
        for attempt in range(1, self.attempts + 1):
            if self.stopping.is_set():
                break
            log(f"attempt {attempt} of {self.attempts}: {shlex.join(self.command)}")
            started = time.monotonic()
            # a session of its own: a terminal's Ctrl-C reaches the launcher once, through stop(), not twice
            self.child = subprocess.Popen(self.command, start_new_session=True)
            code = self.child.wait()
            took = time.monotonic() - started
            if code == 0:
                log(f"attempt {attempt} of {self.attempts} succeeded after {took:.1f} s")
                return 0
            if self.stopping.is_set():
                log(f"attempt {attempt} stopped on request ({describe(code)}) after {took:.1f} s")
                break
            if attempt == self.attempts:
                log(f"attempt {attempt} of {self.attempts} failed ({describe(code)}) after {took:.1f} s; giving up")
                break
            log(
                f"attempt {attempt} of {self.attempts} failed ({describe(code)}) after {took:.1f} s; "
                f"next in {self.delay:g} s"
            )
            self.stopping.wait(self.delay)
        return 128 - code if code < 0 else code


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m scripts.relaunch",
        description=__doc__.splitlines()[0],
        usage="%(prog)s [--attempts N] [--delay S] -- COMMAND ...",
    )
    p.add_argument(
        "--attempts", type=int, default=DEFAULT_ATTEMPTS, help="runs in all, the first included (%(default)s)"
    )
    p.add_argument(
        "--delay",
        type=float,
        default=DEFAULT_DELAY_S,
        help="seconds between a failure and the next run "
        "(%(default)s: longer than a peer takes to notice the failure and end)",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="the launcher command, after --")
    args = p.parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command:
        p.error("no command: put it after --, e.g. -- python -m paddle.distributed.launch ... train.py --resume auto")
    if args.attempts < 1 or args.delay < 0:
        p.error(f"--attempts takes 1 or more and --delay 0 or more; got {args.attempts} and {args.delay:g}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if "--resume" not in args.command:
        log("warning: the command has no --resume: every attempt starts the run afresh; add --resume auto")
    loop = Loop(args.command, args.attempts, args.delay)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, loop.stop)
    return loop.run()


if __name__ == "__main__":
    sys.exit(main())

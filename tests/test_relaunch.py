"""scripts.relaunch, the bounded restart loop, on real commands: reruns a failure, gives up, never restarts a stop.

Its use on two machines with the trainer is tests/test_multihost.py's and scripts/restart_trials.py's.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO, launch_env

from scripts.relaunch import describe

pytestmark = pytest.mark.slow  # starts real processes

# a command that counts its runs in a file and fails until its run number reaches the first argument
COUNTING = """
import pathlib, sys
runs = pathlib.Path(sys.argv[2]); n = int(runs.read_text() if runs.exists() else 0) + 1; runs.write_text(str(n))
sys.exit(0 if n >= int(sys.argv[1]) else 7)
"""


def relaunch(args: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "scripts.relaunch", *args]
    return subprocess.run(cmd, cwd=REPO, env=launch_env(), capture_output=True, text=True, timeout=timeout)


def counting(succeed_at: int, runs: Path) -> list[str]:
    return [sys.executable, "-c", COUNTING, str(succeed_at), str(runs), "--resume", "auto"]


def test_a_failing_command_is_rerun_until_it_succeeds(tmp_path):
    runs = tmp_path / "runs"
    proc = relaunch(["--attempts", "5", "--delay", "0.2", "--", *counting(3, runs)])
    assert proc.returncode == 0, proc.stderr
    assert runs.read_text() == "3"
    assert "attempt 1 of 5: " in proc.stderr and "attempt 2 of 5 failed (exit 7) after " in proc.stderr
    assert "next in 0.2 s" in proc.stderr and "attempt 3 of 5 succeeded after " in proc.stderr
    assert "attempt 4" not in proc.stderr and "warning" not in proc.stderr


def test_the_loop_gives_up_with_the_last_status(tmp_path):
    runs = tmp_path / "runs"
    started = time.monotonic()
    proc = relaunch(["--attempts", "3", "--delay", "0.5", "--", *counting(99, runs)])
    assert proc.returncode == 7 and runs.read_text() == "3", proc.stderr
    assert "attempt 3 of 3 failed (exit 7)" in proc.stderr and "giving up" in proc.stderr
    assert time.monotonic() - started >= 2 * 0.5


def test_a_killed_command_is_rerun_and_a_command_without_resume_is_warned_about(tmp_path):
    marker = tmp_path / "killed-once"
    kill_once = (
        f"import os, pathlib, signal; m = pathlib.Path({str(marker)!r})\n"
        "if not m.exists(): m.write_text(''); os.kill(os.getpid(), signal.SIGKILL)"
    )
    proc = relaunch(["--delay", "0", "--", sys.executable, "-c", kill_once])
    assert proc.returncode == 0, proc.stderr
    assert "attempt 1 of 5 failed (killed by SIGKILL)" in proc.stderr and "attempt 2 of 5 succeeded" in proc.stderr
    assert "warning: the command has no --resume" in proc.stderr


def test_a_stop_request_is_passed_on_once_and_ends_the_loop(tmp_path):
    """SIGTERM to the loop (a preemption): the command gets it once, stops, and no attempt follows."""
    got = tmp_path / "got"
    trap = (
        "import pathlib, signal, sys, time\n"
        f"got = pathlib.Path({str(got)!r})\n"
        "def on(signum, frame): got.write_text(got.read_text() + 'TERM ' if got.exists() else 'TERM ')\n"
        "signal.signal(signal.SIGTERM, on); print('ready', flush=True); time.sleep(2); sys.exit(143)\n"
    )
    cmd = [sys.executable, "-m", "scripts.relaunch", "--delay", "0", "--", sys.executable, "-c", trap, "--resume"]
    loop = subprocess.Popen(cmd, cwd=REPO, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert loop.stdout.readline().strip() == "ready"
        loop.send_signal(signal.SIGTERM)
        _, stderr = loop.communicate(timeout=30)
    finally:
        if loop.poll() is None:
            loop.kill()
    assert loop.returncode == 143, stderr
    assert got.read_text() == "TERM ", got.read_text()
    assert "SIGTERM received: passed to the command; no further attempt" in stderr
    assert "attempt 1 stopped on request (exit 143 = 128 + SIGTERM)" in stderr and "attempt 2" not in stderr


def test_no_command_is_refused_in_one_line():
    proc = relaunch(["--attempts", "3"])
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith(
        "python -m scripts.relaunch: error:"
    )
    assert "no command: put it after --" in proc.stderr


@pytest.mark.parametrize(
    "code,line",
    [
        (0, "exit 0"),
        (2, "exit 2"),
        (-9, "killed by SIGKILL"),
        (143, "exit 143 = 128 + SIGTERM"),
        (247, "exit 247 = 256 - SIGKILL: a worker's signal, as Paddle's launcher reports it"),
        (250, "exit 250 = 256 - SIGABRT: a worker's signal, as Paddle's launcher reports it"),
        (255, "exit 255"),
    ],
)
def test_an_ending_names_the_signal_behind_its_code(code, line):
    assert describe(code) == line

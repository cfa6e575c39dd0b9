"""`python -m paddle_mnist.plots`: its help, and a folder that is not a run's."""

from __future__ import annotations

import subprocess
import sys

from helpers import REPO, launch_env


def plots(*args: str, cwd) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "paddle_mnist.plots", *args]
    return subprocess.run(cmd, cwd=cwd, env=launch_env(), capture_output=True, text=True, timeout=120)


def test_help_says_what_the_command_takes(tmp_path):
    for flag in ("--help", "-h"):
        proc = plots(flag, cwd=tmp_path)
        assert proc.returncode == 0 and proc.stdout.startswith("usage: python -m paddle_mnist.plots OUTPUT_DIR"), proc
        assert "not found" not in proc.stdout + proc.stderr


def test_a_folder_without_metrics_or_an_unknown_flag_is_refused_in_one_line(tmp_path):
    proc = plots(str(tmp_path), cwd=REPO)
    assert proc.returncode == 1
    assert proc.stderr.strip() == f"error: {tmp_path}/metrics.jsonl not found; pass the --output-dir of a run"
    proc = plots("--verbose", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith("usage: python -m paddle_mnist.plots OUTPUT_DIR")

"""One run per output directory: a second run is refused while the first holds the folder; a dead holder's lock
is taken over."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys

import pytest
from helpers import (
    TRAIN_PY,
    explain,
    launch_env,
    make_dataset,
    run_launch,
    run_single,
    small_run,
    wait_for,
    worker_log,
)

from paddle_mnist.runtime.lock import LOCK_NAME, RunLock

ARGS = small_run(eval_limit=64, batch_size=64, log_every=1, lr=None)


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.mark.slow
def test_second_run_into_a_busy_output_dir_is_refused_with_the_holder_then_sigint_stops_the_first(tmp_path):
    """Refused through the launcher and without it, before training, naming the holder's pid; the first run goes
    on untouched, and Ctrl-C (SIGINT) then stops it cleanly (exit 130), releasing the folder."""
    args = [*ARGS, "--data-dir", str(make_dataset(tmp_path / "mnist", n_train=512, n_test=64))]
    out, first_log = tmp_path / "o", tmp_path / "first.log"
    with open(first_log, "w") as log:
        first = subprocess.Popen(
            [sys.executable, str(TRAIN_PY), *args, "--epochs", "500", "--output-dir", str(out)],
            cwd=tmp_path, env=launch_env(), stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        wait_for(first, first_log, "epoch 1 step 1/8")
        holder = json.loads((out / LOCK_NAME).read_text())
        assert holder["pid"] == first.pid and holder["host"] == socket.gethostname()

        launched = run_launch([*args, "--output-dir", str(out), "--overwrite"], cwd=tmp_path, log_dir=tmp_path / "l")
        alone = run_single([*args, "--output-dir", str(out), "--resume", "auto"], cwd=tmp_path)
        for proc, text in ((launched, worker_log(tmp_path / "l", 0)), (alone, alone.stdout + alone.stderr)):
            assert proc.returncode == 2, explain(proc, tmp_path / "l")
            errors = [line for line in text.splitlines() if "error:" in line]
            assert len(errors) == 1, errors
            assert f"{out} is in use by another run: pid {first.pid} on {socket.gethostname()}" in errors[0]
            assert "epoch 1 step" not in text  # refused before training
        assert "rank 0 refused --output-dir" in worker_log(tmp_path / "l", 1)
        assert first.poll() is None and json.loads((out / LOCK_NAME).read_text())["pid"] == first.pid

        first.send_signal(signal.SIGINT)
        assert first.wait(timeout=30) == 128 + signal.SIGINT
    finally:
        if first.poll() is None:
            first.kill()
    assert "stopped by SIGINT at step" in first_log.read_text()
    assert not (out / LOCK_NAME).exists()


@pytest.mark.slow
def test_stale_lock_of_a_dead_process_is_taken_over_with_a_warning(tmp_path):
    args = [*ARGS, "--data-dir", str(make_dataset(tmp_path / "mnist", n_train=64, n_test=16)), "--epochs", "1"]
    out = tmp_path / "o"
    out.mkdir()
    pid = dead_pid()
    stale = {"host": socket.gethostname(), "pid": pid, "started": "2026-01-01 00:00:00 UTC", "command": "train.py"}
    (out / LOCK_NAME).write_text(json.dumps(stale))
    proc = run_single([*args, "--train-limit", "64", "--output-dir", str(out)], cwd=tmp_path)
    assert proc.returncode == 0, explain(proc)
    warnings = [line for line in (proc.stdout + proc.stderr).splitlines() if "warning: took over" in line]
    assert len(warnings) == 1 and f"pid {pid} on {socket.gethostname()}" in warnings[0], warnings
    assert (out / "model.pdparams").is_file() and not (out / LOCK_NAME).exists()


def test_lock_naming_another_host_is_respected_and_a_live_holder_refuses_a_second_lock(tmp_path):
    other = {"host": "node-17", "pid": 4242, "started": "2026-01-01 00:00:00 UTC", "command": "train.py"}
    (tmp_path / LOCK_NAME).write_text(json.dumps(other))
    refusal = RunLock(tmp_path).acquire()
    assert "pid 4242 on node-17" in refusal and f"delete {tmp_path / LOCK_NAME}" in refusal, refusal

    (tmp_path / LOCK_NAME).unlink()
    mine = RunLock(tmp_path)
    assert mine.acquire() is None and mine.taken_over is None
    try:
        refusal = RunLock(tmp_path).acquire()  # another open file description: flock refuses it
        assert refusal and "is in use by another run: pid" in refusal, refusal
    finally:
        mine.release()
    assert not (tmp_path / LOCK_NAME).exists()

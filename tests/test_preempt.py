"""Preemption on real processes: SIGTERM to the launcher mid-epoch and during evaluation, SIGINT to one process."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import (
    TRAIN_PY,
    check_read_by_facts,
    explain,
    launch_env,
    make_dataset,
    rank_pid,
    reaped,
    run_launch,
    small_run,
    weights,
    worker_log,
)

from paddle_mnist.files import checkpoint
from paddle_mnist.files.logs import summarise

pytestmark = pytest.mark.slow  # each test starts the trainer under the launcher and stops it with a signal

# 64 steps an epoch: the ranks meet about every 0.25 s, so a signal early in the epoch stops it mid-epoch
ARGS = small_run(train_limit=4096, eval_limit=100, batch_size=64, epochs=2)
STOP_LINE = re.compile(
    r"stopped by (SIG\w+) at step (\d+) \(([^)]*)\); checkpoint (\S+); continue with: (.*--resume auto)$", re.M
)


def launch(args: list[str], log_dir: Path, cwd: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2", "--log_dir", str(log_dir)]
    cmd += [str(TRAIN_PY), *args]
    return subprocess.Popen(cmd, cwd=cwd, env=launch_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def signal_when(job, log: Path, ready: str, not_yet: str = "", sig=signal.SIGTERM, rank: int | None = None) -> float:
    """Send sig to job (or to one rank's worker) once log matches the regex ready (and holds no not_yet); when."""
    deadline = time.time() + 120
    while True:
        text = log.read_text() if log.exists() else ""
        if re.search(ready, text):
            assert not not_yet or not_yet not in text, f"too late: {not_yet!r} already logged"
            break
        assert time.time() < deadline and job.poll() is None, f"never saw {ready!r}"
        time.sleep(0.01)
    if rank is None:
        job.send_signal(sig)
    else:
        os.kill(rank_pid(Path(job.args[job.args.index("--output-dir") + 1]), rank), sig)
    return time.time()


def stop_lines(log_dir: Path) -> list[re.Match]:
    found = [STOP_LINE.search(worker_log(log_dir, rank)) for rank in (0, 1)]
    assert all(found), "\n".join(worker_log(log_dir, r)[-1500:] for r in (0, 1))
    return found


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("data") / "mnist", n_train=4096, n_test=1000)


@pytest.mark.readme
def test_sigterm_mid_epoch_and_during_evaluation_then_resume_equals_uninterrupted(tmp_path, data_dir):
    """SIGTERM twice: to a real launcher mid-epoch, then (after resuming) to rank 1 alone while the workers
    evaluate, as srun or scancel may reach one node first; each time both workers stop at one step with a
    checkpoint, and the run resumed to the end has an uninterrupted run's weights, bit for bit."""
    args = [*ARGS, "--data-dir", str(data_dir)]
    full = run_launch([*args, "--output-dir", str(tmp_path / "full")], cwd=tmp_path, log_dir=tmp_path / "l0")
    assert full.returncode == 0, explain(full, tmp_path / "l0")
    out = tmp_path / "stopped"

    job = launch([*args, "--output-dir", str(out)], tmp_path / "l1", tmp_path)
    sent = signal_when(job, tmp_path / "l1" / "workerlog.0", "epoch 1 step 8/64")
    code = job.wait(timeout=60)
    took = time.time() - sent
    assert code == signal.SIGTERM, explain(subprocess.CompletedProcess([], code, "", ""), tmp_path / "l1")
    assert took < 10, f"the job took {took:.1f} s to stop"
    first, other = stop_lines(tmp_path / "l1")
    assert first.group(1) == "SIGTERM" and first.group(2) == other.group(2), (first.group(0), other.group(0))
    step = int(first.group(2))
    assert 8 <= step < 64 and first.group(3) == f"epoch 1, batch {step} of 64"
    assert Path(first.group(4)) == checkpoint.checkpoint_path(out, step) and Path(first.group(4)).is_file()
    assert "paddle.distributed.launch" in first.group(5) and str(out) in first.group(5)
    summary = summarise(tmp_path / "l1")
    assert "rank 0   signalled" in summary and "cause: stopped by SIGTERM or SIGINT" in summary, summary
    assert "fix: nothing is broken: continue with --resume auto" in summary
    check_read_by_facts(tmp_path / "l1", summary)

    # resumed, and rank 1 alone is stopped while the workers evaluate epoch 1 (1000 test images, 2 at a time)
    job = launch(
        [*args, "--output-dir", str(out), "--resume", "auto", "--eval-limit", "1000", "--eval-batch-size", "2"],
        tmp_path / "l2",
        tmp_path,
    )
    # the last step of epoch 1 is logged as "step N/N" (N: the steps left after the checkpoint), evaluation follows
    log0 = tmp_path / "l2" / "workerlog.0"
    signal_when(job, log0, r"epoch 1 step (\d+)/\1 ", not_yet="epoch 1/2 done", rank=1)
    # the launcher reports a worker's status: 143, or its own SIGKILL's if that worker took over 3 s to exit
    assert job.wait(timeout=60) != 0
    first, other = stop_lines(tmp_path / "l2")
    assert (other.group(2), other.group(3)) == ("64", "end of epoch 1")  # rank 1 took the signal
    assert (first.group(2), first.group(3)) == ("64", "end of epoch 1; rank 1 took the signal, this rank none")
    text = worker_log(tmp_path / "l2", 0)
    assert text.index("epoch 1/2 done") < text.index("stopped by SIGTERM")  # evaluation finished, then it stopped
    assert checkpoint.checkpoint_path(out, 64).is_file()

    again = run_launch([*args, "--output-dir", str(out), "--resume", "auto"], cwd=tmp_path, log_dir=tmp_path / "l3")
    assert again.returncode == 0, explain(again, tmp_path / "l3")
    assert "resumed from" in worker_log(tmp_path / "l3", 0) and "step 64" in worker_log(tmp_path / "l3", 0)
    a, b = weights(tmp_path / "full" / "model.pdparams"), weights(out / "model.pdparams")
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(b[name], a[name], err_msg=name)


def test_sigterm_during_start_up_stops_before_training_with_nothing_to_save(tmp_path, data_dir):
    out, log_path = tmp_path / "o", tmp_path / "run.log"
    with open(log_path, "w") as log:
        job = subprocess.Popen(
            [sys.executable, str(TRAIN_PY), *ARGS, "--data-dir", str(data_dir), "--output-dir", str(out)],
            cwd=tmp_path, env=launch_env(), stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    signal_when(job, log_path, "rank 0 of world size 1")  # logged before the data loads
    assert job.wait(timeout=60) == 128 + signal.SIGTERM
    text = log_path.read_text()
    assert "stopped by SIGTERM at step 0 (before training); nothing trained yet, so no checkpoint" in text, text
    assert "--resume auto" in text and "epoch 1 step" not in text and "Traceback" not in text
    assert not checkpoint.list_checkpoints(out)


STOPPING = """
import sys, time
import paddle  # installs Paddle's own handler, which aborts on SIGTERM
from paddle_mnist.runtime import preempt
preempt.SAME_REQUEST_S = float(sys.argv[1])  # the test's window
stop = preempt.StopSignals().install()
print("ready", flush=True)
while not stop.signum:
    time.sleep(0.01)
print("stopping", flush=True)
time.sleep(60)  # a stop that takes long: only a second signal ends it
"""
WINDOW_S = 4.0  # twice SAME_REQUEST_S: the repeat, sent half-way through, has 2 s to spare


def test_repeats_within_the_window_are_one_request_and_a_later_signal_ends_at_once(tmp_path):
    """Paddle's launcher passes SIGTERM on three times, 0.2 s apart: one request, as is any repeat within
    SAME_REQUEST_S of the first (set to WINDOW_S here). A signal after that ends the process at once with 128 + its
    number, even while the trainer is busy stopping. The repeat goes half a window after the first signal; the
    late signal a second after the window closes, counted from the moment the process said it had taken the first
    signal, so a busy machine can only make it later."""
    job = subprocess.Popen(
        [sys.executable, "-c", STOPPING, str(WINDOW_S)], env=launch_env(), stdout=subprocess.PIPE, text=True
    )
    with reaped(job):
        assert job.stdout.readline().strip() == "ready"
        first = time.monotonic()
        for _ in range(3):
            job.send_signal(signal.SIGTERM)
            time.sleep(0.2)
        assert job.stdout.readline().strip() == "stopping"
        taken = time.monotonic()  # the process took the first signal between first and now
        time.sleep(max(0.0, first + WINDOW_S / 2 - time.monotonic()))
        job.send_signal(signal.SIGTERM)  # still the same request
        repeat = time.monotonic() - first
        time.sleep(max(0.0, taken + WINDOW_S + 1 - time.monotonic()))
        assert job.poll() is None, f"a repeat {repeat:.1f} s after the first signal ended the process"
        sent = time.monotonic()
        job.send_signal(signal.SIGINT)
        assert job.wait(timeout=10) == 128 + signal.SIGINT
        assert time.monotonic() - sent < 2

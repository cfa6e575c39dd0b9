"""Automatic restart by Paddle's elastic launcher (etcd master): a killed worker comes back and resumes.

Needs Debian's etcd-server and the etcd3 client with protobuf 3.20 (.ci/requirements-elastic.txt), so it
is marked `elastic` and left out of the default run; CI runs it in its own environment:
    python -m pytest -m elastic tests/test_elastic.py
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
from helpers import TRAIN_PY, explain, free_port, launch_env, make_dataset, run_launch, weights, worker_log
from test_recovery import ARGS, kill_rank_1_in_epoch_2

pytestmark = [pytest.mark.elastic, pytest.mark.slow]


@pytest.fixture
def etcd(tmp_path):
    binary = shutil.which("etcd")
    assert binary, "etcd not found: apt-get install etcd-server"
    client, peer = free_port(), free_port()
    cmd = [binary, "--data-dir", str(tmp_path / "etcd"), "--name", "test"]
    cmd += [
        "--listen-client-urls",
        f"http://127.0.0.1:{client}",
        "--advertise-client-urls",
        f"http://127.0.0.1:{client}",
    ]
    cmd += [
        "--listen-peer-urls",
        f"http://127.0.0.1:{peer}",
        "--initial-advertise-peer-urls",
        f"http://127.0.0.1:{peer}",
    ]
    cmd += ["--initial-cluster", f"test=http://127.0.0.1:{peer}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 30
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", client), timeout=1):
            break
        assert time.time() < deadline and proc.poll() is None, "etcd did not start"
        time.sleep(0.2)
    yield f"127.0.0.1:{client}"
    proc.kill()
    proc.wait()


class LauncherGaveUp(RuntimeWarning):
    """Shown in the test summary (the project's pytest settings hide UserWarning)."""


def gave_up_without_restarting(output: str) -> bool:
    """Paddle 3.3.1's elastic launcher lost its own race: after a failure it checks whether the job is
    "restarting" before its etcd watch has said so, and exits (controllers/collective.py,
    CollectiveElasticController.run). Seen in 2 of 27 runs here; our code plays no part in it."""
    return output.count("Run Pod") == 1 and "Pod failed" in output and "peer not ready" in output


def run_elastic_and_kill(etcd: str, attempt: int, args: list[str], tmp_path: Path) -> tuple[int, str, Path, Path]:
    out, log_dir = tmp_path / f"elastic{attempt}", tmp_path / f"l{attempt}"
    launch = [sys.executable, "-m", "paddle.distributed.launch", "--master", f"etcd://{etcd}"]
    launch += ["--job_id", f"t{attempt}", "--nnodes", "1", "--nproc_per_node", "2"]
    launch += ["--elastic_level", "1", "--max_restart", "3", "--log_dir", str(log_dir)]
    launch += [str(TRAIN_PY), *args, "--output-dir", str(out)]
    env = dict(launch_env(), GRPC_ENABLE_FORK_SUPPORT="false")  # grpcio's fork handlers crash workers
    job = subprocess.Popen(launch, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        kill_rank_1_in_epoch_2(job, out)
        output, _ = job.communicate(timeout=240)
    finally:
        if job.poll() is None:
            job.kill()
    return job.returncode, output, out, log_dir


def test_killed_worker_is_restarted_and_resumes_without_a_human(etcd, tmp_path):
    data_dir = make_dataset(tmp_path / "mnist", n_train=2048, n_test=100)
    args = [*ARGS, "--data-dir", str(data_dir), "--save-every-steps", "5", "--resume", "auto"]
    full = run_launch([*args, "--output-dir", str(tmp_path / "full")], cwd=tmp_path, log_dir=tmp_path / "l0")
    assert full.returncode == 0, explain(full, tmp_path / "l0")

    # The launcher's race is counted and reported, never hidden: each lost race is a warning in the
    # test summary, and three in a row (about 1 in 2,500 at the rate seen here) fail the test.
    for attempt in range(1, 4):
        returncode, output, out, log_dir = run_elastic_and_kill(etcd, attempt, args, tmp_path)
        if not (returncode != 0 and gave_up_without_restarting(output)):
            break
        lost = f"attempt {attempt}: Paddle's elastic launcher exited instead of restarting (its race)"
        warnings.warn(lost, LauncherGaveUp, stacklevel=1)
    assert returncode == 0, output[-4000:]
    assert output.count("Run Pod") >= 2, output[-4000:]  # started, then restarted
    assert "resumed from" in worker_log(log_dir, 0)
    a, b = weights(tmp_path / "full" / "model.pdparams"), weights(out / "model.pdparams")
    for name in a:
        np.testing.assert_array_equal(b[name], a[name], err_msg=name)

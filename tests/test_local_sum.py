"""Sums through shared memory: the same bits on every rank, in rank order; a rank gone or stopped ends the wait,
naming it; nothing left in /dev/shm; gloo, with the size it needed, where /dev/shm cannot hold the segment."""

from __future__ import annotations

import contextlib
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
    PLAIN_MNIST,
    REAL_JOB,
    REPO,
    TRAIN_PY,
    explain,
    launch_env,
    make_dataset,
    param_digest,
    rank_pid,
    reaped,
    run_launch,
    small_run,
    wait_for,
    watch_end,
    worker_log,
)

from paddle_mnist.runtime import local_sum
from paddle_mnist.runtime.local_sum import LocalSum

# One rank of a job of LocalSums, in a process of its own: argv is the rank, the world, the segment's path, an
# output .npz and a deadline; rank 0 creates the segment (its path then written to PATH.created). Three sums of
# float32 (one of two parts, scaled), one of float64, one max, then float64 sums rounded into float32 arrays (three
# of them, a float32 sum between the last two); each rank's values drawn from its own seed.
RANK = r"""
import sys, time, numpy as np
from paddle_mnist.runtime.local_sum import LocalSum
ORDERED = (1 + 2**-24, 2**-53 + 2**-60, -(2**-53))
rank, world, path, out, deadline = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], float(sys.argv[5])
if rank == 0:
    s = LocalSum.create(world, 1 << 16, deadline)
    open(path + ".created", "w").write(s.path)
else:
    while True:
        try:
            s = LocalSum.attach(open(path + ".created").read(), rank, world, 1 << 16, deadline)
            break
        except OSError:
            time.sleep(0.01)
rng = np.random.default_rng(rank)
got = {}
a, b = rng.standard_normal(1000).astype(np.float32), rng.standard_normal((7, 3)).astype(np.float32)
s.sum_into([a, b], scale=1 / world)
got["a"], got["b"] = a, b
got["c"] = s.sum(rng.standard_normal(5000).astype(np.float32))
got["d"] = s.sum(rng.standard_normal(300))
got["m"] = s.max(rng.standard_normal(50))
e, f = rng.standard_normal(400), rng.standard_normal((5, 4))
kept = e.copy(), f.copy()
got["e"], got["f"] = np.empty(400, np.float32), np.empty((5, 4), np.float32)
s.sum_rounded_into([e, f], [got["e"], got["f"]])
assert np.array_equal(e, kept[0]) and np.array_equal(f, kept[1])  # the parts keep their values
# rounded sums one after another and between plain ones (the sets in turn), a part of fewer values than ranks
g, h = rng.standard_normal(1), rng.standard_normal(33)
got["g"], got["h"] = np.empty(1, np.float32), np.empty(33, np.float32)
s.sum_rounded_into([g, h], [got["g"], got["h"]])
got["i"] = s.sum(rng.standard_normal(64).astype(np.float32))
j = rng.standard_normal((9, 7))
got["j"] = np.empty((9, 7), np.float32)
s.sum_rounded_into([j], [got["j"]])
# values whose float64 sum rounds to another float32 if the ranks are added in another order (expected())
got["k"] = np.empty(6, np.float32)
s.sum_rounded_into([np.full(6, ORDERED[rank])], [got["k"]])
print("entered", flush=True)
if len(sys.argv) > 6:  # a sum rank 0 enters and the others never do
    if rank == 0:
        s.sum(np.ones(3))
    else:
        time.sleep(600)
np.savez(out, **got)
"""


def start_ranks(tmp_path: Path, world: int, deadline: float = 30.0, stall_after: bool = False):
    path = str(tmp_path / "segment")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    extra = ["stall"] if stall_after else []
    return [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(r), str(world), path, str(tmp_path / f"{r}.npz"), str(deadline), *extra],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]


def expected(world: int) -> dict:
    """What every rank must hold: each rank's values from its seed, added in rank order."""
    draws = []
    for r in range(world):
        rng = np.random.default_rng(r)
        a, b = rng.standard_normal(1000).astype(np.float32), rng.standard_normal((7, 3)).astype(np.float32)
        c = rng.standard_normal(5000).astype(np.float32)
        d, m = rng.standard_normal(300), rng.standard_normal(50)
        e, f = rng.standard_normal(400), rng.standard_normal((5, 4))
        g, h = rng.standard_normal(1), rng.standard_normal(33)
        i = rng.standard_normal(64).astype(np.float32)
        j = rng.standard_normal((9, 7))
        # 1 + 2^-24 lies halfway between two float32s: in rank order 0, 1, 2 the float64 sum stays on it and
        # rounds to 1, as rank 0 then 2 then 1 would not (1 + 2^-23); on 2 ranks it rounds up
        k = np.full(6, (1 + 2**-24, 2**-53 + 2**-60, -(2**-53))[r])
        draws.append((a, b, c, d, m, e, f, g, h, i, j, k))
    scale = np.float32(1 / world)
    want = {}
    for i, key in enumerate("abcdmefghijk"):
        parts = [d[i] * scale if key in "ab" else d[i] for d in draws]
        total = parts[0].copy()
        for part in parts[1:]:
            total = np.maximum(total, part) if key == "m" else total + part
        want[key] = total.astype(np.float32) if key in "efghjk" else total  # added in float64, rounded once
    return want


def shm_files(procs=None) -> set[str]:
    """The shared-memory names in the directory; with procs, only those their processes made (each name holds its
    maker's pid), not another test's running beside this one (pytest -n)."""
    names = {p.name for p in Path(local_sum.DIRECTORY).glob("paddle_mnist-*")}
    if procs is None:
        return names
    pids = {str(proc.pid) for proc in procs}
    return {name for name in names if name.split("-")[1] in pids}


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_holds_the_sum_in_rank_order_to_the_bit(tmp_path, world):
    before = shm_files()
    ranks = start_ranks(tmp_path, world)
    for r, proc in enumerate(ranks):
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"rank {r}: {err[-2000:]}"
    Path(tmp_path / "segment.created").unlink()
    want = expected(world)
    for r in range(world):
        got = np.load(tmp_path / f"{r}.npz")
        for key, value in want.items():
            assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
            assert got[key].tobytes() == value.tobytes(), f"rank {r}, {key}: not the rank-order sum to the bit"
    # the processes never removed the name (rank 0 of a job does, in distributed.open_local_sum): this test must
    shm_now = shm_files(ranks) - before
    for name in shm_now:
        os.unlink(Path(local_sum.DIRECTORY) / name)
    assert len(shm_now) == 1, shm_now


def test_a_rank_killed_while_the_others_wait_is_named_within_two_seconds(tmp_path):
    before = shm_files()
    rank_0, rank_1 = start_ranks(tmp_path, 2, stall_after=True)
    try:
        assert rank_1.stdout.readline().strip() == "entered", rank_1.stderr.read()
        assert rank_0.stdout.readline().strip() == "entered", rank_0.stderr.read()
        time.sleep(0.5)  # rank 0 waits in a sum rank 1 never enters
        rank_1.kill()  # left unreaped (a zombie) on purpose: the wait must see through that
        t0 = time.monotonic()
        _, err = rank_0.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        for proc in (rank_0, rank_1):
            proc.kill()
            proc.wait()
        for name in shm_files((rank_0, rank_1)) - before:
            os.unlink(Path(local_sum.DIRECTORY) / name)
    assert rank_0.returncode != 0
    assert re.search(r"SumTimeout: rank 1 \(pid \d+\) exited while the others waited for it", err), err[-2000:]
    assert took < 2.0, f"named {took:.1f} s after the kill"


def test_a_stopped_rank_ends_the_wait_at_the_deadline_without_spinning_meanwhile(tmp_path):
    before = shm_files()
    rank_0, rank_1 = start_ranks(tmp_path, 2, deadline=3.0, stall_after=True)
    try:
        assert rank_1.stdout.readline().strip() == "entered", rank_1.stderr.read()
        assert rank_0.stdout.readline().strip() == "entered", rank_0.stderr.read()
        os.kill(rank_1.pid, signal.SIGSTOP)  # rank 0 enters the last sum and waits for a rank that never comes
        t0 = time.monotonic()
        cpu0 = _cpu_seconds(rank_0.pid)
        time.sleep(2.0)
        cpu_used = _cpu_seconds(rank_0.pid) - cpu0
        _, err = rank_0.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(rank_1.pid, signal.SIGKILL)
        for proc in (rank_0, rank_1):
            proc.kill()
            proc.wait()
        for name in shm_files((rank_0, rank_1)) - before:
            os.unlink(Path(local_sum.DIRECTORY) / name)
    assert "SumTimeout: rank 1 did not reach the sum over the workers within 3 s" in err, err[-2000:]
    assert 2.5 < took < 6.0, took
    assert cpu_used < 0.5, f"rank 0 used {cpu_used:.2f} s of CPU in 2 s of waiting: it spins instead of sleeping"


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_two_segments_never_share_a_name_and_a_foreign_size_is_refused():
    first, second = LocalSum.create(2, 4096), LocalSum.create(2, 4096)
    try:
        assert first.path != second.path
        with pytest.raises(OSError, match="not this job's segment"):
            LocalSum.attach(first.path, 1, 3, 4096)  # a job of another world size
        with pytest.raises(FileExistsError):  # O_EXCL: an existing name is never taken over
            os.close(os.open(first.path, os.O_CREAT | os.O_EXCL | os.O_RDWR))
    finally:
        for s in (first, second):
            s.unlink()
            s.close()
    assert not Path(first.path).exists() and not Path(second.path).exists()


# The trainer's jobs: the default model (batch norm, float32 gradients) on 2 workers

JOB = [*small_run(train_limit=1024, eval_limit=200, batch_size=64, epochs=1, log_every=4), "--model", "mnist_cnn_bn_fc"]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["mnist_cnn_bn_fc", "mnist_cnn"])
def test_two_workers_train_glooes_weights_through_shared_memory_and_leave_nothing_in_dev_shm(tmp_path, model):
    """Shipped MNIST, the default model (batch norm: float32 gradients, DataParallel's averaging replaced) and
    mnist_cnn (float64 sums: each summed in its own memory through shared memory, as one buffer over gloo)."""
    before = shm_files()
    digests = {}
    for sums in ("shared-memory", "gloo"):
        args = [*REAL_JOB, "--model", model, "--output-dir", str(tmp_path / sums), "--cpu-sums", sums]
        proc = run_launch(args, cwd=tmp_path, log_dir=tmp_path / f"log-{sums}")
        assert proc.returncode == 0, explain(proc, tmp_path / f"log-{sums}")
        log = worker_log(tmp_path / f"log-{sums}", 1)
        digests[sums] = param_digest(log)
        assert param_digest(worker_log(tmp_path / f"log-{sums}", 0)) == digests[sums]
        line = "sums over the workers: shared memory" if sums == "shared-memory" else "sums over the workers: gloo"
        assert line in log, log[-2000:]
    # each rank's gradient scaled by 1/2 and the two added: the same float32 sum in either order
    assert digests["shared-memory"] == digests["gloo"]
    assert shm_files() == before


@pytest.mark.slow
def test_a_worker_killed_mid_training_is_named_and_leaves_nothing_in_dev_shm(tmp_path):
    """Killed mid-epoch (step 8 of 128): rank 0 then waits in a shared-memory sum, not in a gloo gather. The epoch
    is long enough that the kill lands within it on a loaded machine (with 32 steps an epoch, a default-model step
    of 5 ms, and a second test beside it, rank 0 once reached the epoch's end, and gloo's gather, first)."""
    before = shm_files()
    data_dir = make_dataset(tmp_path / "mnist", n_train=8192, n_test=100)
    args = [
        *JOB,
        "--train-limit",
        "8192",
        "--epochs",
        "5",
        "--data-dir",
        str(data_dir),
        "--output-dir",
        str(tmp_path / "o"),
    ]
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2", "--log_dir", str(tmp_path / "l")]
    job = subprocess.Popen([*cmd, str(TRAIN_PY), *args], cwd=tmp_path, env=launch_env(), stdout=subprocess.DEVNULL)
    with reaped(job):
        wait_for(job, tmp_path / "l" / "workerlog.0", "epoch 1 step 8/128")
        rank_0 = rank_pid(tmp_path / "o", 0)
        os.kill(rank_pid(tmp_path / "o", 1), signal.SIGKILL)
        rank_0_ended, _ = watch_end(job, rank_0, limit=60)
    assert job.returncode != 0
    assert rank_0_ended is not None and rank_0_ended < 10, rank_0_ended
    text = worker_log(tmp_path / "l", 0)
    # rank 0 sees rank 1 gone within a second and names it; the launcher, which polls once a second, may SIGTERM
    # rank 0 first, which then stops as a signal stops it
    named = re.search(r"error: rank 1 \(pid \d+\) exited while the others waited for it in a sum", text)
    assert named or "stopped by SIGTERM" in text, text[-2000:]
    assert shm_files() == before


@pytest.mark.slow
def test_the_whole_job_killed_leaves_nothing_in_dev_shm(tmp_path, dataset):
    before = shm_files()
    args = [*JOB, "--epochs", "30", "--data-dir", str(dataset), "--output-dir", str(tmp_path / "o")]
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2", "--log_dir", str(tmp_path / "l")]
    job = subprocess.Popen([*cmd, str(TRAIN_PY), *args], cwd=tmp_path, env=launch_env(), stdout=subprocess.DEVNULL)
    with reaped(job):
        wait_for(job, tmp_path / "l" / "workerlog.0", "sums over the workers: shared memory")
        wait_for(job, tmp_path / "l" / "workerlog.0", "epoch 1 step 4/")
        pids = [rank_pid(tmp_path / "o", r) for r in (0, 1)]
        for pid in [job.pid, *pids]:
            os.kill(pid, signal.SIGKILL)
        job.wait(timeout=30)
    assert shm_files() == before


def _in_own_dev_shm(mount_options: str, command: list[str]) -> list[str]:
    """command run in a mount namespace of its own whose /dev/shm is a new tmpfs mounted with mount_options."""
    script = f'mount -t tmpfs -o {mount_options} tmpfs /dev/shm && exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *command]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("options", "why"),
    [("size=256k", r"could not take [0-9.]+ MiB \(No space left on device\)"), ("ro", r"Read-only file system")],
)
def test_a_dev_shm_too_small_or_read_only_leaves_the_sums_to_gloo_saying_why(tmp_path, options, why):
    if os.geteuid() != 0:
        pytest.fail("this test mounts a tmpfs in a mount namespace of its own: run it as root (CI does)")
    data_dir = make_dataset(tmp_path / "mnist", n_train=256, n_test=64)
    args = [*PLAIN_MNIST, "--model", "mnist_cnn_bn_fc", "--data-dir", str(data_dir), "--max-steps", "4"]
    args += ["--train-limit", "256", "--eval-limit", "64", "--output-dir", str(tmp_path / "o")]
    launch = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2"]
    launch += ["--log_dir", str(tmp_path / "l"), str(TRAIN_PY), *args]
    proc = subprocess.run(
        _in_own_dev_shm(options, launch), cwd=tmp_path, env=launch_env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, explain(proc, tmp_path / "l")
    line = next(x for x in worker_log(tmp_path / "l", 0).splitlines() if "sums over the workers" in x)
    assert "sums over the workers: gloo, since shared memory could not be set up" in line, line
    assert re.search(why, line), line
    assert "--shm-size" in line, line

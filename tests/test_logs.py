"""python -m paddle_mnist.logs names Paddle's failures: each case's log text is produced for real where this machine
can (the out-of-memory killer, a port clash, a bus error, the legacy launcher's ABORT!!!, Paddle's own SIGTERM
handler); the GPU-only ones (NCCL) are Paddle's texts quoted from its issues. The watchdog's verdict, a diverged
loss and a SIGTERM to the launcher are checked where test_recovery.py and test_preempt.py produce them."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import (
    TRAIN_PY,
    free_port,
    launch_env,
    make_dataset,
    rank_pid,
    reaped,
    small_run,
    wait_for,
)

from paddle_mnist.config import Config
from paddle_mnist.files.log import get_logger
from paddle_mnist.files.logs import LogsError, main, read_rank, summarise
from paddle_mnist.training import engine, session, timing

ARGS = small_run(train_limit=None, eval_limit=None, batch_size=64)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("data") / "mnist", n_train=2048, n_test=1000)


def start(launcher: list[str], args: list[str], tmp_path: Path, **env: str) -> subprocess.Popen:
    """The launcher with its own output in tmp_path/launcher.out, as `... > launcher.out 2>&1` would keep it."""
    cmd = [sys.executable, "-m", *launcher, "--log_dir", str(tmp_path / "log"), str(TRAIN_PY), *args]
    with open(tmp_path / "launcher.out", "w") as out:
        return subprocess.Popen(cmd, cwd=tmp_path, env=launch_env() | env, stdout=out, stderr=subprocess.STDOUT)


@dataclasses.dataclass(frozen=True)
class MemoryGroup:
    path: Path
    events: str  # the file that counts the kernel's OOM kills: memory.oom_control (v1), memory.events (v2)

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def oom_kills(self) -> int:
        lines = (self.path / self.events).read_text().splitlines()
        return next((int(x.split()[1]) for x in lines if x.startswith("oom_kill ")), 0)


def _v1_group(name: str, limit: int) -> MemoryGroup:
    """A child of this process's group in cgroup v1's memory hierarchy (needs root and a writable mount)."""
    own = next(x for x in Path("/proc/self/cgroup").read_text().splitlines() if x.split(":")[1] == "memory")
    group = Path("/sys/fs/cgroup/memory") / own.split(":", 2)[2].strip("/") / name
    group.mkdir()
    (group / "memory.limit_in_bytes").write_text(str(limit))
    return MemoryGroup(group, "memory.oom_control")


def _v2_group(name: str, limit: int) -> MemoryGroup:
    """A child of this process's cgroup v2 group, or else a sibling: the first whose parent passes the memory
    controller on to its children (a group that holds processes cannot, unless it is the root)."""
    own = next(x[3:] for x in Path("/proc/self/cgroup").read_text().splitlines() if x.startswith("0::"))
    mounts = [line.split(" - ") for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    mount = next(Path(before.split()[4]) for before, after in mounts if after.split()[0] == "cgroup2")
    here = mount / own.strip("/")
    candidates = [here] if here == mount else [here, here.parent]
    for parent in candidates:
        if "memory" in (parent / "cgroup.subtree_control").read_text().split():
            (parent / name).mkdir()
            (parent / name / "memory.max").write_text(str(limit))
            if (parent / name / "memory.swap.max").exists():  # swapping would only slow the worker down
                (parent / name / "memory.swap.max").write_text("0")
            return MemoryGroup(parent / name, "memory.events")
    raise OSError(f"no memory controller passed on to the children of {' or '.join(map(str, candidates))}")


@contextlib.contextmanager
def memory_cgroup(limit_mb: int):
    """(a memory cgroup with this limit, "") where one can be made; else (None, why not)."""
    name, reasons, group = f"paddle_mnist_test_{os.getpid()}", [], None
    for version, make in (("v1", _v1_group), ("v2", _v2_group)):
        try:
            group = make(name, limit_mb * 2**20)
            break
        except StopIteration:  # no line for it in /proc/self/cgroup or /proc/self/mountinfo
            reasons.append(f"cgroup {version}: no memory hierarchy here")
        except (IndexError, OSError) as e:
            reasons.append(f"cgroup {version}: {e}")
    try:
        yield group, "; ".join(reasons)
    finally:
        for _ in range(50 if group else 0):  # empty once its process is gone
            with contextlib.suppress(OSError):
                group.path.rmdir()
                break
            time.sleep(0.1)


@pytest.mark.slow
def test_worker_killed_by_the_out_of_memory_killer(tmp_path, data_dir):
    """Rank 1 is moved into a 32 MiB memory cgroup while it trains; evaluating 1000 images at once then needs more,
    and the kernel's OOM killer ends it with SIGKILL. Where no memory cgroup can be made (not root, a read-only
    /sys/fs/cgroup, cgroup v2 without the memory controller for us) the test sends the SIGKILL itself, checks the
    same summary (a log that stops mid-line) and is reported as skipped, with the reason: the kernel's part was
    not checked."""
    out = tmp_path / "o"
    args = [*ARGS, "--data-dir", str(data_dir), "--epochs", "1", "--eval-batch-size", "1000", "--output-dir", str(out)]
    # glibc's smallest mmap threshold (the trainer keeps a threshold the user set): each large buffer is then new
    # memory, charged to the group it is made in; with the trainer's 32 MiB threshold the evaluation could reuse
    # heap memory charged before the move, and no kill would come
    launcher = ["paddle.distributed.launch", "--nproc_per_node", "2"]
    job = start(launcher, args, tmp_path, MALLOC_MMAP_THRESHOLD_="131072")
    with memory_cgroup(32) as (group, why_not):
        with reaped(job):
            wait_for(job, tmp_path / "log" / "workerlog.1", "epoch 1 step 8/32")
            pid = rank_pid(out, 1)
            if group is not None:
                group.add(pid)
            else:
                os.kill(pid, signal.SIGKILL)
            assert job.wait(timeout=120) != 0
        if group is not None:
            assert group.oom_kills() == 1  # the kernel's killer, not us
    summary = summarise(tmp_path / "log", [tmp_path / "launcher.out"])
    assert "rank 1   stopped" in summary and "first to stop: rank 1" in summary, summary
    assert "cause: killed from outside without a word: most likely the kernel's out-of-memory killer" in summary
    assert "workerlog.1 ends with: " in summary and "memory" in summary.split("workerlog.1 ends with: ")[1]
    assert "MiB of memory" in summary and "fix: confirm with dmesg" in summary, summary
    if group is None:
        pytest.skip(f"no memory cgroup ({why_not}): checked on a SIGKILL the test sent, not the kernel's OOM killer")


@pytest.mark.slow
def test_a_stopped_rank_0_is_named_by_the_verdict_not_as_killed_for_memory(tmp_path, data_dir):
    """Rank 0 (the store's host) is held by SIGSTOP: rank 1's watchdog says rank 0 stopped answering and ends, and
    the launcher kills rank 0 without a word in its log. The summary names rank 0 and the verdict as the cause,
    not the out-of-memory killer that a silent log alone would suggest."""
    out = tmp_path / "o"
    args = [*ARGS, "--data-dir", str(data_dir), "--epochs", "40", "--output-dir", str(out)]
    job = start(["paddle.distributed.launch", "--nproc_per_node", "2"], args, tmp_path)
    with reaped(job):
        wait_for(job, tmp_path / "log" / "workerlog.0", "epoch 1 step 4/32")
        os.kill(rank_pid(out, 0), signal.SIGSTOP)
        assert job.wait(timeout=120) != 0
    summary = summarise(tmp_path / "log", [tmp_path / "launcher.out"])
    assert "first to stop: rank 0" in summary and "rank 1   error" in summary, summary
    assert "cause: a worker stopped making progress, so the watchdog ended the job" in summary, summary
    assert "workerlog.1: " in summary and "rank 0, which hosts the job's key-value store, stopped answering" in summary
    assert "out-of-memory" not in summary, summary


@pytest.mark.slow
def test_a_reused_log_dir_is_read_for_its_last_run_only(tmp_path, data_dir):
    """The launcher appends each run to the workerlog.N of the runs before it. A run refused at once, then one that
    finishes: the summary is the finished one's, and says the earlier run was ignored; a third, refused, is the
    one read. The finished run's logs start with the trainer's own lines: Paddle's notes are quieted."""
    args = [*ARGS, "--data-dir", str(data_dir), "--train-limit", "256", "--epochs", "1", "--output-dir"]
    launcher = ["paddle.distributed.launch", "--nproc_per_node", "2"]
    # a refused run: the launcher exits with the code of whichever worker it reads after stopping the other, 2 from
    # the refusal or 241 (-15) from the worker it stopped before that one got to its own refusal
    for n, run_args in enumerate(([*args, str(tmp_path / "o"), "--lr", "-1"], [*args, str(tmp_path / "o")]), 1):
        with reaped(start(launcher, run_args, tmp_path)) as job:
            code = job.wait(timeout=300)
            assert (code != 0) if n == 1 else (code == 0), (tmp_path / "launcher.out").read_text()
    summary = summarise(tmp_path / "log")
    assert summary.splitlines()[0] == (
        "workerlog.0, workerlog.1 also hold 1 earlier run (the launcher appends to a reused --log_dir): ignored, "
        "only the last run of each file is read"
    ), summary
    assert "rank 0   finished" in summary and "rank 1   finished" in summary and "error" not in summary, summary
    for rank in (0, 1):
        lines = (tmp_path / "log" / f"workerlog.{rank}").read_text().splitlines()
        starts = [i for i, line in enumerate(lines) if f"[rank {rank}/2] started: " in line]
        assert len(starts) == 2 and str(TRAIN_PY) in lines[starts[1]], lines
        # nothing between the start and the first line of training: no ccache note, FLAGS banner or glog INFO
        assert f"[rank {rank}/2] rank {rank} of world size 2" in lines[starts[1] + 1], lines[starts[1] :]
        assert not [line for line in lines[starts[1] :] if "UserWarning" in line or line.startswith("I")], lines
    with reaped(start(launcher, [*args, str(tmp_path / "o2"), "--lr", "-1"], tmp_path)) as job:
        assert job.wait(timeout=300) != 0
    summary = summarise(tmp_path / "log")
    assert "also hold 2 earlier runs" in summary and re.search(r"rank [01]   error", summary), summary
    assert "--lr must be positive, got -1.0" in summary, summary


@pytest.mark.slow
def test_port_already_in_use(tmp_path, data_dir):
    """--start_port fixes the workers' ports; the first is rank 0's key-value store, and this test holds it."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        launcher = ["paddle.distributed.launch", "--ips", "127.0.0.1", "--start_port", str(port), "--nproc_per_node"]
        args = [*ARGS, "--data-dir", str(data_dir), "--output-dir", str(tmp_path / "o")]
        job = start([*launcher, "2"], args, tmp_path)
        with reaped(job):
            assert job.wait(timeout=120) != 0
    summary = summarise(tmp_path / "log")
    assert "first to stop: rank 0" in summary and "workerlog.0  port in use" in summary, summary
    # Paddle 3.3.1: "create libuv server at port: N" then an abort; 2.6: "Bind network on IP_ANY:N failed"
    assert "cause: a port the job needs was already taken" in summary and f":{port}" in summary.replace(": ", ":")
    assert "fix: find who holds it (ss -ltnp | grep PORT)" in summary


@pytest.mark.slow
def test_legacy_launchers_abort_is_followed_to_the_bus_error_of_the_rank_it_names(tmp_path, data_dir):
    """SIGBUS to rank 1 (what a full /dev/shm does): Paddle's handler names it, rank 0 loses its connection, and the
    legacy launcher (paddle.distributed.fleet.launch) prints ABORT!!! naming both ranks; the reader picks rank 1."""
    out = tmp_path / "o"
    launcher = ["paddle.distributed.fleet.launch", "--backend", "gloo", "--nproc_per_node", "2"]
    job = start(launcher, [*ARGS, "--data-dir", str(data_dir), "--epochs", "3", "--output-dir", str(out)], tmp_path)
    with reaped(job):
        wait_for(job, tmp_path / "log" / "workerlog.1", "epoch 1 step 8/32")
        os.kill(rank_pid(out, 1), signal.SIGBUS)
        assert job.wait(timeout=120) != 0
    assert "ABORT!!!" in (tmp_path / "launcher.out").read_text()
    # the trainer's faulthandler speaks first, with the Python stack of every thread, the main one in cli.py
    log1 = (tmp_path / "log" / "workerlog.1").read_text(errors="replace")
    assert "Fatal Python error: Bus error" in log1 and "paddle_mnist/cli.py" in log1, log1[-3000:]
    summary = summarise(tmp_path / "log", [tmp_path / "launcher.out"])
    assert "the launcher: ABORT!!! Out of all 2 trainers, the trainer process with rank=[" in summary, summary
    assert "workerlog.1  bus error (shm)" in summary and "first to stop: rank 1" in summary, summary
    assert "cause: a bus error: most often the shared memory (/dev/shm) is too small or full" in summary
    # the faulthandler line is there even when Paddle's handler hangs before its own "SIGBUS ... received" line
    assert "workerlog.1: Fatal Python error: Bus error" in summary and "fix: check it with df -h /dev/shm" in summary


# A run where Paddle's SIGBUS handler hung in rank 1 before printing anything: rank 0 waited in an all-reduce until
# gloo gave up, the legacy launcher named only rank 0, and rank 1's watchdog ended it once rank 0's store was gone.
# Rank 0's lines are that run's; rank 1's bus error line is what the trainer's faulthandler writes first.
HUNG_RANK_0 = """\
12:00:00 [rank 0/2] rank 0 of world size 2 (local rank 0 of 2), backend gloo, device cpu
12:00:01 [rank 0/2] epoch 1 step 8/32 loss 1.7161 lr 0.01833 1353 img/s (global), memory 313 MiB
terminate called after throwing an instance of 'gloo::TimeoutException'
  what():  [/paddle/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:83] TIMEOUT self_rank = none pair_rank = -1
FatalError: `Process abort signal` is detected by the operating system.
"""
HUNG_RANK_1 = """\
12:00:00 [rank 1/2] rank 1 of world size 2 (local rank 1 of 2), backend gloo, device cpu
12:00:01 [rank 1/2] epoch 1 step 8/32 loss 1.7161 lr 0.01833 1353 img/s (global), memory 313 MiB
Fatal Python error: Bus error

Current thread 0x00007f6f7be22b80 (most recent call first):
  File "/work/paddle_mnist/training/engine.py", line 180 in train_step
12:00:32 [rank 1/2] error: the job's key-value store stopped answering (Connection reset by peer); rank 0 has probably \
exited; ending this worker. Rerun the same command with --resume auto to continue from the last checkpoint
"""
HUNG_LAUNCHER = (
    "ERROR 2026-11-23 12:00:31,388 launch_utils.py:648] ABORT!!! Out of all 2 trainers, the trainer process with "
    "rank=[0] was aborted. Please check its log.\n"
)


def test_a_rank_with_a_cause_of_its_own_beats_the_echo_the_launcher_names(tmp_path):
    log = tmp_path / "log"
    log.mkdir()
    (log / "workerlog.1").write_text(HUNG_RANK_1)
    (log / "workerlog.0").write_text(HUNG_RANK_0)
    (tmp_path / "launcher.out").write_text(HUNG_LAUNCHER)
    summary = summarise(log, [tmp_path / "launcher.out"])
    assert "workerlog.0  connection lost" in summary and "workerlog.1  bus error (shm)" in summary, summary
    assert "rank=[0] was aborted" in summary and "first to stop: rank 1" in summary, summary
    assert "cause: a bus error" in summary and "workerlog.1: Fatal Python error: Bus error" in summary, summary
    # the same logs without the bus error line: both ends are echoes, and the launcher's pointer decides
    (log / "workerlog.1").write_text(HUNG_RANK_1.replace("Fatal Python error: Bus error", ""))
    assert "first to stop: rank 0" in summarise(log, [tmp_path / "launcher.out"])


# The cold start of #40 before its fix: rank 0 decodes a folder, rank 1 waits in a gloo collective that aborts
# at 30 s, the launcher then stops rank 0 with SIGTERM (the lines are the trainer's and gloo's own)
DECODING_RANK_0 = """\
12:00:00 [rank 0/2] rank 0 of world size 2 (local rank 0 of 2), backend gloo, device cpu
12:00:01 [rank 0/2] decoding 60000 images (3x32x32) into a cache (no cache yet)
12:00:{stop} [rank 0/2] stopped by SIGTERM while decoding the folder; the unfinished cache was removed and nothing \
was trained: run the same command again
"""
WAITING_RANK_1 = """\
12:00:00 [rank 1/2] rank 1 of world size 2 (local rank 1 of 2), backend gloo, device cpu
terminate called after throwing an instance of 'gloo::EnforceNotMet'
  what():  [/paddle/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:133] TIMEOUT self_rank = 1 pair_rank = 0
FatalError: `Process abort signal` is detected by the operating system.
"""


@pytest.mark.parametrize("stop,first", [("36", "rank 1"), ("20", "rank 0")], ids=["launchers-answer", "signal-first"])
def test_a_sigterm_logged_after_another_ranks_end_is_the_launchers_answer(tmp_path, stop, first):
    """Rank 1's gloo abort is an echo and rank 0's SIGTERM is no failure of its own: where the SIGTERM came after
    rank 1's log ended, the launcher sent it in answer, and rank 1 stopped first; where it came before, the
    signal (a user, a scheduler) ended the job."""
    log = tmp_path / "log"
    log.mkdir()
    (log / "workerlog.0").write_text(DECODING_RANK_0.format(stop=stop))
    (log / "workerlog.1").write_text(WAITING_RANK_1)
    noon = time.mktime(time.localtime()[:3] + (12, 0, 0, 0, 0, -1))
    os.utime(log / "workerlog.1", (noon + 31.5, noon + 31.5))  # gloo's abort, 30 s after rank 1 began to wait
    os.utime(log / "workerlog.0", (noon + 36.2, noon + 36.2))
    summary = summarise(log)
    assert f"first to stop: {first}" in summary, summary
    if first == "rank 1":
        assert "cause: the connection between the workers failed" in summary, summary
    else:
        assert "cause: stopped by SIGTERM or SIGINT" in summary, summary


# Paddle 3.3.1's port clash as a CI run logged it: the libuv assertion and the faulthandler line, and no C++
# traceback after them (Paddle's handler never printed it)
PORT_WITHOUT_TRACEBACK = """\
I1123 10:16:36.561946 27791 tcp_store.cc:336] create libuv server at port: 46279
python: /paddle/third_party/libuv/src/unix/core.c:314: uv__finish_close: Assertion `handle->flags & UV_HANDLE_CLOSING' \
failed.
Fatal Python error: Aborted
"""


def test_port_clash_is_named_without_paddles_cpp_traceback(tmp_path):
    (tmp_path / "workerlog.0").write_text(PORT_WITHOUT_TRACEBACK)
    summary = summarise(tmp_path)
    assert "workerlog.0  port in use" in summary and "create libuv server at port: 46279" in summary, summary


LOADER_BUS = """
import os, signal
import numpy as np
import paddle

class Images(paddle.io.Dataset):
    def __len__(self):
        return 1000

    def __getitem__(self, i):
        if i == 40:  # in the loader's worker process: what a full /dev/shm does to it
            os.kill(os.getpid(), signal.SIGBUS)
        return np.zeros(4, "float32")

for batch in paddle.io.DataLoader(Images(), batch_size=8, num_workers=1):
    pass
"""

PADDLE_SIGTERM = "import os, signal, paddle; os.kill(os.getpid(), signal.SIGTERM)"


@pytest.mark.slow  # each case starts Python and imports Paddle
@pytest.mark.parametrize(
    "script, kind, evidence",
    [
        (LOADER_BUS, "bus error (shm)", "Unexpected BUS error encountered in DataLoader worker"),
        # a SIGTERM before the trainer takes the signal over (while paddle imports): Paddle's own handler speaks
        (PADDLE_SIGTERM, "signal", "`Termination signal` is detected by the operating system"),
    ],
    ids=["dataloader-bus-error", "paddle-sigterm"],
)
def test_paddles_own_fatal_messages(tmp_path, script, kind, evidence):
    (tmp_path / "log").mkdir()
    with open(tmp_path / "log" / "workerlog.0", "w") as log:
        proc = subprocess.run([sys.executable, "-c", script], env=launch_env(), stdout=log, stderr=subprocess.STDOUT)
    assert proc.returncode != 0
    summary = summarise(tmp_path / "log")
    assert f"workerlog.0  {kind}" in summary and evidence in summary, summary


# Paddle's texts for NCCL failures, from GPU machines (this one has none):
NCCL_SYSTEM = """\
  File "/usr/local/lib/python3.8/dist-packages/paddle/distributed/collective.py", line 328, in barrier
    task = group.process_group.barrier()
OSError: (External) NCCL error(2), unhandled system error.
  [Hint: Please search for the error code(2) on website (https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/api/types.html#ncclresult-t) to get Nvidia's official solution and advice about NCCL Error.] (at /paddle/paddle/fluid/distributed/collective/ProcessGroupNCCL.cc:236)
"""  # noqa: E501  (PaddlePaddle/PaddleDetection issue 7380, Paddle 2.4)
NCCL_CUDA = """\
  File "/usr/local/python3.7.0/lib/python3.7/site-packages/paddle/fluid/dygraph/parallel_helper.py", line 42, in _init_parallel_ctx
    __parallel_ctx__clz__.init()
OSError: (External) NCCL error(1), unhandled cuda error.
  [Hint: 'ncclUnhandledCudaError'. A call to a CUDA function failed.] (at /paddle/paddle/fluid/platform/collective_helper.cc:100)
"""  # noqa: E501  (PaddlePaddle/PaddleSpeech issue 3171)


@pytest.mark.parametrize("quoted", [NCCL_SYSTEM, NCCL_CUDA], ids=["ncclSystemError", "ncclUnhandledCudaError"])
def test_nccl_errors_quoted_from_paddles_issues(tmp_path, quoted):
    log = tmp_path / "log"
    log.mkdir()
    start = "12:00:00 [rank {0}/2] rank {0} of world size 2 (local rank {0} of 2), backend nccl, device gpu:{0}\n"
    (log / "workerlog.0").write_text(start.format(0) + "Traceback (most recent call last):\n" + quoted)
    (log / "workerlog.1").write_text(start.format(1) + "12:00:01 [rank 1/2] finished: test accuracy 0.9900\n")
    summary = summarise(log)
    assert "rank 0   crashed" in summary and "workerlog.0  NCCL error" in summary, summary
    assert "cause: NCCL, the library that carries the GPUs' collectives, failed" in summary
    assert "OSError: (External) NCCL error(" in summary.split("evidence:")[1]
    assert "fix: rerun with NCCL_DEBUG=INFO" in summary


EPOCH_ENDS = [(None, "end of epoch 1 of 8"), ((30, 32), "--max-steps 30 in epoch 1 of 8")]


@pytest.mark.parametrize(("cut", "where"), EPOCH_ENDS)
def test_the_epoch_line_is_read_whether_the_epoch_ended_or_max_steps_cut_it(tmp_path, capsys, cut, where):
    """The trainer's own epoch lines (session.log_epoch through its logger) give the rank's last progress."""
    shares = timing.shares(dict.fromkeys(timing.SAMPLED + timing.EVERY_STEP, 0.01), 1.0, 0.9, 0.1)
    fields = {"loss": 0.5, "acc": 0.8, "images": 480, "seconds": 1.0, "input_wait": 0.01, "own_seconds": 1.0}
    stats = engine.EpochStats(**fields, steps=30, phase_shares=shares, samples=1)
    row = {"epoch": 1, "world_size": 1, "train_loss": 0.5, "train_acc": 0.8, "val_loss": 0.4, "val_acc": 0.9}
    row |= {"val_count": 201, "epoch_time_s": 1.0, "images_per_sec": 480, "input_wait_share": 0.01, "rss_mb": 300}
    session.log_epoch(get_logger(0, 1), Config(epochs=8, max_steps=30), row, stats, cut)
    (tmp_path / "workerlog.0").write_text(capsys.readouterr().out)
    assert read_rank(tmp_path / "workerlog.0").where == where


def test_command_line(tmp_path, capsys):
    (tmp_path / "workerlog.0").write_text("12:00:00 [rank 0/1] finished: test accuracy 0.99\n")
    (tmp_path / "launcher.out").write_text("LAUNCH INFO 2026-11-23 12:00:01,000 Exit code 0\n")
    assert main([str(tmp_path)]) == 0 and main([str(tmp_path / "launcher.out"), str(tmp_path)]) == 0
    assert capsys.readouterr().out.count("rank 0   finished") == 2  # directories and files told apart, any order
    assert main([]) == 2 and main([str(tmp_path / "launcher.out")]) == 2
    assert "usage: python -m paddle_mnist.logs LOG_DIR [LOG_DIR ...] [LAUNCHER_OUTPUT ...]" in capsys.readouterr().err
    assert main([str(tmp_path), str(tmp_path / "no-launcher.out")]) == 2
    assert (
        capsys.readouterr().err == f"error: {tmp_path / 'no-launcher.out'} not found; pass the launcher's "
        "--log_dir (one per machine) and its output files\n"
    )
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path), str(tmp_path / "empty")]) == 2
    assert "empty: no workerlog.N files; pass the launcher's --log_dir of each machine" in capsys.readouterr().err
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0 and "usage: python -m paddle_mnist.logs" in capsys.readouterr().out


def _launchers_on_two_machines(tmp_path: Path, args: list[str]) -> list[subprocess.Popen]:
    """A job of two machines, one worker each, as two launchers on 127.0.0.1: machine N's logs in nodeN/log (each
    starts at workerlog.0) and its launcher's output in nodeN/launcher.out; one output directory, out/, shared as
    a real job's is (two would draw the not-shared warning into the logs the test reads)."""
    port, jobs = free_port(), []
    for node in (0, 1):
        (tmp_path / f"node{node}").mkdir()
        launcher = ["--nnodes", "2", "--master", f"127.0.0.1:{port}", "--rank", str(node), "--nproc_per_node", "1"]
        cmd = [sys.executable, "-m", "paddle.distributed.launch", *launcher, "--log_dir", f"node{node}/log"]
        cmd += [str(TRAIN_PY), *args, "--output-dir", str(tmp_path / "out")]
        with open(tmp_path / f"node{node}" / "launcher.out", "w") as out:
            jobs.append(subprocess.Popen(cmd, cwd=tmp_path, env=launch_env(), stdout=out, stderr=subprocess.STDOUT))
    return jobs


@pytest.mark.slow
def test_the_first_to_stop_across_machines_log_directories(tmp_path, data_dir):
    """Machine 1's only worker (global rank 1, its workerlog.0) is killed mid-run; machine 0's loses its peer.
    Read together the directories name rank 1; each read alone says the other machine's logs are missing, so
    machine 0's survivor is never named the job's first to stop."""
    args = [*ARGS, "--data-dir", str(data_dir), "--epochs", "3", "--collective-timeout", "30"]
    jobs = _launchers_on_two_machines(tmp_path, args)
    with reaped(jobs[0]), reaped(jobs[1]):
        wait_for(jobs[1], tmp_path / "node1" / "log" / "workerlog.0", "epoch 1 step 8/32")
        os.kill(rank_pid(tmp_path / "out", 1), signal.SIGKILL)
        assert jobs[1].wait(timeout=120) != 0 and jobs[0].wait(timeout=120) != 0
    command = [sys.executable, "-m", "paddle_mnist.logs", "node0/log", "node1/log"]
    command += ["node0/launcher.out", "node1/launcher.out"]
    proc = subprocess.run(command, cwd=tmp_path, env=launch_env(), capture_output=True, text=True, timeout=60)
    summary = proc.stdout
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    rows = summary.split("\n\n")[0].splitlines()
    assert rows[0].startswith("rank 0 ") and rows[0].split()[-3:] == ["node0/log/workerlog.0", "connection", "lost"]
    assert rows[1].startswith("rank 1   stopped ") and rows[1].endswith(" node1/log/workerlog.0"), summary
    assert len(rows) == 2 and "missing" not in summary, summary
    # the kill lands a few steps after step 8 was logged: the reader must name the last step rank 1 logged
    steps = re.findall(r"epoch (\d+) step (\d+)/32", (tmp_path / "node1" / "log" / "workerlog.0").read_text())
    epoch, step = steps[-1]
    assert (int(epoch), int(step)) >= (1, 8), steps
    assert f"first to stop: rank 1 (node1/log/workerlog.0), at epoch {epoch}, step {step} of 32:" in summary, summary
    assert "cause: killed from outside without a word" in summary, summary
    # machine 1's launcher reported its worker 0; machine 0's also has a worker 0, which it did not report killed
    assert "  node1/log/workerlog.0 ends with: " in summary, summary
    assert "  launcher: Container rank 0 status failed ... code -9" in summary, summary

    for alone, missing in ((0, 1), (1, 0)):
        summary = summarise(tmp_path / f"node{alone}" / "log")
        assert summary.splitlines()[0] == (
            f"the job has 2 ranks but this directory holds the logs of 1 (rank {missing} missing): the others ran on "
            "other machines, whose log directories were not given, and the first rank to stop may be among them; "
            "pass every machine's --log_dir: python -m paddle_mnist.logs DIR1 DIR2 ..."
        ), summary
        assert "first to stop: " not in summary, summary
        among = "first to stop of the ranks given (the job's first may be among the missing, see above): "
        assert f"{among}rank {alone} ({tmp_path}/node{alone}/log/workerlog.0)" in summary, summary

    # the same machine's directory twice (a copy of it): both claim global rank 0
    shutil.copytree(tmp_path / "node0" / "log", tmp_path / "copy")
    with pytest.raises(LogsError) as refused:
        summarise([tmp_path / "node0" / "log", tmp_path / "node1" / "log", tmp_path / "copy"])
    assert str(refused.value) == (
        f"{tmp_path}/node0/log/workerlog.0 and {tmp_path}/copy/workerlog.0 both hold global rank 0: the same "
        "machine's logs given twice, or directories of different runs; pass each machine's --log_dir of one job once"
    )


def test_directories_of_jobs_of_different_sizes_are_refused(tmp_path):
    """A 2-machine job's machine 0 beside a machine of a 4-worker job (its ranks 2 and 3): one line, no summary."""
    line = "12:00:0{s} [rank {r}/{w}] epoch 1 step 8/32 loss 1.7161 lr 0.01833 673 img/s (global), memory 335 MiB\n"
    for name, ranks, world in (("a", [0], 2), ("b", [2, 3], 4)):
        (tmp_path / name).mkdir()
        for n, rank in enumerate(ranks):
            (tmp_path / name / f"workerlog.{n}").write_text(line.format(s=n, r=rank, w=world))
    with pytest.raises(LogsError) as refused:
        summarise([tmp_path / "a", tmp_path / "b"])
    assert str(refused.value) == (
        f"{tmp_path}/a/workerlog.0 is from a job of 2 workers but {tmp_path}/b/workerlog.0 from one of 4: these "
        "directories hold different jobs; pass the log directories of one job, one per machine"
    )
    # machine b alone: the 4-worker job's ranks 0 and 1 are missing
    assert summarise(tmp_path / "b").startswith("the job has 4 ranks but this directory holds the logs of 2 (ranks 0-1")

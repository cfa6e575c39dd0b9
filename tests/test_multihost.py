"""Two machines, as docs/distributed.md runs them: network namespaces with their own addresses and hostnames.

Each machine's hostname resolves to 127.0.1.1 in its own /etc/hosts, as on Debian, so the docs' command needs
`--host` and `GLOO_SOCKET_IFNAME`. One launcher per machine (one worker each), a shared output directory. Checked:
the weights equal one process's; a machine killed mid-epoch and both relaunched with --resume auto end bitwise
equal to the uninterrupted run; a partition is named by the watchdog before gloo aborts; without the two settings
the job refuses in one line (GLOO_SOCKET_IFNAME) or waits for a master nobody serves (--host), as the docs say.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import (
    REAL_JOB,
    TRAIN_PY,
    check_read_by_facts,
    explain,
    launch_env,
    make_dataset,
    param_digest,
    run_single,
    weights,
    worker_log,
)

from paddle_mnist.files.logs import summarise
from scripts import restart_trials
from scripts.netns import namespaces_problem, two_hosts, wait_all

pytestmark = pytest.mark.slow  # every test here starts launchers on two machines

# restart_trials' job: 32 steps an epoch (2048 images, global batch 64), one CPU thread per worker (two machines
# share this box's cores), a checkpoint every 5 steps
ARGS = restart_trials.TRAINER
PORT = 8090
BOUND_S = 26  # the watchdog's verdict comes 18 to 22 s after the last progress; gloo's abort at 30 s


@pytest.fixture(scope="module")
def two_machines():
    if problem := namespaces_problem():
        pytest.skip(problem)
    with two_hosts() as pair:
        yield pair


@pytest.fixture
def hosts(two_machines):
    """The module's two machines, left as found: no process and no firewall rule outlives a test."""
    try:
        yield two_machines
    finally:
        for host in two_machines:
            host.kill_all()
            if shutil.which("nft"):
                host.nft("flush ruleset")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("data") / "mnist", n_train=2048, n_test=100)


def launch(
    hosts,
    root: Path,
    out: Path,
    extra: list[str] = (),
    host_flag: bool = True,
    ifname: bool = True,
    machine_1: list[str] = (),
    job: list[str] = ARGS,
    launcher: str = "paddle.distributed.launch",
):
    """The docs' command on each machine (machine 0 serves --master), started in root, which gets each machine's
    log_dir (log0, log1) and launcher output (launcher0.txt, launcher1.txt); returns the two launchers. machine_1:
    flags machine 1's command adds (a command that differs between machines)."""
    root.mkdir(parents=True, exist_ok=True)
    master = hosts[0]
    jobs = []
    for rank, host in enumerate(hosts):
        cmd = [sys.executable, "-m", launcher, "--nnodes", "2"]
        cmd += ["--master", f"{master.address}:{PORT}", "--rank", str(rank)]
        cmd += ["--host", host.address] if host_flag else []
        cmd += ["--nproc_per_node", "1", "--log_dir", str(root / f"log{rank}")]
        cmd += [str(TRAIN_PY), *job, *extra, "--output-dir", str(out), "--resume", "auto"]
        cmd += list(machine_1) if rank == 1 else []
        env = dict(launch_env(), GLOO_SOCKET_IFNAME=host.interface) if ifname else launch_env()
        with open(root / f"launcher{rank}.txt", "w") as output:  # the launcher keeps its own descriptor
            jobs.append(subprocess.Popen(host.command(cmd), cwd=root, env=env, stdout=output, stderr=subprocess.STDOUT))
    return jobs


def explain_job(codes: list[int | None], root: Path, output: str = "launcher") -> str:
    parts = [f"exit codes {codes}"]
    for rank in (0, 1):
        parts.append(f"--- {output}{rank}.txt\n" + (root / f"{output}{rank}.txt").read_text()[-2000:])
        log = root / f"log{rank}" / "workerlog.0"
        if log.exists():
            parts.append(f"--- machine {rank}'s workerlog.0\n" + log.read_text()[-2000:])
    return "\n".join(parts)


def steps_of(out: Path) -> list[int]:
    return sorted(int(p.stem.split("_")[1]) for p in (out / "checkpoints").glob("step_*.pdckpt"))


def wait_for_step(jobs: list[subprocess.Popen], root: Path, out: Path, after: int) -> None:
    """Until a checkpoint past step `after` exists; fails if a launcher ends first or two minutes pass."""
    deadline = time.monotonic() + 120
    while not any(step > after for step in steps_of(out)):
        assert time.monotonic() < deadline, f"no checkpoint past step {after} within 120 s"
        assert all(job.poll() is None for job in jobs), explain_job([job.poll() for job in jobs], root)
        time.sleep(0.02)


@pytest.fixture(scope="module")
def uninterrupted(two_machines, data_dir, tmp_path_factory) -> Path:
    """The docs' command on both machines, run to the end; returns its root (outputs in out/, logs in log0, log1)."""
    root = tmp_path_factory.mktemp("uninterrupted")
    jobs = launch(two_machines, root, root / "out", ["--data-dir", str(data_dir)])
    codes = wait_all(jobs, 180)
    assert codes == [0, 0], explain_job(codes, root)
    return root


def test_each_machine_has_its_own_hostname_on_loopback(hosts):
    """What makes --host and GLOO_SOCKET_IFNAME necessary, as on a Debian machine."""
    probe = "import socket; h = socket.gethostname(); print(h, socket.gethostbyname(socket.getfqdn(h)))"
    for host in hosts:
        seen = subprocess.run(host.command([sys.executable, "-c", probe]), capture_output=True, text=True, timeout=30)
        assert seen.stdout.split() == [host.hostname, "127.0.1.1"], seen.stdout + seen.stderr


def test_two_machines_equal_one_process_with_the_same_global_batch(uninterrupted, data_dir, tmp_path):
    logs = [worker_log(uninterrupted / f"log{rank}", 0) for rank in (0, 1)]
    assert "rank 1 of world size 2 (local rank 0 of 1), backend gloo" in logs[1]
    assert param_digest(logs[0]) == param_digest(logs[1])
    one = run_single([*ARGS, "--data-dir", str(data_dir), "--output-dir", str(tmp_path / "one")], cwd=tmp_path)
    assert one.returncode == 0, explain(one)
    a, b = weights(tmp_path / "one" / "model.pdparams"), weights(uninterrupted / "out" / "model.pdparams")
    assert a.keys() == b.keys() and len(a) == 6
    for name in a:  # test_parallel's tolerance for two launchers on one machine
        np.testing.assert_allclose(b[name], a[name], atol=1e-5, rtol=0, err_msg=name)


def test_two_machines_equal_one_process_on_real_mnist_with_its_default_recipe(two_machines, tmp_path):
    """test_parallel's job on real MNIST, augmented as its recipe says, on two machines of one worker each,
    started by python -m paddle_mnist.launch (Paddle's launcher after a check, the arguments unchanged)."""
    jobs = launch(two_machines, tmp_path, tmp_path / "out", job=REAL_JOB, launcher="paddle_mnist.runtime.launch")
    codes = wait_all(jobs, 180)
    assert codes == [0, 0], explain_job(codes, tmp_path)
    assert "augmentation random shifts of up to 2 px" in worker_log(tmp_path / "log1", 0)
    one = run_single([*REAL_JOB, "--output-dir", str(tmp_path / "one")], cwd=tmp_path)
    assert one.returncode == 0, explain(one)
    a, b = weights(tmp_path / "one" / "model.pdparams"), weights(tmp_path / "out" / "model.pdparams")
    assert a.keys() == b.keys() and len(a) == 6
    for name in a:
        np.testing.assert_allclose(b[name], a[name], atol=1e-5, rtol=0, err_msg=name)


def test_machine_killed_mid_epoch_then_both_relaunched_end_bitwise_equal(hosts, uninterrupted, data_dir, tmp_path):
    out, first, second = tmp_path / "out", tmp_path / "first", tmp_path / "second"
    jobs = launch(hosts, first, out, ["--data-dir", str(data_dir)])
    try:
        wait_for_step(jobs, first, out, 32)  # in the second epoch
        killed = hosts[1].kill_all()  # machine 1's launcher and worker, at once, as a power cut would
        assert len(killed) >= 2, killed
        t0 = time.monotonic()
        codes = wait_all(jobs, 60)  # machine 0's worker loses its peer and ends; its launcher with it
        ended = time.monotonic() - t0
    finally:
        wait_all(jobs, 0)
    assert codes[0] != 0 and codes[1] == -9, explain_job(codes, first)
    killed_at = steps_of(out)[-1]
    assert 32 < killed_at < 64 and not (out / "model.pdparams").exists(), (killed_at, explain_job(codes, first))

    again = wait_all(launch(hosts, second, out, ["--data-dir", str(data_dir)]), 180)
    assert again == [0, 0], explain_job(again, second)
    for rank in (0, 1):
        resumed_line = next(x for x in worker_log(second / f"log{rank}", 0).splitlines() if "resumed from" in x)
        assert resumed_line.endswith(f"step {killed_at}"), resumed_line
    full, resumed = weights(uninterrupted / "out" / "model.pdparams"), weights(out / "model.pdparams")
    for name in full:
        np.testing.assert_array_equal(resumed[name], full[name], err_msg=name)
    print(f"machine 0's launcher ended {ended:.1f} s after machine 1 was killed")


def launcher_pid(host) -> int:
    """The pid of paddle.distributed.launch on this machine."""
    for pid in host.pids():
        with contextlib.suppress(OSError):
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"paddle.distributed.launch" in cmd and str(TRAIN_PY).encode() in cmd:
                return pid
    raise AssertionError(f"no launcher on {host.hostname}")


def test_a_machine_whose_launcher_dies_is_named_as_the_cause_on_both(hosts, data_dir, tmp_path):
    """SIGKILL to machine 1's launcher alone: its worker stops with a checkpoint, saying its launcher went away;
    machine 0's worker stops with it, naming rank 1 as the one that took the signal (it took none itself); and
    paddle_mnist.files.logs names rank 1 first, the launcher's end as the cause."""
    out = tmp_path / "out"
    jobs = launch(hosts, tmp_path, out, ["--data-dir", str(data_dir)])
    try:
        wait_for_step(jobs, tmp_path, out, 10)
        os.kill(launcher_pid(hosts[1]), signal.SIGKILL)
        codes = wait_all(jobs, 60)
    finally:
        wait_all(jobs, 0)
    assert codes[0] not in (None, 0) and codes[1] == -9, explain_job(codes, tmp_path)
    ours, theirs = (worker_log(tmp_path / f"log{rank}", 0) for rank in (1, 0))
    assert re.search(r"its launcher \(pid \d+\) went away", ours) and "stopped by SIGTERM at step" in ours, ours
    line = next((x for x in theirs.splitlines() if "stopped by SIGTERM at step" in x), "")
    assert "rank 1 took the signal, its launcher having gone away, this rank none" in line, theirs[-2000:]
    summary = summarise([tmp_path / "log0", tmp_path / "log1"])
    assert "first to stop: rank 1" in summary, summary
    assert "cause: this machine's launcher went away" in summary and "went away" in summary.split("evidence:")[1]
    check_read_by_facts([tmp_path / "log0", tmp_path / "log1"], summary)


def test_restart_loops_on_both_machines_finish_the_job_after_a_kill(hosts, uninterrupted, data_dir, tmp_path):
    """The docs' command inside scripts.relaunch on each machine; rank 0's worker (it hosts the job's store) is
    SIGKILLed mid-epoch: both loops relaunch and the job ends by itself, bitwise equal to the uninterrupted run.
    A 5 s delay suffices here: the killed worker's connections are reset, so every launcher ends within seconds."""
    full = weights(uninterrupted / "out" / "model.pdparams")
    trial = restart_trials.trial(hosts, tmp_path, data_dir, full, machine=0, victim="worker", step=40, delay=5)
    assert trial.finished and trial.equal, (trial, explain_job([], tmp_path, "machine"))
    assert trial.attempts == (2, 2) and trial.recovery_s is not None and trial.recovery_s < 60, trial


PARTITION = """table inet partition {{
    chain in {{ type filter hook input priority 0; ip saddr {peer} drop; }}
    chain out {{ type filter hook output priority 0; ip daddr {peer} drop; }}
}}"""


def test_partition_is_named_by_the_watchdog_before_gloo_aborts(hosts, data_dir, tmp_path):
    """Drop every packet between the machines mid-training: the watchdog (15 s by default on gloo) must name the
    cut-off rank within BOUND_S, before gloo's fixed 30 s abort (test_multi explains the bound)."""
    assert shutil.which("nft"), "nft not found: apt-get install nftables"
    out = tmp_path / "out"
    jobs = launch(hosts, tmp_path, out, ["--data-dir", str(data_dir), "--epochs", "20"])
    logs = [tmp_path / f"log{rank}" / "workerlog.0" for rank in (0, 1)]
    named = re.compile(r"no progress for 15 s \(--collective-timeout\) at step \d+: (.*)")
    verdicts: dict[int, tuple[float, str]] = {}
    try:
        deadline = time.monotonic() + 120
        while not (logs[0].exists() and "epoch 2 step 8/32" in logs[0].read_text()):
            assert time.monotonic() < deadline, "training did not reach epoch 2 within 120 s"
            assert all(job.poll() is None for job in jobs), explain_job([j.poll() for j in jobs], tmp_path)
            time.sleep(0.05)
        hosts[0].nft(PARTITION.format(peer=hosts[1].address))
        t0 = time.monotonic()
        while any(job.poll() is None for job in jobs) and time.monotonic() - t0 < 60:
            for rank, log in enumerate(logs):
                if rank not in verdicts and (found := named.search(log.read_text())):
                    verdicts[rank] = (time.monotonic() - t0, found.group(1))
            time.sleep(0.05)
    finally:
        codes = wait_all(jobs, 0)
    texts = [log.read_text() for log in logs]
    assert 0 in verdicts, explain_job(codes, tmp_path)
    seconds, cause = verdicts[0]
    assert re.match(r"rank 1 \(last seen at step \d+\) stopped responding \(stopped, hung or cut off\)", cause), cause
    assert 15 < seconds < BOUND_S, f"rank 0 named rank 1 {seconds:.1f} s after the partition"
    # rank 1 cannot reach the store on rank 0's machine: it waits 3 intervals more for it, then blames rank 0
    assert 1 in verdicts and verdicts[1][1].startswith("rank 0, which hosts the job's key-value store"), verdicts
    for text in texts:
        assert "SIGABRT" not in text and "Timed out" not in text, text[-2000:]
    print(f"verdicts (seconds after the partition): {verdicts}; launchers' exit codes {codes}")


def test_without_gloo_socket_ifname_each_worker_refuses_in_one_line(hosts, data_dir, tmp_path):
    jobs = launch(hosts, tmp_path, tmp_path / "out", ["--data-dir", str(data_dir)], ifname=False)
    codes = wait_all(jobs, 90)
    assert all(code != 0 for code in codes), explain_job(codes, tmp_path)
    for rank, host in enumerate(hosts):
        errors = [x for x in worker_log(tmp_path / f"log{rank}", 0).splitlines() if "error:" in x]
        assert len(errors) == 1, explain_job(codes, tmp_path)
        assert f"hostname '{host.hostname}' resolves to 127.0.1.1" in errors[0], errors[0]
        assert f"set GLOO_SOCKET_IFNAME={host.interface}" in errors[0], errors[0]


def test_without_host_the_launchers_wait_for_a_master_nobody_serves(hosts, data_dir, tmp_path):
    """What the docs say happens, and why the preflight check exists: 'master not ready' every 5 s, no worker.
    The 5 s are Paddle's launcher's own: the test waits for the first of these lines on each machine."""
    jobs = launch(hosts, tmp_path, tmp_path / "out", ["--data-dir", str(data_dir)], host_flag=False)
    outputs = [tmp_path / f"launcher{rank}.txt" for rank in (0, 1)]
    try:
        deadline = time.monotonic() + 60
        while not all("master not ready" in output.read_text() for output in outputs):
            assert all(job.poll() is None for job in jobs), explain_job([job.poll() for job in jobs], tmp_path)
            assert time.monotonic() < deadline, "no 'master not ready' in 60 s\n" + explain_job([None, None], tmp_path)
            time.sleep(0.1)
        running = [job.poll() is None for job in jobs]
    finally:
        wait_all(jobs, 0)
    assert running == [True, True]
    for rank in (0, 1):
        assert not (tmp_path / f"log{rank}" / "workerlog.0").exists()


def test_paddle_mnist_launch_without_host_stops_at_once_naming_it(hosts, data_dir, tmp_path):
    """The same command through python -m paddle_mnist.launch: each machine stops within seconds, in one line
    naming --host and this machine's address, and no launcher or worker starts."""
    started = time.monotonic()
    args = ["--data-dir", str(data_dir)]
    jobs = launch(hosts, tmp_path, tmp_path / "out", args, host_flag=False, launcher="paddle_mnist.runtime.launch")
    codes = wait_all(jobs, 30)
    assert codes == [1, 1] and time.monotonic() - started < 30, explain_job(codes, tmp_path)
    for rank, host in enumerate(hosts):
        text = (tmp_path / f"launcher{rank}.txt").read_text()
        errors = [x for x in text.splitlines() if x.startswith("error: ")]
        assert f"hostname '{host.hostname}' resolves to 127.0.1.1" in errors[0], text
        assert f"pass --host {host.address} to paddle.distributed.launch" in errors[0], text
        assert f"GLOO_SOCKET_IFNAME={host.interface}" not in errors[0], text  # it is set: the fix is --host alone
        assert len(errors) == 1 and "LAUNCH" not in text, text  # Paddle's launcher never started
        assert not (tmp_path / f"log{rank}").exists()


@pytest.mark.parametrize(
    "theirs,named",
    [
        (["--lr", "0.01"], "--lr: 0.02 on rank 0, 0.01 on rank 1"),
        (["--batch-size", "128"], "--batch-size: 64 on rank 0, 128 on rank 1"),
        (["--model", "mnist_cnn_bn"], "--model: 'mnist_cnn' on rank 0, 'mnist_cnn_bn' on rank 1"),
    ],
    ids=["lr", "batch", "model"],
)
def test_machines_started_with_different_flags_stop_naming_the_flag(hosts, data_dir, tmp_path, theirs, named):
    """Machine 1's command differs by one flag: both machines stop before training, exit non-zero, and each
    worker's log names the flag and both values in one line. Before, --lr trained apart to a "finished" run,
    --batch-size hung in a collective and --model aborted inside gloo."""
    jobs = launch(hosts, tmp_path, tmp_path / "o", ["--data-dir", str(data_dir)], machine_1=theirs)
    codes = wait_all(jobs, 120)
    assert all(code not in (None, 0) for code in codes), explain_job(codes, tmp_path)
    for rank in (0, 1):
        log = (tmp_path / f"log{rank}" / "workerlog.0").read_text()
        line = next((x for x in log.splitlines() if "the ranks disagree on" in x), "")
        assert f"error: the ranks disagree on {named}" in line, explain_job(codes, tmp_path)
        assert "epoch 1 step" not in log and "Traceback" not in log


def test_an_output_directory_that_is_not_shared_is_named_at_start(hosts, data_dir, tmp_path):
    """Machine 1 writes to a folder of its own: both machines stop before training, naming it, instead of training
    and failing at the first --resume."""
    theirs = ["--output-dir", str(tmp_path / "machine-1-only")]
    jobs = launch(hosts, tmp_path, tmp_path / "o", ["--data-dir", str(data_dir)], machine_1=theirs)
    codes = wait_all(jobs, 120)
    assert all(code not in (None, 0) for code in codes), explain_job(codes, tmp_path)
    for rank in (0, 1):
        log = (tmp_path / f"log{rank}" / "workerlog.0").read_text()
        assert "error: --output-dir is not shared: rank 1 on " in log, explain_job(codes, tmp_path)
        assert "epoch 1 step" not in log and "Traceback" not in log
    assert not list((tmp_path / "o").glob(".paddle_mnist-shared-*"))  # rank 0's marker is removed

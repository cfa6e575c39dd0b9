"""Several machines: a stalled rank named before gloo aborts, no orphaned workers, and the preflight check."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import (
    TRAIN_PY,
    exited,
    launch_env,
    make_dataset,
    rank_pid,
    small_run,
    watch_end,
    worker_log,
)

from paddle_mnist.runtime import preflight, watchdog
from scripts.netns import Host, namespaces_problem, two_hosts

ARGS = small_run(train_limit=2048, eval_limit=100, log_every=8, tutorial_cnn=False)


def start_job(tmp_path: Path, extra: list[str]) -> tuple[subprocess.Popen, Path, Path]:
    """A 2-worker CPU job of 20 epochs (16 steps each), started; returns it once rank 1 is half-way through epoch 2."""
    data_dir = make_dataset(tmp_path / "mnist", n_train=2048, n_test=100)
    out, logs = tmp_path / "o", tmp_path / "l"
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2", "--log_dir", str(logs)]
    cmd += [str(TRAIN_PY), *ARGS, "--epochs", "20", "--data-dir", str(data_dir), "--output-dir", str(out), *extra]
    job = subprocess.Popen(cmd, cwd=tmp_path, env=launch_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not ((logs / "workerlog.1").exists() and "epoch 2 step 8/16" in (logs / "workerlog.1").read_text()):
        if time.time() > deadline or job.poll() is not None:
            job.kill()
            pytest.fail("training did not start")
        time.sleep(0.05)
    return job, out, logs


@pytest.mark.slow
def test_stopped_worker_is_named_before_gloo_aborts_with_the_default_timeout(tmp_path):
    """SIGSTOP rank 1 with no --collective-timeout: rank 0's watchdog must name it before gloo's fixed 30 s abort.

    The bound, from the code: rank 0 acts 15 to 16 s after its last progress (at most a step before the stop),
    watches the heartbeats 3 s and exits: 18 to 19 s after the stop; gloo would abort it 30 s after it began
    waiting. 26 s allows for a busy machine and stays below gloo's 30.
    """
    job, out, logs = start_job(tmp_path, [])
    pids = {rank: rank_pid(out, rank) for rank in (0, 1)}
    try:
        os.kill(pids[1], signal.SIGSTOP)
        rank_0_ended, _ = watch_end(job, pids[0])
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pids[1], signal.SIGKILL)
        if job.poll() is None:
            job.kill()
    assert job.returncode != 0
    assert rank_0_ended is not None and 15 + 3 - 1 < rank_0_ended < 26, f"rank 0 ended {rank_0_ended} s after the stop"
    text = worker_log(logs, 0)
    assert re.search(
        r"no progress for 15 s \(--collective-timeout\) at step \d+: rank 1 \(last seen at step \d+\) stopped", text
    ), text[-2000:]
    assert "SIGABRT" not in text and "Timed out" not in text, text[-2000:]


@pytest.mark.slow
def test_workers_stop_with_a_checkpoint_when_their_launcher_is_killed(tmp_path):
    """SIGKILL the launcher alone: both workers must end within seconds, say why, and leave a checkpoint."""
    job, out, logs = start_job(tmp_path, [])
    pids = {rank: rank_pid(out, rank) for rank in (0, 1)}
    try:
        job.kill()  # SIGKILL to the launcher only: its workers live in sessions of their own
        job.wait(timeout=10)
        t0 = time.monotonic()
        while not all(exited(pid) for pid in pids.values()):
            assert time.monotonic() - t0 < 15, "a worker outlived its launcher by 15 s"
            time.sleep(0.05)
    finally:
        for pid in pids.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    for rank in (0, 1):
        text = worker_log(logs, rank)
        assert re.search(r"its launcher \(pid \d+\) went away", text), text[-2000:]
        stop = re.search(r"stopped by SIGTERM at step \d+ .* continue with: (.*)", text)
        assert stop and "paddle.distributed.launch" in stop.group(1), text[-2000:]  # the launcher's command
    saved = list((out / "checkpoints").glob("*.pdckpt"))
    assert saved, "no checkpoint was written when the launcher went away"


# --- the preflight check, on two "machines" made of network namespaces joined by a veth pair ---


@pytest.fixture
def machines():
    """Two machines (helpers.two_hosts): 10.78.0.1 and 10.78.0.2, each hostname on 127.0.1.1 as on Debian."""
    if problem := namespaces_problem():
        pytest.skip(problem)
    with two_hosts() as pair:
        yield pair


def preflight_in(host: Host, args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = host.command([sys.executable, "-m", "paddle_mnist.preflight", *args])
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env={**launch_env(), **(env or {})})


def lines(proc: subprocess.CompletedProcess) -> list[str]:
    return proc.stdout.splitlines()


def test_preflight_on_two_machines(machines, tmp_path):
    a, b = machines
    (ip_a, if_a), (ip_b, if_b) = (a.address, a.interface), (b.address, b.interface)
    master = f"{ip_a}:29431"
    shared = tmp_path / "shared"

    bare = preflight_in(b, ["--master", master, "--output-dir", str(shared)])
    assert not bare.stderr.strip(), bare.stderr  # one line per finding, no traceback
    assert bare.returncode == 1, bare.stdout  # the hostname on 127.0.1.1: the hang, named with its fix
    assert any(
        line.startswith(f"error: hostname '{b.hostname}'")
        and "loopback" in line
        and f"--host {ip_b}" in line
        and f"GLOO_SOCKET_IFNAME={if_b}" in line
        for line in lines(bare)
    ), bare.stdout
    assert f"ok: {ip_a} is reached through {if_b} ({ip_b})" in bare.stdout

    fixed = ["--master", master, "--output-dir", str(shared)]
    on_b = preflight_in(b, [*fixed, "--host", ip_b], {"GLOO_SOCKET_IFNAME": if_b})
    assert on_b.returncode == 0, on_b.stdout + on_b.stderr
    assert f"--master {master} is reachable" in on_b.stdout  # machine a answers: refused, nothing listens yet
    assert "note: no other machine's marker" in on_b.stdout
    on_a = preflight_in(a, [*fixed, "--host", ip_a], {"GLOO_SOCKET_IFNAME": if_a})
    assert on_a.returncode == 0, on_a.stdout + on_a.stderr
    assert f"this is the master's machine ({ip_a}) and port 29431 is free" in on_a.stdout
    marker = f"{re.escape(b.hostname)}-{re.escape(ip_b)}"
    assert re.search(rf"ok: --output-dir is shared: it holds the markers of {marker}", on_a.stdout), on_a.stdout
    assert re.search(r"ok: [\d.]+ GiB free in ", on_a.stdout)

    # something else holds the master's port (bound on machine a)
    hold = f"import socket,time; s=socket.create_server(('{ip_a}', 29431)); print('up', flush=True); time.sleep(30)"
    holder = subprocess.Popen(a.command([sys.executable, "-c", hold]), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "up"
        taken = preflight_in(a, [*fixed, "--host", ip_a], {"GLOO_SOCKET_IFNAME": if_a})
        reached = preflight_in(b, [*fixed, "--host", ip_b], {"GLOO_SOCKET_IFNAME": if_b})
    finally:
        holder.kill()
        holder.wait(timeout=10)
    assert taken.returncode == 1 and "port 29431 is taken" in taken.stdout, taken.stdout
    assert reached.returncode == 0 and "is reachable and something listens there" in reached.stdout

    nobody = "10.78.0.9:29431"  # in the subnet, no machine: no answer
    lost = preflight_in(
        b, ["--master", nobody, "--output-dir", str(shared), "--host", ip_b], {"GLOO_SOCKET_IFNAME": if_b}
    )
    assert lost.returncode == 1 and f"error: cannot reach --master {nobody}" in lost.stdout, lost.stdout

    blocked = tmp_path / "a-file"
    blocked.write_text("")
    unwritable = preflight_in(
        b, [*fixed, "--host", ip_b, "--output-dir", str(blocked / "out")], {"GLOO_SOCKET_IFNAME": if_b}
    )
    assert unwritable.returncode == 1 and "error: cannot write to --output-dir" in unwritable.stdout
    assert not unwritable.stderr.strip()


def test_preflight_names_a_bad_master_flag_in_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "paddle_mnist.preflight", "--master", "somewhere", "--output-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        env=launch_env(),
    )
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: --master takes IP:PORT, e.g. --master 10.0.0.1:8090; got 'somewhere'"
    ]


def machine(launcher_ip: str, gloo_ip: str) -> preflight.Machine:
    return preflight.Machine("box", launcher_ip, gloo_ip, {"lo": "127.0.0.1", "eth0": "10.0.0.2"}, "10.0.0.2")


def test_loopback_hostname_is_an_error_only_for_several_machines_and_without_host():
    loop = machine("127.0.1.1", "127.0.1.1")
    several = preflight.address_findings(loop, "10.0.0.1", 2, None, "cpu", {})
    assert [f.level for f in several].count("error") == 2  # the launcher's hang, and gloo's address
    with_host = preflight.address_findings(loop, "10.0.0.1", 2, "10.0.0.2", "cpu", {"GLOO_SOCKET_IFNAME": "eth0"})
    assert all(f.level == "ok" for f in with_host), with_host
    one = preflight.address_findings(loop, "127.0.0.1", 1, None, "cpu", {})
    assert all(f.level == "ok" for f in one), one
    gpu = preflight.address_findings(loop, "10.0.0.1", 2, "10.0.0.2", "gpu", {})
    assert all(f.level == "ok" for f in gpu), gpu  # NCCL picks a non-loopback interface itself


def test_master_machine_must_take_the_masters_address():
    m = preflight.Machine("box", "10.0.0.7", "10.0.0.7", {"eth0": "10.0.0.1", "eth1": "10.0.0.7"}, "10.0.0.1")
    found = preflight.address_findings(m, "10.0.0.1", 2, None, "cpu", {"GLOO_SOCKET_IFNAME": "eth0"})
    assert found[0].level == "error" and "pass --host 10.0.0.1" in found[0].text


def test_gloo_startup_check_only_for_workers_on_several_hosts():
    one_host = {"PADDLE_TRAINER_ENDPOINTS": "10.0.0.1:1,10.0.0.1:2", "PADDLE_CURRENT_ENDPOINT": "10.0.0.1:1"}
    assert preflight.startup_problem(one_host) is None  # several launchers on one machine work on loopback
    two_hosts = {"PADDLE_TRAINER_ENDPOINTS": "10.0.0.1:1,10.0.0.2:2", "PADDLE_CURRENT_ENDPOINT": "10.0.0.2:2"}
    assert preflight.startup_problem({**two_hosts, "GLOO_SOCKET_IFNAME": "eth0"}) is None
    problem = preflight.startup_problem(two_hosts)
    if preflight.is_loopback(preflight.gloo_address()):
        assert problem and "GLOO_SOCKET_IFNAME" in problem and "loopback" in problem
    else:
        assert problem is None


def test_the_default_timeout_fits_the_backend():
    assert watchdog.timeout_for(None, "gloo") == watchdog.GLOO_DEFAULT_S
    assert watchdog.timeout_for(None, "nccl") == watchdog.NCCL_DEFAULT_S == 300
    assert watchdog.timeout_for(42, "gloo") == 42
    # acting (an interval), naming (3) and a hanging store (ASK_INTERVALS) all end before gloo's abort, with room
    assert watchdog.GLOO_DEFAULT_S + 1 + 3 + watchdog.ASK_INTERVALS + 5 <= watchdog.GLOO_TIMEOUT_S
    assert watchdog.timeout_problem(watchdog.GLOO_DEFAULT_S, "gloo") is None
    assert "gloo aborts" in watchdog.timeout_problem(300, "gloo") and watchdog.timeout_problem(300, "nccl") is None
    assert "gloo aborts" in watchdog.timeout_problem(0, "gloo")

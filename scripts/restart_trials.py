"""Restarts across two machines, measured: python -m scripts.restart_trials [--trials 20] [--delay 30] [--seed 0].

Two machines made of network namespaces (scripts.netns), each running the docs' command inside its own restart
loop (scripts.relaunch ... --resume auto), one worker each, a shared output directory. An uninterrupted run
gives the reference weights. Then each trial starts both loops, SIGKILLs the worker or the launcher (drawn at
random) on a machine drawn at random once training reaches a step drawn at random, and records whether the job
finished by itself with weights bitwise equal to the reference, and the recovery time: from the kill until
machine 0's relaunched worker has joined the process group (its `rank 0 of world size 2` line). One line per
trial, then the summary; --jsonl keeps the trials. Needs root, iproute2 and util-linux.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from scripts.netns import Host, namespaces_problem, two_hosts, wait_all
from scripts.relaunch import DEFAULT_DELAY_S

REPO = Path(__file__).resolve().parent.parent
PORT = 8090
STEPS = 64  # 2 epochs of 32 steps: 2048 images, global batch 64
TRAINER = ["--dataset", "mnist", "--no-augment", "--model", "mnist_cnn", "--warmup-epochs", "0", "--lr", "0.02"]
TRAINER += ["--train-limit", "2048", "--eval-limit", "100", "--batch-size", "64", "--epochs", "2"]
TRAINER += ["--cpu-threads", "1", "--log-every", "1", "--save-every-steps", "5"]
JOINED = "rank 0 of world size 2"


@dataclass(frozen=True)
class Trial:
    machine: int
    victim: str  # "worker" or "launcher"
    step: int  # the kill came once machine 0's worker had logged this step (or a later one)
    finished: bool  # both loops exited 0
    equal: bool  # the weights are bitwise equal to the uninterrupted run's
    recovery_s: float | None  # kill -> machine 0's relaunched worker joined the process group
    attempts: tuple[int, int]  # launcher runs per machine, the first included
    seconds: float  # the trial from start to end

    @property
    def success(self) -> bool:
        return self.finished and self.equal


def loop_command(hosts: tuple[Host, Host], rank: int, root: Path, out: Path, data_dir: Path, delay: float) -> list:
    """Machine `rank`'s restart loop around the docs' launcher command."""
    host = hosts[rank]
    launcher = [sys.executable, "-m", "paddle.distributed.launch", "--nnodes", "2"]
    launcher += ["--master", f"{hosts[0].address}:{PORT}", "--rank", str(rank), "--host", host.address]
    launcher += ["--nproc_per_node", "1", "--log_dir", str(root / f"log{rank}")]
    launcher += [str(REPO / "train.py"), *TRAINER, "--data-dir", str(data_dir), "--output-dir", str(out)]
    launcher += ["--resume", "auto"]
    return host.command([sys.executable, "-m", "scripts.relaunch", "--delay", f"{delay:g}", "--", *launcher])


def start(hosts, root: Path, out: Path, data_dir: Path, delay: float) -> list[subprocess.Popen]:
    root.mkdir(parents=True, exist_ok=True)
    loops = []
    for rank, host in enumerate(hosts):
        env = {**os.environ, "PYTHONPATH": str(REPO), "GLOO_SOCKET_IFNAME": host.interface}
        env.pop("OMP_NUM_THREADS", None)
        with open(root / f"machine{rank}.txt", "w") as output:
            cmd = loop_command(hosts, rank, root, out, data_dir, delay)
            loops.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=output, stderr=subprocess.STDOUT))
    return loops


def read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def trained_step(log: Path) -> int:
    """The last optimizer step a worker's log shows (epoch E step S/N is step (E-1)*N + S)."""
    found = re.findall(r"epoch (\d+) step (\d+)/(\d+) ", read(log))
    return max(((int(e) - 1) * int(n) + int(s) for e, s, n in found), default=0)


def victim_pid(host: Host, victim: str) -> int | None:
    """The pid of this machine's launcher or worker, by their command lines (the loop's holds both as words)."""
    for pid in host.pids():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        launcher = argv[1:3] == ["-m", "paddle.distributed.launch"]
        worker = str(REPO / "train.py") in argv[1:3] and "scripts.relaunch" not in argv  # python [-u] train.py
        if (victim == "launcher" and launcher) or (victim == "worker" and worker):
            return pid
    return None


def weights(path: Path) -> dict[str, np.ndarray]:
    import paddle  # here: only the comparison needs Paddle in this process

    return {k: v.numpy() for k, v in paddle.load(str(path)).items()}


def bitwise_equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def reference(hosts, root: Path, data_dir: Path) -> dict[str, np.ndarray]:
    """The uninterrupted run, through the same loops."""
    codes = wait_all(start(hosts, root, root / "out", data_dir, DEFAULT_DELAY_S), 600)
    if codes != [0, 0]:
        raise SystemExit(f"the uninterrupted run failed (exit codes {codes}); see {root}")
    return weights(root / "out" / "model.pdparams")


def trial(hosts, root: Path, data_dir: Path, full: dict, machine: int, victim: str, step: int, delay: float) -> Trial:
    """Start both loops, SIGKILL the victim once machine 0's worker has trained `step` steps, wait for the end."""
    started = time.monotonic()
    out, log0 = root / "out", root / "log0" / "workerlog.0"
    loops = start(hosts, root, out, data_dir, delay)
    try:
        deadline = time.monotonic() + 300
        while trained_step(log0) < step or (pid := victim_pid(hosts[machine], victim)) is None:
            if time.monotonic() > deadline or any(loop.poll() is not None for loop in loops):
                raise RuntimeError(f"training did not reach step {step}; see {root}")
            time.sleep(0.01)
        joined_before = read(log0).count(JOINED)
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        recovery = None
        while any(loop.poll() is None for loop in loops) and time.monotonic() - killed < 600:
            if recovery is None and read(log0).count(JOINED) > joined_before:
                recovery = time.monotonic() - killed
            time.sleep(0.05)
    finally:
        codes = wait_all(loops, 0)
    attempts = tuple(len(re.findall(r"relaunch: attempt \d+ of \d+: ", read(root / f"machine{r}.txt"))) for r in (0, 1))
    finished = codes == [0, 0]
    equal = finished and bitwise_equal(full, weights(out / "model.pdparams"))
    return Trial(machine, victim, step, finished, equal, recovery, attempts, time.monotonic() - started)


def summary(trials: list[Trial]) -> str:
    ok = [t for t in trials if t.success]
    times = [t.recovery_s for t in ok if t.recovery_s is not None]
    spread = f"median {statistics.median(times):.1f} s, {min(times):.1f} to {max(times):.1f} s" if times else "none"
    return f"{len(ok)} of {len(trials)} trials finished bitwise equal to the uninterrupted run; recovery {spread}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--delay", type=float, default=DEFAULT_DELAY_S, help="scripts.relaunch's --delay (%(default)s)")
    p.add_argument("--seed", type=int, default=0, help="draws the machine, the victim and the step of each trial")
    p.add_argument("--data-dir", type=Path, default=REPO / "data" / "mnist")
    p.add_argument("--jsonl", type=Path, help="append each trial here as one JSON line")
    p.add_argument("--keep", action="store_true", help="keep the trials' logs and outputs (else only failed ones)")
    args = p.parse_args(argv)
    if problem := namespaces_problem():
        print(f"error: {problem}", file=sys.stderr)
        return 2
    draw = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="restart_trials"))
    trials = []
    with two_hosts() as hosts:
        full = reference(hosts, work / "reference", args.data_dir)
        for n in range(1, args.trials + 1):
            machine, victim, step = draw.randrange(2), draw.choice(("worker", "launcher")), draw.randint(1, STEPS - 4)
            root = work / f"trial{n:02d}"
            t = trial(hosts, root, args.data_dir, full, machine, victim, step, args.delay)
            trials.append(t)
            recovery = f"{t.recovery_s:.1f} s" if t.recovery_s is not None else "never"
            print(
                f"trial {n}: {victim} of machine {machine} killed at step {step}: "
                f"{'ok' if t.success else 'FAILED'}, recovery {recovery}, attempts {t.attempts}, {t.seconds:.0f} s"
                + ("" if t.success else f" (see {root})"),
                flush=True,
            )
            if args.jsonl:
                with args.jsonl.open("a") as f:
                    f.write(json.dumps({"trial": n, **asdict(t), "success": t.success}) + "\n")
            if t.success and not args.keep:
                shutil.rmtree(root, ignore_errors=True)
    print(summary(trials))
    return 0 if all(t.success for t in trials) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Shared by the tests: small datasets in the real formats (idx, CIFAR-10, mnist.json.gz), short runs of the trainer."""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import pickle
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np

from paddle_mnist.datasets import data, formats
from paddle_mnist.files import plots

REPO = Path(__file__).resolve().parent.parent
TRAIN_PY = REPO / "train.py"
# The tutorial's network (no batch norm) with the recipe the tests were written for: no warmup. Its own recipe
# warms up (config.RECIPES); with it, test_parallel's 1-process and 2-worker weights differed by up to 2.5e-5 after
# 16 steps, past the 1e-5 those tests hold them to. The recipe's own start is tests/test_first_steps.py's.
TUTORIAL_CNN = ["--model", "mnist_cnn", "--warmup-epochs", "0"]
# MNIST-type data trains with random shifts by default; the tests that compare a run with one process, or with
# another run, were written for unshifted batches and keep them
PLAIN_MNIST = ["--dataset", "mnist", "--no-augment"]


# A short job on real MNIST as shipped, with mnist_cnn's own recipe (augmented by default) and the default
# convolutions, for the checks that N workers train one process's step (docs/training.md has the measurements)
REAL_JOB = ["--dataset", "mnist", "--model", "mnist_cnn", "--max-steps", "15", "--batch-size", "96"]
REAL_JOB += ["--train-limit", "3000", "--eval-limit", "600", "--seed", "7"]


def small_run(
    *,
    train_limit: int | None = 512,
    eval_limit: int | None = 201,
    batch_size: int | None = None,
    epochs: int | None = None,
    log_every: int | None = 4,
    lr: float | None = 0.02,
    tutorial_cnn: bool = True,
) -> list[str]:
    """The flags of the tests' short runs on PLAIN_MNIST data, by default with TUTORIAL_CNN's network; the default
    limits take all of conftest's dataset (512 training, 201 test images). None leaves a flag to the trainer. A test
    adds --data-dir, --output-dir and its own flags after these: where it repeats one of them, its value wins."""
    flags = [*PLAIN_MNIST]
    for flag, value in (
        ("--train-limit", train_limit),
        ("--eval-limit", eval_limit),
        ("--batch-size", batch_size),
        ("--epochs", epochs),
        ("--log-every", log_every),
        ("--lr", lr),
    ):
        if value is not None:
            flags += [flag, str(value)]
    return flags + (TUTORIAL_CNN if tutorial_cnn else [])


def idx_bytes(array: np.ndarray) -> bytes:
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(n).to_bytes(4, "big") for n in array.shape)
    return header + np.ascontiguousarray(array, dtype=np.uint8).tobytes()


def write_idx(path: Path, array: np.ndarray, compress: bool = True) -> Path:
    raw = idx_bytes(array)
    path = Path(str(path) + ".gz") if compress else Path(path)
    path.write_bytes(gzip.compress(raw) if compress else raw)
    return path


def make_images(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Ten learnable classes, MNIST-like in brightness: sparse bright strokes per class plus noise."""
    templates = (np.random.RandomState(0).rand(10, 28, 28) < 0.15) * 255.0
    rng = np.random.RandomState(seed)
    labels = rng.randint(0, 10, size=n)
    noise = rng.normal(0, 70, size=(n, 28, 28))
    images = np.clip(templates[labels] + noise, 0, 255).astype(np.uint8)
    return images, labels.astype(np.uint8)


def make_dataset(folder: Path, n_train: int = 512, n_test: int = 201, compress: bool = True, checksums: bool = True):
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for split, n, seed in (("train", n_train, 1), ("test", n_test, 2)):
        images, labels = make_images(n, seed)
        images_name, labels_name = data.IDX_FILES[split]
        written.append(write_idx(folder / images_name, images, compress))
        written.append(write_idx(folder / labels_name, labels, compress))
    if checksums:
        lines = [f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}\n" for p in written]
        (folder / "SHA256SUMS").write_text("".join(lines))
    return folder


def free_port() -> int:
    """A loopback port nothing listens on: free a moment ago, so it can be bound (or a connection to it refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_metrics(out: Path) -> list[dict]:
    """The rows of a run's metrics.jsonl, one per epoch, read as the plotting module reads them."""
    return plots.read_metrics(Path(out) / plots.METRICS_FILE)


def read_results(out: Path) -> dict:
    return json.loads((Path(out) / "results.json").read_text())


def weights(path: Path) -> dict[str, np.ndarray]:
    """A saved state dict (model.pdparams, model_best.pdparams) as numpy arrays, to compare runs."""
    import paddle  # here, not at the top: most helpers serve tests that never start Paddle in this process

    return {k: v.numpy() for k, v in paddle.load(str(path)).items()}


def rank_pid(out: Path, rank: int) -> int:
    """The pid of the worker of this rank, among the trainer processes writing to out."""
    for entry in Path("/proc").iterdir():
        try:
            cmd = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            env = (entry / "environ").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if str(out) in cmd and str(TRAIN_PY) in cmd and f"PADDLE_TRAINER_ID={rank}" in env:
            if not {"paddle.distributed.launch", "paddle.distributed.fleet.launch"} & set(cmd):
                return int(entry.name)
    raise AssertionError(f"no worker of rank {rank} for {out}")


def wait_for(job: subprocess.Popen, log: Path, text: str) -> None:
    """Until log holds text; fails, showing the log's end, if job ends first or two minutes pass."""
    deadline = time.time() + 120
    while not (log.exists() and text in log.read_text(errors="replace")):
        if time.time() > deadline or job.poll() is not None:
            end = log.read_text(errors="replace")[-2000:] if log.exists() else "(no such file)"
            raise AssertionError(f"never saw {text!r} in {log}, which ends:\n{end}")
        time.sleep(0.05)


@contextlib.contextmanager
def reaped(job: subprocess.Popen):
    """Kill the job if the block leaves it running (a failed assertion, a timeout), so no launcher outlives a test."""
    try:
        yield job
    finally:
        if job.poll() is None:
            job.kill()


def launch_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("OMP_NUM_THREADS", None)
    # importing paddle_mnist.deploy.predict (test_predict does, at collection) quiets Paddle's C++ INFO lines in this
    # process's environment; the jobs a test starts log as a user's would
    env.pop("GLOG_minloglevel", None)
    return env


def run_single(args: list[str], cwd: Path, timeout: int = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """python train.py ARGS in one process; env: variables set on top of launch_env()'s."""
    cmd = [sys.executable, str(TRAIN_PY), *args]
    return subprocess.run(cmd, cwd=cwd, env=launch_env() | (env or {}), capture_output=True, text=True, timeout=timeout)


def run_launch(
    args: list[str],
    cwd: Path,
    log_dir: Path,
    launch_args: list[str] | None = None,
    timeout: int = 300,
    env: dict | None = None,
) -> subprocess.CompletedProcess:
    """python -m paddle.distributed.launch [launch_args] --log_dir LOG train.py ARGS, as a user would type it;
    env: variables set on top of launch_env()'s."""
    launch_args = ["--nproc_per_node", "2"] if launch_args is None else launch_args
    cmd = [sys.executable, "-m", "paddle.distributed.launch", *launch_args, "--log_dir", str(log_dir)]
    cmd += [str(TRAIN_PY), *args]
    return subprocess.run(cmd, cwd=cwd, env=launch_env() | (env or {}), capture_output=True, text=True, timeout=timeout)


def run_one_and_two(root: Path, args: list[str]) -> Path:
    """The same job in one process (root/one) and in two workers (root/two, their logs in root/log)."""
    one = run_single([*args, "--output-dir", str(root / "one")], cwd=root)
    assert one.returncode == 0, explain(one)
    two = run_launch([*args, "--output-dir", str(root / "two")], cwd=root, log_dir=root / "log")
    assert two.returncode == 0, explain(two, root / "log")
    return root


def worker_log(log_dir: Path, rank: int) -> str:
    return (Path(log_dir) / f"workerlog.{rank}").read_text()


def param_digest(log_text: str) -> str:
    found = re.findall(r"parameters sha256 ([0-9a-f]{64})", log_text)
    assert found, "no parameter digest in the log"
    return found[-1]


# a line the trainer writes for people: its clock and rank tag, then the words (the run's "started:" line excepted,
# which marks where each run begins in a reused --log_dir), or an error line written before its log existed
TRAINER_LINE = re.compile(r"^(\d\d:\d\d:\d\d \[rank \d+/\S+\] (?!started: )|error: )(.+)$")


def check_read_by_facts(log_dirs: Path | list[Path], summary: str) -> None:
    """python -m paddle_mnist.logs reads the trainer's facts from each rank's events: its summary of a real job's
    logs (summary, of these --log_dir) stays the same, word for word, with every line the trainer wrote for people
    reworded; and with the events taken away (an older trainer's logs), the English lines name the same ranks,
    statuses and cause."""
    from paddle_mnist.files.logs import summarise

    dirs = [Path(d) for d in (log_dirs if isinstance(log_dirs, list) else [log_dirs])]
    assert all(list(d.glob("eventlog.*")) for d in dirs), f"no eventlog.N in one of {dirs}"
    reworded = [d.with_name(d.name + "-reworded") for d in dirs]
    lines_only = [d.with_name(d.name + "-lines") for d in dirs]
    changed = 0
    for d, a, b in zip(dirs, reworded, lines_only):
        shutil.copytree(d, a)  # copy2: the files' times, by which the reader orders the ranks' ends, are kept
        shutil.copytree(d, b)
        for events in b.glob("eventlog.*"):
            events.unlink()
        for log in a.glob("workerlog.*"):
            text, times = log.read_text().splitlines(keepends=True), os.stat(log)
            new = [TRAINER_LINE.sub(r"\1said otherwise", line) for line in text]
            changed += sum(x != y for x, y in zip(text, new))
            log.write_text("".join(new))
            os.utime(log, ns=(times.st_atime_ns, times.st_mtime_ns))
    assert changed, "no line of the trainer's was reworded: the check would prove nothing"

    def read(copies: list[Path]) -> str:
        out = summarise(copies)
        for d, c in zip(dirs, copies):
            out = out.replace(str(c), str(d))
        return out

    assert read(reworded) == summary
    keep = re.compile(r"^(rank [\d?]+ |first to stop|cause: )")
    assert [x for x in read(lines_only).splitlines() if keep.match(x)] == [
        x for x in summary.splitlines() if keep.match(x)
    ]


def explain(proc: subprocess.CompletedProcess, log_dir: Path | None = None) -> str:
    parts = [f"exit {proc.returncode}", proc.stdout[-3000:], proc.stderr[-3000:]]
    if log_dir is not None:
        for p in sorted(Path(log_dir).glob("workerlog.*")):
            parts.append(f"--- {p.name}\n{p.read_text()[-3000:]}")
    return "\n".join(parts)


def make_colour_images(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Ten learnable colour classes, 3 x 32 x 32, CIFAR-like: a per-class pattern plus noise."""
    templates = np.random.RandomState(10).randint(0, 256, size=(10, 3, 32, 32)).astype(np.float64)
    rng = np.random.RandomState(seed)
    labels = rng.randint(0, 10, size=n)
    images = np.clip(templates[labels] + rng.normal(0, 60, size=(n, 3, 32, 32)), 0, 255).astype(np.uint8)
    return images, labels


def cifar_batch_bytes(images: np.ndarray, labels, name: str = "training batch 1 of 5") -> bytes:
    """One batch file as the real archive has it: a protocol-2 pickle of a dict with bytes keys."""
    batch = {
        b"batch_label": name.encode(),
        b"labels": [int(v) for v in labels],
        b"data": np.ascontiguousarray(images, dtype=np.uint8).reshape(len(images), -1),
        b"filenames": [f"img_{i}.png".encode() for i in range(len(images))],
    }
    return pickle.dumps(batch, protocol=2)


CIFAR_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def cifar_members(n_per_batch: int = 64, n_test: int = 50) -> dict[str, bytes]:
    """The archive's members (basename -> bytes): five training batches, the test batch, the meta file."""
    members = {}
    for i, name in enumerate(formats.CIFAR_TRAIN, 1):
        images, labels = make_colour_images(n_per_batch, seed=i)
        members[name] = cifar_batch_bytes(images, labels, f"training batch {i} of {len(formats.CIFAR_TRAIN)}")
    images, labels = make_colour_images(n_test, seed=99)
    members[formats.CIFAR_TEST] = cifar_batch_bytes(images, labels, "testing batch 1 of 1")
    meta = {b"label_names": [c.encode() for c in CIFAR_CLASSES], b"num_cases_per_batch": n_per_batch, b"num_vis": 3072}
    members[formats.CIFAR_META] = pickle.dumps(meta, protocol=2)
    members["readme.html"] = b"<html></html>"
    return members


def write_cifar_archive(path: Path, members: dict[str, bytes]) -> Path:
    """cifar-10-python.tar.gz with the real member names (cifar-10-batches-py/NAME)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as tar:
        for name, payload in members.items():
            info = tarfile.TarInfo(f"{formats.CIFAR_FOLDER}/{name}")
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    return path


def write_cifar_folder(folder: Path, members: dict[str, bytes]) -> Path:
    """The extracted cifar-10-batches-py/ folder."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, payload in members.items():
        (folder / name).write_bytes(payload)
    return folder


def mnist_json_tree(sizes=(120, 40, 30), signed: bool = False) -> list:
    """[train, valid, eval], each [images as flat lists of 784 floats, labels], as the course's file has them."""
    tree = []
    for seed, n in enumerate(sizes, start=5):
        images, labels = make_images(n, seed)
        x = images.reshape(n, 784) / 255.0
        if signed:
            x = x * 2.0 - 1.0
        tree.append([np.round(x, 6).tolist(), labels.astype(int).tolist()])
    return tree


def write_mnist_json(path: Path, tree: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(json.dumps(tree, separators=(",", ":")).encode()))
    return path


def exited(pid: int) -> bool:
    """The process has ended: gone, or a zombie its parent has not reaped yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def watch_end(job: subprocess.Popen, pid: int, limit: float = 90.0) -> tuple[float | None, float]:
    """Seconds from now until the process pid ended (None if it outlived the job) and until the job ended;
    fails when the job runs past limit seconds."""
    t0, ended = time.monotonic(), None
    while job.poll() is None:
        if ended is None and exited(pid):
            ended = time.monotonic() - t0
        assert time.monotonic() - t0 < limit, f"the job did not end within {limit:.0f} s"
        time.sleep(0.02)
    return ended, time.monotonic() - t0

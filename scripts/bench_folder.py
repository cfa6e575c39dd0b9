"""Your own images against the built-in data: the 70,000 Fashion-MNIST images as PNG files, trained from a folder.

    python -m scripts.bench_folder                  # 2 workers, the default model and flags, 3 rounds
    python -m scripts.bench_folder --rounds 5 --workers 1

The idx files of data/fashion-mnist are written as PNG files in the folder layout (train/<class>/ from the training
split, val/<class>/ from the test split) under --work, once. Then the folder's cache is built in a fresh process
(images/s, and the peak resident memory of the building process and of its largest decoding process), and the
trainer runs one epoch of each, --dataset folder and --dataset fashion-mnist, as users run it (under
python -m paddle.distributed.launch), with the same model and flags. The two take turns, round after round (the
order reversed every other round), so a slow spell of a shared machine falls on both. Reported: the median and
range of each one's epoch time (the training epoch, from metrics.jsonl) and of the whole command's wall time.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from PIL import Image

from paddle_mnist.config import Config
from paddle_mnist.datasets import data, folder
from paddle_mnist.files import plots

REPO = Path(__file__).resolve().parent.parent
CLASSES = tuple(name.replace("/", " or ") for name in data.FASHION)  # a class name is a folder name: no slash


_SPLITS: list[data.Split] = []  # set before the writing pool forks, so its processes read them without a copy


def _write(task: tuple[str, int, int]) -> None:
    root, split_index, lo = task
    split = _SPLITS[split_index]
    for i in range(lo, min(lo + 1000, len(split))):
        name = CLASSES[int(split.labels[i])]
        Image.fromarray(split.images[i, 0]).save(Path(root) / f"{name}/{i:05d}.png")


def write_folder(root: Path) -> int:
    """The PNG files, written in parallel unless they are there already; how many images there are."""
    done = root / ".complete"
    ds = data.load_dataset("fashion-mnist")
    train, test = ds.train, ds.test
    _SPLITS[:] = [train, test]
    if not done.is_file():
        tasks = []
        for split_index, (split, name) in enumerate(((train, "train"), (test, "val"))):
            for c in CLASSES:
                (root / name / c).mkdir(parents=True, exist_ok=True)
            tasks += [(str(root / name), split_index, lo) for lo in range(0, len(split), 1000)]
        started = time.perf_counter()
        with multiprocessing.get_context("fork").Pool() as pool:
            pool.map(_write, tasks)
        print(f"wrote {len(train) + len(test)} PNG files to {root} in {time.perf_counter() - started:.0f} s")
        done.write_text("")
    return len(train) + len(test)


def build_cache(root: Path) -> dict:
    """Build the cache anew in a fresh process (this script with --build-only), so its peak memory is its own."""
    cmd = [sys.executable, "-m", "scripts.bench_folder", "--build-only", "--work", str(root)]
    out = subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=REPO, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"building the cache failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def build_here(root: Path) -> dict:
    """{seconds, images_per_s, peak_mb (this process), worker_peak_mb (its largest decoding process)}."""
    listing = folder.list_folder(root)
    cache = folder.default_cache_dir(root)
    shutil.rmtree(cache, ignore_errors=True)
    started = time.perf_counter()
    folder.build(listing, folder.Request.of(Config()), cache, logging.getLogger("bench"))
    seconds = time.perf_counter() - started
    n = sum(len(entries) for entries in listing.splits.values())
    return {
        "seconds": seconds,
        "images_per_s": n / seconds,
        "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "worker_peak_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
    }


def launcher(workers: int, log_dir: Path) -> list[str]:
    if workers == 1:
        return [sys.executable]
    launch = [sys.executable, "-m", "paddle.distributed.launch"]
    return [*launch, "--nproc_per_node", str(workers), "--log_dir", str(log_dir)]


def run(cmd: list[str], env: dict, what: str, log_dir: Path) -> str:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = proc.stdout[-1500:] + proc.stderr[-1500:]
        sys.exit(f"{what} failed (exit {proc.returncode}); its logs: {log_dir}\n{tail}")
    return proc.stdout


def fresh(*folders: Path) -> None:
    """Remove a previous round's run: the launcher appends to old worker logs, the trainer refuses old results."""
    for path in folders:
        if path.exists():
            shutil.rmtree(path)


def train_once(args, contender: str, work: Path) -> dict:
    out, log_dir = work / contender, work / f"{contender}-log"
    fresh(out, log_dir)
    source = ["--dataset", "folder", "--data-dir", str(args.folder)] if contender == "folder" else []
    cmd = launcher(args.workers, log_dir) + [str(REPO / "train.py"), *source, "--epochs", "1"]
    cmd += ["--output-dir", str(out), "--log-every", "0", *args.extra]
    started = time.perf_counter()
    run(cmd, dict(os.environ, PYTHONPATH=str(REPO)), f"{contender} ({args.workers} workers)", log_dir)
    wall = time.perf_counter() - started
    row = plots.read_metrics(out / plots.METRICS_FILE)[-1]
    return {"epoch_s": row["epoch_time_s"], "wall_s": wall, "val_acc": row["val_acc"]}


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} s (range {min(values):.1f} to {max(values):.1f})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.bench_folder", description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, default=Path("/tmp/bench_folder"), help="where the PNG files and runs go")
    p.add_argument("--rounds", type=int, default=3, help="epochs of each contender, taking turns")
    p.add_argument("--workers", type=int, default=2, help="training workers (1: python train.py, no launcher)")
    p.add_argument("--json", type=Path, help="also write the figures to this file")
    p.add_argument("--build-only", action="store_true", help=argparse.SUPPRESS)  # build_cache's child process
    args, extra = p.parse_known_args(argv)
    if args.build_only:
        print(json.dumps(build_here(args.work)))
        return 0
    args.extra = extra  # any other flag goes to both trainer runs alike, e.g. --model mnist_cnn
    args.folder = args.work / "fashion-png"
    n = write_folder(args.folder)
    cache = build_cache(args.folder)
    print(
        f"cache of {n} images built in {cache['seconds']:.1f} s: {cache['images_per_s']:.0f} images/s; peak memory "
        f"{cache['peak_mb']:.0f} MiB (building process), {cache['worker_peak_mb']:.0f} MiB (largest decoding process)"
    )
    times: dict[str, list[dict]] = {"folder": [], "idx": []}
    for r in range(args.rounds):
        order = ("folder", "idx") if r % 2 == 0 else ("idx", "folder")
        for contender in order:
            result = train_once(args, contender, args.work)
            times[contender].append(result)
            print(f"round {r + 1} {contender}: epoch {result['epoch_s']:.1f} s, command {result['wall_s']:.1f} s")
    for contender, rows in times.items():
        print(
            f"{contender}: epoch {summary([x['epoch_s'] for x in rows])}, "
            f"command {summary([x['wall_s'] for x in rows])}, {len(rows)} runs"
        )
    ratio = statistics.median(x["epoch_s"] for x in times["folder"]) / statistics.median(
        x["epoch_s"] for x in times["idx"]
    )
    print(f"folder / idx median epoch time: {ratio:.3f} (target: at most 1.10)")
    if args.json:
        args.json.write_text(json.dumps({"cache": cache, "runs": times, "ratio": ratio}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Input pipeline alone (images/s, with and without augmentation) next to the training rate of the same setup, one run.

    python -m scripts.bench_input                    # CIFAR-10, 2 workers, global batch 128
    python -m scripts.bench_input --dataset fashion-mnist --workers 1

CIFAR-10 comes from data/cifar10 (or --data-dir) when it is there; otherwise a full-size archive in the real
format (50,000 + 10,000 random images, the real member names and pickle layout) is generated in a temporary
folder, so load time and memory are those of the real dataset. The training rate is measured by running the
trainer as users do, under python -m paddle.distributed.launch, and read from its metrics and logs.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

from paddle_mnist.config import AUGMENTED_BY_DEFAULT, DATASETS, PER_WORKER_BATCH, Config
from paddle_mnist.datasets import data, formats
from paddle_mnist.files import plots
from paddle_mnist.files.log import memory_mb
from paddle_mnist.network import models

REPO = Path(__file__).resolve().parent.parent


def generate_cifar_archive(path: Path, n_train: int = 50_000, n_test: int = 10_000) -> None:
    """A cifar-10-python.tar.gz with the real layout and sizes, filled with random pixels."""
    rng = np.random.default_rng(0)

    def batch(n: int, label: str) -> bytes:
        labels = rng.integers(0, 10, n).tolist()
        pixels = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        return pickle.dumps({b"batch_label": label.encode(), b"labels": labels, b"data": pixels}, protocol=2)

    parts = len(formats.CIFAR_TRAIN)
    members = {
        name: lambda i=i: batch(n_train // parts, f"training batch {i} of {parts}")
        for i, name in enumerate(formats.CIFAR_TRAIN, 1)
    }
    members[formats.CIFAR_TEST] = lambda: batch(n_test, "testing batch 1 of 1")
    members[formats.CIFAR_META] = lambda: pickle.dumps({b"label_names": [f"class{i}".encode() for i in range(10)]}, 2)
    with tarfile.open(path, "w:gz", compresslevel=1) as tar:
        for name, make in members.items():
            payload = make()
            info = tarfile.TarInfo(f"{formats.CIFAR_FOLDER}/{name}")
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))


def pipeline_rate(ds: data.Dataset, per_worker: int, world: int, augmented: bool, seconds: float) -> float:
    """Images/s one worker's input pipeline delivers: the trainer's data.TrainBatches (sampler slice, gather,
    augmentation, normalisation, background thread), as rank 0 of `world` workers."""
    pipeline = data.TrainBatches(ds.train, ds, per_worker, 0, world, Config(dataset=ds.name, augment=augmented))
    images = 0
    start = time.perf_counter()
    epoch = 0
    while time.perf_counter() - start < seconds:
        batches = pipeline.epoch(epoch, 0, len(pipeline))
        try:
            for x, _ in batches:
                images += len(x)
                if time.perf_counter() - start >= seconds:
                    break
        finally:
            batches.close()
        epoch += 1
    return images / (time.perf_counter() - start)


def train_rate(args, data_dir: str, out: Path, augmented: bool) -> dict:
    """Run the trainer under the launcher for --train-steps steps; its global images/s, input wait and memory."""
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(args.workers)]
    cmd += ["--log_dir", str(out / "log"), str(REPO / "train.py"), "--dataset", args.dataset, "--data-dir", data_dir]
    cmd += ["--model", args.model, "--max-steps", str(args.train_steps), "--log-every", "0", "--eval-limit", "1000"]
    cmd += ["--batch-size", str(args.batch_size), "--output-dir", str(out / "run")]
    cmd += ["--augment" if augmented else "--no-augment"]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"the training run failed (exit {proc.returncode}): see {out / 'log'}\n{proc.stderr[-2000:]}")
    row = plots.read_metrics(out / "run" / plots.METRICS_FILE)[-1]
    peaks = []
    for rank in range(args.workers):
        text = (out / "log" / f"workerlog.{rank}").read_text()
        peaks.append(float(re.findall(r"peak memory (\d+) MiB", text)[-1]))
    return {"images_per_sec": row["images_per_sec"], "input_wait_share": row["input_wait_share"], "peak_mb": peaks}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dataset", default="cifar10", choices=DATASETS)
    p.add_argument("--data-dir", help="the dataset's folder or file (default: data/<dataset>, else generated)")
    p.add_argument("--model", default="mnist_cnn", choices=list(models.MODELS), help="model for the training rate")
    p.add_argument("--workers", type=int, default=2, help="workers for the training run")
    p.add_argument("--batch-size", type=int, default=0, help=f"global batch (0: {PER_WORKER_BATCH} x workers)")
    p.add_argument("--seconds", type=float, default=5.0, help="time per pipeline measurement")
    p.add_argument("--train-steps", type=int, default=100, help="optimizer steps of the training run")
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args(argv)
    args.batch_size = args.batch_size or PER_WORKER_BATCH * args.workers
    per_worker = args.batch_size // args.workers
    # the pipeline thread shares the cores with training; measure it with the threads one worker gets
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.workers)))

    with tempfile.TemporaryDirectory() as tmp:
        source = args.data_dir or str(data.REPO_DATA / args.dataset)
        generated = args.dataset == "cifar10" and not args.data_dir and not Path(source).exists()
        if generated:
            source = str(Path(tmp) / data.CIFAR_ARCHIVE)
            t = time.perf_counter()
            generate_cifar_archive(Path(source))
            print(f"generated a full-size CIFAR-10-format archive ({time.perf_counter() - t:.0f} s): {source}")
        before = memory_mb()[0]
        t = time.perf_counter()
        ds = data.load_dataset(args.dataset, source)
        load_s = time.perf_counter() - t
        held_mb = (
            ds.train.images.nbytes + ds.test.images.nbytes + (0 if ds.val_is_test else ds.val.images.nbytes)
        ) / 2**20
        print(
            f"{args.dataset}: {len(ds.train)} training images {ds.image_shape}, loaded in {load_s:.1f} s; "
            f"held as uint8: {held_mb:.0f} MiB; resident memory grew {memory_mb()[0] - before:.0f} MiB, "
            f"peak {memory_mb()[1]:.0f} MiB"
        )
        results = {
            "dataset": args.dataset,
            "generated": generated,
            "workers": args.workers,
            "global_batch": args.batch_size,
        }
        results["load_seconds"], results["held_mb"] = load_s, held_mb
        for augmented in (False, True):
            key = "augmented" if augmented else "plain"
            results[f"pipeline_{key}"] = pipeline_rate(ds, per_worker, args.workers, augmented, args.seconds)
        del ds
        augmented_default = args.dataset in AUGMENTED_BY_DEFAULT
        results["train"] = train_rate(args, source, Path(tmp), augmented_default)

    per_worker_train = results["train"]["images_per_sec"] / args.workers
    results["ratio_plain"] = results["pipeline_plain"] / per_worker_train
    results["ratio_augmented"] = results["pipeline_augmented"] / per_worker_train
    aug_text = "with" if augmented_default else "without"
    print(f"\nper worker (batch {per_worker}, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}):")
    print(f"  input pipeline alone, no augmentation   {results['pipeline_plain']:>10,.0f} images/s")
    print(f"  input pipeline alone, augmented         {results['pipeline_augmented']:>10,.0f} images/s")
    print(
        f"  training ({args.model}, {args.workers} workers, {aug_text} augmentation) "
        f"{per_worker_train:>6,.0f} images/s ({results['train']['images_per_sec']:,.0f} global)"
    )
    print(f"  pipeline / training: {results['ratio_plain']:.1f}x plain, {results['ratio_augmented']:.1f}x augmented")
    print(f"  input wait during training: {100 * results['train']['input_wait_share']:.2f}% of step time")
    peaks = ", ".join(f"rank {r}: {m:.0f} MiB" for r, m in enumerate(results["train"]["peak_mb"]))
    print(f"  peak resident memory per training worker: {peaks}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

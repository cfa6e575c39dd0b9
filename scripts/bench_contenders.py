"""The loops scripts/bench.py times against the trainer, one per process (under the launcher for 2+ workers).

    bare      a hand-written loop: forward, loss, backward, step over batches already in memory as tensors
    torch     the same loop, network and batch in PyTorch with DistributedDataParallel (gloo), where torch is installed
    fit       paddle.Model.prepare + fit, a paddle.io.DataLoader over paddle.vision.datasets.FashionMNIST
    tutorial  the Paddle 1.x tutorials' style: a per-sample Python generator, batched in Python, each worker
              keeping every world-th batch (what distributed_batch_reader did), fed to the dygraph loop

Every Paddle contender trains the tutorial's layers as the tutorial writes them (MnistCNN(plain=True): nn.Conv2D
with its bias, ReLU, max-pool) with the plain loop of scripts/plain_loop.py, so they show what a user's own loop
gets. Each rank writes
{"rates": [global images/s per timed window], "peak_mb": ...} to OUT.rank<N>.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import sys
import time
from pathlib import Path

import numpy as np
import paddle
import paddle.distributed as dist

from paddle_mnist.datasets import data
from paddle_mnist.network.models import MnistCNN
from scripts.plain_loop import DEFAULTS, optimizer, train


class Windows:
    """Clock reads after every step: one warm-up window, then `windows` timed windows of `steps` steps."""

    def __init__(self, steps: int, windows: int, global_batch: int):
        self.steps, self.windows, self.global_batch = steps, windows, global_batch
        self.total = steps * (windows + 1)
        self.done = 0
        self.marks: list[float] = []

    def tick(self) -> bool:
        """Count one step; True once the last window is complete."""
        self.done += 1
        if self.done % self.steps == 0:
            self.marks.append(time.perf_counter())
        return self.done >= self.total

    def rates(self) -> list[float]:
        return [self.steps * self.global_batch / (b - a) for a, b in zip(self.marks, self.marks[1:])]


def parallel(model: paddle.nn.Layer) -> paddle.nn.Layer:
    return paddle.DataParallel(model) if dist.get_world_size() > 1 else model


def read_train(data_dir: Path) -> data.Dataset:
    """Fashion-MNIST as the trainer reads it: its training split and statistics."""
    return data.load_dataset("fashion-mnist", str(data_dir))


def shard_batches(ds: data.Dataset, per_worker: int, rank: int, world: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """A few distinct normalised batches of this rank's share, so no step reuses the last one's memory."""
    batches = []
    for k in range(8):
        lo = (k * world + rank) * per_worker
        x = data.normalise(ds.train.images[lo : lo + per_worker], ds.mean, ds.std)
        batches.append((x, ds.train.labels[lo : lo + per_worker]))
    return batches


def run_bare(args, clock: Windows) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = shard_batches(read_train(args.data_dir), args.batch // world, rank, world)
    tensors = [(paddle.to_tensor(x), paddle.to_tensor(y)) for x, y in batches]
    model = parallel(MnistCNN(plain=True))
    train(model, optimizer(model), itertools.cycle(tensors), clock.tick)


def run_fit(args, clock: Windows) -> None:
    import paddle.vision.transforms as T

    ds = read_train(args.data_dir)  # for the statistics fit normalises with
    images, labels = data.IDX_FILES["train"]
    dataset = paddle.vision.datasets.FashionMNIST(
        image_path=str(args.data_dir / f"{images}.gz"),
        label_path=str(args.data_dir / f"{labels}.gz"),
        mode="train",
        transform=T.Compose([T.ToTensor(), T.Normalize(mean=list(ds.mean), std=list(ds.std))]),
    )

    class Tick(paddle.callbacks.Callback):
        def on_train_batch_end(self, step, logs=None):
            clock.tick()

    net = MnistCNN(plain=True)
    model = paddle.Model(net)
    model.prepare(optimizer(net), paddle.nn.CrossEntropyLoss(), paddle.metric.Accuracy())
    model.fit(
        dataset,
        batch_size=args.batch // dist.get_world_size(),  # fit's batch_size is per worker
        epochs=1,
        shuffle=True,  # verbose and log_freq keep fit's defaults: a progress line every 10 steps, as users get
        num_iters=clock.total,
        callbacks=[Tick()],
    )


def run_tutorial(args, clock: Windows) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    per_worker = args.batch // world
    ds = read_train(args.data_dir)
    images, labels = ds.train.images[:, 0], ds.train.labels
    mean, std = ds.mean[0], ds.std[0]

    def sample_reader():  # paddle.dataset.mnist.train(): one normalised, flattened image at a time
        for i in np.random.permutation(len(labels)):
            yield (images[i].astype("float32") / 255 - mean) / std, int(labels[i])

    def batch_reader():  # paddle.batch(..., drop_last=True)
        batch = []
        for sample in sample_reader():
            batch.append(sample)
            if len(batch) == per_worker:
                yield batch
                batch = []

    def distributed_batch_reader():  # every worker reads every batch and keeps its own share
        for i, batch in enumerate(batch_reader()):
            if i % world == rank:
                yield batch

    def tensors():  # epoch after epoch, each batch stacked in Python as the tutorial's feeder did
        while True:
            for batch in distributed_batch_reader():
                x = np.array([s[0].reshape(1, *images.shape[1:]) for s in batch]).astype("float32")
                y = np.array([s[1] for s in batch]).astype("int64")
                yield paddle.to_tensor(x), paddle.to_tensor(y)

    model = parallel(MnistCNN(plain=True))
    train(model, optimizer(model), tensors(), clock.tick)


def run_torch(args, clock: Windows) -> None:
    """The bare loop in PyTorch, started by torch.distributed.run: the same layers, initial scheme aside, and batch."""
    import torch
    import torch.distributed as tdist
    from torch import nn

    torch.set_num_threads(args.threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        tdist.init_process_group("gloo")
    batches = shard_batches(read_train(args.data_dir), args.batch // world, rank, world)
    batches = [(torch.from_numpy(x), torch.from_numpy(y)) for x, y in batches]
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(1, 20, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2, 2),
        nn.Conv2d(20, 20, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2, 2),
        nn.Flatten(), nn.Linear(20 * 7 * 7, 10),
    )  # fmt: skip
    model = nn.parallel.DistributedDataParallel(net) if world > 1 else net
    opt = torch.optim.SGD(
        model.parameters(), lr=DEFAULTS.lr, momentum=DEFAULTS.momentum, weight_decay=DEFAULTS.weight_decay
    )
    step = 0
    while True:
        x, y = batches[step % len(batches)]
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        if clock.tick():
            break
    if world > 1:
        tdist.destroy_process_group()


RUNNERS = {"bare": run_bare, "fit": run_fit, "tutorial": run_tutorial, "torch": run_torch}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("contender", choices=sorted(RUNNERS))
    p.add_argument("--data-dir", type=Path, required=True)
    p.add_argument("--batch", type=int, required=True, help="global batch")
    p.add_argument("--steps", type=int, required=True, help="steps per window")
    p.add_argument("--windows", type=int, required=True, help="timed windows after one warm-up window")
    p.add_argument("--threads", type=int, required=True, help="CPU math threads per worker")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    np.random.seed(0)
    if args.contender == "torch":  # started by torch.distributed.run, which names the rank in RANK
        rank = int(os.environ.get("RANK", "0"))
    else:
        paddle.base.core.set_num_threads(args.threads)
        paddle.set_device("cpu")
        paddle.seed(0)
        if int(paddle.distributed.ParallelEnv().world_size) > 1:
            dist.init_parallel_env()
        rank = dist.get_rank()
    clock = Windows(args.steps, args.windows, args.batch)
    RUNNERS[args.contender](args, clock)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result = {"rates": clock.rates(), "peak_mb": peak}
    Path(f"{args.out}.rank{rank}.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

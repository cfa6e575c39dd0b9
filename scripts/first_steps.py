"""First steps: how many optimizer steps each model's recipe takes to get clearly below chance, seed by seed.

    python -m scripts.first_steps --datasets mnist fashion-mnist --seeds 1 2 3 4 5 6 7 8

Each (dataset, model, seed) trains the model's default recipe (or the recipe with the flags after `--`) in this
one process, with the global batch of --workers workers, built by the trainer's own model, optimizer, schedule,
batch builders and convolutions (oneDNN's where it builds, as --conv-backend auto), until the mean loss of the
last 10 steps is below --limit (chance is ln 10 = 2.30). A start that has not got there after --steps optimizer
steps stalled. Prints one line per run and a table per model and dataset; exits 1 if any start stalled.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
import zlib  # noqa: F401 (before Paddle: Paddle 2.6's own zlib symbols would otherwise serve gzip and crash it)
from dataclasses import dataclass

import paddle

from paddle_mnist import config
from paddle_mnist.datasets import data
from paddle_mnist.datasets.transfer import Feed
from paddle_mnist.network.models import MODELS
from paddle_mnist.ops import onednn
from paddle_mnist.runtime import cpu
from paddle_mnist.runtime.distributed import DistEnv
from paddle_mnist.training import engine
from paddle_mnist.training.state import TrainState

ONE_PROCESS = DistEnv(0, 1, 0, 1, "none", "cpu")
WINDOW = 10  # steps averaged, as a progress line would
LIMIT = 1.5  # clearly below chance, ln 10 = 2.30


def window_mean(losses: list[float]) -> float:
    """The mean of the last WINDOW losses; infinite before there are WINDOW of them."""
    return statistics.mean(losses[-WINDOW:]) if len(losses) >= WINDOW else math.inf


@dataclass(frozen=True)
class Start:
    model: str
    dataset: str
    seed: int
    losses: list[float]  # one per optimizer step trained
    seconds: float

    def reached(self, limit: float) -> bool:
        return window_mean(self.losses) < limit


def first_losses(
    ds: data.Dataset, model: str, seed: int, steps: int, limit: float = LIMIT, workers: int = 2, flags=()
) -> Start:
    """The loss of each optimizer step of `model` on ds, as a run of `workers` workers plans them (the same global
    batch, schedule and data order), trained in this one process until the mean loss of the last WINDOW steps is
    below limit, or for `steps` steps. Batch norm normalises over the whole global batch here, where each worker
    would normalise over its own share."""
    argv = ["--model", model, "--dataset", ds.name, "--seed", str(seed), *flags]
    cfg = config.resolve(config.parse_args(argv), workers, config.DataFacts(ds.classes, len(ds.train)))
    per_epoch = len(ds.train) // cfg.batch_size
    state = TrainState.create(cfg, len(ds.classes), ds.image_shape, ONE_PROCESS, per_epoch)
    batches = data.TrainBatches(ds.train, ds, cfg.batch_size, 0, 1, cfg)
    losses: list[float] = []
    started = time.perf_counter()
    epoch = 0
    while len(losses) < steps and not window_mean(losses) < limit:
        epoch_batches = batches.epoch(epoch, 0, min(per_epoch, steps - len(losses)))
        for images, labels in epoch_batches:
            losses.append(float(engine.train_step(state, images, labels, cfg, Feed("cpu"), engine.ONE_PROCESS).loss))
            state.sched.step()
            if window_mean(losses) < limit:
                break
        epoch_batches.close()
        epoch += 1
    return Start(model, ds.name, seed, losses, time.perf_counter() - started)


def table(starts: list[Start], limit: float) -> list[str]:
    """A markdown table: per dataset and model, the seeds that stalled and the steps the others took."""
    lines = [
        f"| dataset | model | seeds | stalled | steps to a {WINDOW}-step mean loss below {limit}: median (range) |",
        "|---|---|---|---|---|",
    ]
    for key in dict.fromkeys((s.dataset, s.model) for s in starts):
        group = [s for s in starts if (s.dataset, s.model) == key]
        stalled = ", ".join(str(s.seed) for s in group if not s.reached(limit)) or "none"
        steps = [len(s.losses) for s in group if s.reached(limit)]
        took = f"{statistics.median(steps):g} ({min(steps)} to {max(steps)})" if steps else "-"
        lines.append(f"| {key[0]} | `{key[1]}` | {len(group)} | {stalled} | {took} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, flags = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--datasets", nargs="+", default=["mnist", "fashion-mnist"], choices=config.DATASETS)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--seeds", type=int, nargs="+", default=list(range(1, 9)))
    p.add_argument("--steps", type=int, default=150, help="the most optimizer steps a start may take")
    p.add_argument("--workers", type=int, default=2, help="the run whose global batch is trained (64 per worker)")
    p.add_argument("--limit", type=float, default=LIMIT, help="the mean loss over 10 steps to get below")
    args = p.parse_args(own)
    cpu.prefer_fast_kernels()
    paddle.base.core.set_num_threads(1)  # one core: a run's figures do not depend on how many the machine has
    cpu.set_openmp_threads(1)
    sys.stdout.reconfigure(line_buffering=True)
    # the convolutions (and minigooglenet's blocked layout) the trainer would use: --conv-backend after --
    print(onednn.activate(onednn.prepare(config.parse_args(flags).conv_backend), "cpu"))
    print(f"at most {args.steps} steps; global batch of {args.workers} workers; flags: {' '.join(flags) or 'none'}")
    starts = []
    for name in args.datasets:
        ds = data.load_dataset(name)
        for model in args.models:
            for seed in args.seeds:
                s = first_losses(ds, model, seed, args.steps, args.limit, args.workers, flags)
                starts.append(s)
                print(
                    f"  {name} {model} seed {seed}: loss {s.losses[0]:.2f} at step 1, {WINDOW}-step mean "
                    f"{window_mean(s.losses):.3f} at step {len(s.losses)} "
                    f"({'ok' if s.reached(args.limit) else 'STALLED'}); {s.seconds:.0f} s"
                )
    print("\n" + "\n".join(table(starts, args.limit)))
    return 0 if all(s.reached(args.limit) for s in starts) else 1


if __name__ == "__main__":
    sys.exit(main())

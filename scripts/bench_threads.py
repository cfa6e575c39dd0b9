"""Measure training speed (MNIST CNN, the plain loop on in-memory tensors) under CPU thread settings.

Each setting runs in its own fresh process, one after another, so they compare side by side in one run:

    python -m scripts.bench_threads --threads 1 2 --onednn 0 1 --steps 60
    python -m scripts.bench_threads --procs 2 --threads 1 2 --onednn 0   # two local workers side by side
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from paddle_mnist.config import PER_WORKER_BATCH

REPO = Path(__file__).resolve().parent.parent
WARMUP = 10  # steps before the clock starts


def measure(threads: int, batch: int, steps: int) -> float:
    """In the child process: Paddle is imported here, after the parent set its thread variables."""
    import numpy as np
    import paddle

    from paddle_mnist.network.models import MnistCNN
    from scripts import plain_loop

    paddle.base.core.set_num_threads(threads)
    paddle.seed(0)
    model = MnistCNN()
    opt = plain_loop.optimizer(model)
    x = paddle.to_tensor(np.random.RandomState(0).randn(batch, *plain_loop.MNIST_SHAPE).astype("float32"))
    y = paddle.to_tensor(np.random.RandomState(1).randint(0, 10, batch).astype("int64"))
    plain_loop.train(model, opt, itertools.repeat((x, y), WARMUP))
    start = time.perf_counter()
    loss = plain_loop.train(model, opt, itertools.repeat((x, y), steps))
    float(loss)  # wait for the last step's kernels
    return batch * steps / (time.perf_counter() - start)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="thread counts to try")
    p.add_argument("--onednn", type=int, nargs="+", default=[0, 1], help="FLAGS_use_mkldnn values to try")
    p.add_argument("--batch", type=int, default=PER_WORKER_BATCH, help="per-worker batch")
    p.add_argument("--steps", type=int, default=60, help=f"timed steps after {WARMUP} warm-up steps")
    p.add_argument(
        "--procs", type=int, nargs="+", default=[1], help="processes running at once, as local workers do (summed)"
    )
    p.add_argument("--child", nargs=3, type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps({"images_per_sec": measure(*args.child)}))
        return 0
    print(f"{'procs':>5} {'threads':>7} {'oneDNN':>6} {'img/s':>8}")
    for procs in args.procs:
        for onednn in args.onednn:
            for threads in args.threads:
                env = dict(os.environ, FLAGS_use_mkldnn=str(onednn), OMP_NUM_THREADS=str(threads), PYTHONPATH=str(REPO))
                cmd = [sys.executable, "-m", "scripts.bench_threads", "--child", str(threads)]
                cmd += [str(args.batch), str(args.steps)]
                running = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True) for _ in range(procs)]
                outs = [proc.communicate()[0] for proc in running]
                if any(proc.returncode for proc in running):
                    sys.exit(f"a measuring process failed: {cmd}")
                rate = sum(json.loads(out.strip().splitlines()[-1])["images_per_sec"] for out in outs)
                print(f"{procs:>5} {threads:>7} {onednn:>6} {rate:>8.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

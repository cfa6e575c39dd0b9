"""The trainer against PyTorch, side by side: the same network, data, batch, cores and world size.

    python -m scripts.bench_torch --torch-python /path/to/venv-with-torch/bin/python

For each model (--models: mnist_cnn, the default mnist_cnn_bn_fc and minigooglenet, all on Fashion-MNIST's 28x28
images) and each cell (1 worker x 1 thread, 1 worker x 2 threads, 2 workers x 1 thread), the two contenders take
turns in fresh processes, round after round, the order reversed every other round, so a slow spell of a shared
machine falls on both:

    trainer  python train.py as a user runs it (under paddle.distributed.launch for 2 workers), with
             --timing-every 0 and --no-augment (PyTorch does neither), its rate read from its log lines
    torch    the same layers in a plain PyTorch loop (DistributedDataParallel over gloo for 2 workers, started by
             torch.distributed.run) over batches already in memory as tensors: SGD with the trainer's momentum and
             weight decay, cross-entropy; torch.set_num_threads(threads)

Both run 64 images per worker a step. A contender's figure for a run is the median of its windowed rates after
the first window (global images/s); the table gives the median over rounds and the range, the ratio
trainer/torch of the medians, and the processor's model and vector extensions. PyTorch is not a requirement:
point --torch-python at any Python that has torch and numpy (this file's `worker` part imports nothing else).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PER_WORKER = 64
MOMENTUM, WEIGHT_DECAY, LR = 0.9, 5e-4, 0.01
RATE = re.compile(r"step (\d+)/\d+ .* (\d+) img/s \(global\)")
STEPS = {"mnist_cnn": (300, 50), "mnist_cnn_bn_fc": (300, 50), "minigooglenet": (24, 4)}  # (steps, per window)


def processor() -> str:
    """The processor's model name and its AVX2 / AVX-512 extensions, from /proc/cpuinfo."""
    name, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and name == "unknown":
                name = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    wide = sorted(f for f in flags if f.startswith("avx512"))
    ext = ["AVX2"] if "avx2" in flags else []
    ext += [f"AVX-512 ({', '.join(w[6:] or 'f' for w in wide)})"] if wide else ["no AVX-512"]
    return f"{name}; {', '.join(ext)}; {os.cpu_count()} cores"


# ---- the PyTorch side (run by --torch-python; imports torch and numpy only) ----


def read_idx(path: Path):
    import numpy as np

    raw = gzip.decompress(path.read_bytes())
    dims = raw[3]
    shape = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(raw, np.uint8, offset=4 + 4 * dims).reshape(shape)


def torch_net(name: str):
    from torch import nn

    if name in ("mnist_cnn", "mnist_cnn_bn_fc"):
        bn = name == "mnist_cnn_bn_fc"

        def block(cin):
            conv = nn.Conv2d(cin, 20, 5, padding=2, bias=not bn)
            norm = [nn.BatchNorm2d(20)] if bn else []
            return [conv, *norm, nn.ReLU(), nn.MaxPool2d(2, 2)]

        head = [nn.Linear(980, 256), nn.ReLU(), nn.Linear(256, 10)] if bn else [nn.Linear(980, 10)]
        return nn.Sequential(*block(1), *block(20), nn.Flatten(), *head)
    import torch

    def conv_module(cin, cout, k, stride=1, pad=None):
        pad = k // 2 if pad is None else pad
        return nn.Sequential(nn.Conv2d(cin, cout, k, stride, pad), nn.BatchNorm2d(cout), nn.ReLU())

    class Inception(nn.Module):
        def __init__(self, cin, k1, k3):
            super().__init__()
            self.b1, self.b3, self.out = conv_module(cin, k1, 1), conv_module(cin, k3, 3), k1 + k3

        def forward(self, x):
            return torch.cat([self.b1(x), self.b3(x)], 1)

    class Downsample(nn.Module):
        def __init__(self, cin, k):
            super().__init__()
            self.conv, self.pool, self.out = conv_module(cin, k, 3, 2, 0), nn.MaxPool2d(3, 2), k + cin

        def forward(self, x):
            return torch.cat([self.conv(x), self.pool(x)], 1)

    plan = [("i", 32, 32), ("i", 32, 48), ("d", 80), ("i", 112, 48), ("i", 96, 64), ("i", 80, 80), ("i", 48, 96)]
    plan += [("d", 96), ("i", 176, 160), ("i", 176, 160)]
    layers, channels = [conv_module(1, 96, 3)], 96
    for kind, *sizes in plan:
        block = Inception(channels, *sizes) if kind == "i" else Downsample(channels, *sizes)
        layers.append(block)
        channels = block.out
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.5), nn.Linear(channels, 10))


def torch_worker(args) -> None:
    import numpy as np
    import torch
    import torch.distributed as tdist

    torch.set_num_threads(args.threads)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if world > 1:
        tdist.init_process_group("gloo")
    images = read_idx(REPO / "data" / "fashion-mnist" / "train-images-idx3-ubyte.gz")
    labels = read_idx(REPO / "data" / "fashion-mnist" / "train-labels-idx1-ubyte.gz").astype(np.int64)
    batches = []
    for k in range(8):
        lo = (k * world + rank) * PER_WORKER
        x = (images[lo : lo + PER_WORKER, None].astype(np.float32) / 255 - 0.286) / 0.353
        batches.append((torch.from_numpy(x), torch.from_numpy(labels[lo : lo + PER_WORKER])))
    torch.manual_seed(0)
    net = torch_net(args.model)
    model = torch.nn.parallel.DistributedDataParallel(net) if world > 1 else net
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
    marks = []
    for step in range(1, args.steps + 1):
        x, y = batches[step % len(batches)]
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % args.window == 0:
            marks.append(time.perf_counter())
    rates = [args.window * PER_WORKER * world / (b - a) for a, b in zip(marks, marks[1:])]
    if rank == 0:
        Path(args.out).write_text(json.dumps(rates))
    if world > 1:
        tdist.destroy_process_group()


# ---- the driver ----


def windowed(log: str, batch: int) -> list[float]:
    """Rates between the trainer's log lines, from the running averages they print (steps x batch / rate is the
    time since the epoch started)."""
    points = [(int(s), int(s) * batch / float(r)) for s, r in RATE.findall(log)]
    return [(s1 - s0) * batch / (t1 - t0) for (s0, t0), (s1, t1) in zip(points, points[1:]) if t1 > t0]


def run_trainer(model: str, workers: int, threads: int, work: Path, env: dict) -> list[float]:
    steps, window = STEPS[model]
    out, log_dir = work / "trainer", work / "trainer-log"
    shutil.rmtree(log_dir, ignore_errors=True)  # the launcher appends to an existing workerlog.N
    launch = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2", "--log_dir", str(log_dir)]
    cmd = (launch if workers > 1 else [sys.executable]) + [str(REPO / "train.py"), "--model", model]
    cmd += ["--cpu-threads", str(threads), "--timing-every", "0", "--no-augment", "--max-steps", str(steps)]
    cmd += ["--log-every", str(window), "--eval-limit", "100", "--output-dir", str(out), "--overwrite"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    log = (log_dir / "workerlog.0").read_text() if workers > 1 else proc.stdout
    if proc.returncode != 0:
        raise SystemExit(f"the trainer failed ({model}, {workers}x{threads}):\n{log[-2000:]}{proc.stderr[-2000:]}")
    used = re.search(r"convolutions: .*", log)
    if not used or not used.group().startswith("convolutions: oneDNN"):  # a fallback would be measured unawares
        said = used.group() if used else log[-500:]
        raise SystemExit(f"the trainer did not run oneDNN's operators ({model}): {said}")
    rates = windowed(log, PER_WORKER * workers)
    if len(rates) != steps // window - 1:  # one run's lines, each window once
        raise SystemExit(f"the trainer's log holds {len(rates)} windows, not {steps // window - 1}:\n{log[-2000:]}")
    return rates


def run_torch(python: str, model: str, workers: int, threads: int, work: Path, env: dict) -> list[float]:
    steps, window = STEPS[model]
    out = work / "torch.json"
    launch = [python, "-m", "torch.distributed.run", "--nproc_per_node", str(workers), "--master_port", "29533"]
    cmd = (launch if workers > 1 else [python]) + [str(Path(__file__).resolve()), "worker", "--model", model]
    cmd += ["--threads", str(threads), "--steps", str(steps), "--window", str(window), "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"PyTorch failed ({model}, {workers}x{threads}):\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command")
    w = sub.add_parser("worker", help="(internal) one PyTorch worker")
    w.add_argument("--model", required=True)
    w.add_argument("--threads", type=int, required=True)
    w.add_argument("--steps", type=int, required=True)
    w.add_argument("--window", type=int, required=True)
    w.add_argument("--out", required=True)
    p.add_argument("--torch-python", default=sys.executable, help="a Python with torch and numpy")
    p.add_argument("--models", default="mnist_cnn,mnist_cnn_bn_fc,minigooglenet")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cells", default="1x1,1x2,2x1", help="WORKERSxTHREADS, comma-separated")
    p.add_argument("--json", type=Path, help="write the table's figures here")
    args = p.parse_args()
    if args.command == "worker":
        torch_worker(args)
        return 0
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("OMP_NUM_THREADS", None)
    rows = []
    print(f"processor: {processor()}")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for model in args.models.split(","):
            for workers, threads in (tuple(int(n) for n in c.split("x")) for c in args.cells.split(",")):
                got = {"trainer": [], "torch": []}
                for r in range(args.rounds):
                    order = ("trainer", "torch") if r % 2 == 0 else ("torch", "trainer")
                    for name in order:
                        rates = (
                            run_trainer(model, workers, threads, work, env)
                            if name == "trainer"
                            else run_torch(args.torch_python, model, workers, threads, work, env)
                        )
                        got[name].append(statistics.median(rates))
                row = {"model": model, "workers": workers, "threads": threads, **got}
                tm, pm = statistics.median(got["trainer"]), statistics.median(got["torch"])
                row["ratio"] = tm / pm
                rows.append(row)
                print(
                    f"{model:<16} {workers} worker(s) x {threads} thread(s): trainer {tm:7.0f} "
                    f"({min(got['trainer']):.0f}-{max(got['trainer']):.0f}), torch {pm:7.0f} "
                    f"({min(got['torch']):.0f}-{max(got['torch']):.0f}) images/s; trainer/torch {tm / pm:.2f}",
                    flush=True,
                )
    if args.json:
        args.json.write_text(json.dumps({"processor": processor(), "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The trainer against PyTorch, side by side: the same network, data, batch, cores and world size.

    python -m scripts.bench_torch --torch-python /path/to/venv-with-torch/bin/python
    python -m scripts.bench_torch --torch-python PYTHON --dataset folder --data-dir /tmp/cifar   # CIFAR-10, 3x32x32

The images: Fashion-MNIST's 1x28x28 (--dataset fashion-mnist, the default; --models mnist_cnn, the default
mnist_cnn_bn_fc and minigooglenet), or a class folder such as CIFAR-10's 3x32x32 (--dataset folder --data-dir DIR;
--models cifar_cnn, mnist_cnn_bn_fc and minigooglenet; cifar_fast when named). For a folder the trainer reads it
as a user's run does, from its decoded cache (DIR/.paddle_mnist-cache/<setting>/, built here first, before any
timing, when there is none yet), and PyTorch reads the same cache's train.npy, normalised by the same per-channel
mean and std.

For each model and each cell (1 worker x 1 thread, 1 worker x 2 threads, 2 workers x 1 thread by default; --cells
scaling for 1, 2, 4, ... workers up to the machine's cores, then 1 worker x a thread a core) the contenders take
turns in fresh processes, round after round, the order reversed every other round, so a slow spell of a shared
machine falls on all of them:

    trainer   python train.py as a user runs it (under paddle.distributed.launch for 2 workers or more), with
              --timing-every 0 and --no-augment (PyTorch does neither), its rate read from its log lines; its
              workers sum through shared memory (runtime/local_sum.py)
    trainer-gloo  the same with --cpu-sums gloo: Paddle's gloo all-reduce carries the sums (cells of 2 workers
              or more)
    trainer-f32   the same with the step's sums in float32 (PADDLE_MNIST_SUMS=float32): what exactness costs, for
              the models whose sums are float64 (mnist_cnn, cifar_cnn; elsewhere it equals trainer)
    trainer-blocked  the same with every convolution's maps in the layout oneDNN chooses
              (PADDLE_MNIST_CONV_MAPS=blocked): what csrc/onednn_conv.cc's NHWC maps gain
    trainer-nchw  the same with cifar_cnn's maps held NCHW between its layers (PADDLE_MNIST_CONV_MAPS=nchw):
              what keeping them blocked gains (elsewhere it equals trainer)
    alone     the limit without a collective: as many single-process trainers as the cell has workers, each with
              the cell's threads and 64 images a step, started together; their rates summed (cells of 2 workers
              or more). trainer/alone is the job's efficiency; trainer/slowest compares it with the workers' count
              times the slowest independent trainer, the most a job that meets every step can reach
    torch     the same layers in a plain PyTorch loop (DistributedDataParallel over gloo for 2 workers, started by
              torch.distributed.run) over batches already in memory as tensors: SGD with the trainer's momentum
              and weight decay, cross-entropy; torch.set_num_threads(threads); NCHW, PyTorch's default
    torch-cl  the same loop tuned as PyTorch's users tune it on CPUs: the model and its inputs channels_last
              (model.to(memory_format=torch.channels_last), each batch converted likewise, outside the timing)

All run 64 images per worker a step. A contender's figure for a run is the median of its windowed rates after the
first window (global images/s); the table gives the median over rounds and the range, the ratios trainer/torch
and trainer/torch-cl of the medians, the PyTorch version, and the processor's model and vector extensions.
PyTorch is not a requirement: point --torch-python at any Python that has torch and numpy (this file's `worker`
part imports nothing else).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
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
# (steps, per window): fewer for the slower models; every run ends inside the first epoch, also at 2 workers on
# CIFAR-10's 45,000 training images (351 steps), since the trainer's running averages restart with each epoch
STEPS = {
    "mnist_cnn": (300, 50),
    "mnist_cnn_bn_fc": (300, 50),
    "cifar_cnn": (100, 20),
    "minigooglenet": (24, 4),
    "cifar_fast": (48, 8),
}
MODELS = {  # --models by --dataset
    "fashion-mnist": "mnist_cnn,mnist_cnn_bn_fc,minigooglenet",
    "folder": "cifar_cnn,mnist_cnn_bn_fc,minigooglenet",
}
CONTENDERS = ("trainer", "trainer-gloo", "trainer-f32", "trainer-blocked", "trainer-nchw", "alone", "torch", "torch-cl")
TRAINER_ENV = {  # each trainer-X contender: the environment its runs add
    "trainer-f32": {"PADDLE_MNIST_SUMS": "float32"},
    "trainer-blocked": {"PADDLE_MNIST_CONV_MAPS": "blocked"},
    "trainer-nchw": {"PADDLE_MNIST_CONV_MAPS": "nchw"},
}
TORCH_NAMES = {"torch": "torch", "torch-cl": "torch channels_last"}
NAMES = {"alone": "independent trainers (sum)", "trainer-gloo": "the trainer over gloo", **TORCH_NAMES}
NAMES |= {"trainer-f32": "the trainer, float32 sums", "trainer-blocked": "the trainer, blocked maps"}
NAMES |= {"trainer-nchw": "the trainer, NCHW maps between layers"}


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


def training_images(cache: str | None):
    """(uint8 images N x C x H x W, int64 labels, per-channel mean, std): Fashion-MNIST's, or the training split of
    a folder's decoded cache (paddle_mnist/datasets/folder.py) with the mean and std its manifest holds, which the
    trainer normalises by."""
    import numpy as np

    if cache is None:
        images = read_idx(REPO / "data" / "fashion-mnist" / "train-images-idx3-ubyte.gz")[:, None]
        labels = read_idx(REPO / "data" / "fashion-mnist" / "train-labels-idx1-ubyte.gz")
        return images, labels.astype(np.int64), (0.286,), (0.353,)
    folder = Path(cache)
    manifest = json.loads((folder / "manifest.json").read_text())
    images = np.load(folder / "train.npy", mmap_mode="r")
    labels = np.load(folder / "train-labels.npy").astype(np.int64)
    return images, labels, tuple(manifest["mean"]), tuple(manifest["std"])


def head_scale(features: int, reference: int) -> float:
    """paddle_mnist.network.models.head_scale: the flattened map is scaled before the first dense layer when it holds
    more values than a 28x28 image's (here, at 32x32)."""
    return math.sqrt(reference / features) if features > reference else 1.0


def torch_net(name: str, shape: tuple[int, int, int]):
    """The layers of paddle_mnist/network/models.py's `name` for images of shape (channels, height, width), as PyTorch
    layers: the same convolutions, paddings, norms, pools, dropouts, dense layers and head scaling."""
    import torch
    from torch import nn

    channels, height, width = shape

    class Scaled(nn.Module):
        def __init__(self, factor: float):
            super().__init__()
            self.factor = factor

        def forward(self, x):
            return x if self.factor == 1.0 else x * self.factor

    if name in ("mnist_cnn", "mnist_cnn_bn_fc"):
        bn = name == "mnist_cnn_bn_fc"

        def block(cin):
            conv = nn.Conv2d(cin, 20, 5, padding=2, bias=not bn)
            norm = [nn.BatchNorm2d(20)] if bn else []
            return [conv, *norm, nn.ReLU(), nn.MaxPool2d(2, 2)]

        features = 20 * (height // 4) * (width // 4)
        head = [nn.Linear(features, 256), nn.ReLU(), nn.Linear(256, 10)] if bn else [nn.Linear(features, 10)]
        scale = Scaled(head_scale(features, 20 * 7 * 7))
        return nn.Sequential(*block(channels), *block(20), nn.Flatten(), scale, *head)
    if name == "cifar_cnn":

        def pair(cin, cout):  # Keras: the first conv pads ("same"), the second does not ("valid")
            convs = [nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU(), nn.Conv2d(cout, cout, 3), nn.ReLU()]
            return [*convs, nn.MaxPool2d(2, 2), nn.Dropout(0.25)]

        features = 64 * (((height - 2) // 2 - 2) // 2) * (((width - 2) // 2 - 2) // 2)
        head = [nn.Linear(features, 512), nn.ReLU(), nn.Dropout(0.5), nn.Linear(512, 10)]
        scale = Scaled(head_scale(features, 64 * 5 * 5))
        return nn.Sequential(*pair(channels, 32), *pair(32, 64), nn.Flatten(), scale, *head)
    if name == "cifar_fast":

        def module(cin, cout):
            return [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU()]

        layers, maps = module(channels, 32), 32
        for width in (64, 128, 256):
            layers += [*module(maps, width), nn.MaxPool2d(2, 2), *module(width, width)]
            maps = width
        head = [nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Linear(maps, 10, bias=False), Scaled(1 / 8)]
        return nn.Sequential(*layers, *head)
    if name != "minigooglenet":
        raise SystemExit(f"no PyTorch mirror of {name}: bench_torch mirrors {', '.join(STEPS)}")

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
    layers, maps = [conv_module(channels, 96, 3)], 96
    for kind, *sizes in plan:
        block = Inception(maps, *sizes) if kind == "i" else Downsample(maps, *sizes)
        layers.append(block)
        maps = block.out
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.5), nn.Linear(maps, 10))


def torch_worker(args) -> None:
    import numpy as np
    import torch
    import torch.distributed as tdist

    torch.set_num_threads(args.threads)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if world > 1:
        tdist.init_process_group("gloo")
    images, labels, mean, std = training_images(args.cache)
    mean = np.asarray(mean, np.float32).reshape(1, -1, 1, 1)
    std = np.asarray(std, np.float32).reshape(1, -1, 1, 1)
    layout = torch.channels_last if args.channels_last else torch.contiguous_format
    batches = []
    for k in range(8):
        lo = (k * world + rank) * PER_WORKER
        x = torch.from_numpy((images[lo : lo + PER_WORKER].astype(np.float32) / 255 - mean) / std)
        batches.append((x.contiguous(memory_format=layout), torch.from_numpy(labels[lo : lo + PER_WORKER])))
    torch.manual_seed(0)
    net = torch_net(args.model, tuple(images.shape[1:])).to(memory_format=layout)
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
        Path(args.out).write_text(json.dumps({"rates": rates, "version": torch.__version__}))
    if world > 1:
        tdist.destroy_process_group()


# ---- the driver ----


def folder_cache(data_dir: Path) -> Path:
    """The decoded cache that `train.py --dataset folder --data-dir data_dir` reads, with the trainer's defaults:
    found, or built now (once, from this one process), so that no contender's run pays for decoding."""
    import logging

    from paddle_mnist import config
    from paddle_mnist.datasets import folder

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    cfg = config.parse_args(["--dataset", "folder", "--data-dir", str(data_dir)])
    listing = folder.list_folder(cfg.data_dir)
    request, caches = folder.Request.of(cfg), folder.default_cache_dir(listing.root)
    return folder.ensure_cache(listing, request, caches, logging.getLogger("bench_torch"))


def windowed(log: str, batch: int) -> list[float]:
    """Rates between the trainer's log lines, from the running averages they print (steps x batch / rate is the
    time since the epoch started)."""
    points = [(int(s), int(s) * batch / float(r)) for s, r in RATE.findall(log)]
    return [(s1 - s0) * batch / (t1 - t0) for (s0, t0), (s1, t1) in zip(points, points[1:]) if t1 > t0]


def trainer_args(model: str, threads: int, plan: tuple[int, int], data: list[str], out: Path) -> list[str]:
    """train.py and the flags every timed trainer run takes (the caller adds --batch-size)."""
    steps, window = plan
    args = [str(REPO / "train.py"), *data, "--model", model, "--cpu-threads", str(threads), "--timing-every", "0"]
    args += ["--no-augment", "--max-steps", str(steps), "--log-every", str(window), "--eval-limit", "100"]
    return args + ["--output-dir", str(out), "--overwrite"]


def run_trainer(
    model: str,
    workers: int,
    threads: int,
    plan: tuple[int, int],
    data: list[str],
    work: Path,
    env: dict,
    extra: tuple[str, ...] = (),
) -> list[float]:
    """extra: flags after the rest (trainer-gloo's --cpu-sums gloo)."""
    steps, window = plan
    out, log_dir = work / "trainer", work / "trainer-log"
    shutil.rmtree(log_dir, ignore_errors=True)  # the launcher appends to an existing workerlog.N
    launch = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(workers)]
    launch += ["--log_dir", str(log_dir)]
    cmd = (launch if workers > 1 else [sys.executable]) + trainer_args(model, threads, plan, data, out)
    cmd += ["--batch-size", str(PER_WORKER * workers), *extra]  # as PyTorch's; cifar_fast's recipe would take 256
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    log = (log_dir / "workerlog.0").read_text() if workers > 1 else proc.stdout
    if proc.returncode != 0:
        raise SystemExit(f"the trainer failed ({model}, {workers}x{threads}):\n{log[-2000:]}{proc.stderr[-2000:]}")
    if f"of world size {workers} " not in log:  # the cell's workers, not another number of them
        raise SystemExit(f"the trainer did not run on {workers} worker(s) ({model}):\n{log[-2000:]}")
    used = re.search(r"convolutions: .*", log)
    if not used or not used.group().startswith("convolutions: oneDNN"):  # a fallback would be measured unawares
        said = used.group() if used else log[-500:]
        raise SystemExit(f"the trainer did not run oneDNN's operators ({model}): {said}")
    rates = windowed(log, PER_WORKER * workers)
    if len(rates) != steps // window - 1:  # one run's lines, each window once
        raise SystemExit(f"the trainer's log holds {len(rates)} windows, not {steps // window - 1}:\n{log[-2000:]}")
    return rates


def run_alone(
    model: str, workers: int, threads: int, plan: tuple[int, int], data: list[str], work: Path, env: dict
) -> list[float]:
    """The no-collective limit of a cell: `workers` single-process trainers (each as the cell's worker: `threads`
    threads, 64 images a step, its own seed and output) started together and run side by side on the machine's
    cores; each one's median windowed rate, in rank order. Their sum is what the machine gives without a meeting."""
    steps, window = plan
    procs = []
    for i in range(workers):
        cmd = [sys.executable, *trainer_args(model, threads, plan, data, work / f"alone{i}")]
        cmd += ["--seed", str(i + 1), "--batch-size", str(PER_WORKER)]
        log = open(work / f"alone{i}.log", "w")
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True), log))
    rates = []
    for i, (proc, log) in enumerate(procs):
        code = proc.wait(timeout=1800)
        log.close()
        text = (work / f"alone{i}.log").read_text()
        if code != 0:
            raise SystemExit(f"an independent trainer failed ({model}, {i + 1} of {workers}):\n{text[-2000:]}")
        windows = windowed(text, PER_WORKER)
        if len(windows) != steps // window - 1:
            raise SystemExit(f"independent trainer {i + 1}'s log holds {len(windows)} windows:\n{text[-2000:]}")
        rates.append(statistics.median(windows))
    return rates


def run_torch(
    python: str,
    model: str,
    workers: int,
    threads: int,
    plan: tuple[int, int],
    channels_last: bool,
    cache: Path | None,
    work: Path,
    env: dict,
) -> tuple[list[float], str]:
    """The windowed rates of one PyTorch run, and PyTorch's version."""
    steps, window = plan
    out = work / "torch.json"
    launch = [python, "-m", "torch.distributed.run", "--nproc_per_node", str(workers), "--master_port", "29533"]
    cmd = (launch if workers > 1 else [python]) + [str(Path(__file__).resolve()), "worker", "--model", model]
    cmd += ["--threads", str(threads), "--steps", str(steps), "--window", str(window), "--out", str(out)]
    cmd += (["--channels-last"] if channels_last else []) + (["--cache", str(cache)] if cache else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"PyTorch failed ({model}, {workers}x{threads}):\n{proc.stderr[-3000:]}")
    got = json.loads(out.read_text())
    return got["rates"], got["version"]


def scaling_cells(cores: int) -> list[tuple[int, int]]:
    """1, 2, 4, ... workers of 1 thread up to the cores (the cores themselves last), then 1 worker x cores threads."""
    counts = [n for n in (2**k for k in range(cores.bit_length())) if n < cores] + [cores]
    return [(n, 1) for n in counts] + ([(1, cores)] if cores > 1 else [])


def parse_cells(text: str) -> list[tuple[int, int]]:
    cells = []
    for cell in text.split(","):
        workers, _, threads = cell.partition("x")
        if not (workers.isdigit() and threads.isdigit() and int(workers) > 0 and int(threads) > 0):
            return []
        cells.append((int(workers), int(threads)))
    return cells


def spread(rates: list[float]) -> str:
    return f"{statistics.median(rates):7.0f} ({min(rates):.0f}-{max(rates):.0f})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command")
    w = sub.add_parser("worker", help="(internal) one PyTorch worker")
    w.add_argument("--model", required=True)
    w.add_argument("--threads", type=int, required=True)
    w.add_argument("--steps", type=int, required=True)
    w.add_argument("--window", type=int, required=True)
    w.add_argument("--out", required=True)
    w.add_argument("--channels-last", action="store_true")
    w.add_argument("--cache", help="a folder's decoded cache (its train.npy); none: Fashion-MNIST")
    p.add_argument("--torch-python", default=sys.executable, help="a Python with torch and numpy")
    p.add_argument(
        "--dataset",
        default="fashion-mnist",
        choices=sorted(MODELS),
        help="fashion-mnist (1x28x28) or folder: the class folder of --data-dir, e.g. CIFAR-10's JPEG copy (3x32x32)",
    )
    p.add_argument("--data-dir", type=Path, help="with --dataset folder: DIR/train/<class>/ (as train.py takes it)")
    p.add_argument(
        "--models", help="comma-separated (default: " + "; ".join(f"{k}: {v}" for k, v in MODELS.items()) + ")"
    )
    p.add_argument(
        "--contenders",
        default="trainer,trainer-gloo,alone,torch,torch-cl",
        help="comma-separated, of " + ", ".join(CONTENDERS),
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--steps",
        type=int,
        help="steps a run, for every model (default, steps/window: "
        + ", ".join(f"{k} {s}/{w}" for k, (s, w) in STEPS.items())
        + ")",
    )
    p.add_argument("--window", type=int, help="steps a window, with --steps (at least 2 windows a run)")
    p.add_argument(
        "--cells",
        default="1x1,1x2,2x1",
        help="WORKERSxTHREADS, comma-separated; scaling: 1, 2, 4, ... workers up to the machine's cores (1 thread "
        "each), then 1 worker with a thread a core",
    )
    p.add_argument("--json", type=Path, help="write the table's figures here")
    args = p.parse_args()
    if args.command == "worker":
        torch_worker(args)
        return 0
    if (args.dataset == "folder") != (args.data_dir is not None):
        p.error("--data-dir goes with --dataset folder, and --dataset folder needs it (e.g. --data-dir /tmp/cifar)")
    models = (args.models or MODELS[args.dataset]).split(",")
    contenders = args.contenders.split(",")
    unknown = [m for m in models if m not in STEPS] + [c for c in contenders if c not in CONTENDERS]
    if unknown:
        p.error(f"unknown {', '.join(unknown)}: models are {', '.join(STEPS)}; contenders {', '.join(CONTENDERS)}")
    if (args.steps is None) != (args.window is None) or (args.steps and args.steps < 2 * args.window):
        p.error("--steps and --window go together, with at least 2 windows a run: the first is not counted")
    cells = scaling_cells(os.cpu_count() or 1) if args.cells == "scaling" else parse_cells(args.cells)
    if not cells:
        p.error("--cells: WORKERSxTHREADS, comma-separated (e.g. 1x1,2x1), or scaling")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("OMP_NUM_THREADS", None)
    data = ["--dataset", args.dataset] + (["--data-dir", str(args.data_dir)] if args.data_dir else [])
    cache = folder_cache(args.data_dir) if args.data_dir else None
    print(f"processor: {processor()}")
    print(f"images: {args.dataset}" + (f", the trainer's cache {cache} (PyTorch reads its train.npy)" if cache else ""))
    rows, version = [], None
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for model in models:
            plan = (args.steps, args.window) if args.steps else STEPS[model]
            for workers, threads in cells:
                # one worker's limit is the trainer itself: independent trainers are timed from 2 workers up
                names = [n for n in contenders if n not in ("alone", "trainer-gloo") or workers > 1]
                got, each = {name: [] for name in names}, []
                for r in range(args.rounds):
                    for name in names if r % 2 == 0 else names[::-1]:
                        if name.startswith("trainer"):
                            extra = ("--cpu-sums", "gloo") if name == "trainer-gloo" else ()
                            run_env = {**env, **TRAINER_ENV.get(name, {})}
                            rates = run_trainer(model, workers, threads, plan, data, work, run_env, extra)
                        elif name == "alone":
                            each.append(run_alone(model, workers, threads, plan, data, work, env))
                            rates = [sum(each[-1])]
                        else:
                            cell, cl = (model, workers, threads, plan), name == "torch-cl"
                            rates, version = run_torch(args.torch_python, *cell, cl, cache, work, env)
                        got[name].append(statistics.median(rates))
                medians = {name: statistics.median(v) for name, v in got.items()}
                ratios = {k: medians["trainer"] / medians[k] for k in NAMES if k in got and "trainer" in got}
                if each and "trainer" in got:  # a synchronous job waits for its slowest worker at every step
                    ratios["slowest"] = medians["trainer"] / statistics.median(workers * min(e) for e in each)
                row = {"model": model, "workers": workers, "threads": threads, **got, "ratios": ratios}
                rows.append({**row, "alone_each": each} if each else row)
                figures = ", ".join(f"{NAMES.get(name, name)} {spread(v)}" for name, v in got.items())
                said = "".join(f"; trainer/{k} {v:.2f}" for k, v in ratios.items())
                if each:
                    cores = ", ".join(f"{min(e):.0f}-{max(e):.0f}" for e in each)
                    said += f" (an independent trainer: {cores} images/s by round)"
                print(f"{model:<16} {workers} worker(s) x {threads} thread(s): {figures} images/s{said}", flush=True)
    if version:
        print(f"PyTorch {version} ({args.torch_python})")
    if args.json:
        facts = {"processor": processor(), "dataset": args.dataset, "cache": str(cache) if cache else None}
        args.json.write_text(json.dumps({**facts, "torch": version, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where one training step goes, operator by operator: the trainer against PyTorch channels_last, in ms a step.

    python -m scripts.op_table --torch-python /path/to/venv-with-torch/bin/python --model mnist_cnn_bn_fc
    python -m scripts.op_table --torch-python PYTHON --model mnist_cnn --env PADDLE_MNIST_CONV_MAPS=blocked

The trainer runs as a user runs it, one process of --threads threads, 64 images a step, on Fashion-MNIST's 1x28x28
(or, with --data-dir DIR, a class folder such as the CIFAR-10 JPEG copy's 3x32x32), with --profile-steps over
--steps steps after 40 unrecorded ones: paddle.profiler's trace gives each top-level operator's time
(training/profiling.py's operator_times). PyTorch runs scripts/bench_torch.py's mirror of the same layers in
channels_last with the same SGD under torch.profiler, after 40 unrecorded steps, on the same images. Each operator
is put in a row (convolutions forward and backward, batch norm, ReLU, pools, dense layers, the loss, the
optimizer); "between and around the operators" is the step's wall time, as each profiler recorded it, less the rows
above it: Python, dispatch, allocation, and the trainer's own work per step (its data, its sums). A profiled step
runs slower than an unprofiled one; the table's last line gives both contenders' unprofiled rate from the same
runs' logs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WARM = 40  # steps before the recorded ones
FORWARD_UNRECORDED = "convolutions and max-pools forward"
ROWS = (  # (row, patterns of Paddle's operator names, of PyTorch's), matched in this order
    # paddle.profiler records no custom operator's forward pass: the trainer's row is the model's forward time less
    # the operators it recorded inside it (unrecorded_forward), so the convolutions' reorders count here too
    (FORWARD_UNRECORDED, ("conv2d", "pool2d"), ("mkldnn_convolution", "aten::convolution", "max_pool2d_with_indices")),
    ("convolution backward", ("conv2d", "PyLayer__Conv2D"), ("convolution_backward",)),
    ("batch norm forward", ("batch_norm", "bn_"), ("native_batch_norm",)),
    ("batch norm backward", ("BatchNormGrad", "_GlobalNorm", "bn_nhwc_grad"), ("native_batch_norm_backward",)),
    ("ReLU forward", ("relu",), ("clamp_min", "relu")),
    ("ReLU backward", ("ReluGrad",), ("threshold_backward",)),
    (
        "max-pool backward",
        # the MNIST models' and cifar_cnn's pools run with the ReLU before them, and its gradient, inside
        (
            "max_pool2x2_grad",
            "max_pool_blocked_grad",
            "max_pool_relu_blocked_grad",
            "Pool2dGrad",
            "max_pool2d_with_index_grad",
        ),
        ("max_pool2d_with_indices_backward",),
    ),
    ("dense layers (forward, backward)", ("matmul", "Matmul", "_Linear"), ("addmm", "aten::mm", "aten::t")),
    ("bias adds (forward, backward)", ("add", "AddGrad", "ChannelBias"), ("aten::add",)),
    ("loss", ("cross_entropy", "CrossEntropy", "mean", "MeanAll"), ("cross_entropy", "log_softmax", "nll_loss")),
    ("optimizer", ("momentum",), ("_foreach", "aten::add_", "aten::mul_")),
)
ORDER = [row for row, _, _ in ROWS]


def row_of(name: str, torch: bool) -> str:
    """The table's row for an operator's name (PyTorch's when torch); "other operators" where no pattern fits."""
    backward = "grad" in name.lower() or "backward" in name.lower()
    if name == FORWARD_UNRECORDED:
        return name
    for row, paddle_patterns, torch_patterns in ROWS:
        if "forward" in row.split(" (")[0] and backward or row.endswith("backward") and not backward:
            continue  # a forward row's pattern ("relu") also fits its gradient's name ("ReluGrad")
        patterns = torch_patterns if torch else paddle_patterns
        if any(p.lower() in name.lower() for p in patterns):
            if torch and row.startswith("bias") and name != "aten::add":
                continue  # aten::add_ is the optimizer's
            return row
    return "other operators"


def unrecorded_forward(events: list) -> float:
    """Milliseconds of the model's forward passes (the outermost "Forward" events) that no operator event recorded
    inside them: the custom operators' forward passes."""
    forwards = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "Forward" and "dur" in e)
    outer = []
    for start, end in forwards:
        if outer and start < outer[-1][1]:
            continue  # inside the previous one
        outer.append((start, end))
    inside = 0.0
    ops = sorted((e["ts"], e["dur"]) for e in events if e.get("cat") == "Operator" and "dur" in e)
    for start, end in outer:
        inside += sum(dur for ts, dur in ops if start <= ts < end)
    return (sum(end - start for start, end in outer) - inside) / 1000


# ---- PyTorch, in the Python that has it: prints {"wall_ms": ..., "ops": {name: self ms a step}, "rate": ...}


def torch_part(args) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    sys.path.insert(0, str(REPO))
    import numpy as np

    from scripts.bench_torch import LR, MOMENTUM, PER_WORKER, WEIGHT_DECAY, torch_net, training_images

    torch.set_num_threads(args.threads)
    layout = torch.channels_last
    # the trainer's images, normalised as it normalises them: PyTorch's ReLU and max-pool kernels branch on the
    # values, and ran its step 1.7 times slower on random normal inputs than on Fashion-MNIST's (mnist_cnn, 1 thread)
    images, labels, mean, std = training_images(args.cache)
    mean = np.asarray(mean, np.float32).reshape(1, -1, 1, 1)
    std = np.asarray(std, np.float32).reshape(1, -1, 1, 1)
    batches = [slice(k * PER_WORKER, (k + 1) * PER_WORKER) for k in range(4)]
    xs = [torch.from_numpy((images[b].astype(np.float32) / 255 - mean) / std) for b in batches]
    xs = [x.contiguous(memory_format=layout) for x in xs]
    ys = [torch.from_numpy(labels[b]) for b in batches]
    torch.manual_seed(0)
    net = torch_net(args.model, tuple(images.shape[1:])).to(memory_format=layout)
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)

    def step(i: int) -> None:
        loss = torch.nn.functional.cross_entropy(net(xs[i % 4]), ys[i % 4])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for i in range(WARM):
        step(i)
    started = time.perf_counter()
    for i in range(args.steps):
        step(i)
    rate = args.steps * PER_WORKER / (time.perf_counter() - started)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        started = time.perf_counter()
        for i in range(args.steps):
            step(i)
        wall = (time.perf_counter() - started) * 1000 / args.steps
    ops = {  # each operator's own time: nothing counted twice
        event.key: event.self_cpu_time_total / 1000 / args.steps
        for event in prof.key_averages()
        if event.key.startswith("aten::") and event.self_cpu_time_total > 0
    }
    print(json.dumps({"wall_ms": wall, "ops": ops, "rate": rate, "version": torch.__version__}))


# ---- the trainer


def trainer_part(model: str, threads: int, steps: int, data: list[str], env: dict) -> dict:
    from paddle_mnist.training import profiling

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        first, last = WARM + 1, WARM + steps
        cmd = [sys.executable, str(REPO / "train.py"), *data, "--model", model, "--cpu-threads", str(threads)]
        cmd += ["--batch-size", "64", "--no-augment", "--timing-every", "0", "--max-steps", str(last)]
        cmd += ["--log-every", "10", "--eval-limit", "100", "--profile-steps", f"{first}:{last}"]
        cmd += ["--output-dir", str(out)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise SystemExit(f"the trainer failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        trace = out / profiling.PROFILE_DIR / "trace.rank0.json"
        ops = {name: ms / steps for name, ms in profiling.operator_times(trace)}
        events = json.loads(trace.read_text())
        events = events["traceEvents"] if isinstance(events, dict) else events
        walls = [e["dur"] / 1000 for e in events if str(e.get("name", "")).startswith("ProfileStep") and "dur" in e]
        ops[FORWARD_UNRECORDED] = unrecorded_forward(events) / steps
        # the windows of 10 steps before the recorded ones, but the first (the operators' first plans)
        windows = re.findall(r"step (\d+)/\d+ .* (\d+) img/s", proc.stdout)
        rates = [float(rate) for step, rate in windows if 10 < int(step) <= WARM]
        exact = "summed in float64" in proc.stdout
    return {
        "wall_ms": sum(walls) / len(walls),
        "ops": ops,
        "rate": statistics.median(rates) if rates else float("nan"),
        "exact": exact,
    }


def table(paddle_side: dict, torch_side: dict) -> list[str]:
    rows = {}
    for side, figures, is_torch in (("trainer", paddle_side, False), ("torch", torch_side, True)):
        for name, ms in figures["ops"].items():
            rows.setdefault(row_of(name, is_torch), {"trainer": 0.0, "torch": 0.0})[side] += ms
    lines = ["| part of the step | trainer, ms | PyTorch channels_last, ms |", "|---|---|---|"]
    named = {"trainer": 0.0, "torch": 0.0}
    for row in [*ORDER, "other operators"]:
        if row in rows:
            lines.append(f"| {row} | {rows[row]['trainer']:.2f} | {rows[row]['torch']:.2f} |")
            for side in named:
                named[side] += rows[row][side]
    lines.append(
        f"| between and around the operators | {paddle_side['wall_ms'] - named['trainer']:.2f} | "
        f"{torch_side['wall_ms'] - named['torch']:.2f} |"
    )
    lines.append(f"| **the step, profiled** | **{paddle_side['wall_ms']:.2f}** | **{torch_side['wall_ms']:.2f}** |")
    lines.append(f"| images/s unprofiled | {paddle_side['rate']:.0f} | {torch_side['rate']:.0f} |")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="part")
    w = sub.add_parser("torch", help="(internal) PyTorch's side")
    for q in (p, w):
        q.add_argument("--model", default="mnist_cnn_bn_fc")
        q.add_argument("--threads", type=int, default=1)
        q.add_argument("--steps", type=int, default=40, help="recorded steps")
    w.add_argument("--cache", help="the folder's decoded cache (bench_torch.folder_cache); Fashion-MNIST without")
    p.add_argument("--torch-python", help="a Python with torch (required)")
    p.add_argument("--data-dir", type=Path, help="a class folder (CIFAR-10's JPEG copy) for the CIFAR models")
    p.add_argument("--env", action="append", default=[], help="NAME=VALUE for the trainer's runs (repeatable)")
    p.add_argument("--operators", action="store_true", help="also print every operator's ms a step, both sides")
    args = p.parse_args()
    if args.part == "torch":
        torch_part(args)
        return 0
    if not args.torch_python:
        p.error("--torch-python: a Python with torch and numpy is required")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("OMP_NUM_THREADS", None)
    for item in args.env:
        name, _, value = item.partition("=")
        env[name] = value
    data = ["--dataset", "folder", "--data-dir", str(args.data_dir)] if args.data_dir else []
    paddle_side = trainer_part(args.model, args.threads, args.steps, data, env)
    cmd = [args.torch_python, "-m", "scripts.op_table", "torch", "--model", args.model, "--threads", str(args.threads)]
    cmd += ["--steps", str(args.steps)]
    if args.data_dir:
        from scripts.bench_torch import folder_cache

        cmd += ["--cache", str(folder_cache(args.data_dir))]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"PyTorch's side failed:\n{proc.stderr[-2000:]}")
    torch_side = json.loads(proc.stdout.strip().splitlines()[-1])
    path = "float64 sums" if paddle_side["exact"] else "float32 sums"
    print(
        f"{args.model}, 64 images a step, {args.threads} thread(s), {args.steps} recorded steps; the trainer's {path}"
    )
    print(f"PyTorch {torch_side['version']}; extra environment: {' '.join(args.env) or 'none'}")
    print("\n".join(table(paddle_side, torch_side)))
    if args.operators:
        print(json.dumps({"trainer": paddle_side["ops"], "torch": torch_side["ops"]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

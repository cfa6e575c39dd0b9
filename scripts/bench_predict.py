"""Images per second of the exported model on one CPU thread, batch 1 and 256, through each way of running it.

    python -m scripts.bench_predict                        # trains a small default model first (1 epoch, 2,000 images)
    python -m scripts.bench_predict --model output/inference --rounds 5

Contenders, each in a process of its own (MKL's kernel choice is made once per process):
  before     what predict ran before the Predictor: paddle.jit.load in dygraph, no MKL setting
  jit        Predictor(backend="jit"): the same program, with the trainer's MKL setting
  inference  Predictor(backend="inference"): Paddle Inference with oneDNN, the default
  onnx       Predictor(backend="onnx"): ONNX Runtime (needs requirements-onnx.txt; converts the export first)
Inputs are decoded Fashion-MNIST test images (uint8 arrays), so the figures are the network and its
normalisation, not file decoding. Rounds alternate the contenders; the table gives the median and range.
Every contender's probabilities for the same 256 images are compared with the first one's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
CONTENDERS = ("before", "jit", "inference", "onnx")
BATCHES = (1, 256)


def child(contender: str, prefix: str, seconds: float, out: Path) -> None:
    """In a fresh process: load, warm up, then time each batch size for about `seconds`."""
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("GLOG_minloglevel", "2")  # before Paddle loads: no INFO lines in the table
    warnings.filterwarnings("ignore")
    from paddle_mnist.datasets import data

    images = data.load_dataset("fashion-mnist", None).test.images[:256]
    if contender == "before":
        import paddle

        from paddle_mnist.deploy import export
        from paddle_mnist.deploy.predictor import softmax

        paddle.base.core.set_num_threads(1)
        layer, meta = export.load_exported(prefix)

        def probabilities(x: np.ndarray) -> np.ndarray:
            inputs = data.normalise(x, tuple(meta["mean"]), tuple(meta["std"]))
            with paddle.no_grad():
                return softmax(layer(paddle.to_tensor(inputs)).numpy())
    else:
        from paddle_mnist.deploy.predictor import Predictor

        probabilities = Predictor.load(prefix, backend=contender, threads=1).probabilities

    rates = {}
    for batch in BATCHES:
        x = images[:batch]
        probabilities(x)  # warm-up: kernels chosen, caches filled
        calls, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            probabilities(x)
            calls += 1
        rates[batch] = calls * batch / (time.perf_counter() - start)
    np.save(out / f"{contender}.npy", probabilities(images))
    (out / f"{contender}.json").write_text(json.dumps(rates))


def ensure_model(prefix: str | None, work: Path) -> str:
    if prefix:
        return prefix
    out = work / "model"
    cmd = [sys.executable, str(REPO / "train.py"), "--train-limit", "2000", "--eval-limit", "500", "--epochs", "1"]
    subprocess.run([*cmd, "--output-dir", str(out)], check=True, stdout=subprocess.DEVNULL)
    return str(out / "inference")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", metavar="PREFIX", help="an export (OUTPUT_DIR/inference); default: train one")
    p.add_argument("--contenders", nargs="+", choices=CONTENDERS, default=list(CONTENDERS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=3.0, help="timed seconds per contender, batch size and round")
    p.add_argument("--child", nargs=3, metavar=("CONTENDER", "PREFIX", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args.seconds, Path(args.child[2]))
        return 0

    contenders = list(args.contenders)
    if "onnx" in contenders and importlib.util.find_spec("onnxruntime") is None:
        print("note: onnx left out (pip install -r requirements-onnx.txt)")
        contenders.remove("onnx")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        prefix = ensure_model(args.model, work)
        if "onnx" in contenders:
            subprocess.run([sys.executable, "-m", "paddle_mnist.export", "--onnx", prefix], check=True, cwd=REPO)
        rates: dict[str, dict[int, list[float]]] = {c: {b: [] for b in BATCHES} for c in contenders}
        for r in range(args.rounds):
            for c in contenders if r % 2 == 0 else reversed(contenders):
                cmd = [sys.executable, "-m", "scripts.bench_predict", "--seconds", str(args.seconds)]
                subprocess.run([*cmd, "--child", c, prefix, str(work)], check=True, cwd=REPO)
                for b, v in json.loads((work / f"{c}.json").read_text()).items():
                    rates[c][int(b)].append(v)
        first = np.load(work / f"{contenders[0]}.npy")
        heads = ("batch 1 img/s", "batch 256 img/s", "x before @256", "max |dp|")
        print(f"\n{'contender':<10} {heads[0]:>22} {heads[1]:>22} {heads[2]:>14} {heads[3]:>9}")
        for c in contenders:
            cells = []
            for b in BATCHES:
                v = rates[c][b]
                cells.append(f"{statistics.median(v):>8,.0f} ({min(v):,.0f}-{max(v):,.0f})")
            base = statistics.median(rates["before"][256]) if "before" in rates else float("nan")
            diff = float(np.abs(np.load(work / f"{c}.npy") - first).max())
            speed_up = statistics.median(rates[c][256]) / base
            print(f"{c:<10} {cells[0]:>22} {cells[1]:>22} {speed_up:>14.2f} {diff:>9.1e}")
    print(f"\n{args.rounds} rounds of {args.seconds:g} s per contender and batch size, 1 thread; median (range)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

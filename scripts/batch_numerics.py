"""Batch numerics: whether an image's results depend on the batch it is in, operator by operator and for a step.

    python -m scripts.batch_numerics --dataset fashion-mnist --model mnist_cnn --batch-size 96 --parts 3 --steps 6

Trains --steps steps of the model's recipe in this process (the operators of --conv-backend auto), so that the
activations are a trained network's, then records the input of every convolution, 2x2 max-pool and dense layer of
one forward pass over the next batch. Each recorded operator then runs alone on that batch whole and on its
--parts parts (the batch of one process against the micro-batches of --accum-steps or the shares of workers),
with one fixed gradient for its output; and then the whole model's gradient, whole against parts. Each line gives
the largest difference relative to the largest value:

    output, input gradient   per image: 0 means an image's result does not depend on the batch around it
    weight, bias gradient    sums over the batch: whole against the parts' sums added up; ours (the oneDNN
                             operators, and exact.linear for the dense layers) in float64 as the trainer adds them
                             (network/exact.py), both rounded to float32 once; Paddle's in float32
    against Paddle           the operator's whole-batch result against F.conv2d's, F.max_pool2d's or F.linear's

The model's gradient is compared three ways: as the trainer sums it (float64, rounded once), with the oneDNN
operators' float32 results added in float32 (as the models with batch norm add them), and with Paddle's layers.

Run it with ONEDNN_MAX_CPU_ISA=AVX2 to see the kernels of a processor without AVX-512 on one that has it.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import zlib  # noqa: F401 (before Paddle: Paddle 2.6's own zlib symbols would otherwise serve gzip and crash it)
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import paddle
import paddle.nn.functional as F

from paddle_mnist import config
from paddle_mnist.datasets import data
from paddle_mnist.datasets.transfer import Feed
from paddle_mnist.network import dropout, exact
from paddle_mnist.ops import fastpath, onednn
from paddle_mnist.runtime import cpu
from paddle_mnist.runtime.distributed import DistEnv
from paddle_mnist.training import engine
from paddle_mnist.training.state import TrainState

ONE_PROCESS = DistEnv(0, 1, 0, 1, "none", "cpu")


@dataclass
class Call:
    """One operator call of a forward pass: its kind ("conv" or "pool") and what it was given."""

    kind: str
    x: np.ndarray
    weight: np.ndarray | None = None
    bias: np.ndarray | None = None
    stride: int = 1
    padding: int = 0


@contextlib.contextmanager
def recording(calls: list[Call]) -> Iterator[None]:
    """Record every fastpath.conv2d, fastpath.max_pool2x2 and exact.linear call made inside (layers.Conv2D, MaxPool2D
    and Linear call them in training; Linear calls exact.linear only while a step sums in float64, exact.active)."""
    conv2d, pool, linear = fastpath.conv2d, fastpath.max_pool2x2, exact.linear

    def conv_and_note(x, weight, stride, padding, bias=None, block=0):
        b = None if bias is None else bias.numpy()
        calls.append(Call("conv", x.numpy(), weight.numpy(), b, stride, padding))
        return conv2d(x, weight, stride, padding, bias, block)

    def pool_and_note(x):
        calls.append(Call("pool", x.numpy()))
        return pool(x)

    def linear_and_note(x, weight, bias):
        calls.append(Call("linear", x.numpy(), weight.numpy(), bias.numpy()))
        return linear(x, weight, bias)

    fastpath.conv2d, fastpath.max_pool2x2, exact.linear = conv_and_note, pool_and_note, linear_and_note
    try:
        yield
    finally:
        fastpath.conv2d, fastpath.max_pool2x2, exact.linear = conv2d, pool, linear


def results(call: Call, run: Callable, x: np.ndarray, grad: np.ndarray, wide: bool = False) -> list[np.ndarray]:
    """run's output for the batch x, and the gradients of sum(output * grad) for x, the weight and the bias; with
    wide, the weight's and the bias's as exact.py hands them over, in float64."""
    inputs = [paddle.to_tensor(x, stop_gradient=False)]
    inputs += [paddle.to_tensor(t, stop_gradient=False) for t in (call.weight, call.bias) if t is not None]
    sums = exact.Sums() if wide else None
    with exact.summing(sums):
        y = run(*inputs)
        (y * paddle.to_tensor(grad)).sum().backward()
    if sums is None:
        return [y.numpy()] + [t.grad.numpy() for t in inputs]
    return [y.numpy(), inputs[0].grad.numpy()] + [sums.by_param[id(t)][1].numpy() for t in inputs[1:]]


def operators(call: Call, backend: str) -> Callable:
    """The operator of the call by oneDNN (backend "onednn"; a dense layer: exact.linear's products by rows) or by
    Paddle."""
    if call.kind == "linear":
        return exact.linear if backend == "onednn" else F.linear
    if call.kind == "pool":
        return fastpath.max_pool2x2 if backend == "onednn" else (lambda x: F.max_pool2d(x, 2, 2))
    s, p = call.stride, call.padding
    if backend == "onednn":
        return lambda x, w, b=None: exact.conv2d(x, w, s, p, b)
    return lambda x, w, b=None: F.conv2d(x, w, b, stride=s, padding=p)


def relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-30))


def whole_against_parts(call: Call, backend: str, parts: int, grad: np.ndarray) -> list[float]:
    """Relative differences of each result (output, input gradient, then the parameters' gradients). The parts'
    parameter gradients are added as a step adds them: in float32 for Paddle's; for ours in float64 (exact.py),
    both sides rounded to float32 once at the end."""
    run, wide = operators(call, backend), backend == "onednn"
    whole = results(call, run, call.x, grad, wide)
    split = zip(np.array_split(call.x, parts), np.array_split(grad, parts))
    pieces = [results(call, run, x, g, wide) for x, g in split]
    joined = [np.concatenate([p[i] for p in pieces]) for i in (0, 1)]
    summed = [np.sum([p[i] for p in pieces], axis=0) for i in range(2, len(whole))]
    rounded = [t.astype(np.float32) for t in whole[2:] + summed]
    return [relative(w, p) for w, p in zip(whole[:2] + rounded[: len(summed)], joined + rounded[len(summed) :])]


def operator_table(calls: list[Call], parts: int) -> list[str]:
    names = ("output", "input gradient", "weight gradient", "bias gradient")
    lines = ["| operator | result | ours: whole vs parts | Paddle: whole vs parts | ours vs Paddle |"]
    lines.append("|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for k, call in enumerate(calls):
        out_shape = results(call, operators(call, "paddle"), call.x[:1], np.zeros(1, "float32"))[0].shape[1:]
        grad = rng.standard_normal((len(call.x), *out_shape)).astype("float32")
        ours = whole_against_parts(call, "onednn", parts, grad)
        theirs = whole_against_parts(call, "paddle", parts, grad)
        against = [
            relative(a, b)
            for a, b in zip(
                results(call, operators(call, "paddle"), call.x, grad),
                results(call, operators(call, "onednn"), call.x, grad, wide=True),
            )
        ]
        what = f"{call.kind} {k}: {'x'.join(map(str, call.x.shape))}"
        if call.weight is not None:
            what += f", weight {'x'.join(map(str, call.weight.shape))}" + (", bias" if call.bias is not None else "")
        for name, a, b, c in zip(names, ours, theirs, against):
            lines.append(f"| {what} | {name} | {a:.1e} | {b:.1e} | {c:.1e} |")
    return lines


def model_gradients(state, images, labels, cfg, parts: int, wide: bool) -> dict[str, np.ndarray]:
    """The gradient of the batch's mean loss, from the whole batch (parts=1) or from its parts added up, as
    --accum-steps adds them: in float32, each part's mean loss divided by the number of parts; with wide as the
    trainer does (engine.train_step), each image's loss weighing 1/(batch) and the sums in float64 (exact.py)."""
    model = state.model
    drops = dropout.layers(model)
    position = 0
    sums = exact.Sums() if wide else None
    for x, y in zip(np.array_split(images, parts), np.array_split(labels, parts)):
        with exact.summing(sums):
            with dropout.placed(drops, dropout.Place(cfg.seed, state.step, position, len(labels))):
                logits = model(paddle.to_tensor(x))
            position += len(y)
            losses = F.cross_entropy(logits, paddle.to_tensor(y), reduction="none", label_smoothing=cfg.label_smoothing)
            (losses.sum() * (1.0 / len(labels)) if wide else losses.mean() / parts).backward()
    if sums is not None:
        sums.gradients(model.parameters(), lambda t: None)
    grads = {p.name: p.grad.numpy().copy() for p in model.parameters() if p.grad is not None}
    state.opt.clear_grad()
    return grads


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="fashion-mnist", choices=config.DATASETS)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--model", default="mnist_cnn", help="a model without batch norm (mnist_cnn, cifar_cnn)")
    p.add_argument("--batch-size", type=int, default=96)
    p.add_argument("--parts", type=int, default=3, help="micro-batches or workers the batch is split into")
    p.add_argument("--steps", type=int, default=6, help="steps trained before the batch is examined")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    cpu.prefer_fast_kernels()
    paddle.base.core.set_num_threads(args.threads)
    cpu.set_openmp_threads(args.threads)
    print(onednn.activate(onednn.prepare("auto"), "cpu"))
    if not onednn.active():
        print("the oneDNN operators are not active here: nothing to compare", file=sys.stderr)
        return 1
    flags = ["--model", args.model, "--dataset", args.dataset, "--seed", str(args.seed)]
    flags += ["--batch-size", str(args.batch_size)] + (["--data-dir", args.data_dir] if args.data_dir else [])
    ds = data.load_dataset(args.dataset, args.data_dir)
    cfg = config.resolve(config.parse_args(flags), 1, config.DataFacts(ds.classes, len(ds.train)))
    paddle.seed(args.seed)
    per_epoch = len(ds.train) // cfg.batch_size
    state = TrainState.create(cfg, len(ds.classes), ds.image_shape, ONE_PROCESS, per_epoch)
    epoch = data.TrainBatches(ds.train, ds, cfg.batch_size, 0, 1, cfg).epoch(0, 0, args.steps + 1)
    batches = iter(epoch)
    for _ in range(args.steps):
        images, labels = next(batches)
        engine.train_step(state, images, labels, cfg, Feed("cpu"), engine.ONE_PROCESS)
        state.sched.step()
    images, labels = next(batches)
    epoch.close()
    calls: list[Call] = []
    # cifar_cnn's maps blocked between its layers give the numbers of NCHW maps to the bit (tests/test_onednn.py):
    # held NCHW here, each operator is recorded as F.conv2d and F.max_pool2d take it
    blocked_maps = getattr(state.model, "blocked_maps", None)
    if blocked_maps is not None:
        state.model.blocked_maps = False
    with recording(calls), exact.summing(exact.Sums()):  # the layers' calls as a step summing in float64 makes them
        state.model(paddle.to_tensor(images))
    if blocked_maps is not None:
        state.model.blocked_maps = blocked_maps
    print(f"{args.model} on {args.dataset} after {args.steps} steps: batch {len(labels)} against {args.parts} parts")
    print("\n".join(operator_table(calls, args.parts)))
    print("\n| backend | parameter | whole vs parts (largest difference / largest value) |\n|---|---|---|")
    for backend, wide in (
        ("onednn, float64 sums (the trainer's)", True),
        ("onednn, float32", False),
        ("paddle", False),
    ):
        if backend == "paddle":
            onednn.deactivate()
        whole = model_gradients(state, images, labels, cfg, 1, wide)
        split = model_gradients(state, images, labels, cfg, args.parts, wide)
        for name in whole:
            print(f"| {backend} | {name} | {relative(whole[name], split[name]):.1e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""oneDNN's convolution operator: the same numbers as F.conv2d, built once, rebuilt when damaged, left aside cleanly.

The operator is built into the user's cache (~/.cache/paddle_mnist) by the first test that needs it, as the trainer
would; the tests of building itself use a cache of their own.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest
from helpers import REPO, explain, launch_env, make_dataset, read_results, run_single, small_run

from paddle_mnist.network import models
from paddle_mnist.ops import fastpath, onednn, selfcheck
from paddle_mnist.runtime import cpu

SMALL = small_run(eval_limit=100, batch_size=64, epochs=1, log_every=None, lr=None)


def output_and_grads(conv, *inputs: paddle.Tensor):
    """conv(*inputs)'s output and the gradients of every input."""
    for t in inputs:
        t.stop_gradient = False
    y = conv(*inputs)
    (y * paddle.cos(y)).sum().backward()  # a gradient that differs from place to place
    result = [y.numpy()] + [t.grad.numpy() for t in inputs]
    for t in inputs:
        t.clear_gradient()
    return result


# (batch, in channels, side, out channels, kernel, stride, padding): every geometry the models use, and odd sides
GEOMETRIES = [
    (8, 1, 28, 20, 5, 1, 2),  # mnist_cnn's first
    (8, 20, 14, 20, 5, 1, 2),  # its second
    (4, 3, 32, 96, 3, 1, 1),  # minigooglenet's stem
    (4, 96, 32, 32, 1, 1, 0),  # an inception module's 1x1
    (4, 80, 32, 80, 3, 2, 0),  # a downsample module: 32 -> 15
    (4, 80, 15, 48, 3, 2, 0),  # and an odd side: 15 -> 7
    (4, 32, 30, 32, 3, 1, 0),  # cifar_cnn's unpadded 3x3
    (3, 2, 9, 5, 3, 2, 1),  # padding with a stride that leaves a row over
]


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=[f"{g[1]}x{g[2]}-k{g[4]}s{g[5]}p{g[6]}" for g in GEOMETRIES])
def test_the_operator_gives_f_conv2ds_output_and_gradients(op, geometry, bias):
    n, c, side, out, kernel, stride, padding = geometry
    rng = np.random.default_rng(side * kernel + c)
    x = paddle.to_tensor(rng.normal(size=(n, c, side, side)).astype("float32"))
    w = paddle.to_tensor((rng.normal(size=(out, c, kernel, kernel)) / np.sqrt(c * kernel * kernel)).astype("float32"))
    if bias:
        b = paddle.to_tensor(rng.normal(size=(out,)).astype("float32"))
        ours = output_and_grads(lambda x, w, b: op.onednn_conv2d_bias(x, w, b, stride, padding, True, 0), x, w, b)
        paddles = output_and_grads(lambda x, w, b: F.conv2d(x, w, b, stride=stride, padding=padding), x, w, b)
    else:
        ours = output_and_grads(lambda x, w: op.onednn_conv2d(x, w, stride, padding, True, 0), x, w)
        paddles = output_and_grads(lambda x, w: F.conv2d(x, w, stride=stride, padding=padding), x, w)
    assert len(ours) == len(paddles) == (4 if bias else 3)
    for name, a, b in zip(("output", "input gradient", "weight gradient", "bias gradient"), ours, paddles):
        assert a.shape == b.shape, name
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * np.abs(b).max(), err_msg=name)


def per_image(run, x: np.ndarray, grad: np.ndarray, *params: np.ndarray) -> list[np.ndarray]:
    """run's output for the batch x and the gradients of sum(output * grad) for x and each parameter."""
    inputs = [paddle.to_tensor(t, stop_gradient=False) for t in (x, *params)]
    y = run(*inputs)
    (y * paddle.to_tensor(grad)).sum().backward()
    return [y.numpy()] + [t.grad.numpy() for t in inputs]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=[f"{g[1]}x{g[2]}-k{g[4]}s{g[5]}p{g[6]}" for g in GEOMETRIES])
def test_an_images_results_do_not_depend_on_the_batch_around_it(op, geometry, bias, threads):
    """Each image's output and input gradient are the same bits in a batch as alone, and the weights' and the bias's
    gradients of a batch are its images' gradients summed in float64 and rounded once, on 1 thread as on 2; the
    float64 operators hand that sum over unrounded (exact.py adds them up over micro-batches and workers): a
    batch split among workers or micro-batches sums the same per-image numbers as one process (docs/training.md,
    "N workers equal one process"). oneDNN's kernels for a whole batch sum it in an order of their own, which
    changed with the batch's size and rounded 20 times more than Paddle's convolution."""
    n, c, side, out, kernel, stride, padding = geometry
    n = max(n, 3)
    rng = np.random.default_rng(side * kernel + c)
    x = rng.normal(size=(n, c, side, side)).astype("float32")
    w = (rng.normal(size=(out, c, kernel, kernel)) / np.sqrt(c * kernel * kernel)).astype("float32")
    params = (w, rng.normal(size=(out,)).astype("float32")) if bias else (w,)
    if bias:
        conv = lambda x, w, b: op.onednn_conv2d_bias(x, w, b, stride, padding, True, 0)  # noqa: E731
    else:
        conv = lambda x, w: op.onednn_conv2d(x, w, stride, padding, True, 0)  # noqa: E731
    o = (side + 2 * padding - kernel) // stride + 1
    grad = rng.normal(size=(n, out, o, o)).astype("float32")
    before = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD).omp_get_max_threads()  # oneDNN's runtime
    cpu.set_openmp_threads(threads)
    try:
        batch = per_image(conv, x, grad, *params)
        alone = [per_image(conv, x[i : i + 1], grad[i : i + 1], *params) for i in range(n)]
    finally:
        cpu.set_openmp_threads(before)
    for k, name in enumerate(("output", "input gradient")):
        assert np.array_equal(batch[k], np.concatenate([a[k] for a in alone])), name
    wide = grad64(op, x, grad, params, stride, padding)
    for k, name in zip(range(2, len(batch)), ("weight gradient", "bias gradient")):
        summed = np.sum([a[k].astype(np.float64) for a in alone], axis=0)  # exact but for float64's rounding
        assert np.array_equal(batch[k], summed.astype(np.float32)), name  # rounded once
        assert wide[k - 1].dtype == np.float64, name
        np.testing.assert_allclose(wide[k - 1], summed, rtol=2.0**-46, atol=0, err_msg=f"{name} in float64")
        rounded = wide[k - 1 + len(params)]  # after the float64 sums, the same rounded to float32
        assert np.array_equal(rounded, wide[k - 1].astype(np.float32)), f"{name} rounded"


def grad64(op, x, grad, params, stride, padding) -> list[np.ndarray]:
    """onednn_conv2d(_bias)_grad64's input gradient and the weights' (and bias's) in float64, for the batch x."""
    wide = op.onednn_conv2d_bias_grad64 if len(params) == 2 else op.onednn_conv2d_grad64
    out = wide(paddle.to_tensor(x), paddle.to_tensor(params[0]), paddle.to_tensor(grad), stride, padding, True)
    return [t.numpy() for t in out]


def test_a_pooled_images_results_do_not_depend_on_the_batch_around_it(op):
    """max_pool2x2's output and input gradient of each image are the same bits in a batch as alone."""
    rng = np.random.default_rng(3)
    x = np.round(rng.normal(size=(5, 4, 14, 14)) * 2).astype("float32") / 2  # halves: windows with ties
    grad = rng.normal(size=(5, 4, 7, 7)).astype("float32")
    batch = per_image(lambda t: op.max_pool2x2(t)[0], x, grad)
    alone = [per_image(lambda t: op.max_pool2x2(t)[0], x[i : i + 1], grad[i : i + 1]) for i in range(5)]
    for k, name in enumerate(("output", "input gradient")):
        assert np.array_equal(batch[k], np.concatenate([a[k] for a in alone])), name


def test_the_batch_numerics_script_finds_each_images_results_unchanged_by_its_batch(op):
    """scripts/batch_numerics.py on a trained mnist_cnn and real Fashion-MNIST: every operator's output, input
    gradient and (summed in float64, rounded once) weights' gradient the same bits in a batch of 24 as in its 3
    parts, and the model's gradient as the trainer sums it; summed in float32, apart by rounding only."""
    cmd = [sys.executable, "-m", "scripts.batch_numerics", "--steps", "2", "--batch-size", "24", "--parts", "3"]
    proc = subprocess.run(cmd, cwd=REPO, env=launch_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, explain(proc)
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in proc.stdout.splitlines()]
    operators = [r for r in rows if r and r[0].startswith(("conv", "pool", "linear"))]
    # the two blocks of mnist_cnn: a convolution (its bias added after the pool), then the pool; then the dense layer
    blocks = ["output", "input gradient", "weight gradient"] + ["output", "input gradient"]
    dense = ["output", "input gradient", "weight gradient", "bias gradient"]
    assert [r[1] for r in operators] == blocks * 2 + dense, operators
    for what, result, ours, _, _ in operators:  # ours: the weights' sums in float64 as the trainer adds them
        assert float(ours) == 0, (what, result)
    model = [r for r in rows if len(r) == 3 and r[0].startswith(("onednn", "paddle"))]
    assert len(model) == 18 and all(float(r[2]) < 1e-5 for r in model), model
    trainers = [r for r in model if "float64" in r[0]]
    assert len(trainers) == 6 and all(float(r[2]) == 0 for r in trainers), trainers


@pytest.mark.parametrize("through", ["conv2d", "max_pool2x2"])
def test_views_reach_the_operators_as_whole_tensors(op, through):
    """The operators read their inputs and output gradients as dense NCHW memory, and check no strides: Paddle
    hands a custom operator a contiguous copy of a view (3.x makes transpose a view). A transposed input, and an
    output whose gradient comes back through a transpose, give Paddle's numbers."""
    rng = np.random.default_rng(5)
    base, w = rng.normal(size=(4, 8, 12, 12)), rng.normal(size=(8, 8, 3, 3)) / np.sqrt(72)
    weight = paddle.to_tensor(w.astype("float32"))
    ours = {
        "conv2d": lambda x: op.onednn_conv2d(x, weight, 1, 1, True, 0),
        "max_pool2x2": lambda x: op.max_pool2x2(x)[0],
    }
    paddles = {"conv2d": lambda x: F.conv2d(x, weight, padding=1), "max_pool2x2": lambda x: F.max_pool2d(x, 2, 2)}

    def run(layer):
        x = paddle.to_tensor(base.astype("float32"), stop_gradient=False)
        seen = x.transpose([0, 1, 3, 2])  # a view where Paddle has strided tensors
        y = layer(seen).transpose([0, 1, 3, 2])
        (y * paddle.cos(y)).sum().backward()
        return y.numpy(), x.grad.numpy()

    for name, a, b in zip(("output", "input gradient"), run(ours[through]), run(paddles[through])):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * np.abs(b).max(), err_msg=name)


OPS = ("onednn_conv2d", "onednn_conv2d_bias", "max_pool2x2")
OPS += ("onednn_conv_bn_relu", "onednn_conv_relu_blocked", "onednn_max_pool_blocked", "onednn_concat_blocked")
OPS += ("onednn_max_pool_relu_blocked",)  # a pool and the ReLU before it (mnist_cnn's, cifar_cnn's)
OPS += ("onednn_conv2d_grad64", "onednn_conv2d_bias_grad64")  # exact.py's backward passes
OPS += ("onednn_unblock", "bn_nhwc")  # blocked maps as NCHW; batch norm of NHWC maps (csrc/batch_norm.cc)
OPS += ("onednn_rows_matmul", "onednn_dense_backward")  # exact.py's dense layers (csrc/matmul.cc)


class Counted:
    """The operators' module, counting the calls of each operator."""

    def __init__(self, ops):
        self.ops, self.calls = ops, dict.fromkeys(OPS, 0)

    def __getattr__(self, name):
        def call(*args):
            self.calls[name] += 1
            return getattr(self.ops, name)(*args)

        return call


# the model, its input, and how many times a training step calls each operator: convolutions with a bias (oneDNN
# adds it) and without, 2x2 pools of stride 2 (max_pool2x2), and minigooglenet's and cifar_fast's conv modules,
# pools and concatenations in the blocked layout (csrc/blocked.cc; mnist_cnn's and cifar_cnn's pools too)
MODELS = [
    # their maps NHWC from the first convolution on, which adds mnist_cnn's bias
    ("mnist_cnn", (1, 28, 28), {"onednn_conv2d_bias": 2, "onednn_max_pool_relu_blocked": 2, "onednn_unblock": 1}),
    (
        "mnist_cnn_bn_fc",
        (1, 28, 28),
        {"onednn_conv2d": 2, "bn_nhwc": 2, "onednn_max_pool_relu_blocked": 2, "onednn_unblock": 1},
    ),
    (
        "minigooglenet",
        (3, 32, 32),
        {"onednn_conv_bn_relu": 19, "onednn_max_pool_blocked": 2, "onednn_concat_blocked": 10},
    ),
    # its maps blocked
    ("cifar_cnn", (3, 32, 32), {"onednn_conv2d_bias": 4, "onednn_max_pool_relu_blocked": 2, "onednn_unblock": 1}),
    # blocked from its first module on, the global max-pool included
    ("cifar_fast", (3, 32, 32), {"onednn_conv_bn_relu": 7, "onednn_max_pool_blocked": 4}),
]


@pytest.mark.parametrize(("name", "shape", "calls"), MODELS, ids=[m[0] for m in MODELS])
def test_a_models_training_step_through_onednn_matches_paddles_convolutions(op, name, shape, calls):
    """One training step from the same weights, by the custom operators and by Paddle's: the same outputs,
    gradients and batch norm running statistics, every convolution run by oneDNN (with its bias where it has one,
    and with its batch norm and ReLU in minigooglenet), and every pool by an operator."""
    paddle.seed(5)
    net = models.build_model(name, 10, shape)
    start = {k: v.clone() for k, v in net.state_dict().items()}
    x, y = paddle.randn([4, *shape]) * 2 + 0.5, paddle.randint(0, 10, [4])
    results = []
    counted = Counted(op)
    for active in (True, False):
        fastpath.use(counted if active else None)
        net.set_state_dict(start)
        net.clear_gradients()
        paddle.seed(9)  # the same dropout masks
        logits = net(x)
        F.cross_entropy(logits, y).backward()
        grads = {k: p.grad.numpy() for k, p in net.named_parameters() if p.grad is not None}
        buffers = {k: v.numpy() for k, v in net.state_dict().items() if k.endswith(("_mean", "_variance"))}
        results.append((logits.numpy(), grads, buffers))
    fastpath.use(op)
    assert counted.calls == dict.fromkeys(OPS, 0) | calls
    np.testing.assert_allclose(results[0][0], results[1][0], rtol=1e-4, atol=1e-5)
    assert results[0][1].keys() == results[1][1].keys()
    for key, grad in results[0][1].items():
        np.testing.assert_allclose(grad, results[1][1][key], rtol=1e-3, atol=1e-5, err_msg=key)
    assert len(results[0][2]) == 2 * sum(isinstance(m, paddle.nn.BatchNorm2D) for m in net.sublayers())
    for key, value in results[0][2].items():
        assert not np.allclose(value, start[key].numpy()), f"{key} did not move"
        np.testing.assert_allclose(value, results[1][2][key], rtol=1e-4, atol=1e-6, err_msg=key)


# minigooglenet's conv modules, as (in channels, side, out channels, kernel, stride, padding, input blocked): the
# first on a 1- and a 3-channel image, then on blocked maps, with the sides of 28x28 and 32x32 inputs
MODULES = [
    (1, 28, 96, 3, 1, 1, False),
    (3, 32, 96, 3, 1, 1, False),
    (96, 28, 32, 1, 1, 0, True),
    (64, 15, 48, 3, 1, 1, True),
    (80, 28, 80, 3, 2, 0, True),  # downsample: 28 -> 13, oneDNN's right padding -1
    (80, 32, 80, 3, 2, 0, True),  # 32 -> 15
    (160, 13, 96, 3, 2, 0, True),  # 13 -> 6
]


BLOCKS = [8, 16]  # AVX2's and AVX-512's (fastpath.channel_block): both are checked on any processor


def blocked(x: paddle.Tensor, block: int) -> paddle.Tensor:
    """An NCHW map (C a multiple of block) in the layout blocked by `block` channels, [N, C/B, H, W, B]."""
    n, c, h, w = x.shape
    return x.reshape([n, c // block, block, h, w]).transpose([0, 1, 3, 4, 2])


def test_the_block_is_sixteen_channels_with_avx512_and_eight_without():
    assert fastpath.channel_block({"avx2", "fma", "avx512f", "avx512bw", "avx512dq", "avx512vl"}) == 16
    assert fastpath.channel_block({"avx2", "fma", "avx512f"}) == 8  # the first AVX-512 (Knights Landing) lacks BW
    assert fastpath.channel_block({"avx2", "fma"}) == 8
    avx512 = {"avx2", "fma", "avx512f", "avx512bw", "avx512dq", "avx512vl"}
    for isa, block in (("AVX2", 8), ("avx2_vnni", 8), ("SSE41", 8), ("AVX512_CORE", 16), ("AVX512_CORE_AMX", 16)):
        assert fastpath.channel_block(avx512, {"ONEDNN_MAX_CPU_ISA": isa}) == block, isa  # oneDNN held below AVX-512
    assert fastpath.BLOCK == fastpath.channel_block(cpu.cpu_flags(Path("/proc/cpuinfo").read_text())[1])


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("module", MODULES, ids=[f"{m[0]}x{m[1]}-k{m[3]}s{m[4]}" for m in MODULES])
def test_a_conv_module_in_the_blocked_layout_gives_paddles_numbers(op, module, block):
    """onednn_conv_bn_relu against Conv2D, BatchNorm2D and ReLU in training: the output, the gradients of the
    input, the weights, the scale and the shift, and the running statistics after the step."""
    cin, side, cout, kernel, stride, padding, blocked_input = module
    paddle.seed(cin + side)
    conv = models.Conv2D(cin, cout, kernel, stride=stride, padding=padding)
    norm = paddle.nn.BatchNorm2D(cout)
    norm.weight.set_value(paddle.rand([cout]) + 0.5)
    norm.bias.set_value(paddle.randn([cout]))
    x = paddle.randn([8, cin, side, side])
    params = [conv.weight, norm.weight, norm.bias]
    results = []
    for ours in (True, False):
        norm._mean.set_value(paddle.zeros([cout]))
        norm._variance.set_value(paddle.ones([cout]))
        if ours:
            run = lambda x, *_: fastpath.unblock(  # noqa: E731
                fastpath.conv_bn_relu(blocked(x, block) if blocked_input else x, conv, norm, block=block)
            )
        else:
            run = lambda x, *_: F.relu(norm(F.conv2d(x, conv.weight, conv.bias, stride, padding)))  # noqa: E731
        results.append(output_and_grads(run, x, *params) + [norm._mean.numpy(), norm._variance.numpy()])
    names = ("output", "input gradient", "weight gradient", "scale gradient", "shift gradient", "mean", "variance")
    for name, a, b in zip(names, *results):
        assert a.shape == b.shape, name
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * np.abs(b).max(), err_msg=name)


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("module", MODULES, ids=[f"{m[0]}x{m[1]}-k{m[3]}s{m[4]}" for m in MODULES])
def test_a_conv_module_in_evaluation_gives_paddles_numbers(op, module, block):
    """onednn_conv_relu_blocked, batch norm's running statistics folded into the convolution, against Conv2D,
    BatchNorm2D and ReLU in evaluation."""
    cin, side, cout, kernel, stride, padding, blocked_input = module
    paddle.seed(cin * side)
    conv = models.Conv2D(cin, cout, kernel, stride=stride, padding=padding)
    norm = paddle.nn.BatchNorm2D(cout)
    for t, value in ((norm.weight, paddle.rand([cout]) + 0.5), (norm.bias, paddle.randn([cout]))):
        t.set_value(value)
    norm._mean.set_value(paddle.randn([cout]))
    norm._variance.set_value(paddle.rand([cout]) + 0.1)
    norm.eval()
    x = paddle.randn([8, cin, side, side])
    with paddle.no_grad():
        ours = fastpath.conv_relu_folded(blocked(x, block) if blocked_input else x, conv, norm, block=block)
        ours = fastpath.unblock(ours)
        paddles = F.relu(norm(F.conv2d(x, conv.weight, conv.bias, stride, padding)))
    assert ours.shape == paddles.shape
    np.testing.assert_allclose(ours.numpy(), paddles.numpy(), rtol=1e-4, atol=1e-4 * float(paddles.abs().max()))


# the evaluation of the models that train blocked: how many times it calls each operator
EVALUATIONS = [
    ("minigooglenet", {"onednn_conv_relu_blocked": 19, "onednn_max_pool_blocked": 2, "onednn_concat_blocked": 10}),
    ("cifar_fast", {"onednn_conv_relu_blocked": 7, "onednn_max_pool_blocked": 4}),
]


@pytest.mark.parametrize(("name", "calls"), EVALUATIONS, ids=[e[0] for e in EVALUATIONS])
def test_a_blocked_models_evaluation_runs_blocked_and_matches_paddles_layers(op, name, calls):
    """In evaluation without gradients (the trainer's) the network runs blocked, batch norm folded into each
    convolution: the outputs of Paddle's layers, after training steps have moved the running statistics. With
    gradients on, evaluation takes Paddle's layers (the folded operator has no gradient)."""
    paddle.seed(7)
    net = models.build_model(name, 10, (3, 32, 32))
    for _ in range(3):
        F.cross_entropy(net(paddle.randn([8, 3, 32, 32]) * 2 + 0.5), paddle.randint(0, 10, [8])).backward()
    net.eval()
    x = paddle.randn([6, 3, 32, 32]) * 2 + 0.5
    counted = Counted(op)
    outputs = []
    try:
        for active in (True, False):
            fastpath.use(counted if active else None)
            with paddle.no_grad():
                outputs.append(net(x).numpy())
        assert counted.calls == dict.fromkeys(OPS, 0) | calls
        fastpath.use(counted)
        counted.calls = dict.fromkeys(OPS, 0)
        net(x)  # gradients on
        assert sum(counted.calls[k] for k in calls) == 0, counted.calls
    finally:
        fastpath.use(op)
    np.testing.assert_allclose(outputs[0], outputs[1], rtol=1e-4, atol=1e-4 * np.abs(outputs[1]).max())


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("side", [28, 32, 13, 15])
def test_the_blocked_max_pool_gives_paddles_numbers(op, side, block):
    """onednn_max_pool_blocked against F.max_pool2d, 3x3 of stride 2 (the downsample modules'), output and input
    gradient (overlapping windows add up in another order: equal to rounding)."""
    x = paddle.randn([4, 16, side, side])
    ours = output_and_grads(lambda x: fastpath.unblock(fastpath.max_pool_blocked(blocked(x, block), 3, 2)), x)
    assert fastpath.max_pool_blocked(blocked(x, block), 3, 2).shape[4] == block
    paddles = output_and_grads(lambda x: F.max_pool2d(x, 3, 2), x)
    np.testing.assert_array_equal(ours[0], paddles[0])
    np.testing.assert_allclose(ours[1], paddles[1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("block", BLOCKS)
def test_the_blocked_concatenation_gives_paddles_numbers_to_the_bit(op, block):
    """onednn_concat_blocked against paddle.concat on channels: a copy both ways, so equal to the bit."""
    a, b = paddle.randn([4, 96, 13, 13]), paddle.randn([4, 48, 13, 13])
    join = lambda a, b: fastpath.unblock(fastpath.concat_blocked(blocked(a, block), blocked(b, block)))  # noqa: E731
    ours = output_and_grads(join, a, b)
    paddles = output_and_grads(lambda a, b: paddle.concat([a, b], axis=1), a, b)
    for name, x, y in zip(("output", "first gradient", "second gradient"), ours, paddles):
        np.testing.assert_array_equal(x, y, err_msg=name)


@pytest.mark.parametrize("m", [1, 15, 16, 17, 64, 100])
@pytest.mark.parametrize("transpose_y", [False, True])
def test_the_rows_product_is_the_product_and_each_row_the_same_bits_anywhere(op, m, transpose_y):
    """csrc/matmul.cc's onednn_rows_matmul: x @ w (w transposed where asked), a short last block padded, close to
    the float64 product; each row the same bits alone, in the whole batch and on 1 or 2 threads."""
    rng = np.random.default_rng(m)
    k, n = 300, 70  # neither a multiple of a vector's width
    x = rng.standard_normal((m, k)).astype("float32")
    w = rng.standard_normal((n, k) if transpose_y else (k, n)).astype("float32")
    wide = x.astype(np.float64) @ (w.T if transpose_y else w).astype(np.float64)
    got = {}
    try:
        for threads in (1, 2):
            cpu.set_openmp_threads(threads)
            got[threads] = op.onednn_rows_matmul(paddle.to_tensor(x), paddle.to_tensor(w), transpose_y, 16).numpy()
    finally:
        cpu.set_openmp_threads(1)
    np.testing.assert_allclose(got[1], wide, rtol=1e-4, atol=1e-4)
    assert np.array_equal(got[1], got[2])
    last = op.onednn_rows_matmul(paddle.to_tensor(x[-1:]), paddle.to_tensor(w), transpose_y, 16).numpy()
    assert np.array_equal(last[0], got[1][-1])


def test_a_rows_product_of_shapes_that_do_not_meet_is_refused_in_one_line(op):
    x, w = paddle.randn([4, 30]), paddle.randn([20, 8])
    with pytest.raises(OSError, match="x has 30 columns, w does not take them"):
        op.onednn_rows_matmul(x, w, False, 16)
    with pytest.raises(OSError, match="rows must be 1 or more, not 0"):
        op.onednn_rows_matmul(x, paddle.randn([30, 8]), False, 0)


@pytest.mark.parametrize(("m", "k", "n"), [(64, 980, 10), (37, 301, 256), (17, 300, 250)])
def test_the_dense_backward_sums_each_gradient_over_the_rows_in_order_in_float64(op, m, k, n):
    """csrc/matmul.cc's onednn_dense_backward: the weights' and the bias's gradients are the float64 sums over the
    rows, added in the rows' order (the same bits as that loop here, on 1 and 2 threads), and their float32
    roundings; the input's gradient is the rows product's, to the bit, and zeros where none is asked. The shapes:
    mnist_cnn's classifier (fewer than 32 outputs: the product transposed), a gradient written in place with a
    short last tile, and one padded; the last two large enough to be shared among the threads."""
    rng = np.random.default_rng(k)
    x, w, g = (rng.standard_normal(shape).astype("float32") for shape in ((m, k), (k, n), (m, n)))
    wide_w, wide_b = np.zeros((k, n)), np.zeros(n)
    for r in range(m):  # float32 products are exact in float64: only the order of the adds decides the bits
        wide_w += np.outer(x[r].astype(np.float64), g[r].astype(np.float64))
        wide_b += g[r]
    got = {}
    try:
        for threads in (1, 2):
            cpu.set_openmp_threads(threads)
            outs = op.onednn_dense_backward(paddle.to_tensor(x), paddle.to_tensor(w), paddle.to_tensor(g), True, 16)
            got[threads] = [t.numpy() for t in outs]
    finally:
        cpu.set_openmp_threads(1)
    grad_x, grad_w, grad_b, rounded_w, rounded_b = got[1]
    np.testing.assert_array_equal(grad_w, wide_w)
    np.testing.assert_array_equal(grad_b, wide_b)
    np.testing.assert_array_equal(rounded_w, wide_w.astype("float32"))
    np.testing.assert_array_equal(rounded_b, wide_b.astype("float32"))
    rows = op.onednn_rows_matmul(paddle.to_tensor(g), paddle.to_tensor(w), True, 16).numpy()
    np.testing.assert_array_equal(grad_x, rows)
    for a, b in zip(got[1], got[2]):
        np.testing.assert_array_equal(a, b)
    unasked = op.onednn_dense_backward(paddle.to_tensor(x), paddle.to_tensor(w), paddle.to_tensor(g), False, 16)
    assert not unasked[0].numpy().any()
    np.testing.assert_array_equal(unasked[1].numpy(), wide_w)


def test_a_dense_backward_of_shapes_that_do_not_meet_is_refused_in_one_line(op):
    with pytest.raises(OSError, match=r"x \[4, 30\], w \[30, 8\] and the output's gradient \[5, 8\] do not fit"):
        op.onednn_dense_backward(paddle.randn([4, 30]), paddle.randn([30, 8]), paddle.randn([5, 8]), True, 16)


def test_maps_of_different_blocks_are_refused_in_one_line(op):
    a, b = paddle.randn([2, 32, 5, 5]), paddle.randn([2, 16, 5, 5])
    with pytest.raises(OSError, match="same batch, height, width and block"):
        fastpath.concat_blocked(blocked(a, 16), blocked(b, 8))
    conv, norm = models.Conv2D(32, 16, 1), paddle.nn.BatchNorm2D(16)
    with pytest.raises(OSError, match="x is blocked by 8 channels, the output would be by 16"):
        op.onednn_conv_bn_relu(blocked(a, 8), conv.weight, conv.bias, norm.weight, norm.bias, 1, 0, 1e-5, True, 16)
    narrow, few = models.Conv2D(32, 8, 1), paddle.nn.BatchNorm2D(8)
    with pytest.raises(OSError, match="output channels \\(8\\) must be a multiple of the block, 16"):
        op.onednn_conv_bn_relu(a, narrow.weight, narrow.bias, few.weight, few.bias, 1, 0, 1e-5, True, 16)


# (what is wrong, x's shape, the weight's shape, stride, padding, the operator's one line): each a call that oneDNN
# would otherwise answer by aborting the process (a dnnl::error) or a zero stride by a division by zero
BAD_GEOMETRIES = [
    ("channels", [2, 3, 9, 9], [4, 2, 3, 3], 1, 1, "onednn_conv2d: x has 3 channels, the weight takes 2"),
    ("stride", [2, 3, 9, 9], [4, 3, 3, 3], 0, 1, "onednn_conv2d: the stride must be 1 or more, not 0"),
    ("padding", [2, 3, 9, 9], [4, 3, 3, 3], 1, -1, "onednn_conv2d: the padding must be 0 or more, not -1"),
    (
        "no-output",
        [2, 3, 4, 9],
        [4, 3, 7, 3],
        2,
        1,
        "onednn_conv2d: no output: the 7x3 kernel is larger than the input with its padding, 6x11",
    ),
]


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize(
    ("what", "x", "w", "stride", "padding", "said"), BAD_GEOMETRIES, ids=[b[0] for b in BAD_GEOMETRIES]
)
def test_a_convolution_of_a_geometry_onednn_cannot_run_is_refused_in_one_line(
    op, what, x, w, stride, padding, said, bias
):
    x, w = paddle.randn(x), paddle.randn(w)
    with pytest.raises(OSError, match=re.escape(said)):
        if bias:
            op.onednn_conv2d_bias(x, w, paddle.randn(w.shape[:1]), stride, padding, True, 0)
        else:
            op.onednn_conv2d(x, w, stride, padding, True, 0)


class UnbiasedVariance:
    """The operators, with a conv module that hands back the batch's unbiased variance (a likely slip): its
    outputs and gradients are right, its running variance is not."""

    def __init__(self, ops):
        self.ops = ops

    def __getattr__(self, name):
        return getattr(self.ops, name)

    def onednn_conv_bn_relu(self, x, *args):
        out, conv, mean, variance = self.ops.onednn_conv_bn_relu(x, *args)
        n = conv.shape[0] * conv.shape[2] * conv.shape[3]
        return out, conv, mean, variance * n / (n - 1)


def test_the_build_check_refuses_a_conv_module_with_another_running_variance(op):
    with pytest.raises(selfcheck.Refused, match="conv module's running variance differs"):
        selfcheck.check_blocked(UnbiasedVariance(op))


# (batch, channels, height, width): the models' pools (28 -> 14 -> 7, cifar_cnn's 30 -> 15 and 13 -> 6), and
# maps of odd sides whose rows hold fewer than 4 outputs
POOLS = [(8, 20, 28, 28), (8, 20, 14, 14), (4, 32, 30, 30), (4, 64, 13, 13), (3, 2, 7, 6), (2, 3, 5, 9)]


@pytest.mark.parametrize("shape", POOLS, ids=["x".join(map(str, s[2:])) for s in POOLS])
def test_max_pool2x2_gives_f_max_pool2ds_numbers_to_the_bit(op, shape):
    """Outputs and input gradients equal to F.max_pool2d's (2x2, stride 2) bit for bit, on maps holding ties
    (values rounded to halves), NaN, +inf and windows of NaN and of -inf."""
    rng = np.random.default_rng(sum(shape))
    data = np.round(rng.normal(size=shape) * 2) / 2
    data[0, 0, :2, :2] = np.nan  # a window of NaN: its output is NaN, and no input takes its gradient
    data[0, 1, 0, 0], data[-1, -1, 2, 1], data[0, -1, -1, -1] = np.nan, np.inf, np.nan  # one NaN among numbers
    data[-1, 0, :2, :2] = -np.inf  # its output is -FLT_MAX, and no input takes its gradient
    x = paddle.to_tensor(data.astype("float32"))
    ours = output_and_grads(lambda x: op.max_pool2x2(x)[0], x)
    paddles = output_and_grads(lambda x: F.max_pool2d(x, 2, 2), x)
    for name, a, b in zip(("output", "input gradient"), ours, paddles):
        assert a.shape == b.shape, name
        assert np.array_equal(a, b, equal_nan=True), f"{name}: {np.sum(~((a == b) | (np.isnan(a) & np.isnan(b))))}"
        assert np.array_equal(np.signbit(a), np.signbit(b)), f"{name}: the signs of zeros differ"
    assert np.isnan(ours[0]).any() and (ours[0] == -np.finfo("float32").max).any()  # the cases were there


class SpreadGradient(paddle.autograd.PyLayer):
    """F.max_pool2d's output, with a gradient shared among the window's four inputs instead of given to its
    maximum."""

    @staticmethod
    def forward(ctx, x):
        ctx.shape = x.shape
        return F.max_pool2d(x, 2, 2)

    @staticmethod
    def backward(ctx, grad):
        spread = paddle.repeat_interleave(paddle.repeat_interleave(grad / 4, 2, axis=2), 2, axis=3)
        return F.pad(spread, [0, ctx.shape[3] % 2, 0, ctx.shape[2] % 2])


class SpreadGradientPool:
    def max_pool2x2(self, x):
        return [SpreadGradient.apply(x)]


def test_the_build_check_refuses_a_max_pool_with_another_gradient():
    """selfcheck.check_max_pool, which every build passes before it is used, fails an operator whose outputs are
    right and whose gradient is not."""
    with pytest.raises(selfcheck.Refused, match="max-pool input gradient differs"):
        selfcheck.check_max_pool(SpreadGradientPool())


def weights_pass_ran(code: str, shape: str) -> tuple[str, str]:
    """Run code in a fresh process with oneDNN's log on: a backward-weights line of the convolution whose shape is
    described by `shape` (oneDNN's "mb1_ic1oc20"), every such line naming one kernel, and the process's output."""
    env = launch_env() | {"ONEDNN_VERBOSE": "1"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, explain(proc)
    ran = [line for line in proc.stdout.splitlines() if ",exec," in line and shape in line]
    weights = [line for line in ran if "backward_weights" in line]
    kernels = {line.split(",convolution,")[1].split(",")[0] for line in weights}
    assert weights and len(kernels) == 1, ran
    kernel = kernels.pop()
    assert kernel.startswith("jit") and "gemm" not in kernel, weights[0]
    return weights[0], proc.stdout


def test_a_first_convolutions_weight_gradient_reads_its_input_as_paddle_holds_it(op):
    """The backward-weights primitive of a 1-channel input (made for one image, run on each) is a direct kernel,
    never im2col and a GEMM or the reference loops, and with oneDNN 3.6 (Paddle 3.3) its kernel for first layers,
    which takes the input in NCHW instead of padding the channel to 8 (8 times the work); oneDNN 3.2 (Paddle 2.6)
    has one in its AVX-512 kernels only, and its AVX2 kernel takes the blocked layout. Read from oneDNN's own log
    of what ran."""
    code = (
        "import paddle; from paddle_mnist.ops import fastpath, onednn as o; "
        "print(o.activate(o.prepare('onednn'), 'cpu')); "
        "x, w = paddle.randn([8, 1, 28, 28]), paddle.randn([20, 1, 5, 5]); w.stop_gradient = False; "
        "fastpath.conv2d(x, w, 1, 2).sum().backward()"
    )
    weights, stdout = weights_pass_ran(code, "mb1_ic1oc20")
    version = re.search(r"oneDNN v(\d+)\.(\d+)", stdout)
    assert version, stdout[:500]
    kernel = weights.split(",convolution,")[1].split(",")[0]
    if tuple(map(int, version.groups())) >= (3, 6) or "avx512" in kernel:
        assert re.search(r"src[:_]f32::blocked:abcd:", weights), weights
    else:  # oneDNN 3.2's AVX2 kernel: the input blocked by 8 channels, the first one and zeros
        assert re.search(r"src[:_]f32:p?:blocked:aBcd8b:", weights), weights


def test_minigooglenets_first_module_on_a_1_channel_image_takes_a_direct_weight_kernel(op):
    """The conv module's backward-weights primitive on a 1-channel NCHW image: where oneDNN has no direct kernel
    for that layout (3.2, Paddle 2.6), it must not take the reference loops (100 times slower: a second a step on
    Fashion-MNIST), but the blocked layout. Read from oneDNN's own log of what ran."""
    code = (
        "import paddle; from paddle_mnist.ops import fastpath, onednn as o; "
        "from paddle_mnist.network import models as m; print(o.activate(o.prepare('onednn'), 'cpu')); "
        "conv, norm = m.Conv2D(1, 96, 3, padding=1), paddle.nn.BatchNorm2D(96); "
        "fastpath.conv_bn_relu(paddle.randn([8, 1, 28, 28]), conv, norm).sum().backward()"
    )
    weights_pass_ran(code, "mb8_ic1oc96")  # a direct kernel, asserted there


@pytest.mark.parametrize("isa", [None, "SSE41"])
def test_a_build_whose_convolutions_run_on_onednns_reference_loops_is_not_used(op, isa):
    """The start-up check counts the convolution primitives made on oneDNN's reference loops, which compute the
    right numbers element by element: on a processor without the instructions of oneDNN's kernels for the blocked
    layout (here oneDNN held to SSE4.1 by ONEDNN_MAX_CPU_ISA, on a machine whose flags choose the layout) the
    trainer takes Paddle's convolutions and says why; with all its instructions, oneDNN's."""
    env = launch_env() | ({"ONEDNN_MAX_CPU_ISA": isa} if isa else {})
    code = "from paddle_mnist.ops import onednn as o; print(o.activate(o.prepare('auto'), 'cpu'))"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = proc.stdout.strip().splitlines()[-1]
    if isa is None:
        assert line.startswith("convolutions: oneDNN"), line
    else:
        assert line.startswith("convolutions: Paddle's (oneDNN's operator from"), line
        assert "reference loops" in line and "Paddle's run faster" in line, line


def test_the_exported_model_and_evaluation_use_paddles_convolution(op, tmp_path):
    """paddle.jit.save traces the network outside dygraph, where Conv2D takes F.conv2d: Paddle Inference and ONNX
    get the operator they know, never the custom one."""
    net = models.build_model("mnist_cnn_bn_fc", 10, (1, 28, 28))
    net.eval()
    spec = paddle.static.InputSpec([None, 1, 28, 28], "float32", "image")
    paddle.jit.save(net, str(tmp_path / "model"), input_spec=[spec])
    program = next(p for p in tmp_path.iterdir() if p.suffix in (".json", ".pdmodel")).read_bytes()
    assert b"conv2d" in program and b"onednn_conv2d" not in program
    assert b"pool2d" in program and b"max_pool2x2" not in program


def test_missing_headers_leave_paddles_convolution_with_the_fix(monkeypatch):
    monkeypatch.setattr(onednn, "HEADERS_PACKAGE", "no-such-onednn-headers")
    prepared = onednn.prepare("auto")
    assert prepared.library is None and "pip install" in prepared.reason
    assert onednn.activate(prepared, "cpu") == f"convolutions: Paddle's ({prepared.reason})"
    with pytest.raises(onednn.Unavailable, match="headers are not installed"):
        onednn.prepare("onednn")


BUILD = """
import json, sys
from paddle_mnist.ops import fastpath, onednn, selfcheck
library, seconds = onednn.build()
print(json.dumps([str(library), seconds]))
"""


def build_in(cache: Path, extra_env: dict | None = None) -> subprocess.Popen:
    env = launch_env() | {"PADDLE_MNIST_CACHE": str(cache)} | (extra_env or {})
    return subprocess.Popen([sys.executable, "-c", BUILD], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def result(proc: subprocess.Popen, said: list[str] | None = None) -> tuple[Path, float | None]:
    """The library and the build's seconds a build_in process printed; its stderr appended to `said`."""
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err.decode()[-2000:]
    library, seconds = json.loads(out.decode().strip().splitlines()[-1])
    if said is not None:
        said.append(err.decode())
    return Path(library), seconds


@pytest.mark.slow
def test_workers_of_one_machine_build_it_once_and_a_damaged_build_is_built_again(tmp_path):
    """Two workers start together on a cache whose build is damaged (this machine's build, copied in and cut
    short): one builds it again, the other waits for it and loads that build. A build without its record (one
    interrupted before the record was written) is not intact either, so it takes the same path; an intact one is
    loaded without a build. One compile in all."""
    machine, _ = onednn.build()  # this machine's build, from the real cache (made here if it is not there yet)
    cache = tmp_path / "cache"
    folder = cache / onednn.NAME / machine.parent.name
    shutil.copytree(machine.parent, folder)
    assert onednn.intact(folder)
    library = folder / machine.name
    library.write_bytes(library.read_bytes()[: library.stat().st_size // 2])  # its digest no longer matches
    assert not onednn.intact(folder)

    first, second = build_in(cache), build_in(cache)
    said = []
    (a, a_s), (b, b_s) = result(first, said), result(second, said)
    assert a == b == library and onednn.intact(folder)
    assert sorted([a_s is None, b_s is None]) == [False, True], (a_s, b_s)  # one built, the other waited
    builder, waiter = said if a_s is not None else said[::-1]
    assert "oneDNN operators: building them for this machine" in builder, builder  # before the silent minute
    assert "is building them" in waiter and "building them for" not in waiter, waiter
    record = json.loads((folder / "build.json").read_text())
    assert record["build_seconds"] == round(a_s or b_s, 1) and record["paddle"] == paddle.__version__
    assert sorted(p.name for p in (cache / onednn.NAME).iterdir()) == sorted([folder.name, folder.name + ".lock"])

    (folder / "build.json").unlink()  # interrupted before its record was written
    assert not onednn.intact(folder)
    (folder / "build.json").write_text(json.dumps(record, indent=2) + "\n")
    found, seconds = result(build_in(cache))
    assert found == library and seconds is None


@pytest.mark.slow
def test_without_a_compiler_the_run_trains_on_paddles_convolution_and_says_why(tmp_path):
    data_dir = make_dataset(tmp_path / "mnist", n_train=512, n_test=100)
    env = {"PADDLE_MNIST_CACHE": str(tmp_path / "cache"), "CXX": str(tmp_path / "no-compiler")}
    args = [*SMALL, "--data-dir", str(data_dir)]
    ok = run_single([*args, "--output-dir", str(tmp_path / "auto")], cwd=tmp_path, env=env)
    assert ok.returncode == 0, explain(ok)
    said = [line.split("] ", 1)[1] for line in ok.stdout.splitlines() if "convolutions:" in line]
    assert said == [f"convolutions: Paddle's (no C++ compiler ({env['CXX']}) to build it with (install g++))"]
    assert read_results(tmp_path / "auto")["test_count"] == 100

    refused = run_single(
        [*args, "--conv-backend", "onednn", "--output-dir", str(tmp_path / "o")], cwd=tmp_path, env=env
    )
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        f"error: --conv-backend onednn: no C++ compiler ({env['CXX']}) to build it with (install g++); "
        "or pass --conv-backend auto"
    ]
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_a_run_resumed_with_the_other_convolution_continues_from_its_checkpoint(tmp_path):
    """The checkpoint holds weights and optimizer state only: which convolution made them does not matter."""
    data_dir = make_dataset(tmp_path / "mnist", n_train=512, n_test=100)
    args = [*SMALL, "--data-dir", str(data_dir), "--output-dir", str(tmp_path / "o")]
    first = run_single([*args, "--conv-backend", "onednn", "--save-every-steps", "4", "--max-steps", "4"], cwd=tmp_path)
    assert first.returncode == 0, explain(first)
    assert "convolutions: oneDNN" in first.stdout
    resumed = run_single([*args, "--conv-backend", "paddle", "--resume"], cwd=tmp_path)
    assert resumed.returncode == 0, explain(resumed)
    assert "convolutions: Paddle's (--conv-backend paddle)" in resumed.stdout
    assert "resumed from" in resumed.stdout and read_results(tmp_path / "o")["steps"] == 8


def test_evaluation_keeps_no_plans_and_training_keeps_a_bounded_number(op):
    """A training step keeps the plans of its shapes, a second keeps no more, evaluation at another batch size
    keeps none (its plans, with their batch-sized buffers, are freed after the call), and a cache past its capacity
    drops its least recently used plans."""
    fastpath.use(op)  # an earlier test may have left Paddle's convolutions active
    paddle.seed(5)
    for name, shape in (("cifar_cnn", (3, 32, 32)), ("minigooglenet", (3, 32, 32))):
        net = models.build_model(name, 10, shape)
        kept = [fastpath.kept_plans()]
        for _ in range(2):
            F.cross_entropy(net(paddle.randn([5, *shape])), paddle.randint(0, 10, [5])).backward()  # a batch of its own
            kept.append(fastpath.kept_plans())
        net.eval()
        with paddle.no_grad():
            net(paddle.randn([7, *shape]))
        kept.append(fastpath.kept_plans())
        assert kept[1] > kept[0] and kept[1] == kept[2] == kept[3], f"{name}: plans kept {kept}"
    capacity = fastpath.PLAN_CACHE_CAPACITY
    w = paddle.randn([2, 1, 3, 3])
    w.stop_gradient = False
    for batch in range(1, capacity + 11):  # shapes no other test uses
        op.onednn_conv2d(paddle.randn([batch, 1, 5, 5]), w, 1, 0, False, 0).sum().backward()
        assert fastpath.kept_plans() <= fastpath.PLAN_CACHES * capacity


MAPS_CODE = (
    "import numpy as np, paddle, paddle.nn.functional as F; from paddle_mnist.ops import fastpath, onednn as o; "
    "print(o.activate(o.prepare('onednn'), 'cpu')); paddle.seed(0); "
    "x, w = paddle.randn([8, 20, 14, 14]), paddle.randn([20, 20, 5, 5]); x.stop_gradient = w.stop_gradient = False; "
    "y = fastpath.conv2d(x, w, 1, 2); y.square().sum().backward(); "
    "xr, wr = x.detach(), w.detach(); xr.stop_gradient = wr.stop_gradient = False; "
    "yr = F.conv2d(xr, wr, padding=2); yr.square().sum().backward(); "
    "close = lambda a, b: np.abs(a.numpy() - b.numpy()).max() <= 1e-5 * np.abs(b.numpy()).max(); "
    "print('same as F.conv2d:', close(y, yr) and close(x.grad, xr.grad) and close(w.grad, wr.grad))"
)


@pytest.mark.slow
@pytest.mark.parametrize("isa, maps, layout", [("", "", None), ("", "blocked", None), ("AVX2", "", "aBcd8b")])
def test_maps_whose_channels_blocking_would_pad_to_twice_the_work_go_nhwc(op, isa, maps, layout):
    """A 20-to-20-channel convolution (mnist_cnn's second): blocked by 16 channels (oneDNN's choice with AVX-512) it
    would do 2.56 times its multiply-adds, so its maps go NHWC (acdb) in all three passes; blocked by 8 (AVX2, here
    by ONEDNN_MAX_CPU_ISA) 1.44 times, and they stay blocked; PADDLE_MNIST_CONV_MAPS=blocked keeps oneDNN's choice.
    Either way the output and both gradients are F.conv2d's. Read from oneDNN's own log of what ran."""
    env = launch_env() | {"ONEDNN_VERBOSE": "1"}
    env |= {"ONEDNN_MAX_CPU_ISA": isa} if isa else {}
    env |= {"PADDLE_MNIST_CONV_MAPS": maps} if maps else {}
    proc = subprocess.run([sys.executable, "-c", MAPS_CODE], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, explain(proc)
    assert "same as F.conv2d: True" in proc.stdout, proc.stdout[-2000:]
    ran = [line for line in proc.stdout.splitlines() if ",exec," in line and "ic20oc20" in line]
    passes = {p for p in ("forward_training", "backward_data", "backward_weights") for line in ran if p in line}
    assert len(passes) == 3, ran
    if layout is None:  # this processor's own block: NHWC where it is 16, unless told to keep oneDNN's choice
        blocked = "aBcd16b" if fastpath.BLOCK == 16 else "aBcd8b"
        layout = "acdb" if fastpath.BLOCK == 16 and not maps else blocked
    for line in ran:
        assert re.search(rf"src[:_]f32:a?p?:blocked:{layout}:", line), (layout, line)


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("source", ["nchw", "blocked"])
def test_the_operator_takes_and_gives_blocked_maps_with_its_nchw_numbers(op, source, bias, block):
    """onednn_conv2d(_bias) with its output blocked by `block` channels and its input NCHW (a network's first
    convolution) or blocked (the next ones): once unblocked, the output and every gradient of NCHW maps, to the
    bit (the same primitives run; only the reorders around them are gone)."""
    rng = np.random.default_rng(block + bias)
    x = paddle.to_tensor(rng.normal(size=(4, 32, 15, 15)).astype("float32"))
    params = [paddle.to_tensor((rng.normal(size=(64, 32, 3, 3)) / 17).astype("float32"))]
    params += [paddle.to_tensor(rng.normal(size=64).astype("float32"))] if bias else []

    def conv(src_block: int, dst_block: int):
        def run(x, *p):
            x = blocked(x, src_block) if src_block else x
            if bias:
                y = op.onednn_conv2d_bias(x, *p, 1, 0, True, dst_block)
            else:
                y = op.onednn_conv2d(x, *p, 1, 0, True, dst_block)
            assert len(y.shape) == (5 if dst_block else 4)
            return fastpath.unblock(y) if dst_block else y

        return run

    nchw = output_and_grads(conv(0, 0), x, *params)
    ours = output_and_grads(conv(block if source == "blocked" else 0, block), x, *params)
    for name, a, b in zip(("output", "input gradient", "weights' gradient", "bias's gradient"), ours, nchw):
        np.testing.assert_array_equal(a, b, err_msg=name)


@pytest.mark.parametrize(("channels", "side"), [(1, 28), (20, 14), (20, 9)])
def test_the_operators_take_and_give_nhwc_maps(op, channels, side):
    """mnist_cnn's maps held NHWC, [N, 1, H, W, C] (blocked by all their channels): onednn_conv2d_bias gives
    Paddle's convolution's output and gradients, the input NCHW (one channel, the first) or NHWC, and
    onednn_max_pool_blocked F.max_pool2d's to the bit (odd sides included)."""
    rng = np.random.default_rng(side)
    x = paddle.to_tensor(rng.normal(size=(4, channels, side, side)).astype("float32"))
    w = paddle.to_tensor((rng.normal(size=(20, channels, 5, 5)) / 9).astype("float32"))
    b = paddle.to_tensor(rng.normal(size=20).astype("float32"))

    def nhwc(x, w, b):
        y = op.onednn_conv2d_bias(blocked(x, channels) if channels > 1 else x, w, b, 1, 2, True, 20)
        assert y.shape == [4, 1, side, side, 20]
        return fastpath.unblock(y)

    ours = output_and_grads(nhwc, x, w, b)
    paddles = output_and_grads(lambda x, w, b: F.conv2d(x, w, b, padding=2), x, w, b)
    for name, a, e in zip(("output", "input gradient", "weights' gradient", "bias's gradient"), ours, paddles):
        np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-5 * np.abs(e).max(), err_msg=name)  # float32 sums

    maps = paddle.to_tensor(rng.normal(size=(4, 20, side, side)).astype("float32"))
    pooled = output_and_grads(lambda m: fastpath.unblock(op.onednn_max_pool_blocked(blocked(m, 20), 2, 2)[0]), maps)
    for a, e in zip(pooled, output_and_grads(lambda m: F.max_pool2d(m, 2, 2), maps)):
        np.testing.assert_array_equal(a, e)


@pytest.mark.parametrize("block", [8, 16, 20])
@pytest.mark.parametrize("side", [28, 15])
def test_the_pool_with_relu_gives_paddles_relu_then_pool_to_the_bit(op, block, side):
    """onednn_max_pool_relu_blocked, 2x2 of stride 2 (its own loops), on maps blocked by 8, 16 or all 20 channels:
    the output and input gradient of F.relu then F.max_pool2d, to the bit, with ties (halves, zeros among them),
    negative windows and odd sides, on 1 and 2 threads; a 3x3 window (oneDNN's pool, then ReLU) too. (A NaN is where
    the two orders part: ReLU first makes it 0.)"""
    rng = np.random.default_rng(side + block)
    channels = 20 if block == 20 else 32
    values = np.round(rng.normal(size=(3, channels, side, side)) * 2).astype("float32") / 2
    values[0, 1, :4, :4] = -1.5  # windows all negative: no input takes the gradient
    maps = paddle.to_tensor(values)
    for k, s in ((2, 2), (3, 2)):
        ours = output_and_grads(
            lambda m, k=k, s=s: fastpath.unblock(op.onednn_max_pool_relu_blocked(blocked(m, block), k, s)[0]), maps
        )
        paddles = output_and_grads(lambda m, k=k, s=s: F.max_pool2d(F.relu(m), k, s), maps)
        for name, a, e in zip(("output", "input gradient"), ours, paddles):
            np.testing.assert_array_equal(a, e, err_msg=f"{name}, {k}x{k}")

    def pooled(m):
        return fastpath.unblock(op.onednn_max_pool_relu_blocked(blocked(m, block), 2, 2)[0])

    try:  # the planes shared among 2 threads: the same bits
        cpu.set_openmp_threads(2)
        shared = output_and_grads(pooled, maps)
    finally:
        cpu.set_openmp_threads(1)
    for a, e in zip(shared, output_and_grads(pooled, maps)):
        np.testing.assert_array_equal(a, e)


@pytest.mark.parametrize("offset", [0.0, 300.0])
def test_batch_norm_of_nhwc_maps_gives_paddles(op, offset):
    """bn_nhwc (mnist_cnn_bn's batch norm in training, its maps NHWC): Paddle's batch norm's output and gradients,
    and the batch's mean and biased variance, also for a mean 300 times the spread (its sums shift by a value near
    the mean, so its squares do not cancel)."""
    rng = np.random.default_rng(int(offset))
    nchw = paddle.to_tensor((rng.normal(size=(6, 20, 9, 9)) + offset).astype("float32"))
    gamma = paddle.to_tensor(rng.uniform(0.5, 2, size=20).astype("float32"))
    beta = paddle.to_tensor(rng.normal(size=20).astype("float32"))
    running = [paddle.zeros([20]), paddle.ones([20])]

    def ours(x, g, b):
        y, mean, variance = op.bn_nhwc(blocked(x, 20), g, b, 1e-5)
        kept.extend([mean.numpy(), variance.numpy()])
        return fastpath.unblock(y)

    kept: list[np.ndarray] = []
    got = output_and_grads(ours, nchw, gamma, beta)
    want = output_and_grads(
        lambda x, g, b: F.batch_norm(x, *running, g, b, training=True, epsilon=1e-5), nchw, gamma, beta
    )
    for name, a, e in zip(("output", "input gradient", "gamma's gradient", "beta's gradient"), got, want):
        np.testing.assert_allclose(a, e, rtol=1e-3, atol=2e-4 * np.abs(e).max(), err_msg=name)
    wide = nchw.numpy().astype(np.float64)
    np.testing.assert_allclose(kept[0], wide.mean(axis=(0, 2, 3)), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(kept[1], wide.var(axis=(0, 2, 3)), rtol=1e-3)


def test_a_block_the_operator_does_not_hold_is_refused_in_one_line(op):
    x, w = paddle.randn([2, 16, 9, 9]), paddle.randn([24, 16, 3, 3])
    with pytest.raises(Exception, match="maps are blocked by 8 or 16 channels or by all of them, not by 12 of 24"):
        op.onednn_conv2d(x, w, 1, 1, True, 12)
    with pytest.raises(Exception, match="24 output channels do not fill blocks of 16"):
        op.onednn_conv2d(x, w, 1, 1, True, 16)


@pytest.mark.parametrize("sums", ["float32", "float64"])
def test_cifar_cnns_blocked_maps_train_and_evaluate_its_nchw_numbers_to_the_bit(op, sums):
    """cifar_cnn keeps its maps blocked from its first convolution to its last pool (ReLU and dropout on them as
    they are, the pools by oneDNN): a training step, dropout placed as the trainer places it, gives the logits and
    every gradient of its maps held NCHW, to the bit, with the step's sums in float32 and in float64
    (exact.py, as the trainer runs cifar_cnn); so does evaluation."""
    from paddle_mnist.network import dropout, exact

    paddle.seed(3)
    net = models.build_model("cifar_cnn", 10, (3, 32, 32))
    x, y = paddle.randn([12, 3, 32, 32]) * 2 + 0.5, paddle.randint(0, 10, [12])
    counted = Counted(op)
    results = []
    fastpath.use(counted)
    try:
        for held_blocked in (True, False):
            net.blocked_maps = held_blocked
            net.clear_gradients()
            kept = exact.Sums() if sums == "float64" else None
            with dropout.placed(dropout.layers(net), dropout.Place(1, 2, 0, 12)), exact.summing(kept):
                logits = net(x)
                F.cross_entropy(logits, y).backward()
            if kept is not None:
                kept.gradients(net.parameters(), lambda t: None)
            net.eval()
            with paddle.no_grad():
                evaluated = net(x).numpy()
            net.train()
            results.append((logits.numpy(), [p.grad.numpy() for p in net.parameters()], evaluated))
            if held_blocked:
                assert counted.calls["onednn_max_pool_relu_blocked"] == 4 and counted.calls["max_pool2x2"] == 0
                assert counted.calls["onednn_conv2d_bias_grad64"] == (4 if sums == "float64" else 0)
    finally:
        fastpath.use(op)
    (logits, grads, evaluated), (nchw_logits, nchw_grads, nchw_evaluated) = results
    np.testing.assert_array_equal(logits, nchw_logits)
    np.testing.assert_array_equal(evaluated, nchw_evaluated)
    assert len(grads) == 12  # 4 convolutions and 2 dense layers, weights and biases
    for (name, _), a, b in zip(net.named_parameters(), grads, nchw_grads):
        np.testing.assert_array_equal(a, b, err_msg=name)


CIFAR_STEP_CODE = (
    "import paddle, paddle.nn.functional as F; from paddle_mnist.ops import onednn as o; "
    "from paddle_mnist.network import models; print(o.activate(o.prepare('onednn'), 'cpu')); paddle.seed(0); "
    "net = models.build_model('cifar_cnn', 10, (3, 32, 32)); "
    "F.cross_entropy(net(paddle.randn([6, 3, 32, 32])), paddle.randint(0, 10, [6])).backward(); print('stepped')"
)


@pytest.mark.parametrize("maps", ["", "nchw"])
def test_cifar_cnns_training_step_reorders_no_map(op, maps):
    """oneDNN's own log of a cifar_cnn training step (6 images): with its maps blocked, the only reorders of a map
    (the dims of a batch of 6) are the last pool's output to NCHW and its gradient back (fastpath.unblock), the
    others the weights'; PADDLE_MNIST_CONV_MAPS=nchw holds them as Paddle's NCHW between the layers, and the maps'
    reorders run around every convolution."""
    env = launch_env() | {"ONEDNN_VERBOSE": "1"} | ({"PADDLE_MNIST_CONV_MAPS": maps} if maps else {})
    proc = subprocess.run([sys.executable, "-c", CIFAR_STEP_CODE], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "stepped" in proc.stdout, explain(proc)
    ran = [line.split(",") for line in proc.stdout.splitlines() if ",exec," in line]
    assert sum(",convolution," in ",".join(line) for line in ran) >= 4 * 2, "the convolutions did not all run"
    reorders = [line for line in ran if "reorder" in line[:7]]  # its place moves between oneDNN's log versions
    of_maps = [line for line in reorders if line[-2].startswith("6x")]
    assert reorders, "no reorder of the weights either: is this oneDNN's log?"
    if maps == "nchw":
        assert len(of_maps) >= 8, reorders
    else:
        assert [line[-2] for line in of_maps] == ["6x64x6x6"] * 2, of_maps

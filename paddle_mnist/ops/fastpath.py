"""The seam between the networks and the operators: the one module network/ calls for its fast path.

onednn.activate puts the loaded operators here (use); every function below then runs them where they run, and
each caller keeps Paddle's own layer beside it for where they do not (another device, float16, paddle.jit.save's
tracing, or no build). What models.py and exact.py ask:

    can_run(x)             whether the operators run a convolution of x: active, float32, CPU, dygraph
    conv2d(...)            F.conv2d by onednn_conv2d(_bias) where can_run(x), else F.conv2d (so paddle.jit.save,
                           and with it Paddle Inference and ONNX, always get Paddle's); conv2d_grad64, its float64
                           backward pass
    can_pool2x2(x, ...)    whether max_pool2x2(x) runs layers.MaxPool2D's pool of x (csrc/max_pool.cc)
    can_run_blocked(l, x)  whether a network of conv modules runs x in oneDNN's layout blocked by BLOCK channels,
                           then conv_bn_relu, conv_relu_folded, max_pool_blocked and concat_blocked (csrc/blocked.cc)
    plane_sums, affine     the per-image float64 sums and per-channel scalings of batchnorm.py (csrc/batch_norm.cc)
    batch_norm_nhwc        per-worker batch norm in training of a map held NHWC (csrc/batch_norm.cc)
    kept_plans()           how many plans the operators keep: a backward pass keeps its shape's, a few dozen per
                           cache at most; evaluation keeps none, and no plan holds a buffer past its call
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import paddle
import paddle.nn.functional as F

from paddle_mnist.runtime import cpu

PLAN_CACHE_CAPACITY = 64  # plans each operator keeps (PlanCache::kCapacity in csrc/onednn_common.h)
PLAN_CACHES = 5  # the convolutions', the conv modules', the blocked max-pools', the concatenations', the unblocks'
AVX512_CORE = frozenset({"avx512f", "avx512bw", "avx512dq", "avx512vl"})  # what oneDNN's AVX-512 kernels need


def channel_block(flags: set[str] | frozenset[str], environ: dict | os._Environ = os.environ) -> int:
    """The channel block of the maps MiniGoogLeNet trains on: oneDNN's own for its convolution kernels, 16 with
    AVX-512, else 8 (docs/performance.md measures both). 8 also where ONEDNN_MAX_CPU_ISA holds oneDNN below AVX-512
    (AVX2 and older), as it holds its kernels (how a machine with AVX-512 runs the kernels of one without)."""
    isa = environ.get("ONEDNN_MAX_CPU_ISA", environ.get("DNNL_MAX_CPU_ISA", "")).upper()
    below_avx512 = isa.startswith(("SSE", "AVX2")) or isa == "AVX"
    return 16 if AVX512_CORE <= flags and not below_avx512 else 8


def _processor_flags() -> set[str]:
    try:
        return cpu.cpu_flags(Path("/proc/cpuinfo").read_text())[1]
    except OSError:
        return set()


BLOCK = channel_block(_processor_flags())


_ops = None  # the loaded operators' Python module, while active


def use(ops) -> None:
    """Route the networks through ops (the loaded operators' module), or through Paddle's layers alone (None)."""
    global _ops
    _ops = ops


def active() -> bool:
    return _ops is not None


@contextlib.contextmanager
def plain_layers():
    """Paddle's own layers for every network run inside, the operators set aside for the while: for what must see
    each layer run (the model summary's hooks), where evaluation would otherwise run blocked."""
    global _ops
    kept, _ops = _ops, None
    try:
        yield
    finally:
        _ops = kept


@paddle.jit.not_to_static  # run as it is while paddle.jit.save traces the network: False there
def can_run(x: paddle.Tensor) -> bool:
    """Whether conv2d(x, ...) runs by oneDNN: the operator is active and x is a float32 CPU tensor in dygraph."""
    return _ops is not None and x.dtype == paddle.float32 and paddle.in_dynamic_mode() and x.place.is_cpu_place()


@paddle.jit.not_to_static  # run as it is while paddle.jit.save traces the network: it then takes F.conv2d
def conv2d(
    x: paddle.Tensor,
    weight: paddle.Tensor,
    stride: int,
    padding: int,
    bias: paddle.Tensor | None = None,
    block: int = 0,
) -> paddle.Tensor:
    """F.conv2d(x, weight, bias, stride, padding), by oneDNN where it runs (can_run(x)). There x may be blocked
    ([N, C/B, H, W, B]), and block 8 or 16 gives the output blocked by that many channels (0: NCHW): a network
    whose maps stay blocked between convolutions skips the reorders to and from Paddle's NCHW around each."""
    if can_run(x):
        if bias is None:
            return _ops.onednn_conv2d(x, weight, stride, padding, not x.stop_gradient, block)
        return _ops.onednn_conv2d_bias(x, weight, bias, stride, padding, not x.stop_gradient, block)
    assert block == 0 and x.ndim == 4, "blocked maps run only where the operators do (can_run)"
    return F.conv2d(x, weight, bias, stride=stride, padding=padding)


@paddle.jit.not_to_static
def conv2d_grad64(
    x: paddle.Tensor, weight: paddle.Tensor, grad_out: paddle.Tensor, stride: int, padding: int, bias: bool
) -> list[paddle.Tensor]:
    """conv2d's backward pass where can_run(x): the input's gradient in float32, the weights' (and the bias's) summed
    over the batch in float64 (exact.py adds them up over micro-batches and workers before it rounds them), then
    those rounded to float32."""
    op = _ops.onednn_conv2d_bias_grad64 if bias else _ops.onednn_conv2d_grad64
    return op(x, weight, grad_out, stride, padding, not x.stop_gradient)


@paddle.jit.not_to_static
def rows_matmul(x: paddle.Tensor, w: paddle.Tensor, transpose_y: bool, rows: int) -> paddle.Tensor:
    """x @ w (x 2-D; w transposed where asked) by csrc/matmul.cc where can_run(x): one product of `rows` rows at a
    time, the blocks shared among the process's threads, each row's result the same bits in any batch, at any place
    in it, on any number of threads (exact.by_rows)."""
    return _ops.onednn_rows_matmul(x, w, transpose_y, rows)


@paddle.jit.not_to_static
def dense_backward(x: paddle.Tensor, w: paddle.Tensor, grad_out: paddle.Tensor, input_grad: bool, rows: int) -> list:
    """A dense layer's backward pass where can_run(x), x [m, k], w [k, n], grad_out [m, n] (csrc/matmul.cc): the
    input's gradient as rows_matmul(grad_out, w, True, rows) gives it (zeros where input_grad is false), the weights'
    and the bias's gradients summed over the rows in float64, and those two rounded to float32."""
    return _ops.onednn_dense_backward(x, w, grad_out, input_grad, rows)


@paddle.jit.not_to_static  # as it is in paddle.jit.save's trace too: the reshapes keep the batch free
def add_channel_bias(x: paddle.Tensor, bias: paddle.Tensor) -> paddle.Tensor:
    """x (N, C, H, W) + bias (C,) per channel, broadcast as (N, C, H*W) + (C, 1): the same sums, faster.

    Paddle's CPU kernels broadcast a (1, C, 1, 1) bias along a slow path; a trailing (C, 1) takes the fast one, for
    the add and for its gradient (docs/performance.md). The 0s in reshape keep the batch size as it comes, so the
    exported model takes any batch.
    """
    _, c, h, w = x.shape
    return (x.reshape([0, c, h * w]) + bias.reshape([c, 1])).reshape([0, c, h, w])


def can_pool2x2(x: paddle.Tensor, kernel: int, stride: int, padding: int, ceil_mode: bool) -> bool:
    """Whether max_pool2x2(x) computes F.max_pool2d(x, kernel, stride, padding, ceil_mode): a 2x2 window of stride
    2 without padding, in floor mode, where the operator runs (can_run(x))."""
    return kernel == 2 and stride == 2 and padding == 0 and not ceil_mode and can_run(x)


@paddle.jit.not_to_static
def max_pool2x2(x: paddle.Tensor) -> paddle.Tensor:
    """F.max_pool2d(x, 2, 2) by the operator of csrc/max_pool.cc; for where can_pool2x2(x, ...) holds."""
    return _ops.max_pool2x2(x)[0]


def can_run_blocked(layer: paddle.nn.Layer, x: paddle.Tensor) -> bool:
    """Whether a network of conv modules runs x in oneDNN's layout blocked by BLOCK channels (csrc/blocked.cc): in
    training (conv_bn_relu), and in evaluation without gradients (conv_relu_folded), where the operators run
    (can_run(x)); max_pool_blocked and concat_blocked then run too."""
    return can_run(x) and (layer.training or not paddle.is_grad_enabled())


@paddle.jit.not_to_static
def conv_bn_relu(
    x: paddle.Tensor, conv: paddle.nn.Conv2D, norm: paddle.nn.BatchNorm2D, ops=None, block: int | None = None
) -> paddle.Tensor:
    """relu(norm(conv(x))) in training, by oneDNN: x NCHW or blocked [N, C/B, H, W, B], the output blocked by B
    channels: x's block where it is blocked, else `block` (BLOCK when None).

    The batch norm normalises by the batch's mean and biased variance, and its running averages move as Paddle's
    do: running = momentum * running + (1 - momentum) * batch. conv is a layers.Conv2D (its geometry); ops, the
    operators' module where it is not the active one (selfcheck).
    """
    stride, padding = conv.geometry["stride"], conv.geometry["padding"]
    out, _, mean, variance = (ops or _ops).onednn_conv_bn_relu(
        x,
        conv.weight,
        conv.bias,
        norm.weight,
        norm.bias,
        stride,
        padding,
        norm._epsilon,
        not x.stop_gradient,
        x.shape[4] if x.ndim == 5 else block or BLOCK,
    )
    _move_running(norm, mean, variance)
    return out


def _move_running(norm: paddle.nn.BatchNorm2D, mean: paddle.Tensor, variance: paddle.Tensor) -> None:
    """norm's running averages moved by a batch's mean and biased variance, as Paddle's batch norm moves them."""
    with paddle.no_grad():
        m = norm._momentum
        paddle.assign(norm._mean * m + mean * (1 - m), norm._mean)
        paddle.assign(norm._variance * m + variance * (1 - m), norm._variance)


@paddle.jit.not_to_static
def batch_norm_nhwc(x: paddle.Tensor, norm: paddle.nn.BatchNorm2D) -> paddle.Tensor:
    """norm(x) in training for a map held NHWC (channels last: [N, 1, H, W, C]), by the batch's mean and biased
    variance (csrc/batch_norm.cc's bn_nhwc; Paddle's own ran twice as slowly as on NCHW); the running averages
    move as conv_bn_relu's."""
    y, mean, variance = _ops.bn_nhwc(x, norm.weight, norm.bias, norm._epsilon)
    _move_running(norm, mean, variance)
    return y


@paddle.jit.not_to_static
def conv_relu_folded(
    x: paddle.Tensor, conv: paddle.nn.Conv2D, norm: paddle.nn.BatchNorm2D, ops=None, block: int | None = None
) -> paddle.Tensor:
    """relu(norm(conv(x))) in evaluation, by oneDNN: batch norm by its running statistics, folded into the
    convolution's weights and bias, ReLU as the convolution's post-op; x NCHW or blocked, the output blocked as
    conv_bn_relu's. No gradient: for where paddle.no_grad() holds (can_run_blocked)."""
    scale = norm.weight / paddle.sqrt(norm._variance + norm._epsilon)
    weight = conv.weight * scale.reshape([-1, 1, 1, 1])
    bias = (conv.bias - norm._mean) * scale + norm.bias
    stride, padding = conv.geometry["stride"], conv.geometry["padding"]
    block = x.shape[4] if x.ndim == 5 else block or BLOCK
    return (ops or _ops).onednn_conv_relu_blocked(x, weight, bias, stride, padding, block)


@paddle.jit.not_to_static
def max_pool_blocked(x: paddle.Tensor, kernel: int, stride: int, ops=None, relu: bool = False) -> paddle.Tensor:
    """F.max_pool2d(x, kernel, stride) of a blocked map [N, C/B, H, W, B] (no padding, floor mode), by oneDNN; with
    relu, F.relu of it, in the same operator (and one gradient operator)."""
    op = (ops or _ops).onednn_max_pool_relu_blocked if relu else (ops or _ops).onednn_max_pool_blocked
    return op(x, kernel, stride)[0]


@paddle.jit.not_to_static
def concat_blocked(a: paddle.Tensor, b: paddle.Tensor, ops=None) -> paddle.Tensor:
    """paddle.concat([a, b], axis=1) of two blocked maps, by oneDNN on every thread (Paddle's copies on one), and
    its gradient split in place from the output's."""
    return (ops or _ops).onednn_concat_blocked(a, b)


def plane_sums(a: paddle.Tensor, b: paddle.Tensor | None = None) -> paddle.Tensor:
    """[N, 2C] float64 of a (and b) [N, C, H, W] float32: each image's per-channel sum of a, then of a * b (a * a
    without b), each plane's in one order whatever the batch (csrc/batch_norm.cc); by Paddle's operators where the
    custom ones do not run (another order: the last bits of float64 differ)."""
    if can_run(a):
        return _ops.bn_plane_sums(a) if b is None else _ops.bn_plane_sums2(a, b)
    n, c, h, w = a.shape
    wide = a.reshape([0, c, h * w]).astype("float64")
    other = wide if b is None else b.reshape([0, c, h * w]).astype("float64")
    return paddle.concat([wide.sum(axis=2), (wide * other).sum(axis=2)], axis=1)


def affine(x: paddle.Tensor, a: paddle.Tensor, b: paddle.Tensor, g=None, c=None) -> paddle.Tensor:
    """x * a + b per channel of x [N, C, H, W] float32 (a, b float32 [C]); with g and c, g * a + x * b + c, added in
    that order. The same bits by csrc/batch_norm.cc and by Paddle's operators (each product and sum rounded)."""
    if can_run(x):
        return _ops.bn_affine(x, a, b) if g is None else _ops.bn_affine2(g, x, a, b, c)
    n, ch, h, w = x.shape
    flat, col = x.reshape([0, ch, h * w]), (lambda v: v.reshape([ch, 1]))
    if g is None:
        return (flat * col(a) + col(b)).reshape([0, ch, h, w])
    return (g.reshape([0, ch, h * w]) * col(a) + flat * col(b) + col(c)).reshape([0, ch, h, w])


def _count(counter) -> int:
    """The value of one of the operators' counters (its input is not read; a custom operator takes one)."""
    return int(counter(paddle.zeros([1])).numpy()[0])


def kept_plans(ops=None) -> int:
    """How many plans (primitives made for one shape) the operators' caches keep, all together. Only backward
    passes keep one, and each cache keeps at most PLAN_CACHE_CAPACITY (csrc/onednn_common.h's PlanCache)."""
    return _count((ops or _ops).onednn_kept_plans)


def reference_kernels(ops=None) -> int:
    """How many convolution primitives this process made on oneDNN's reference loops (note_kernel in
    csrc/onednn_common.h): selfcheck.check refuses a build that makes any."""
    return _count((ops or _ops).onednn_reference_kernels)


def unblock(x: paddle.Tensor) -> paddle.Tensor:
    """A blocked map [N, C/B, H, W, B] as NCHW (the maps after the last pool, tests and checks): by oneDNN's reorder
    where the operators run, its gradient blocked again by it. Paddle 3's transpose gives a strided view, which its
    kernels then read, or copy, value by value: mnist_cnn's last map (63,000 values) took 0.6 ms so (Zen 4)."""
    if can_run(x):
        return _ops.onednn_unblock(x)
    n, cb, h, w, b = x.shape
    return x.transpose([0, 1, 4, 2, 3]).reshape([n, cb * b, h, w])

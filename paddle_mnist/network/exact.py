"""A step's gradient summed in float64: the same float32 weights whether its images ran in one batch, in
micro-batches (--accum-steps) or on N workers.

An image's output and input gradient are the same bits in any batch: the oneDNN convolutions and the max-pools run
the same kernels per image whatever the batch's size (tests/test_onednn.py), and the dense layers here multiply
their rows in blocks of ROWS (by_rows; small layers in float64, rounded once): MKL adds a float32 matrix product's
terms in an order that changes with its number of rows, so products of a fixed ROWS rows give each row the same
bits wherever it stands. What a batch split changes is only how the images' gradients are grouped when their sums
are added: float32 rounds each grouping differently, by 1e-7 of the gradient, and training can amplify that where a
value sits within rounding of a max-pool's tie or ReLU's 0 (docs/training.md). So the layers below hand their
weights' and biases' gradients over in float64: the convolutions' summed image by image (csrc/onednn_conv.cc,
onednn_conv2d_grad64), the dense layers' and the bias adds' by float64 matrix products (products of float32 values
are exact there, their sums round 2^-29 of float32's) and sums. Summing collects them over a step's micro-batches;
the trainer all-reduces the collected sums over the workers in float64 and rounds each to float32 once
(Sums.gradients). The float64 rounding of a sum differs with its order by about 1e-16 of it, which reaches the
rounded float32 only where the sum falls that close to a float32 rounding boundary.

    summing(sums)       inside, the layers below add their float64 gradients to sums
    active()            whether a Sums collects now, in a pass with gradients; collecting(): inside summing
    hand_over(p, g)     a layer's float64 gradient g of parameter p to the Sums (batchnorm.py's too)
    conv2d, linear, add_channel_bias
                        what layers.Conv2D and layers.Linear call while a Sums collects (active()): the outputs
                        of fastpath.conv2d, F.linear and fastpath.add_channel_bias, with their gradients handed over
                        in float64
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import paddle
import paddle.nn.functional as F
from paddle.autograd import PyLayer

from paddle_mnist.ops import fastpath
from paddle_mnist.runtime import cpu

_sums: Sums | None = None


class Sums:
    """Each parameter's gradient over one step's images in float64, as the layers' backward passes hand it over."""

    def __init__(self) -> None:
        self.by_param: dict[int, tuple[paddle.Tensor, paddle.Tensor]] = {}
        self.summed = False  # whether a parameter's sum has more than one part (micro-batches, a shared layer)

    def add(self, param: paddle.Tensor, grad: paddle.Tensor) -> None:
        if param.stop_gradient:
            return
        kept = self.by_param.get(id(param))
        self.summed = self.summed or kept is not None
        self.by_param[id(param)] = (param, grad if kept is None else kept[1] + grad)

    def gradients(self, params: list, all_reduce: Callable[[list[paddle.Tensor]], None] | None) -> None:
        """Set every trainable parameter's gradient to its sum over the step's images on all workers, rounded to
        float32 once: all_reduce sums each float64 sum over the workers in place (None: this worker's images are
        the step's). A trainable parameter without a float64 sum is a layer outside this module, whose float32
        gradient would break the promise: RuntimeError."""
        trainable = [p for p in params if not p.stop_gradient and p.grad is not None]
        missing = [p.name for p in trainable if id(p) not in self.by_param]
        if missing or not trainable:
            raise RuntimeError(f"no float64 gradient sum for the parameters {missing} (a layer outside exact.py)")
        if all_reduce is None and not self.summed:
            # each gradient came in one part, which hand_over gave autograd rounded to float32 once, into a
            # gradient cleared to zero: it already holds the rounded sum (a copy and a cast each the fewer)
            return
        sums = [self.by_param[id(p)][1] for p in trainable]
        rounded = getattr(all_reduce, "rounded", None)  # runtime/distributed.py's SumEach: the sum and the rounding
        if rounded is not None and rounded(sums, [p.grad for p in trainable]):  # in one pass, into the gradients
            return
        if all_reduce is not None:
            all_reduce(sums)
        for p, total in zip(trainable, sums):
            paddle.assign(total.astype("float32"), output=p.grad)


@contextlib.contextmanager
def summing(sums: Sums | None) -> Iterator[None]:
    """The layers below add their float64 gradients to sums inside (nothing changes with None)."""
    global _sums
    kept, _sums = _sums, sums if sums is not None else _sums
    try:
        yield
    finally:
        _sums = kept


@paddle.jit.not_to_static  # False while paddle.jit.save traces the network: it gets Paddle's own layers
def active() -> bool:
    return _sums is not None and paddle.in_dynamic_mode() and paddle.is_grad_enabled()


def collecting() -> bool:
    """Whether a Sums collects the layers' float64 gradients now (inside summing)."""
    return _sums is not None


def hand_over(param: paddle.Tensor, grad: paddle.Tensor, rounded: paddle.Tensor | None = None) -> paddle.Tensor | None:
    """The float64 gradient to the step's Sums; its float32 rounding (`rounded` where the operator gave it) to
    autograd (Sums.gradients replaces it)."""
    if param.stop_gradient:
        return None
    if _sums is not None:
        _sums.add(param, grad)
    return grad.astype("float32") if rounded is None else rounded


def _wide(t: paddle.Tensor) -> paddle.Tensor:
    return t.astype("float64")


ROWS = 16  # the dense layers' block of rows: a 1,600 by 512 layer (cifar_cnn's at 28x28), 64 rows forward by
# oneDNN, 0.37 ms on 2 threads at 16, 0.33 at 32 (one block a thread at 32 images a worker), 0.49 at 8
# (scripts/rows_product.py)
# Without the oneDNN operators, smaller weights multiply in float64 and round once, as fast as Paddle's blocks there:
# mnist_cnn's 980 by 10 layer (its exact path read 0.97 and 0.96 of float32 at 1x1 and 2x1 so, 0.96 and 0.93 in
# blocks; Zen 4). By oneDNN its blocks take 0.02 ms against 0.04 in float64 (1 thread).
BLOCKS_FROM = 65536


def by_rows(x: paddle.Tensor, w: paddle.Tensor, transpose_y: bool = False) -> paddle.Tensor:
    """x @ w (w transposed where asked) in float32, one product of ROWS rows at a time (the last block padded with
    zeros): each row's result the same bits in any batch, at any place in it, in a process of any number of threads
    (tests/test_exact.py). One product of all the rows is not (a GEMM's order of adding changes with their number),
    nor is Paddle's batched product of blocks, which it makes one product again. Where the oneDNN operators run, one
    oneDNN matmul a block, the blocks shared among the process's threads (csrc/matmul.cc); elsewhere one Paddle
    product a block, on one thread. A 1,600 by 512 layer (cifar_cnn's at 28x28), 64 rows forward, on an AMD EPYC
    with AVX-512 with the trainer's settings: 0.37 ms so on 2 threads, 0.65 on 1, against 1.1 in Paddle's blocks
    and 0.47 and 1.0 for Paddle's one product of all the rows (scripts/rows_product.py)."""
    shape, k = x.shape, x.shape[-1]
    rows = x.reshape([-1, k])
    if fastpath.can_run(rows) and w.dtype == paddle.float32:
        y = fastpath.rows_matmul(rows, w, transpose_y, ROWS)
        return y.reshape([*shape[:-1], y.shape[-1]])
    n = rows.shape[0]
    if n % ROWS:
        rows = paddle.concat([rows, paddle.zeros([ROWS - n % ROWS, k], rows.dtype)])
    with cpu.one_thread():  # on 2 threads MKL splits a product so that its order changes too
        blocks = [paddle.matmul(rows[i : i + ROWS], w, transpose_y=transpose_y) for i in range(0, rows.shape[0], ROWS)]
    y = paddle.concat(blocks) if len(blocks) > 1 else blocks[0]
    return y[:n].reshape([*shape[:-1], y.shape[-1]])


def _product(x: paddle.Tensor, w: paddle.Tensor, bias=None, transpose_y: bool = False) -> paddle.Tensor:
    """x @ w (w transposed where asked), plus bias where given, each row the same bits in any batch: by_rows, or for
    a small w in float64, the bias added there too, rounded once."""
    if w.size >= BLOCKS_FROM or fastpath.can_run(x):
        y = by_rows(x, w, transpose_y)
        return y if bias is None else y + bias
    y = paddle.matmul(_wide(x), _wide(w), transpose_y=transpose_y)
    return (y if bias is None else y + _wide(bias)).astype("float32")


def _dense_backward(ctx, grad_out) -> tuple:
    """(the input's gradient, the weights', the bias's) of x @ weight + bias, the weights' and the bias's handed
    over: by one operator where it runs (fastpath.dense_backward), else by Paddle's in float64."""
    (x,), weight, bias = ctx.saved_tensor(), ctx.weight, ctx.bias
    k, n = x.shape[-1], grad_out.shape[-1]
    if fastpath.can_run(x) and weight.dtype == paddle.float32:
        rows, g = x.reshape([-1, k]), grad_out.reshape([-1, n])
        grad_x, grad_w, grad_b, rounded_w, rounded_b = fastpath.dense_backward(
            rows, weight, g, not x.stop_gradient, ROWS
        )
        grad_x = None if x.stop_gradient else grad_x.reshape(x.shape)
        return (
            grad_x,
            hand_over(weight, grad_w, rounded_w),
            None if bias is None else hand_over(bias, grad_b, rounded_b),
        )
    g = _wide(grad_out).reshape([-1, n])
    grad_x = None if x.stop_gradient else _product(grad_out, weight, transpose_y=True)
    grad_w = paddle.matmul(_wide(x).reshape([-1, k]), g, transpose_x=True)
    return grad_x, hand_over(weight, grad_w), None if bias is None else hand_over(bias, g.sum(axis=0))


class _Linear(PyLayer):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x)
        ctx.weight, ctx.bias = weight, bias  # the parameters themselves: Sums knows them by identity
        return _product(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        return _dense_backward(ctx, grad_out)


class _LinearNoBias(PyLayer):
    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x)
        ctx.weight, ctx.bias = weight, None
        return _product(x, weight)

    @staticmethod
    def backward(ctx, grad_out):
        return _dense_backward(ctx, grad_out)[:2]


class _ChannelBias(PyLayer):
    @staticmethod
    def forward(ctx, x, bias):
        ctx.bias = bias
        return fastpath.add_channel_bias(x, bias)

    @staticmethod
    def backward(ctx, grad_out):
        # each image's per-channel sum in float64 (csrc/batch_norm.cc: one order whatever the batch), then over the
        # images: a float64 copy of the whole map and Paddle's sum over three axes took 1.9 ms of mnist_cnn's step
        c = grad_out.shape[1]
        return grad_out, hand_over(ctx.bias, fastpath.plane_sums(grad_out)[:, :c].sum(axis=0))


class _Conv2D(PyLayer):
    @staticmethod
    def forward(ctx, x, weight, stride, padding, block):
        ctx.save_for_backward(x)
        ctx.geometry, ctx.weight = (stride, padding), weight
        return fastpath.conv2d(x, weight, stride, padding, block=block)

    @staticmethod
    def backward(ctx, grad_out):
        (x,), weight = ctx.saved_tensor(), ctx.weight
        grad_x, grad_w, rounded_w = fastpath.conv2d_grad64(x, weight, grad_out, *ctx.geometry, bias=False)
        return (None if x.stop_gradient else grad_x), hand_over(weight, grad_w, rounded_w)


class _Conv2DBias(PyLayer):
    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, block):
        ctx.save_for_backward(x)
        ctx.geometry, ctx.weight, ctx.bias = (stride, padding), weight, bias
        return fastpath.conv2d(x, weight, stride, padding, bias=bias, block=block)

    @staticmethod
    def backward(ctx, grad_out):
        (x,), weight = ctx.saved_tensor(), ctx.weight
        grad_x, grad_w, grad_b, rounded_w, rounded_b = fastpath.conv2d_grad64(
            x, weight, grad_out, *ctx.geometry, bias=True
        )
        grad_x = None if x.stop_gradient else grad_x
        return grad_x, hand_over(weight, grad_w, rounded_w), hand_over(ctx.bias, grad_b, rounded_b)


def linear(x: paddle.Tensor, weight: paddle.Tensor, bias: paddle.Tensor | None) -> paddle.Tensor:
    """F.linear(x, weight, bias); while a Sums collects, multiplied by_rows (each row's result the same bits
    whatever the rows around it), the weights' and bias's gradients handed over in float64."""
    if active():
        return _Linear.apply(x, weight, bias) if bias is not None else _LinearNoBias.apply(x, weight)
    return F.linear(x, weight, bias)


def add_channel_bias(x: paddle.Tensor, bias: paddle.Tensor) -> paddle.Tensor:
    """fastpath.add_channel_bias; while a Sums collects, the bias's gradient handed over in float64."""
    if active():
        return _ChannelBias.apply(x, bias)
    return fastpath.add_channel_bias(x, bias)


def conv2d(x: paddle.Tensor, weight: paddle.Tensor, stride: int, padding: int, bias=None, block=0) -> paddle.Tensor:
    """fastpath.conv2d; while a Sums collects and the operator runs x, the weights' (and bias's) gradient handed
    over in float64 (the operator's gradient comes in the output's layout: NCHW, or blocked by `block`)."""
    if not (active() and fastpath.can_run(x)):
        return fastpath.conv2d(x, weight, stride, padding, bias=bias, block=block)
    if bias is None:
        return _Conv2D.apply(x, weight, stride, padding, block)
    return _Conv2DBias.apply(x, weight, bias, stride, padding, block)

"""The start-up check of a build: every operator against Paddle's own layers before a run uses it.

onednn.activate runs check(ops) on the loaded operators, and the build runs it once in its child process, so a
build that gives other numbers than Paddle's, or whose convolutions run on oneDNN's reference loops, is never used:
the trainer takes Paddle's layers and logs the reason (Refused's message).
"""

from __future__ import annotations

import numpy as np
import paddle
import paddle.nn.functional as F

from paddle_mnist.ops.fastpath import (
    BLOCK,
    concat_blocked,
    conv_bn_relu,
    conv_relu_folded,
    max_pool_blocked,
    reference_kernels,
    unblock,
)

# float32 sums in another order: within 1e-4 of each value, or of the largest where values cancel to near 0
CHECK_RTOL, CHECK_ATOL = 1e-4, 1e-4


class Refused(Exception):
    """A build's operators give other numbers than Paddle's layers, or run too slowly to use: the message says which."""


def check(ops) -> None:
    """Both convolutions against F.conv2d on two small geometries (padded, strided and not), outputs and every
    gradient, the max-pool against F.max_pool2d (check_max_pool) and the blocked operators (check_blocked).
    Refused where they differ, or where a convolution ran on oneDNN's reference loops (right, and slow): such a
    build is not used."""
    rng = paddle.get_rng_state()
    try:
        paddle.seed(0)
        for stride, padding, side, kernel in ((1, 2, 9, 5), (2, 0, 10, 3)):
            x, w, b = paddle.randn([2, 3, side, side]), paddle.randn([4, 3, kernel, kernel]), paddle.randn([4])
            cases = (
                ("", lambda: ops.onednn_conv2d(x, w, stride, padding, True, 0), None),  # noqa: B023 (called here)
                (" with a bias", lambda: ops.onednn_conv2d_bias(x, w, b, stride, padding, True, 0), b),  # noqa: B023
            )
            for which, ours, bias in cases:
                got = _output_and_grads(ours, x, w, bias)
                want = _output_and_grads(lambda: F.conv2d(x, w, bias, stride, padding), x, w, bias)  # noqa: B023
                names = ("output", "input gradient", "weight gradient", "bias gradient")
                for name, a, e in zip(names, got, want):
                    if a.shape != e.shape or not np.allclose(a, e, rtol=CHECK_RTOL, atol=CHECK_ATOL * np.abs(e).max()):
                        raise Refused(f"its {name} differs from F.conv2d's{which} (stride {stride}, padding {padding})")
        check_max_pool(ops)
        check_blocked(ops)
        if slow := reference_kernels(ops):
            raise Refused(
                f"oneDNN has only its reference loops, which go element by element, for {slow} of the checked "
                "convolutions on this processor (no JIT kernel for their layouts): Paddle's run faster"
            )
    finally:
        paddle.set_rng_state(rng)


def check_max_pool(ops) -> None:
    """max_pool2x2 against F.max_pool2d, to the bit, outputs and input gradients: ties, NaN, infinities and a
    window of -inf, on maps with even and odd sides, and rows of fewer than 4 outputs and of a number not a
    multiple of 4."""
    for shape in ([2, 3, 9, 9], [2, 3, 7, 6], [1, 2, 14, 15]):
        x = paddle.round(paddle.randn(shape) * 2) / 2  # halves: many windows hold their maximum twice
        x[0, 0, 0, 0], x[0, 1, 4, 4], x[-1, -1, -1, -2] = float("nan"), float("inf"), float("nan")
        x[0, 0, 2:4, 2:4] = float("-inf")
        got = _output_and_grads(lambda: ops.max_pool2x2(x)[0], x)  # noqa: B023 (called here)
        want = _output_and_grads(lambda: F.max_pool2d(x, 2, 2), x)  # noqa: B023
        for name, a, e in zip(("output", "input gradient"), got, want):
            if a.shape != e.shape or not np.array_equal(a, e, equal_nan=True):
                raise Refused(f"its max-pool {name} differs from F.max_pool2d's (a {shape[2]}x{shape[3]} map)")


def check_blocked(ops) -> None:
    """The blocked operators (csrc/blocked.cc) against Paddle's layers: a conv module on an NCHW image and on a
    blocked map (3x3, stride 2, unpadded: oneDNN's right padding is then negative), outputs, every gradient and the
    running statistics in training, outputs in evaluation; the concatenation of two blocked maps, to the bit; and
    the 3x3 max-pool of stride 2 on a map of odd side."""
    from paddle import nn

    image, blocked_map = paddle.randn([2, 3, 9, 9]), paddle.randn([2, 32 // BLOCK, 9, 9, BLOCK])
    for x, stride, padding in ((image, 1, 1), (blocked_map, 2, 0)):
        with paddle.utils.unique_name.guard():  # names of their own: the model's parameters, built later, keep theirs
            conv, norm = nn.Conv2D(_channels(x), 32, 3, stride=stride, padding=padding), nn.BatchNorm2D(32)
        conv.geometry = {"stride": stride, "padding": padding}
        norm.weight.set_value(paddle.rand([32]) + 0.5)
        norm.bias.set_value(paddle.randn([32]))
        params = (conv.weight, conv.bias, norm.weight, norm.bias)
        ours = _output_and_grads(lambda: unblock(conv_bn_relu(x, conv, norm, ops)), x, *params)  # noqa: B023
        ours += [norm._mean.numpy(), norm._variance.numpy()]
        norm._mean.set_value(paddle.zeros([32]))
        norm._variance.set_value(paddle.ones([32]))
        want = _output_and_grads(lambda: F.relu(norm(conv(unblock(x) if x.ndim == 5 else x))), x, *params)  # noqa: B023
        want += [norm._mean.numpy(), norm._variance.numpy()]
        names = ("output", "input", "weight", "bias", "scale", "shift", "running mean", "running variance")
        for name, a, e in zip(names, ours, want):
            # the convolution's bias gradient is 0 but for rounding (batch norm subtracts the mean): compared to 1
            if a.shape != e.shape or not np.allclose(a, e, rtol=CHECK_RTOL, atol=CHECK_ATOL * max(np.abs(e).max(), 1)):
                raise Refused(f"its conv module's {name} differs from Paddle's layers' (stride {stride})")
        norm._mean.set_value(paddle.randn([32]))
        norm._variance.set_value(paddle.rand([32]) + 0.5)
        norm.eval()
        with paddle.no_grad():
            got = unblock(conv_relu_folded(x, conv, norm, ops)).numpy()
            expected = F.relu(norm(conv(unblock(x) if x.ndim == 5 else x))).numpy()
        if got.shape != expected.shape or not np.allclose(got, expected, rtol=CHECK_RTOL, atol=CHECK_ATOL):
            raise Refused(f"its conv module in evaluation differs from Paddle's layers' (stride {stride})")
    other = paddle.randn([2, 1, 9, 9, BLOCK])
    got = _output_and_grads(lambda: unblock(concat_blocked(blocked_map, other, ops)), blocked_map, other)
    want = _output_and_grads(lambda: paddle.concat([unblock(blocked_map), unblock(other)], axis=1), blocked_map, other)
    if any(a.shape != e.shape or not np.array_equal(a, e) for a, e in zip(got, want)):
        raise Refused("its blocked concatenation differs from paddle.concat's")
    got = _output_and_grads(lambda: unblock(max_pool_blocked(blocked_map, 3, 2, ops)), blocked_map)
    want = _output_and_grads(lambda: F.max_pool2d(unblock(blocked_map), 3, 2), blocked_map)
    for name, a, e in zip(("output", "input gradient"), got, want):
        if a.shape != e.shape or not np.allclose(a, e, rtol=CHECK_RTOL, atol=CHECK_ATOL * np.abs(e).max()):
            raise Refused(f"its blocked max-pool {name} differs from F.max_pool2d's")


def _channels(x: paddle.Tensor) -> int:
    return x.shape[1] * x.shape[4] if x.ndim == 5 else x.shape[1]


def _output_and_grads(run, *inputs: paddle.Tensor | None) -> list[np.ndarray]:
    """run()'s output and the gradients of sum(output * cos(output)) for each of the inputs given (None: left out):
    a loss whose gradient differs from place to place."""
    inputs = [t for t in inputs if t is not None]
    for t in inputs:
        t.stop_gradient = False
    y = run()
    (y * paddle.cos(y)).sum().backward()
    grads = [t.grad.numpy() for t in inputs]
    for t in inputs:
        t.clear_gradient()
    return [y.numpy(), *grads]

"""The layers the networks are built of: nn.Conv2D, nn.Linear and nn.MaxPool2D with the same parameters, names and
outputs, whose work runs by the oneDNN operators where they are active (ops/fastpath.py) and whose gradients a step
sums in float64 where the trainer asks (exact.py); conv_relu_pool, the tutorial CNN's block in the order that does
least work.
"""

from __future__ import annotations

import paddle
import paddle.nn.functional as F
from paddle import nn

from paddle_mnist.network import exact
from paddle_mnist.ops import fastpath


class Conv2D(nn.Conv2D):
    """nn.Conv2D (same parameters, same names, same output) whose convolution, in float32 CPU training, runs by
    oneDNN where onednn.activate made that possible, with the bias added inside it; elsewhere Paddle's convolution
    runs and fastpath.add_channel_bias adds the bias. While a step sums its gradients in float64 (exact.active),
    exact.py wraps the same operators and hands the weights' gradients over."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1, padding: int = 0, **kw):
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, padding=padding, **kw)
        self.geometry = {"stride": stride, "padding": padding}

    def convolve(self, x: paddle.Tensor) -> paddle.Tensor:
        """The convolution without the bias."""
        return (exact.conv2d if exact.active() else fastpath.conv2d)(x, self.weight, **self.geometry)

    def add_bias(self, y: paddle.Tensor) -> paddle.Tensor:
        if self.bias is None:
            return y
        return exact.add_channel_bias(y, self.bias) if exact.active() else fastpath.add_channel_bias(y, self.bias)

    def fused(self, x: paddle.Tensor) -> bool:
        """Whether oneDNN adds the bias inside the convolution of x (its kernel adds it as it writes the output,
        and sums its gradient in the weights' backward pass: Paddle's add and its gradient no longer run)."""
        return self.bias is not None and fastpath.can_run(x)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        if not self.fused(x):
            return self.add_bias(self.convolve(x))
        return self.blocked(x, 0)

    def blocked(self, x: paddle.Tensor, block: int) -> paddle.Tensor:
        """forward(x) with x NCHW or blocked [N, C/B, H, W, B], the output blocked by `block` channels (0: NCHW);
        where fused(x)."""
        convolve = exact.conv2d if exact.active() else fastpath.conv2d
        return convolve(x, self.weight, bias=self.bias, block=block, **self.geometry)


class Linear(nn.Linear):
    """nn.Linear (same parameters, same names, same output) whose gradients a step sums in float64 where the
    trainer asks it to (exact.py: N workers equal one process)."""

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        if exact.active():
            return exact.linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class MaxPool2D(nn.MaxPool2D):
    """nn.MaxPool2D that, in training, also keeps where each window's maximum was: the same output, and a backward
    pass that only scatters (docs/performance.md has its cost against Paddle's).

    For 2x2 windows of stride 2 where the custom operators are active (fastpath.can_pool2x2: float32 CPU training), that
    is the max_pool2x2 operator of csrc/max_pool.cc, which runs four windows at a time and matches F.max_pool2d to
    the bit, NaN included. Elsewhere it is Paddle's kernel with the mask, as follows.

    Paddle's max-pool backward on the CPU searches every window again for the input equal to its maximum; the
    kernel that returns the mask records that position in the forward pass (the first maximum, as the search
    finds), so the gradient goes to the same input, to the bit. In evaluation, and so in the exported model, it is
    nn.MaxPool2D's own forward, which Paddle Inference and ONNX know.

    A window with nothing above -FLT_MAX (all NaN or -inf: a step whose loss diverged) gets no position, -1, and
    Paddle's CPU backward would add its gradient at that offset, outside the tensor, corrupting the heap. Such a
    pass is run again by nn.MaxPool2D, whose backward only adds where an input equals the window's output: the
    check reads the mask's minimum (a reduction over a quarter of the input, on the CPU only; the GPU backward
    matches positions and never writes at -1).
    """

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        # nn.MaxPool2D named: Paddle 2.6's paddle.jit.save rewrites this method, and super() without arguments
        # then finds no class to start from
        if not self.training or self.return_mask or self.data_format != "NCHW":
            return nn.MaxPool2D.forward(self, x)
        kernel, stride, padding = (_square(v) for v in (self.ksize, self.stride or self.ksize, self.padding))
        if None not in (kernel, stride, padding) and fastpath.can_pool2x2(x, kernel, stride, padding, self.ceil_mode):
            return fastpath.max_pool2x2(x)
        out, mask = F.max_pool2d(
            x, self.ksize, self.stride, self.padding, ceil_mode=self.ceil_mode, return_mask=True, name=self.name
        )
        if x.place.is_cpu_place() and int(mask.min()) < 0:
            return nn.MaxPool2D.forward(self, x)
        return out


def _square(v: int | list | tuple) -> int | None:
    """A pooling setting given as one int, or as a pair of equal ones: that int; else None."""
    if isinstance(v, int):
        return v
    return v[0] if isinstance(v, (list, tuple)) and len(v) == 2 and v[0] == v[1] and isinstance(v[0], int) else None


def conv_relu_pool(x: paddle.Tensor, conv: Conv2D, pool: nn.MaxPool2D) -> paddle.Tensor:
    """pool(relu(conv(x))), computed as relu(pool(conv(x) without bias) + bias): the same result with less work.

    Adding a per-channel constant and ReLU never lower a value, so they commute with taking a maximum, in floating
    point too (rounding is monotonic): the output is the same to the bit. The bias add, its gradient and the ReLU
    then run on the pooled map, a quarter of the size. Also with oneDNN's convolutions: its bias inside the
    convolution, on the whole map, made mnist_cnn's two blocks slower (docs/performance.md).
    """
    return F.relu(conv.add_bias(pool(conv.convolve(x))))

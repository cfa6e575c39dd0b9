"""The networks, chosen by name: the tutorial CNN (also with batch norm), MiniGoogLeNet and the Keras CIFAR-10 CNN."""

from __future__ import annotations

import functools
import os

import paddle
import paddle.nn.functional as F
from paddle import nn

from paddle_mnist.network import backbones, batchnorm, exact
from paddle_mnist.network.dropout import Dropout
from paddle_mnist.network.heads import head_pool, head_scale, pooled, scaled
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


def sums_exactly(model: nn.Layer) -> bool:
    """Whether every trainable parameter of model is a Conv2D's or a Linear's here, or a batch norm's whose
    statistics span the global batch (batchnorm.py), whose gradients exact.py can sum in float64; per-worker batch
    norm has statistics of each worker's own."""
    for layer in model.sublayers(include_self=True):
        own = [p for p in layer.parameters(include_sublayers=False) if not p.stop_gradient]
        spans = isinstance(layer, batchnorm.BatchNorm2D) and layer.spans_global_batch
        if own and not (isinstance(layer, (Conv2D, Linear)) or spans):
            return False
    return True


def runs_blocked(net: nn.Layer, x: paddle.Tensor) -> bool:
    """Whether a network of conv modules runs x blocked (fastpath.can_run_blocked): not in training with batch norm over
    the global batch, which runs NCHW by batchnorm.py (csrc/blocked.cc's batch norm is per worker)."""
    return fastpath.can_run_blocked(net, x) and not (net.training and batchnorm.spans_global_batch(net))


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


class MnistCNN(nn.Layer):
    """The tutorial's CNN: two 5x5 conv (20 channels, padding 2) + ReLU + 2x2 max-pool blocks, then one dense layer.

    batch_norm=True (model mnist_cnn_bn) puts batch norm between each conv and its ReLU; the conv then drops its
    bias, which the norm's shift replaces. hidden=N (model mnist_cnn_bn_fc: batch norm and N=256) puts a dense layer
    of N units and ReLU before the classifier: the convolutions stay as they are (most of the multiply-adds) and the
    network reaches mnist_cnn's accuracy in fewer epochs (docs/results.md). Without batch norm each block runs as
    conv_relu_pool; with it, ReLU moves after the pool (relu(max) = max(relu), to the bit) and runs on a quarter of
    the values.
    plain=True builds the tutorial's own layers (nn.Conv2D) and runs them one after another: the reference that
    tests and benchmarks hold the fast network against. Both hold the same parameters under the same names, so
    weights load into either.
    """

    def __init__(
        self,
        num_classes: int = 10,
        in_channels: int = 1,
        image_size: int | tuple[int, int] = 28,
        batch_norm: bool = False,
        plain: bool = False,
        hidden: int = 0,
    ):
        super().__init__()
        conv, pool, dense = (nn.Conv2D, nn.MaxPool2D, nn.Linear) if plain else (Conv2D, MaxPool2D, Linear)
        norm = nn.BatchNorm2D if plain else batchnorm.BatchNorm2D

        def block(cin: int) -> list[nn.Layer]:
            if not batch_norm:
                return [conv(cin, 20, 5, padding=2), nn.ReLU(), pool(2, 2)]
            return [conv(cin, 20, 5, padding=2, bias_attr=False), norm(20), nn.ReLU(), pool(2, 2)]

        # the order each block runs in: the tutorial's, or max-pooling first (the same output to the bit, with less
        # work after it); batch norm needs the whole map's statistics, so there only ReLU moves after the pool
        self.order = "plain" if plain else "relu_after_pool" if batch_norm else "bias_after_pool"
        self.features = nn.Sequential(*block(in_channels), *block(20))
        height, width = _sides(image_size)
        self.head_pool, (rows, cols) = head_pool(height // 4, width // 4)
        features = 20 * rows * cols
        self.head_scale = head_scale(features, 20 * 7 * 7)  # a 28x28 image's map: 20 channels of 7x7
        self.hidden = nn.Sequential(dense(features, hidden), nn.ReLU()) if hidden else None
        self.fc = dense(hidden or features, num_classes)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        f = self.features
        if self.order == "bias_after_pool":  # features: conv, ReLU, pool, twice
            conv1, pool1, conv2, pool2 = f[0], f[2], f[3], f[5]
            x = conv_relu_pool(conv_relu_pool(x, conv1, pool1), conv2, pool2)
        elif self.order == "relu_after_pool":  # features: conv, batch norm, ReLU, pool, twice
            conv1, norm1, pool1, conv2, norm2, pool2 = f[0], f[1], f[3], f[4], f[5], f[7]
            x = F.relu(pool1(norm1(conv1(x))))
            x = F.relu(pool2(norm2(conv2(x))))
        else:
            x = f(x)
        x = scaled(paddle.flatten(pooled(x, self.head_pool), 1), self.head_scale)
        return self.fc(self.hidden(x) if self.hidden is not None else x)


def _sides(image_size: int | tuple[int, int]) -> tuple[int, int]:
    """(height, width) of a square side or of a (height, width) pair."""
    return (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)


class ConvModule(nn.Sequential):
    """Conv, batch norm, ReLU: MiniGoogLeNet's building block (Keras Conv2D keeps its bias, so does this).

    blocked(x) is the same by oneDNN (fastpath.conv_bn_relu in training, fastpath.conv_relu_folded in evaluation),
    its input NCHW or blocked by fastpath.BLOCK channels and its output blocked (csrc/blocked.cc).
    """

    def __init__(self, in_channels: int, out_channels: int, kernel: int, stride: int = 1, padding: int | str = "same"):
        pad = kernel // 2 if padding == "same" else 0
        super().__init__(
            Conv2D(in_channels, out_channels, kernel, stride=stride, padding=pad),
            batchnorm.BatchNorm2D(out_channels),
            nn.ReLU(),
        )

    def blocked(self, x: paddle.Tensor) -> paddle.Tensor:
        if self.training:
            return fastpath.conv_bn_relu(x, self[0], self[1])
        return fastpath.conv_relu_folded(x, self[0], self[1])  # by the running statistics


class Inception(nn.Layer):
    """A 1x1 and a 3x3 conv module side by side, concatenated on channels."""

    def __init__(self, in_channels: int, k1: int, k3: int):
        super().__init__()
        self.b1 = ConvModule(in_channels, k1, 1)
        self.b3 = ConvModule(in_channels, k3, 3)
        self.out_channels = k1 + k3

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return paddle.concat([self.b1(x), self.b3(x)], axis=1)

    def blocked(self, x: paddle.Tensor) -> paddle.Tensor:
        return fastpath.concat_blocked(self.b1.blocked(x), self.b3.blocked(x))


class Downsample(nn.Layer):
    """A stride-2 3x3 conv module beside a stride-2 3x3 max-pool (both unpadded), concatenated on channels."""

    def __init__(self, in_channels: int, k: int):
        super().__init__()
        self.conv = ConvModule(in_channels, k, 3, stride=2, padding="valid")
        self.pool = MaxPool2D(3, stride=2)
        self.out_channels = k + in_channels

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return paddle.concat([self.conv(x), self.pool(x)], axis=1)

    def blocked(self, x: paddle.Tensor) -> paddle.Tensor:
        return fastpath.concat_blocked(self.conv.blocked(x), fastpath.max_pool_blocked(x, 3, 2))


class MiniGoogLeNet(nn.Layer):
    """The Keras multi-GPU tutorial's MiniGoogLeNet for 32x32x3 CIFAR-10 (any size of at least 28 works)."""

    # (kind, sizes) in order; "i" is an inception module (1x1 filters, 3x3 filters), "d" a downsample module
    PLAN = (
        ("i", (32, 32)),
        ("i", (32, 48)),
        ("d", (80,)),
        ("i", (112, 48)),
        ("i", (96, 64)),
        ("i", (80, 80)),
        ("i", (48, 96)),
        ("d", (96,)),
        ("i", (176, 160)),
        ("i", (176, 160)),
    )

    def __init__(self, num_classes: int = 10, in_channels: int = 3, image_size: int | tuple[int, int] = 32):
        super().__init__()
        if min(_sides(image_size)) < 28:
            raise ValueError(f"minigooglenet needs images of at least 28x28, got {image_size}")
        layers = [ConvModule(in_channels, 96, 3)]
        channels = 96
        for kind, sizes in self.PLAN:
            block = Inception(channels, *sizes) if kind == "i" else Downsample(channels, *sizes)
            layers.append(block)
            channels = block.out_channels
        self.features = nn.Sequential(*layers)
        # the tutorial's 7x7 average pool covers the whole 7x7 map left of a 32x32 input; pooling globally
        # is the same there and also fits 28x28 inputs (6x6 maps)
        self.pool = nn.AdaptiveAvgPool2D(1)
        self.dropout = Dropout(0.5)
        self.fc = Linear(channels, num_classes)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        if runs_blocked(self, x):
            x = self.blocked_features(x)
        else:
            x = paddle.flatten(self.pool(self.features(x)), 1)
        return self.fc(self.dropout(x))

    def blocked_features(self, x: paddle.Tensor) -> paddle.Tensor:
        """paddle.flatten(self.pool(self.features(x)), 1) by oneDNN, the maps blocked by fastpath.BLOCK
        channels between the first conv module and the global average pool (every width here is a multiple of 16): no
        reorder around each convolution, and batch norm, ReLU, the max-pools and the concatenations on every
        thread (docs/performance.md)."""
        for layer in self.features:
            x = layer.blocked(x)
        return x.mean([2, 3]).flatten(1)  # [N, C/B, B] -> [N, C]: channel b * B + i, as in NCHW


class CifarCNN(nn.Layer):
    """The Keras CIFAR-10 example CNN: two (conv, conv, pool, dropout) blocks of 32 and 64 filters, dense 512."""

    def __init__(self, num_classes: int = 10, in_channels: int = 3, image_size: int | tuple[int, int] = 32):
        super().__init__()

        def block(cin: int, cout: int) -> list[nn.Layer]:
            # Keras: the first conv pads ("same"), the second does not ("valid")
            return [
                Conv2D(cin, cout, 3, padding=1),
                nn.ReLU(),
                Conv2D(cout, cout, 3),
                nn.ReLU(),
                MaxPool2D(2, 2),
                Dropout(0.25),
            ]

        self.features = nn.Sequential(*block(in_channels, 32), *block(32, 64))
        # 32 and 64 channels fill blocks of 8 or 16 (fastpath.BLOCK); PADDLE_MNIST_CONV_MAPS=nchw holds the maps
        # as Paddle's NCHW between the layers, to price it (scripts/bench_torch's trainer-nchw contender)
        self.blocked_maps = os.environ.get("PADDLE_MNIST_CONV_MAPS") != "nchw"
        height, width = (((side - 2) // 2 - 2) // 2 for side in _sides(image_size))
        self.head_pool, (height, width) = head_pool(height, width)
        self.head_scale = head_scale(64 * height * width, 64 * 5 * 5)  # a 28x28 image's map: 64 channels of 5x5
        self.classifier = nn.Sequential(
            Linear(64 * height * width, 512), nn.ReLU(), Dropout(0.5), Linear(512, num_classes)
        )

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        maps = self.blocked_features(x) if self.runs_blocked(x) else self.features(x)
        x = pooled(maps, self.head_pool)
        return self.classifier(scaled(paddle.flatten(x, 1), self.head_scale))

    def runs_blocked(self, x: paddle.Tensor) -> bool:
        """Whether the features run with their maps blocked by fastpath.BLOCK channels: where oneDNN runs them
        (fastpath.can_run), each convolution adding its bias (Conv2D.fused), while blocked_maps holds (tests set it
        False to hold both ways against each other)."""
        return self.blocked_maps and fastpath.can_run(x) and all(c.bias is not None for c in self._convs())

    def _convs(self) -> list[Conv2D]:
        return [layer for layer in self.features if isinstance(layer, Conv2D)]

    def blocked_features(self, x: paddle.Tensor) -> paddle.Tensor:
        """self.features(x), the same values, with the maps blocked by fastpath.BLOCK channels from the first
        convolution's output to the last pool's (ReLU and dropout run on them as they are, the pools by oneDNN),
        and NCHW again after it: Paddle's NCHW maps cost each convolution a reorder of its input and of its output,
        in the forward and the backward pass (a tenth of the step on 32x32 images; docs/performance.md)."""
        for layer in self.features:
            if isinstance(layer, Conv2D):
                x = layer.blocked(x, fastpath.BLOCK)
            elif isinstance(layer, MaxPool2D):
                x = fastpath.max_pool_blocked(x, 2, 2)
            else:
                x = layer(x)
        return fastpath.unblock(x)


class CifarFast(nn.Layer):
    """A VGG-like network of three conv groups for CIFAR-10 in minutes on CPUs (docs/results.md#cifar-10): a conv
    module, then per group a conv module, a 2x2 max-pool and a second conv module (conv, batch norm, ReLU each), a
    global max-pool and a linear classifier whose outputs are scaled down (a temperature: the network learns faster
    than with the raw outputs under label smoothing).

    Every width is a multiple of 16, so in training and in evaluation without gradients it runs blocked by
    fastpath.BLOCK channels from the first module's output to the global pool, as MiniGoogLeNet does
    (blocked_features): no reorder around any convolution.
    """

    WIDTHS = (64, 128, 256)
    STEM = 32
    LOGIT_SCALE = 1 / 8

    def __init__(
        self,
        num_classes: int = 10,
        in_channels: int = 3,
        image_size: int | tuple[int, int] = 32,
        widths: tuple[int, ...] = WIDTHS,
    ):
        super().__init__()
        if min(_sides(image_size)) < 8:
            raise ValueError(f"cifar_fast needs images of at least 8x8, got {image_size}")
        layers, channels = [ConvModule(in_channels, self.STEM, 3)], self.STEM
        for width in widths:
            layers += [ConvModule(channels, width, 3), MaxPool2D(2, 2), ConvModule(width, width, 3)]
            channels = width
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveMaxPool2D(1)
        self.fc = Linear(channels, num_classes, bias_attr=False)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        if runs_blocked(self, x):
            x = self.blocked_features(x)
        else:
            x = paddle.flatten(self.pool(self.features(x)), 1)
        return self.fc(x) * self.LOGIT_SCALE

    def blocked_features(self, x: paddle.Tensor) -> paddle.Tensor:
        """paddle.flatten(self.pool(self.features(x)), 1) by oneDNN, on maps blocked by fastpath.BLOCK."""
        for layer in self.features:
            x = fastpath.max_pool_blocked(x, 2, 2) if isinstance(layer, MaxPool2D) else layer.blocked(x)
        n, cb, h, w, b = x.shape
        if h == w:  # oneDNN's pool over the whole map: Paddle's CPU gradient of max is slow (docs/results.md)
            return fastpath.max_pool_blocked(x, h, h).reshape([n, cb * b])  # [N, C/B, 1, 1, B] -> channel b * B + i
        # over H*W as one axis: Paddle 3.3.1's CPU gradient of max over axes [2, 3] of a 5-D tensor is garbage
        return x.reshape([n, cb, h * w, b]).max(2).flatten(1)  # [N, C/B, B] -> [N, C]: channel b * B + i


MODELS = {
    "mnist_cnn": MnistCNN,
    "mnist_cnn_bn": functools.partial(MnistCNN, batch_norm=True),
    "mnist_cnn_bn_fc": functools.partial(MnistCNN, batch_norm=True, hidden=256),
    "minigooglenet": MiniGoogLeNet,
    "cifar_cnn": CifarCNN,
    "cifar_fast": CifarFast,
    # Paddle's ImageNet networks, whose ImageNet weights --pretrained loads (backbones.py)
    "resnet18": backbones.ResNet18,
    "mobilenet_v3_small": backbones.MobileNetSmall,
}


def build_model(name: str, num_classes: int = 10, image_shape: tuple[int, int, int] = (1, 28, 28)) -> nn.Layer:
    """image_shape is (channels, height, width) of the dataset's images."""
    channels, height, width = image_shape
    return MODELS[name](num_classes=num_classes, in_channels=channels, image_size=(height, width))


def count_parameters(model: nn.Layer) -> int:
    """Trainable parameters (batch norm running statistics are buffers, not counted)."""
    return sum(int(p.size) for p in model.parameters() if not p.stop_gradient)

"""The networks, chosen by name: the tutorial CNN (also with batch norm), MiniGoogLeNet and the Keras CIFAR-10 CNN."""

from __future__ import annotations

import functools
import os

import paddle
import paddle.nn.functional as F
from paddle import nn

from paddle_mnist.network import backbones, batchnorm
from paddle_mnist.network.dropout import Dropout
from paddle_mnist.network.heads import head_pool, head_scale, pooled, scaled
from paddle_mnist.network.layers import Conv2D, Linear, MaxPool2D, conv_relu_pool
from paddle_mnist.ops import fastpath


def sums_exactly(model: nn.Layer) -> bool:
    """Whether every trainable parameter of model is a Conv2D's or a Linear's (layers.py), or a batch norm's whose
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
        # PADDLE_MNIST_CONV_MAPS=nchw holds the maps as Paddle's NCHW between the layers (nhwc_features), to price it
        self.blocked_maps = os.environ.get("PADDLE_MNIST_CONV_MAPS") != "nchw"

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        f = self.features
        if self.blocked_maps and self.order == "bias_after_pool" and fastpath.can_run(x):
            x = self.nhwc_features(x)
        elif self.blocked_maps and self.order == "relu_after_pool" and self.nhwc_norms(x):
            x = self.nhwc_features(x)
        elif self.order == "bias_after_pool":  # features: conv, ReLU, pool, twice
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

    def nhwc_features(self, x: paddle.Tensor) -> paddle.Tensor:
        """The features of the order "bias_after_pool", the same values, by oneDNN with the maps NHWC from the first
        convolution's output to the last pool's, as 5-D tensors [N, 1, H, W, 20] (blocked by all 20 channels:
        csrc/onednn_common.h), NCHW again after: Paddle's NCHW maps cost each convolution a reorder of its input and
        of its output, in the forward and the backward pass (1.3 ms of a 12 ms step, docs/performance.md). The
        convolution adds the bias (max(v + b) = max(v) + b, to the bit) and sums its gradient in the weights'
        backward pass; ReLU runs after the pool, on a quarter of the values. With batch norm (where nhwc_norms),
        each convolution is followed by fastpath.batch_norm_nhwc."""
        f = self.features
        norms = self.order == "relu_after_pool"  # features: conv, batch norm, ReLU, pool (else conv, ReLU, pool), twice
        blocks = ((f[0], f[1], f[3]), (f[4], f[5], f[7])) if norms else ((f[0], None, f[2]), (f[3], None, f[5]))
        for conv, norm, pool in blocks:
            x = conv.blocked(x, conv.weight.shape[0])
            x = x if norm is None else fastpath.batch_norm_nhwc(x, norm)
            x = fastpath.max_pool_blocked(x, pool.ksize, pool.stride or pool.ksize, relu=True)
        return fastpath.unblock(x)

    def nhwc_norms(self, x: paddle.Tensor) -> bool:
        """Whether the batch norm network runs x with NHWC maps: in training where oneDNN runs (fastpath.can_run),
        its batch norm per worker (over the global batch it runs NCHW: batchnorm.py); evaluation runs NCHW."""
        return self.training and fastpath.can_run(x) and not batchnorm.spans_global_batch(self)


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
        (fastpath.can_run; every convolution here has a bias, which it adds: Conv2D.fused), while blocked_maps
        holds (tests set it False to hold both ways against each other)."""
        return self.blocked_maps and fastpath.can_run(x)

    def blocked_features(self, x: paddle.Tensor) -> paddle.Tensor:
        """self.features(x), the same values, with the maps blocked by fastpath.BLOCK channels from the first
        convolution's output to the last pool's (ReLU and dropout run on them as they are, the pools by oneDNN),
        and NCHW again after it: Paddle's NCHW maps cost each convolution a reorder of its input and of its output,
        in the forward and the backward pass (a tenth of the step on 32x32 images; docs/performance.md). A ReLU
        before a pool runs after it, in the pool's operator: relu(max) = max(relu), to the bit, on a quarter of the
        values."""
        layers = list(self.features)
        for i, layer in enumerate(layers):
            before_pool = i + 1 < len(layers) and isinstance(layers[i + 1], MaxPool2D)
            if isinstance(layer, Conv2D):
                x = layer.blocked(x, fastpath.BLOCK)
            elif isinstance(layer, MaxPool2D):
                x = fastpath.max_pool_blocked(x, 2, 2, relu=i > 0 and isinstance(layers[i - 1], nn.ReLU))
            elif not (isinstance(layer, nn.ReLU) and before_pool):
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

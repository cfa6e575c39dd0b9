"""Dense heads on maps of any size: the map pooled to a bounded size, and the inputs scaled to a 28x28 image's."""

from __future__ import annotations

import math

import paddle
from paddle import nn

HEAD_MAP = 8  # the largest side of the map a dense head takes: a 32x32 image's map in the tutorial's CNN


def head_pool(height: int, width: int) -> tuple[nn.AvgPool2D | None, tuple[int, int]]:
    """An average pool that brings a feature map of height x width to at most HEAD_MAP on each side, and the
    pooled (height, width); None where the map is that small already (every image of up to 32x32 pixels).

    A dense head over the whole map grows with the image's area: for a 4032x3024 photo the tutorial's CNN would
    need billions of weights. Windows of ceil(side / HEAD_MAP) without overlap keep the head the size it has at 32
    pixels and the map's layout (a 64x64 image's 16x16 map becomes 8x8), and a plain pool exports to Paddle
    Inference and ONNX; rows and columns that do not fill a window at the far edge are left out, as a
    stride-k pool does. docs/training.md#any-image-size has what it does to accuracy.
    """
    kh, kw = -(-height // HEAD_MAP), -(-width // HEAD_MAP)
    if kh == kw == 1:
        return None, (height, width)
    return nn.AvgPool2D((kh, kw), stride=(kh, kw)), (height // kh, width // kw)


def pooled(x: paddle.Tensor, pool: nn.Layer | None) -> paddle.Tensor:
    return x if pool is None else pool(x)


def head_scale(features: int, reference: int) -> float:
    """The factor the flattened feature map is multiplied by before the first dense layer: sqrt(reference /
    features) when the map holds more than `reference` values, the map of a 28x28 image (the size the recipes
    were measured on), else 1.

    Under SGD, one step changes a dense layer's outputs by about lr x (its inputs' squared norm) x the output
    gradient, and that squared norm grows with the number of inputs, the image's area: at the same --lr the first
    steps of a 64x64 run moved the loss 3x, and of a 128x128 run 6x, as much as a 28x28 run's, overshot, and could
    leave the network at chance (docs/training.md#any-image-size). Scaled by this factor, the inputs' squared norm
    is at most a 28x28 image's, at every size: one recipe serves them all. Smaller images already take smaller
    steps and are left as they are, as is 28x28 (a factor of 1 is no operation at all).
    """
    return math.sqrt(reference / features) if features > reference else 1.0


def scaled(x: paddle.Tensor, factor: float) -> paddle.Tensor:
    return x if factor == 1.0 else x * factor

"""Paddle's ImageNet networks (paddle.vision.models) as this trainer's models, and where their trained weights are.

Each keeps Paddle's own layers and parameter names, so Paddle's ImageNet weights (--pretrained) load into it by name.
Two changes make it a model of this trainer: grey images are repeated to three channels at the input, so the first
convolution keeps the shape (and the trained filters) of Paddle's weights, where a one-channel convolution would
have to start anew; and MobileNetV3's dropout draws its masks by place in the global batch (dropout.Dropout), so N
workers drop what one process drops. The classifier has the dataset's number of classes.
"""

from __future__ import annotations

import paddle
from paddle import nn
from paddle.vision.models import MobileNetV3Small, ResNet
from paddle.vision.models import mobilenetv3 as paddle_mobilenetv3
from paddle.vision.models import resnet as paddle_resnet
from paddle.vision.models.resnet import BasicBlock

from paddle_mnist.network.dropout import Dropout

# the weights paddle.vision.models.<name>(pretrained=True) downloads: (URL, MD5), from Paddle's own tables
IMAGENET_WEIGHTS = {
    "resnet18": paddle_resnet.model_urls["resnet18"],
    "mobilenet_v3_small": paddle_mobilenetv3.model_urls["mobilenet_v3_small_x1.0"],
}
IMAGENET_CLASSES = 1000


def _rgb(x: paddle.Tensor, in_channels: int) -> paddle.Tensor:
    """A grey batch repeated to three channels: the first convolution sums its three filters over the same image."""
    return paddle.tile(x, [1, 3, 1, 1]) if in_channels == 1 else x


def _check_channels(name: str, in_channels: int) -> None:
    if in_channels not in (1, 3):
        raise ValueError(f"{name} takes grey (1 channel) or colour (3 channels) images, got {in_channels} channels")


class ResNet18(ResNet):
    """paddle.vision.models.resnet18: a 7x7 stride-2 convolution and a max-pool, four stages of two basic blocks,
    global average pooling and a dense classifier (fc). It downsamples by 32, so a 28x28 or 32x32 image ends in a
    1x1 map; pooling globally, it takes any size."""

    def __init__(self, num_classes: int = 10, in_channels: int = 3, image_size: int | tuple[int, int] = 32):
        _check_channels("resnet18", in_channels)
        super().__init__(BasicBlock, 18, num_classes=num_classes)
        self.in_channels = in_channels

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        # ResNet named: Paddle 2.6's paddle.jit.save rewrites this method, and super() then finds no class
        return ResNet.forward(self, _rgb(x, self.in_channels))


class MobileNetSmall(MobileNetV3Small):
    """paddle.vision.models.mobilenet_v3_small (width 1.0): inverted residual blocks with squeeze-and-excitation,
    global average pooling, a dense layer of 1,024 units with hard-swish and dropout 0.2, then the classifier
    (classifier.3)."""

    def __init__(self, num_classes: int = 10, in_channels: int = 3, image_size: int | tuple[int, int] = 32):
        _check_channels("mobilenet_v3_small", in_channels)
        super().__init__(scale=1.0, num_classes=num_classes)
        self.in_channels = in_channels
        for parent in self.sublayers(include_self=True):
            for key, layer in list(parent._sub_layers.items()):
                if type(layer) is nn.Dropout:  # no parameters: the names and the weights file are unchanged
                    parent._sub_layers[key] = Dropout(layer.p)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return MobileNetV3Small.forward(self, _rgb(x, self.in_channels))

"""The networks, chosen by name."""

from __future__ import annotations

import paddle
from paddle import nn


class MnistCNN(nn.Layer):
    """The tutorial's CNN: two 5x5 conv (20 channels, padding 2) + ReLU + 2x2 max-pool blocks, then one dense layer."""

    def __init__(self, num_classes: int = 10, in_channels: int = 1, image_size: int = 28):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2D(in_channels, 20, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2D(2, 2),
            nn.Conv2D(20, 20, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2D(2, 2),
        )
        self.fc = nn.Linear(20 * (image_size // 4) ** 2, num_classes)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.fc(paddle.flatten(self.features(x), 1))


MODELS = {"mnist_cnn": MnistCNN}


def build_model(name: str, num_classes: int = 10, image_shape: tuple[int, int, int] = (1, 28, 28)) -> nn.Layer:
    """image_shape is (channels, height, width) of the dataset's images."""
    channels, height, width = image_shape
    if height != width:
        raise ValueError(f"{name} expects square images, got {height}x{width}")
    return MODELS[name](num_classes=num_classes, in_channels=channels, image_size=height)


def count_parameters(model: nn.Layer) -> int:
    return sum(int(p.size) for p in model.parameters())

"""The bare Paddle training step that profile_step and step_timeline time: the trainer's optimizer values, none of its
machinery."""

from __future__ import annotations

import paddle
import paddle.nn.functional as F

from paddle_mnist.config import Config
from paddle_mnist.datasets.formats import CIFAR_SHAPE

DEFAULTS = Config()  # the trainer's defaults: learning rate, momentum, weight decay
MNIST_SHAPE = (1, 28, 28)


def image_shape(model: str) -> tuple[int, int, int]:
    """The images a benchmark feeds a model: 28 x 28 grey for the mnist_* models, CIFAR-10's otherwise."""
    return MNIST_SHAPE if model.startswith("mnist") else CIFAR_SHAPE


def optimizer(model: paddle.nn.Layer, cfg: Config = DEFAULTS) -> paddle.optimizer.Momentum:
    """SGD with momentum and L2 weight decay, as a user writes it, with the trainer's values (no schedule)."""
    return paddle.optimizer.Momentum(
        learning_rate=cfg.lr,
        momentum=cfg.momentum,
        parameters=model.parameters(),
        weight_decay=paddle.regularizer.L2Decay(cfg.weight_decay),
    )


def step(model: paddle.nn.Layer, opt: paddle.optimizer.Optimizer, x: paddle.Tensor, y: paddle.Tensor) -> paddle.Tensor:
    """One optimizer step: forward, cross-entropy, backward, update, clear the gradients."""
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.clear_grad()
    return loss

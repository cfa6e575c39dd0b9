"""What a network is: parameters, multiply-adds per image, and each layer's output shape, logged once per run."""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass

import paddle
from paddle import nn

from paddle_mnist.network.models import build_model
from paddle_mnist.ops import fastpath


@dataclass(frozen=True)
class ModelSummary:
    parameters: int
    trainable: int
    macs: int  # multiply-adds of one image's forward pass, in the convolutions and dense layers
    table: str  # paddle.summary's per-layer table: layer, input shape, output shape, parameters

    @property
    def flops(self) -> int:
        return 2 * self.macs  # a multiply-add is two floating-point operations

    def headline(self, name: str) -> str:
        frozen = self.parameters - self.trainable
        extra = f" and {frozen:,} batch norm statistics" if frozen else ""
        return (
            f"model {name}: {self.trainable:,} trained parameters{extra}; forward pass {self.flops / 1e6:.2f} MFLOPs "
            f"per image ({self.macs / 1e6:.2f} M multiply-adds in its convolutions and dense layers)"
        )


def _layer_macs(layer: nn.Layer, output: paddle.Tensor) -> int:
    """Multiply-adds of one call: each output value of a conv or dense layer sums one product per weight it sees."""
    if isinstance(layer, nn.Conv2D):
        per_output = int(layer.weight.shape[1]) * int(layer.weight.shape[2]) * int(layer.weight.shape[3])
        return int(output.size) * per_output
    if isinstance(layer, nn.Linear):
        return int(output.size) * int(layer.weight.shape[0])
    return 0


def describe(model_name: str, num_classes: int, image_shape: tuple[int, int, int]) -> ModelSummary:
    """Describe a fresh copy of the network, so the one being trained, its batch norm statistics and the random
    generator's state are untouched. The copy runs layer by layer (MnistCNN's blocks in the tutorial's order), so
    that every layer reports its output shape; its other orders compute the same values with the same parameters.

    paddle.summary gives the table and the parameter counts. paddle.flops is not used: on Paddle 3.x with numpy 2
    it fails (int() of a one-element buffer) and it does not know this package's Conv2D; the multiply-adds are
    counted here by forward hooks on the conv and dense layers.
    """
    rng = paddle.get_rng_state()
    try:
        net = build_model(model_name, num_classes, image_shape)
    finally:
        paddle.set_rng_state(rng)
    if hasattr(net, "order"):
        net.order = "plain"
    net.eval()
    macs = []
    hooks = [
        layer.register_forward_post_hook(lambda layer, _inputs, output: macs.append(_layer_macs(layer, output)))
        for layer in net.sublayers()
        if isinstance(layer, (nn.Conv2D, nn.Linear))
    ]
    printed = io.StringIO()
    try:
        # paddle.summary prints its table; every layer must run for its row and hooks (not the blocked evaluation)
        with fastpath.plain_layers(), contextlib.redirect_stdout(printed):
            counts = paddle.summary(net, (1, *image_shape))
    finally:
        for hook in hooks:
            hook.remove()
    return ModelSummary(
        parameters=int(counts["total_params"]),
        trainable=int(counts["trainable_params"]),
        macs=sum(macs),
        table=printed.getvalue().strip("\n"),
    )


PROBE_SIDE = 64  # the estimate runs the network on an image of at most this many pixels a side and scales up
FLOAT_BYTES = 4
WEIGHT_COPIES = 4  # the weights, their gradients, the momentum, and an EMA or the optimizer's temporaries
# the layers' outputs of a batch, counted once (the gradients are freed as the backward pass goes), and Paddle, the
# data and the operators' workspace before the first batch: measured peaks in docs/datasets.md#large-images
ACTIVATION_COPIES = 1
BASE_BYTES = 600 << 20


def training_bytes(model_name: str, num_classes: int, image_shape: tuple[int, int, int], batch: int) -> int:
    """About how much memory one worker needs to train the network on batches of `batch` images: the weights
    with their gradients and optimizer state, and the layers' outputs for a batch.

    The outputs are counted on a fresh copy run on one image brought down to at most PROBE_SIDE a side (aspect
    kept) and scaled back up by the area, which is how convolutional maps grow; so a 4032x3024 photo is judged
    without a forward pass at that size. An estimate to refuse what cannot fit before anything is allocated,
    not a prediction of the peak (docs/datasets.md has it against measured peaks).
    """
    channels, height, width = image_shape
    scale = min(1.0, PROBE_SIDE / max(height, width))
    probe = (channels, max(32, round(height * scale)), max(32, round(width * scale)))
    rng = paddle.get_rng_state()  # a fresh copy: the generator's state is left as it was, and the parameters'
    try:  # names too (the trained model's are built later; its optimizer's state is saved under them)
        with paddle.utils.unique_name.guard():
            weights = sum(int(p.size) for p in build_model(model_name, num_classes, image_shape).parameters())
            net = build_model(model_name, num_classes, probe)
        if hasattr(net, "order"):
            net.order = "plain"
        net.eval()  # the same output sizes as in training, without dropout's draws
        outputs = []
        leaves = [layer for layer in net.sublayers() if not layer.sublayers()]
        count = lambda _layer, _inputs, out: outputs.append(int(out.size))  # noqa: E731
        hooks = [layer.register_forward_post_hook(count) for layer in leaves]
        with paddle.no_grad(), fastpath.plain_layers():
            net(paddle.zeros([1, *probe]))
        for hook in hooks:
            hook.remove()
    finally:
        paddle.set_rng_state(rng)
    per_image = sum(outputs) * (height * width) / (probe[1] * probe[2])
    return int(BASE_BYTES + FLOAT_BYTES * (WEIGHT_COPIES * weights + ACTIVATION_COPIES * batch * per_image))


def available_bytes() -> int | None:
    """The memory the system can give without swapping (MemAvailable of /proc/meminfo); None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None

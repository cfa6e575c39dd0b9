"""Batch norm over the global batch, exactly: what --sync-bn does on CPU workers.

Each worker trains on its share of a global batch (of a global micro-batch with --accum-steps). Per-worker batch
norm normalises each share by its own statistics, so N workers train other weights than one process; Paddle's and
PyTorch's SyncBatchNorm have GPU kernels only. Here a layer whose statistics span the global batch
(over_global_batch) computes, in training, per image and channel the float64 sums it needs (forward: the sum and the
sum of squares of its input; backward: the sums of the output's gradient and of its product with the input; a
product of two float32 values is exact in float64). The workers meet (Meeting.rows): every worker then holds every
image's sums, in the global batch's order, and adds them in that order, so the mean, the variance and the two
gradient sums are the same bits on every worker and in one process, however the batch is split. The rest is
elementwise in float32 (y = x * scale + shift; dx = dy * a + x * b + c, with per-channel constants from those
sums), the same bits for an image wherever it runs. The running statistics move by the global mean and biased
variance, as Paddle's batch norm moves them by a batch's, so every worker holds the same ones.

The weight's and bias's gradients are global sums already: on the exact path (network/exact.py) rank 0 hands them
over and the others hand over zeros, which the workers' float64 sum leaves as they are; elsewhere each worker
returns 1/N of them, which averaging over the workers makes whole again.

    meeting(m)              inside, the layers below meet through m (a Meeting)
    over_global_batch(net)  turn on the global statistics in net's BatchNorm2D layers; spans_global_batch(net)
    BatchNorm2D             nn.BatchNorm2D (same parameters and names) with the global statistics when turned on
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import paddle
from paddle import nn
from paddle.autograd import PyLayer

from paddle_mnist.network import exact
from paddle_mnist.ops import fastpath


@dataclass(frozen=True)
class Meeting:
    """How one worker's images meet the others': places position .. position + n - 1 of a global (micro-)batch of
    total images; add sums a float64 tensor over the workers in place; rank 0 leads; world workers."""

    add: Callable[[paddle.Tensor], None]
    position: int
    total: int
    lead: bool = True
    world: int = 1

    def rows(self, mine: paddle.Tensor) -> paddle.Tensor:
        """Every image's rows of the global batch, in its order: this worker's `mine` [n, K] at its places, the
        others' at theirs (each place is written by one worker and zero elsewhere: x + 0 is x in the sum)."""
        n, k = mine.shape
        if n == self.total:
            return mine
        parts = [paddle.zeros([self.position, k], mine.dtype)] if self.position else []
        parts.append(mine)
        if self.total - self.position - n:
            parts.append(paddle.zeros([self.total - self.position - n, k], mine.dtype))
        everyone = paddle.concat(parts)
        self.add(everyone)
        return everyone


_meeting: Meeting | None = None


@contextlib.contextmanager
def meeting(m: Meeting | None) -> Iterator[None]:
    """Layers with global statistics meet through m inside (with None, they normalise as Paddle's)."""
    global _meeting
    kept, _meeting = _meeting, m
    try:
        yield
    finally:
        _meeting = kept


@paddle.jit.not_to_static  # False while paddle.jit.save traces the network: it gets Paddle's own batch norm
def _meets() -> bool:
    return _meeting is not None and paddle.in_dynamic_mode() and paddle.is_grad_enabled()


def _f32(v: np.ndarray) -> paddle.Tensor:
    """A per-channel float64 vector as float32, for the elementwise operators."""
    return paddle.to_tensor(v.astype(np.float32))


def _channel_sums(m: Meeting, mine: paddle.Tensor) -> np.ndarray:
    """The per-channel sums [2C] over the global batch, from this worker's per-image ones: every worker adds every
    image's in the global order (numpy for the per-channel arithmetic: tens of values, where each Paddle operator
    costs more than its work)."""
    return m.rows(mine).numpy().sum(axis=0)


class _GlobalNorm(PyLayer):
    @staticmethod
    def forward(ctx, x, weight, bias, layer, m):
        n, c, h, w = x.shape
        sums = _channel_sums(m, fastpath.plane_sums(x))
        count = m.total * h * w
        mean = sums[:c] / count
        variance = np.maximum(sums[c:] / count - mean * mean, 0.0)
        inv_std = 1.0 / np.sqrt(variance + layer._epsilon)
        scale = weight.numpy().astype(np.float64) * inv_std
        y = fastpath.affine(x, _f32(scale), _f32(bias.numpy().astype(np.float64) - mean * scale))
        keep, rest = np.float32(layer._momentum), np.float32(1 - layer._momentum)
        for running, batch in ((layer._mean, mean), (layer._variance, variance)):  # as Paddle's, in float32
            paddle.assign(paddle.to_tensor(running.numpy() * keep + batch.astype(np.float32) * rest), running)
        ctx.save_for_backward(x)
        ctx.kept = (weight, bias, m, mean, inv_std, scale, count)
        return y

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensor()
        weight, bias, m, mean, inv_std, scale, count = ctx.kept
        c = x.shape[1]
        sums = _channel_sums(m, fastpath.plane_sums(grad_out, x))
        grad_bias = sums[:c]  # the sum of dy
        grad_weight = inv_std * (sums[c:] - mean * grad_bias)  # the sum of dy * (x - mean) / std
        b = -scale * inv_std * grad_weight / count
        shift = -scale * grad_bias / count - b * mean
        grad_x = fastpath.affine(x, _f32(scale), _f32(b), g=grad_out, c=_f32(shift))
        return grad_x, _hand_over(weight, grad_weight, m), _hand_over(bias, grad_bias, m)


def _hand_over(param: paddle.Tensor, total: np.ndarray, m: Meeting) -> paddle.Tensor | None:
    if param.stop_gradient:
        return None
    if exact.collecting():
        return exact.hand_over(param, paddle.to_tensor(total if m.lead else np.zeros_like(total)))
    return paddle.to_tensor((total * (1.0 / m.world)).astype(np.float32))


class BatchNorm2D(nn.BatchNorm2D):
    """nn.BatchNorm2D (same parameters, running statistics and names, so weights load either way); once
    over_global_batch turned it on, it normalises in training by the global batch's statistics (module docstring)
    wherever a step has set a meeting. Elsewhere, and always in evaluation and export, it is Paddle's own."""

    spans_global_batch = False

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        if self.spans_global_batch and self.training and _meets() and self._data_format == "NCHW":
            return _GlobalNorm.apply(x, self.weight, self.bias, self, _meeting)
        return nn.BatchNorm2D.forward(self, x)  # named, as layers.MaxPool2D does, for Paddle 2.6's jit.save


def over_global_batch(net: nn.Layer) -> int:
    """Turn on the global statistics in every 2-D batch norm of net, Paddle's own (the ImageNet backbones') made
    this module's BatchNorm2D, which holds nothing more; how many there are."""
    layers = [layer for layer in net.sublayers(include_self=True) if type(layer) in (nn.BatchNorm2D, BatchNorm2D)]
    for layer in layers:
        layer.__class__ = BatchNorm2D
        layer.spans_global_batch = True
    return len(layers)


def norm_layers(net: nn.Layer) -> list[nn.Layer]:
    """net's batch norm layers of any kind (Paddle's, this module's, SyncBatchNorm)."""
    return [layer for layer in net.sublayers(include_self=True) if isinstance(layer, nn.layer.norm._BatchNormBase)]


def spans_global_batch(net: nn.Layer) -> bool:
    """Whether net has batch norm and every batch norm layer of it normalises over the global batch."""
    norms = norm_layers(net)
    return bool(norms) and all(getattr(layer, "spans_global_batch", False) for layer in norms)

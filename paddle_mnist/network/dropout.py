"""Dropout whose masks do not depend on how a global batch is split: N workers drop what one process drops.

paddle.nn.Dropout draws from each process's generator, and every rank seeds it alike, so rank 1 drops the units
rank 0 drops for its own images, where one process training the same global batch draws a new mask for each image.
Here the mask of the image at place j of a global batch is drawn from a counter-based generator (Philox) keyed by
(seed, step, layer) at a counter that depends on j alone: each rank computes its own images' masks without drawing
the others', and a resumed run draws what the uninterrupted run drew, whatever the generators' states.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

_WORDS_PER_BLOCK = 4  # Philox4x64 yields 4 64-bit words per counter value
_DRAWS_PER_WORD = 2  # each word gives two 32-bit draws


@dataclass(frozen=True)
class Place:
    """Where a forward pass's images sit: places position .. position + N - 1 of a global batch of total images,
    trained at optimizer step `step` of a run seeded with `seed`."""

    seed: int
    step: int
    position: int
    total: int


class Dropout(nn.Layer):
    """nn.Dropout (upscale in training, identity in evaluation) with its masks drawn by keep_mask when the trainer
    has placed the batch (placed); outside the trainer, it is paddle's own dropout."""

    def __init__(self, p: float):
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability must be in [0, 1], got {p}")
        self.p = p
        self.place: Place | None = None
        self.index = 0  # this layer's number among the model's Dropout layers, set by placed()

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if self.place is None:
            if x.ndim == 5:  # a map blocked by channels: the mask Paddle draws for its NCHW form, blocked as x is
                return x * _blocked_as(F.dropout(paddle.ones(_nchw_shape(x), dtype=x.dtype), self.p, training=True), x)
            return F.dropout(x, self.p, training=True)
        if self.p == 1.0:
            return x * 0
        keep = keep_mask(self.place, self.index, x.shape[0], int(np.prod(x.shape[1:])), self.p)
        scale = np.float32(1.0 / (1.0 - self.p))
        mask = paddle.to_tensor((keep * scale).reshape(_nchw_shape(x)), place=x.place)
        if x.ndim == 5:  # a map blocked by channels: each value takes its NCHW place's draw
            mask = _blocked_as(mask, x)
        return x * (mask if mask.dtype == x.dtype else mask.astype(x.dtype))

    def extra_repr(self) -> str:
        return f"p={self.p}, masks by batch place"


def keep_mask(place: Place, layer: int, n: int, units: int, p: float) -> np.ndarray:
    """bool (n, units): which units images place.position .. + n - 1 keep (each with probability 1 - p).

    Image j of the global batch owns counter values j * blocks .. (j + 1) * blocks - 1 of the stream keyed by
    (seed, layer, step), blocks being what `units` 32-bit draws take; a rank starts its stream at its first image's.
    """
    if not (0 <= place.position and place.position + n <= place.total):
        raise ValueError(f"images {place.position}..{place.position + n - 1} are not in a batch of {place.total}")
    blocks = -(-units // (_WORDS_PER_BLOCK * _DRAWS_PER_WORD))
    key = [(place.seed & 0xFFFFFFFF) | (layer << 32), place.step]
    stream = np.random.Philox(key=key, counter=[place.position * blocks, 0, 0, 0])
    draws = stream.random_raw(n * blocks * _WORDS_PER_BLOCK).view(np.uint32)
    threshold = np.uint64(round((1.0 - p) * 2**32))  # a draw below it keeps its unit: probability 1 - p
    return draws.reshape(n, -1)[:, :units] < threshold


def layers(model: nn.Layer) -> list[Dropout]:
    """The model's Dropout layers in a fixed order (sublayers' order), each numbered."""
    found = [layer for layer in model.sublayers() if isinstance(layer, Dropout)]
    for k, layer in enumerate(found):
        layer.index = k
    return found


@contextlib.contextmanager
def placed(found: list[Dropout], place: Place) -> Iterator[None]:
    """The found layers draw for `place` inside the block, and fall back to paddle's dropout after it."""
    for layer in found:
        layer.place = place
    try:
        yield
    finally:
        for layer in found:
            layer.place = None


def _nchw_shape(x: paddle.Tensor) -> list[int]:
    """x's shape, or the NCHW shape of a map blocked by channels [N, C/B, H, W, B]."""
    if x.ndim != 5:
        return list(x.shape)
    n, cb, h, w, b = x.shape
    return [n, cb * b, h, w]


def _blocked_as(mask: paddle.Tensor, x: paddle.Tensor) -> paddle.Tensor:
    """An NCHW mask in the blocked layout of x [N, C/B, H, W, B] (fastpath.unblock's inverse)."""
    n, cb, h, w, b = x.shape
    return mask.reshape([n, cb, b, h, w]).transpose([0, 1, 3, 4, 2])

"""--whiten: the first convolution starts as a whitening of the training images' patches.

Each filter of the first convolution is a principal direction of the (channels x k x k) patches of the training
images, scaled by one over the square root of its variance: the first layer's outputs start decorrelated and of
equal variance, so the layers above learn from features that are not dominated by the images' brightest, most
correlated directions. With more filters than directions the leading directions are repeated with their sign
flipped (a ReLU after the layer then passes each half of a direction). The filters stay trainable.
"""

from __future__ import annotations

import numpy as np
import paddle
from numpy.lib.stride_tricks import sliding_window_view

IMAGES = 2_000  # images taken evenly across the training split (a folder's cache holds it class by class)
EPS = 5e-4  # added to each variance: directions of almost no variance are not blown up


def covariance(
    images: np.ndarray, mean: tuple[float, ...], std: tuple[float, ...], k: int, chunk: int = 100
) -> tuple[np.ndarray, int]:
    """The covariance (D x D, D = C*k*k, float64) of every k x k patch of up to IMAGES uint8 images (N, C, H, W)
    taken evenly across them, normalised as training normalises them, and how many patches it covers; read a chunk
    of images at a time."""
    m = np.asarray(mean, np.float32)[:, None, None]
    s = np.asarray(std, np.float32)[:, None, None]
    total = second = None
    count = 0
    taken = np.linspace(0, len(images) - 1, min(len(images), IMAGES)).round().astype(np.int64)
    for lo in range(0, len(taken), chunk):
        x = (np.asarray(images[taken[lo : lo + chunk]], np.float32) / 255.0 - m) / s
        windows = sliding_window_view(x, (k, k), axis=(2, 3))  # (n, C, H-k+1, W-k+1, k, k), a view
        n, c, h, w = windows.shape[:4]
        found = windows.transpose(0, 2, 3, 1, 4, 5).reshape(n * h * w, c * k * k).astype(np.float64)
        total = found.sum(axis=0) + (0 if total is None else total)
        second = found.T @ found + (0 if second is None else second)
        count += len(found)
    centre = total / count
    return second / count - np.outer(centre, centre), count


def filters(cov: np.ndarray, count: int) -> np.ndarray:
    """float32 (count, D): the whitening filters of a patch covariance (D x D), the highest-variance direction
    first."""
    variance, directions = np.linalg.eigh(cov)
    order = np.argsort(variance)[::-1]
    whitening = directions[:, order].T / np.sqrt(np.maximum(variance[order], 0) + EPS)[:, None]  # a filter a row
    repeats = -(-count // len(whitening))
    signed = np.concatenate([whitening * (1 if r % 2 == 0 else -1) for r in range(repeats)])
    return signed[:count].astype(np.float32)


def first_conv(model: paddle.nn.Layer) -> paddle.nn.Conv2D:
    convs = [layer for layer in model.sublayers() if isinstance(layer, paddle.nn.Conv2D)]
    if not convs:
        raise ValueError("--whiten sets the first convolution's filters, and this model has none")
    return convs[0]


def whiten(model: paddle.nn.Layer, images: np.ndarray, mean: tuple[float, ...], std: tuple[float, ...]) -> str:
    """Set the model's first convolution to the whitening of images' patches (its bias to 0); what was done, for
    the log."""
    conv = first_conv(model)
    out, channels, k, k2 = conv.weight.shape
    if k != k2 or channels != images.shape[1]:
        raise ValueError(f"--whiten needs a square first convolution over the images' {images.shape[1]} channels")
    cov, count = covariance(images, mean, std, k)
    conv.weight.set_value(filters(cov, out).reshape(out, channels, k, k))
    if conv.bias is not None:
        conv.bias.set_value(np.zeros(conv.bias.shape, np.float32))
    return (
        f"whitened: the first convolution's {out} filters start as the principal directions of {count:,} "
        f"{channels}x{k}x{k} patches of {min(len(images), IMAGES):,} training images"
    )

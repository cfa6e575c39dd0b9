"""Batch augmentation: random shifts (pad and crop) and horizontal flips, on whole uint8 batches at once."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


@dataclass(frozen=True)
class Augment:
    pad: int  # shift by up to this many pixels each way (zero padding, then a random crop)
    flip: bool  # mirror left-right with probability 1/2


# CIFAR-10: pad 4 of 32 (about 0.1 of the width, as the tutorials shifted) and flips. Digits are not mirror
# symmetric, so MNIST-type data only shifts; Fashion-MNIST clothes are, so it flips too.
POLICIES = {
    "cifar10": Augment(pad=4, flip=True),
    "fashion-mnist": Augment(pad=2, flip=True),
    "mnist": Augment(pad=2, flip=False),
    "mnist-json": Augment(pad=2, flip=False),
    "folder": Augment(pad=2, flip=False),  # a user's classes may not be mirror-symmetric: flips only with --flip
}


def policy_for(dataset: str, shift: int | None = None, flip: bool = False) -> Augment:
    """The dataset's policy, with the shift replaced by --shift when it is given; flip (--flip) turns flips on."""
    base = POLICIES[dataset]
    base = base if shift is None else dataclasses.replace(base, pad=shift)
    return dataclasses.replace(base, flip=True) if flip else base


def describe(policy: Augment) -> str:
    parts = ([f"random shifts of up to {policy.pad} px"] if policy.pad else []) + (
        ["horizontal flips"] if policy.flip else []
    )
    return " and ".join(parts) or "nothing to do (no shift, and this dataset is not flipped)"


def batch_rng(seed: int, rank: int, epoch: int, batch: int) -> np.random.Generator:
    """A generator for one batch: reproducible from its coordinates, different on every rank and epoch.

    Seeding each batch on its own (not one stream per epoch) lets a resumed run draw the same augmentations
    for the batches after a mid-epoch checkpoint as the run that was never stopped.
    """
    return np.random.default_rng([seed & 0xFFFFFFFF, rank, epoch, batch])


def shift_and_flip(images: np.ndarray, policy: Augment, rng: np.random.Generator) -> np.ndarray:
    """uint8 (N, C, H, W) -> a new uint8 batch of the same shape, each image shifted and maybe flipped."""
    n, _, h, w = images.shape
    out = images
    if policy.pad:
        p = policy.pad
        padded = np.pad(images, ((0, 0), (0, 0), (p, p), (p, p)))
        windows = sliding_window_view(padded, (h, w), axis=(2, 3))  # (N, C, 2p+1, 2p+1, H, W), a view
        dy, dx = rng.integers(0, 2 * p + 1, size=(2, n))
        out = windows[np.arange(n), :, dy, dx]  # the advanced indices gather one crop per image: (N, C, H, W)
    if policy.flip:
        mirror = rng.random(n) < 0.5
        out = out.copy() if out is images else out
        out[mirror] = out[mirror, :, :, ::-1]
    return out

"""Batch augmentation: random shifts (pad and crop) and horizontal flips, on whole uint8 batches at once."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

FOLDER = "folder"  # config.FOLDER, spelt out here because config imports this module


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
}


@dataclass(frozen=True)
class FolderRule:
    """How a folder is augmented when --shift and --flip/--no-flip leave it to the rule: like the built-in dataset
    whose classes it resembles in their symmetry, the shift scaled to the image's side."""

    like: str  # the built-in dataset whose policy it scales
    looks: str  # what the measure says of the classes, as the start-up line puts it
    share: int  # shifts of up to 1/share of the shorter side, rounded down, at least 1 px
    flip: bool

    def shift(self, height: int, width: int) -> int:
        return max(1, min(height, width) // self.share)


# A folder is measured (mirror_asymmetry) when its cache is built. Classes that look the same mirrored are taken
# for pictures of things, as CIFAR-10's are: shifts of 1/8 of the side (CIFAR-10's 4 px of 32) and flips. Classes
# with a handedness are taken for glyphs, as MNIST's digits are: 1/14 of the side (MNIST's 2 px of 28), no flips.
# Measured medians over the classes: CIFAR-10 (JPEG copy) 0.07, Fashion-MNIST 0.18, MNIST's digits 0.64 to 0.72
# (16 to 128 px, grey or tinted in colour).
MIRROR_SYMMETRIC = 0.3
FOLDER_RULES = {
    True: FolderRule("CIFAR-10", "look the same mirrored", share=32 // POLICIES["cifar10"].pad, flip=True),
    False: FolderRule("MNIST", "look handed", share=28 // POLICIES["mnist"].pad, flip=False),
}


def folder_rule(asymmetry: float | None) -> FolderRule:
    """The rule a folder's measure picks; an unmeasured folder (None) is taken for glyphs: no flips."""
    return FOLDER_RULES[asymmetry is not None and asymmetry < MIRROR_SYMMETRIC]


def mirror_asymmetry(images: np.ndarray, labels: np.ndarray, chunk: int = 4096) -> float:
    """The median over classes of |m - mirror(m)| / |m - mean(m)|, m a class's mean image (uint8 N x C x H x W,
    read a chunk at a time, so a memory-mapped split is never loaded whole). A class of one flat image counts 0."""
    classes = np.unique(labels)
    sums = np.zeros((len(classes), *images.shape[1:]), np.float64)
    for lo in range(0, len(images), chunk):
        block, held = np.asarray(images[lo : lo + chunk], np.float32), labels[lo : lo + chunk]
        for k, c in enumerate(classes):
            sums[k] += block[held == c].sum(axis=0)
    found = []
    for k, c in enumerate(classes):
        m = sums[k] / np.count_nonzero(labels == c)
        contrast = np.linalg.norm(m - m.mean())
        found.append(np.linalg.norm(m - m[..., ::-1]) / contrast if contrast else 0.0)
    return float(np.median(found))


def policy_for(
    dataset: str,
    shape: tuple[int, int, int],
    shift: int | None = None,
    flip: bool | None = None,
    asymmetry: float | None = None,
) -> Augment:
    """The policy a run's training batches get: a built-in dataset's own (POLICIES); a folder's by the rule its
    classes' measured mirror asymmetry picks (folder_rule), scaled to its images' (channels, height, width).
    --shift (shift) replaces the shift, and for a folder --flip or --no-flip (flip True or False; None: the
    rule's) decides the flips."""
    if dataset == FOLDER:
        _, height, width = shape
        rule = folder_rule(asymmetry)
        base = Augment(pad=rule.shift(height, width), flip=rule.flip if flip is None else flip)
    else:
        base = POLICIES[dataset]
    return base if shift is None else dataclasses.replace(base, pad=shift)


def describe(
    dataset: str,
    shape: tuple[int, int, int],
    shift: int | None = None,
    flip: bool | None = None,
    asymmetry: float | None = None,
) -> str:
    """The policy for the start-up line; for a folder, also the rule that chose it, why, and the flags that change
    it."""
    policy = policy_for(dataset, shape, shift, flip, asymmetry)
    parts = ([f"random shifts of up to {policy.pad} px"] if policy.pad else ["no shifts"]) + (
        ["horizontal flips"] if policy.flip else ["no flips"]
    )
    if dataset != FOLDER:
        parts = [p for p in parts if p not in ("no shifts", "no flips")]
        return " and ".join(parts) or "nothing to do (no shift, and this dataset is not flipped)"
    _, height, width = shape
    rule = folder_rule(asymmetry)
    side = f"{min(height, width)} px" + (", the shorter side" if height != width else "")
    why = (
        f"the classes {rule.looks}: mirror asymmetry {asymmetry:.2f} {'<' if rule.flip else '>='} {MIRROR_SYMMETRIC}"
        if asymmetry is not None
        else "the classes not measured"
    )
    given = [f"--shift {shift}"] * (shift is not None) + [("--flip" if flip else "--no-flip")] * (flip is not None)
    free = [
        f for f, left in (("--shift N", shift is None), ("--no-flip" if rule.flip else "--flip", flip is None)) if left
    ]
    source = f"{rule.like}'s rule at {side}, {why}" + (f"; {', '.join(given)} given" if given else "")
    change = f"; {' or '.join(free)} to change" if free else ""
    return f"{' and '.join(parts)} ({source}{change})"


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

"""Batch augmentation: random shifts (pad and crop) and horizontal flips, on whole uint8 batches at once."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from paddle_mnist.config import FOLDER


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


# A folder shifts by up to 1/FOLDER_SHARE of its images' shorter side (MNIST's 2 px of 28, rounded down, at least
# 1 px) and flips only with --flip: CIFAR-10's larger shifts and flips cost accuracy in the default recipes on the
# CIFAR-10 copy and on the generality matrix's folders (docs/datasets.md has the measurements). Its classes are
# measured for mirror symmetry (mirror_asymmetry) when its cache is built, and the start-up line points to --flip
# where they look the same mirrored (below MIRROR_SYMMETRIC).
FOLDER_SHARE = 28 // POLICIES["mnist"].pad
MIRROR_SYMMETRIC = 0.3


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


def policy_for(dataset: str, shape: tuple[int, int, int], shift: int | None = None, flip: bool = False) -> Augment:
    """The policy a run's training batches get: a built-in dataset's own (POLICIES); a folder's shifts scaled to
    its images' (channels, height, width), and flips where flip (--flip) says its classes are mirror-symmetric (a
    built-in dataset flips as its policy says). --shift (shift) replaces the shift."""
    if dataset == FOLDER:
        _, height, width = shape
        base = Augment(pad=max(1, min(height, width) // FOLDER_SHARE), flip=flip)
    else:
        base = POLICIES[dataset]
    return base if shift is None else dataclasses.replace(base, pad=shift)


def tta_problem(dataset: str, flip: bool) -> str | None:
    """Why --tta, which mirrors the evaluation images, does not suit the classes; None when it does. flip: --flip,
    which says a folder's classes are mirror-symmetric (a built-in dataset's policy says whether its are)."""
    if dataset != FOLDER:
        if POLICIES[dataset].flip:
            return None
        return (
            f"--tta mirrors the evaluation images, but {dataset}'s classes are not mirror-symmetric "
            "(a mirrored digit is another shape): drop --tta"
        )
    if flip:
        return None
    return (
        "--tta mirrors the evaluation images, which goes with training on mirrored ones: add --flip if a mirror "
        "keeps the class, or drop --tta"
    )


def describe(
    dataset: str,
    shape: tuple[int, int, int],
    shift: int | None = None,
    flip: bool = False,
    asymmetry: float | None = None,
) -> str:
    """The policy for the start-up line; for a folder, also the rule, the flags that change it, and whether its
    classes (asymmetry: their measured mirror asymmetry) look the same mirrored."""
    policy = policy_for(dataset, shape, shift, flip)
    parts = ([f"random shifts of up to {policy.pad} px"] if policy.pad else ["no shifts"]) + (
        ["horizontal flips"] if policy.flip else ["no flips"]
    )
    if dataset != FOLDER:
        parts = [p for p in parts if p not in ("no shifts", "no flips")]
        return " and ".join(parts) or "nothing to do (no shift, and this dataset is not flipped)"
    _, height, width = shape
    side = f"{min(height, width)} px" + (", the shorter side" if height != width else "")
    shifts = f"--shift {shift}" if shift is not None else f"1/{FOLDER_SHARE} of {side}; --shift N to change"
    if flip:
        flips = "--flip"
    elif asymmetry is not None and asymmetry < MIRROR_SYMMETRIC:
        flips = f"the classes look the same mirrored (mirror asymmetry {asymmetry:.2f}): --flip to flip them"
    elif asymmetry is not None:
        flips = f"the classes look handed (mirror asymmetry {asymmetry:.2f}): flips would change them"
    else:
        flips = "--flip if a mirror keeps the class"
    return f"{' and '.join(parts)} ({shifts}; {flips})"


def batch_rng(seed: int, epoch: int, batch: int) -> np.random.Generator:
    """A generator for one global batch: reproducible from its coordinates, different in every epoch.

    Seeding each batch on its own (not one stream per epoch) lets a resumed run draw the same augmentations
    for the batches after a mid-epoch checkpoint as the run that was never stopped. Every rank seeds the same
    generator and draws for the whole global batch (shift_and_flip), so an image is shifted and flipped alike
    whatever the number of workers.
    """
    return np.random.default_rng([seed & 0xFFFFFFFF, epoch, batch])


def shift_and_flip(
    images: np.ndarray,
    policy: Augment,
    rng: np.random.Generator,
    position: int | np.ndarray = 0,
    total: int | None = None,
) -> np.ndarray:
    """uint8 (N, C, H, W) -> a new uint8 batch of the same shape, each image shifted and maybe flipped.

    images are places position .. position + N - 1 of a global batch of `total` images (N when None), or the
    places in the array `position`: the draws are made for all `total` and these images take theirs, so a worker's
    images get the shifts and flips one process training the whole global batch would give them.
    """
    n, _, h, w = images.shape
    total = n if total is None else total
    places = slice(position, position + n) if np.ndim(position) == 0 else np.asarray(position)
    out = images
    if policy.pad:
        p = policy.pad
        padded = np.pad(images, ((0, 0), (0, 0), (p, p), (p, p)))
        windows = sliding_window_view(padded, (h, w), axis=(2, 3))  # (N, C, 2p+1, 2p+1, H, W), a view
        dy, dx = rng.integers(0, 2 * p + 1, size=(2, total))[:, places]
        out = windows[np.arange(n), :, dy, dx]  # the advanced indices gather one crop per image: (N, C, H, W)
    if policy.flip:
        mirror = rng.random(total)[places] < 0.5
        out = out.copy() if out is images else out
        out[mirror] = out[mirror, :, :, ::-1]
    return out

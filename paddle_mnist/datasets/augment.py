"""Batch augmentation on whole uint8 batches at once: random shifts (pad and crop) and horizontal flips, and for
photos (--augment photo) random resized crops, colour jitter and random erasing."""

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
    crop_scale: float = 0.0  # random resized crop: a share of the area in [crop_scale, 1], resized back (0: none)
    jitter: float = 0.0  # brightness, contrast and saturation each times a factor in [1 - jitter, 1 + jitter]
    erase: float = 0.0  # the chance that an image has a random rectangle painted over in one random colour
    mixup: float = 0.0  # blend each image with its partner in the global batch by a weight drawn from Beta(a, a)
    cutmix: float = 0.0  # paste a rectangle of its partner into each image, 1 - a weight from Beta(a, a) of its area

    @property
    def photo_ops(self) -> bool:
        """Whether any of the photo operations is on (--augment photo's, or mixing)."""
        return bool(self.crop_scale or self.jitter or self.erase) or self.mixes

    @property
    def mixes(self) -> bool:
        """Whether the batch's labels become mixed ones (mix_pairs)."""
        return bool(self.mixup or self.cutmix)


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


def policy_for(
    dataset: str, shape: tuple[int, int, int], shift: int | None = None, flip: bool = False, **photo
) -> Augment:
    """The policy a run's training batches get: a built-in dataset's own (POLICIES); a folder's shifts scaled to
    its images' (channels, height, width), and flips where flip (--flip) says its classes are mirror-symmetric (a
    built-in dataset flips as its policy says). --shift (shift) replaces the shift; photo: the photo operations
    (crop_scale, jitter, erase, mixup, cutmix: config.PHOTO_OPERATIONS) as given."""
    if dataset == FOLDER:
        _, height, width = shape
        base = Augment(pad=max(1, min(height, width) // FOLDER_SHARE), flip=flip)
    else:
        base = POLICIES[dataset]
    return dataclasses.replace(base, **photo, **({} if shift is None else {"pad": shift}))


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
    **photo,
) -> str:
    """The policy for the start-up line; for a folder, also the rule, the flags that change it, and whether its
    classes (asymmetry: their measured mirror asymmetry) look the same mirrored."""
    policy = policy_for(dataset, shape, shift, flip, **photo)
    parts = (
        ([f"random resized crops of {policy.crop_scale:g} to 1 of the area"] if policy.crop_scale else [])
        + ([f"random shifts of up to {policy.pad} px"] if policy.pad else ["no shifts"])
        + (["horizontal flips"] if policy.flip else ["no flips"])
        + ([f"colour jitter of {policy.jitter:g}"] if policy.jitter else [])
        + ([f"random erasing with chance {policy.erase:g}"] if policy.erase else [])
        + ([f"mixup with Beta({policy.mixup:g}, {policy.mixup:g})"] if policy.mixup else [])
        + ([f"cutmix with Beta({policy.cutmix:g}, {policy.cutmix:g})"] if policy.cutmix else [])
    )
    if policy.photo_ops:
        parts = [p for p in parts if p != "no shifts"]
        if dataset == FOLDER:
            return " and ".join(parts) + " (--crop-scale, --jitter, --erase, --mixup, --cutmix and --shift set them)"
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


def augment_batch(
    images: np.ndarray,
    policy: Augment,
    rng: np.random.Generator,
    position: int | np.ndarray = 0,
    total: int | None = None,
) -> np.ndarray:
    """uint8 (N, C, H, W) -> the batch augmented by policy: shifts and flips (shift_and_flip), then the photo
    operations it has, in this order: a random resized crop, colour jitter, random erasing. position and total
    as in shift_and_flip: every operation draws for all `total` images of the global batch, in a fixed order, and
    these images take their places' draws."""
    n = len(images)
    total = n if total is None else total
    places = slice(position, position + n) if np.ndim(position) == 0 else np.asarray(position)
    out = shift_and_flip(images, policy, rng, position, total)
    if policy.crop_scale:
        out = resized_crops(out, policy.crop_scale, rng, places, total)
    if policy.jitter:
        out = colour_jitter(out, policy.jitter, rng, places, total)
    if policy.erase:
        out = erase_rectangles(out, policy.erase, rng, places, total)
    return out


GREY = np.float32([0.299, 0.587, 0.114])  # a colour pixel's grey (ITU-R BT.601)


def _draw(rng: np.random.Generator, low: float, high: float, total: int, places) -> np.ndarray:
    return rng.uniform(low, high, total)[places]


def resized_crops(
    images: np.ndarray, scale: float, rng: np.random.Generator, places, total: int, ratio: float = 4 / 3
) -> np.ndarray:
    """Each image's crop of a random share of its area in [scale, 1] and aspect ratio in [1/ratio, ratio] (drawn
    on a log scale), at a random place, resized back to the image's size by bilinear interpolation."""
    n, _, h, w = images.shape
    area = _draw(rng, scale, 1.0, total, places)
    aspect = np.exp(_draw(rng, -np.log(ratio), np.log(ratio), total, places))
    ch = np.clip(np.sqrt(area / aspect) * h, 1.0, h)  # the crop's height and width in pixels
    cw = np.clip(np.sqrt(area * aspect) * w, 1.0, w)
    top = _draw(rng, 0.0, 1.0, total, places) * (h - ch)
    left = _draw(rng, 0.0, 1.0, total, places) * (w - cw)
    # where each output pixel's centre falls in the input, in pixel coordinates: rows, then columns (separable)
    ys = np.clip(top[:, None] + (np.arange(h) + 0.5) * (ch / h)[:, None] - 0.5, 0, h - 1)
    xs = np.clip(left[:, None] + (np.arange(w) + 0.5) * (cw / w)[:, None] - 0.5, 0, w - 1)
    y0, x0 = ys.astype(np.int64), xs.astype(np.int64)  # floor: both are at least 0
    y1, x1 = np.minimum(y0 + 1, h - 1), np.minimum(x0 + 1, w - 1)
    wy, wx = (ys - y0).astype(np.float32), (xs - x0).astype(np.float32)
    out = np.empty(images.shape, np.float32)
    for k in range(n):  # an image at a time: gathers along one axis are numpy's fast case
        image = images[k].astype(np.float32)
        upper, lower = image[:, y0[k]], image[:, y1[k]]
        rows = upper + (lower - upper) * wy[k][:, None]
        before, after = rows[:, :, x0[k]], rows[:, :, x1[k]]
        out[k] = before + (after - before) * wx[k]
    return np.rint(out).astype(np.uint8)


def colour_jitter(images: np.ndarray, strength: float, rng: np.random.Generator, places, total: int) -> np.ndarray:
    """Each image's brightness, contrast and (in colour) saturation scaled by its own factors in
    [1 - strength, 1 + strength], in that order: contrast about the image's mean grey, saturation about each
    pixel's grey (GREY's weights), clipped to 0..255 once at the end."""
    low, high = max(0.0, 1 - strength), 1 + strength
    b, c, s = (_draw(rng, low, high, total, places).astype(np.float32)[:, None, None, None] for _ in range(3))
    x = images.astype(np.float32)
    if x.shape[1] == 3:
        grey = x[:, 0] * GREY[0]  # (N, H, W), summed a channel at a time: no transposed copy
        grey += x[:, 1] * GREY[1]
        grey += x[:, 2] * GREY[2]
    else:
        grey, s = x[:, 0].copy(), np.ones_like(s)  # no saturation in grey
    mean = grey.mean(axis=(1, 2), dtype=np.float32)[:, None, None, None]
    # the three steps in one: b x, then about its mean grey b m times c, then about each pixel's grey times s
    x *= s * c * b
    grey *= (c * b * (1 - s))[:, 0]
    x += grey[:, None]
    x += b * mean * (1 - c)
    np.clip(x, 0, 255, out=x)
    return np.rint(x, out=x).astype(np.uint8)


def erase_rectangles(
    images: np.ndarray, chance: float, rng: np.random.Generator, places, total: int, area=(0.02, 0.25), ratio=3.3
) -> np.ndarray:
    """With the given chance per image, a rectangle of a random share of its area (in `area`) and aspect ratio
    (in [1/ratio, ratio], on a log scale), at a random place, painted in one random colour."""
    n, c, h, w = images.shape
    erased = rng.random(total)[places] < chance
    share = _draw(rng, *area, total, places)
    aspect = np.exp(_draw(rng, -np.log(ratio), np.log(ratio), total, places))
    eh = np.clip(np.rint(np.sqrt(share * aspect) * h), 1, h).astype(np.int64)
    ew = np.clip(np.rint(np.sqrt(share / aspect) * w), 1, w).astype(np.int64)
    top = (_draw(rng, 0.0, 1.0, total, places) * (h - eh + 1)).astype(np.int64)
    left = (_draw(rng, 0.0, 1.0, total, places) * (w - ew + 1)).astype(np.int64)
    colours = rng.integers(0, 256, size=(total, c))[places].astype(np.uint8)
    out = images.copy()
    for k in np.flatnonzero(erased):
        out[k, :, top[k] : top[k] + eh[k], left[k] : left[k] + ew[k]] = colours[k][:, None, None]
    return out


def mix_pairs(
    images: np.ndarray,
    labels: np.ndarray,
    policy: Augment,
    rng: np.random.Generator,
    position: int | np.ndarray = 0,
    total: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Mixup and cutmix by pairs of places in the global batch: places 2j and 2j + 1 are partners (the sampler
    shuffles, so the pairs are random), and each image is mixed with its partner's unmixed image by its own weight
    lam drawn from Beta(a, a): mixup blends the two, lam times its own; cutmix pastes the partner's rectangle of
    1 - lam of the area at a random centre, and lam becomes the part of its own pixels left. With both, each image
    takes one of the two with chance 1/2. position and total as in shift_and_flip; a worker's images must form
    whole pairs (config.global_batch asks for micro-batches of an even number of images).

    Returns the mixed uint8 images and float32 label rows (own label, partner's label, lam), which the step's loss
    reads as lam times its own label's loss plus 1 - lam times the partner's (training/engine.image_losses).
    """
    n, _, h, w = images.shape
    total = n if total is None else total
    places = np.arange(position, position + n) if np.ndim(position) == 0 else np.asarray(position)
    partner = np.arange(n) ^ 1
    if n % 2 or not np.array_equal(places[partner], places ^ 1):
        raise ValueError(f"mixing needs whole pairs of places among a worker's images; got places {places.tolist()}")
    if policy.mixup and policy.cutmix:
        cut = rng.random(total)[places] < 0.5
    else:
        cut = np.full(n, bool(policy.cutmix))
    blend = rng.beta(policy.mixup, policy.mixup, total)[places] if policy.mixup else np.ones(n)
    paste = rng.beta(policy.cutmix, policy.cutmix, total)[places] if policy.cutmix else np.ones(n)
    centre = rng.random((2, total))[:, places] * np.array([[h], [w]])
    lam = np.where(cut, paste, blend)
    out = np.rint(
        images.astype(np.float32) * blend[:, None, None, None].astype(np.float32)
        + images[partner].astype(np.float32) * (1 - blend[:, None, None, None]).astype(np.float32)
    ).astype(np.uint8)
    side = np.sqrt(1 - paste)
    for k in np.flatnonzero(cut):
        (top, bottom), (left, right) = (
            np.clip(np.rint([c - size * side[k] / 2, c + size * side[k] / 2]), 0, size).astype(int)
            for c, size in zip(centre[:, k], (h, w))
        )
        out[k] = images[k]
        out[k, :, top:bottom, left:right] = images[partner[k], :, top:bottom, left:right]
        lam[k] = 1 - (bottom - top) * (right - left) / (h * w)
    rows = np.stack([labels, labels[partner], lam], axis=1).astype(np.float32)
    return out, rows

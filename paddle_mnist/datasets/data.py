"""Datasets held once in memory as uint8, checked on load, served as whole normalised batches by a background thread."""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from paddle_mnist.config import DATASETS, PHOTO_OPERATIONS
from paddle_mnist.datasets import augment, download, formats
from paddle_mnist.datasets.datafiles import (
    CIFAR_ARCHIVE,
    IDX_FILES,
    MNIST_JSON,
    REPO_DATA,
    SUMS,
    file_digest,
    read_sums,
)
from paddle_mnist.datasets.formats import DataError

DIGITS = tuple(str(i) for i in range(10))
FASHION = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")


@dataclass(frozen=True)
class Split:
    images: np.ndarray  # uint8, (N, C, H, W)
    labels: np.ndarray  # int64, (N,)

    def __len__(self) -> int:
        return len(self.labels)

    def head(self, n: int) -> Split:
        return self if n <= 0 or n >= len(self) else Split(self.images[:n], self.labels[:n])


@dataclass(frozen=True)
class Dataset:
    name: str
    train: Split
    val: Split  # scored every epoch
    test: Split  # scored once at the end; the same object as val when the dataset has no validation split
    mean: tuple[float, ...]  # per channel, pixels scaled to [0, 1], from the whole training split
    std: tuple[float, ...]
    classes: tuple[str, ...]
    mirror_asymmetry: float | None = None  # a folder's, measured (augment.mirror_asymmetry): the start-up line's hint

    @property
    def val_is_test(self) -> bool:
        return self.val is self.test

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return tuple(self.train.images.shape[1:])


# what each built-in dataset's files are, for the message when --data-dir holds class folders instead
FORMATS = {
    "mnist": "MNIST's idx files",
    "fashion-mnist": "Fashion-MNIST's idx files",
    "cifar10": "CIFAR-10's python batches",
    "mnist-json": "an mnist.json file",
}


class MissingFiles(DataError):
    """A built-in dataset's files are not where --data-dir (or data/NAME) points."""


def _missing(folder: Path, name: str, what: str) -> MissingFiles:
    return MissingFiles(
        f"{folder}: {what}; run python -m paddle_mnist.download {name} (on a machine with network), "
        "or put the files there, or pass --data-dir"
    )


def _class_folder(folder: Path) -> str | None:
    """train/<class>, the first class folder of --dataset folder's layout under folder; None where it has none."""
    train = folder / "train"
    try:
        names = sorted(p.name for p in train.iterdir() if p.is_dir() and not p.name.startswith("."))
    except OSError:  # no train/ folder, or not one this process may list
        return None
    return f"train/{names[0]}" if names else None


def verify_checksums(folder: Path) -> None:
    """Check every file named in folder/SHA256SUMS (sha256sum format); no list, nothing to check."""
    listing = folder / SUMS
    for name, digest in (read_sums(folder) or {}).items():
        path = folder / name
        if not path.is_file():
            raise DataError(f"{path}: listed in {listing} but missing; restore it")
        if file_digest(path, "sha256") != digest:
            raise DataError(f"{path}: SHA-256 does not match {listing}; the file is damaged, restore a good copy")


def _find(folder: Path, stem: str) -> Path:
    for name in (stem + ".gz", stem):
        if (folder / name).is_file():
            return folder / name
    raise _missing(folder, folder.name, f"no {stem}[.gz]")


def load_split(folder: Path, split: str) -> Split:
    image_stem, label_stem = IDX_FILES[split]
    ipath, lpath = _find(folder, image_stem), _find(folder, label_stem)
    images, labels = formats.check_pair(formats.read_idx(ipath, 3), formats.read_idx(lpath, 1), f"{ipath}, {lpath}")
    return Split(images[:, None], labels)  # a channel axis, as a view


def _cifar_source(path: Path) -> Path:
    """The archive or the extracted batch folder, whichever --data-dir (or data/cifar10) leads to."""
    if path.is_file():
        return path
    for candidate in (path / CIFAR_ARCHIVE, path / formats.CIFAR_FOLDER, path):
        if candidate.is_file() or (candidate / formats.CIFAR_TRAIN[0]).is_file():
            return candidate
    raise _missing(path, "cifar10", f"neither {CIFAR_ARCHIVE} nor {formats.CIFAR_FOLDER}/ is here")


def channel_stats(images: np.ndarray, chunk: int = 4096) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Exact per-channel mean and std of uint8 images, scaled to [0, 1], from pixel histograms.

    Counting the 256 values per channel needs no float copy of the dataset, so memory stays flat.
    """
    counts = np.zeros((images.shape[1], 256), np.int64)
    for lo in range(0, len(images), chunk):
        block = images[lo : lo + chunk]
        for c in range(images.shape[1]):
            counts[c] += np.bincount(block[:, c].ravel(), minlength=256)
    levels = np.arange(256) / 255.0
    total = counts.sum(axis=1)
    mean = counts @ levels / total
    std = np.sqrt(np.maximum(counts @ levels**2 / total - mean**2, 1e-12))
    return tuple(float(m) for m in mean), tuple(float(s) for s in std)


def _read(name: str, path: Path) -> tuple[Split, Split, Split, tuple[str, ...]]:
    """(train, val, test, class names); val is test when the format has no validation split."""
    if name in ("mnist", "fashion-mnist"):
        train, test = load_split(path, "train"), load_split(path, "test")
        return train, test, test, FASHION if name == "fashion-mnist" else DIGITS
    if name == "cifar10":
        train, test, classes = formats.read_cifar10(_cifar_source(path))
        test = Split(*test)
        return Split(*train), test, test, classes
    file = path if path.is_file() else path / MNIST_JSON
    if not file.is_file():
        raise _missing(path, name, f"no {MNIST_JSON}")
    parts = formats.read_mnist_json(file)
    return Split(*parts["train"]), Split(*parts["valid"]), Split(*parts["eval"]), DIGITS


def load_dataset(name: str, data_dir: str | None = None) -> Dataset:
    if name not in DATASETS:
        raise DataError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")
    path = Path(data_dir) if data_dir else REPO_DATA / name
    if name == "mnist-json" and not data_dir:
        download.build_shipped_mnist_json(path)  # in 10 s or so, the first time, from data/mnist
    if not path.exists():
        raise _missing(path, name, "no such folder")
    verify_checksums(path if path.is_dir() else path.parent)
    try:
        train, val, test, classes = _read(name, path)
    except MissingFiles:
        if example := _class_folder(path):  # the layout --dataset folder reads: say so, not how to download
            raise DataError(
                f"{path} holds class folders ({example}/...), not {FORMATS[name]}: "
                f"pass --dataset folder --data-dir {path}"
            ) from None
        raise
    mean, std = channel_stats(train.images)
    return Dataset(name, train, val, test, mean, std, classes)


def normalise(images: np.ndarray, mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
    """uint8 (N, C, H, W) -> float32, standardised per channel as one array operation."""
    scale = (1.0 / (255.0 * np.asarray(std, np.float32))).reshape(1, -1, 1, 1)
    shift = (np.asarray(mean, np.float32) / np.asarray(std, np.float32)).reshape(1, -1, 1, 1)
    x = images.astype(np.float32)
    x *= scale
    x -= shift
    return x


def sampler_epoch(seed: int, epoch: int) -> int:
    """The value for DistributedBatchSampler.set_epoch: Paddle seeds its shuffle with it alone, so fold in the seed."""
    return (seed * 1_000_003 + epoch) % 2**32


def eval_shard(n: int, rank: int, world_size: int) -> range:
    """Contiguous, disjoint shards that cover 0..n-1 exactly once; sizes differ by at most one."""
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


def worker_places(per_worker: int, rank: int, world_size: int, accum: int = 1) -> np.ndarray:
    """The places in a global batch of a worker's share, in the order it trains them: for each of the accum
    micro-batches, its slice of that global micro-batch (every worker's micro-batch i together are places
    i * M .. i * M + M - 1, M the global micro-batch), so that batch norm over the global batch normalises the
    micro-batches one process with the same --accum-steps would. Without accumulation: rank * n .. rank * n + n - 1."""
    m = per_worker // accum
    return np.concatenate([i * m * world_size + rank * m + np.arange(m) for i in range(accum)])


@dataclass(frozen=True)
class AugmentPlan:
    """What batches() needs to draw one batch's augmentation: the policy and the batch's coordinates."""

    policy: augment.Augment
    seed: int
    epoch: int
    rank: int  # this worker's share of each global batch: worker_places(n, rank, world_size, accum)
    world_size: int
    accum: int = 1


def photo_ops(cfg) -> dict:
    """cfg's photo augmentation (--crop-scale, --jitter, --erase, --mixup, --cutmix) as augment.policy_for takes it."""
    return {key: getattr(cfg, key) for key in PHOTO_OPERATIONS}


def batches(
    split: Split, ds: Dataset, index_batches: Iterable, plan: AugmentPlan | None = None, first: int = 0
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(float32 images, int64 labels) per index batch; with a plan, batch number first + k is augmented, and where
    it mixes pairs of images (--mixup, --cutmix) the labels are float32 rows (label, partner's label, lam)."""
    for k, idx in enumerate(index_batches, start=first):
        idx = np.asarray(idx)
        images, labels = split.images[idx], split.labels[idx]
        if plan is not None:
            rng = augment.batch_rng(plan.seed, plan.epoch, k)
            n = len(idx)
            places = worker_places(n, plan.rank, plan.world_size, plan.accum)
            images = augment.augment_batch(images, plan.policy, rng, places, plan.world_size * n)
            if plan.policy.mixes:
                images, labels = augment.mix_pairs(images, labels, plan.policy, rng, places, plan.world_size * n)
        yield normalise(images, ds.mean, ds.std), labels


class IndexSpace:
    """What DistributedBatchSampler needs of a dataset: its length. Batches are built from indices."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


def make_sampler(n: int, per_worker: int, rank: int, world_size: int):
    """Each worker's share of every global batch of n images (a paddle.io.DistributedBatchSampler): per_worker
    indices, disjoint across workers. Paddle is imported here, so that reading data (and the download command)
    does not load it."""
    import paddle

    return paddle.io.DistributedBatchSampler(
        IndexSpace(n), batch_size=per_worker, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True
    )


@dataclass(frozen=True)
class Batches:
    """One epoch's batches for one worker, from batch number `first` on, `count` of them, assembled ahead."""

    first: int
    count: int
    items: Iterator[tuple[np.ndarray, np.ndarray]]

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        return self.items

    def close(self) -> None:
        self.items.close()  # stops the assembling thread


class TrainBatches:
    """A worker's training batches over a run: its share of each global batch (DistributedBatchSampler, shuffled
    anew each epoch from the run's seed), augmented as the run asks, normalised, assembled in a background thread.

    Batch k of an epoch is the same whether the epoch is trained whole or resumed from a checkpoint at batch j < k:
    its augmentation is drawn from (seed, epoch, k) alone, for the whole global batch, so that each image gets the
    same shift and flip on any number of workers.
    """

    def __init__(self, split: Split, ds: Dataset, per_worker: int, rank: int, world_size: int, cfg):
        self.split, self.ds, self.rank, self.world_size = split, ds, rank, world_size
        self.sampler = make_sampler(len(split), per_worker, rank, world_size)
        self.accum = cfg.accum_steps
        # with micro-batches on several workers, each worker's share of a global batch is worker_places of it,
        # picked from the global batch, which every rank's sampler gives a part of
        spread = range(world_size) if self.accum > 1 and world_size > 1 else range(0)
        self.samplers = [make_sampler(len(split), per_worker, r, world_size) for r in spread]
        self.places = worker_places(per_worker, rank, world_size, self.accum)
        self.seed = cfg.seed
        self.policy = (
            augment.policy_for(ds.name, ds.image_shape, cfg.shift, cfg.flip, **photo_ops(cfg)) if cfg.augment else None
        )

    def __len__(self) -> int:
        return len(self.sampler)  # batches per epoch

    def _shares(self, epoch: int) -> Iterator:
        """This worker's index batches of the epoch."""
        self.sampler.set_epoch(sampler_epoch(self.seed, epoch))
        if not self.samplers:
            return iter(self.sampler)
        for sampler in self.samplers:
            sampler.set_epoch(sampler_epoch(self.seed, epoch))
        return (np.concatenate(parts)[self.places] for parts in zip(*self.samplers))

    def epoch(self, epoch: int, first: int, count: int, stage=None) -> Batches:
        """stage: a last step for each batch in the background thread (transfer.Feed.host), or None."""
        plan = None
        if self.policy:
            plan = AugmentPlan(self.policy, self.seed, epoch, self.rank, self.world_size, self.accum)
        indices = itertools.islice(self._shares(epoch), first, first + count)
        return Batches(first, count, prefetch(batches(self.split, self.ds, indices, plan, first=first), stage=stage))


def prefetch(it: Iterator, depth: int = 2, stage=None) -> Iterator:
    """Run a batch iterator in a background thread so batch assembly overlaps the step; stage(item), if given,
    runs there too."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    done = object()
    stop = threading.Event()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in it:
                if not put(stage(item) if stage else item):
                    return
        except BaseException as e:  # handed to the consumer, raised there
            put(e)
            return
        put(done)

    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    try:
        while (item := q.get()) is not done:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()

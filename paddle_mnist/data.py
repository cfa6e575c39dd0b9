"""Datasets held in memory as uint8, checked against their checksums, served in whole batches."""

from __future__ import annotations

import gzip
import hashlib
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO_DATA = Path(__file__).resolve().parent.parent / "data"
IDX_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
# mean and std of the training pixels scaled to [0, 1], computed once on the full training splits
NORMALISATION = {"fashion-mnist": (0.2860, 0.3530), "mnist": (0.1307, 0.3081)}
CLASS_NAMES = {
    "fashion-mnist": (
        "T-shirt/top",
        "Trouser",
        "Pullover",
        "Dress",
        "Coat",
        "Sandal",
        "Shirt",
        "Sneaker",
        "Bag",
        "Ankle boot",
    ),
    "mnist": tuple(str(i) for i in range(10)),
}


class DataError(ValueError):
    """A dataset file that is missing, damaged or not what it claims to be."""


@dataclass(frozen=True)
class Split:
    images: np.ndarray  # uint8, (N, H, W)
    labels: np.ndarray  # int64, (N,)

    def __len__(self) -> int:
        return len(self.labels)

    def head(self, n: int) -> Split:
        return self if n <= 0 or n >= len(self) else Split(self.images[:n], self.labels[:n])


@dataclass(frozen=True)
class Dataset:
    name: str
    train: Split
    test: Split
    mean: float
    std: float
    classes: tuple[str, ...]


def _read_bytes(path: Path) -> bytes:
    try:
        raw = path.read_bytes()
        return gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise DataError(f"{path}: cannot read it ({e}); replace the file with a good copy") from e


def parse_idx(data: bytes, path: Path, ndim: int) -> np.ndarray:
    """Decode an idx file (the MNIST format): magic 0x0000 0x08 ndim, big-endian sizes, uint8 data."""
    if len(data) < 4 + 4 * ndim:
        raise DataError(f"{path}: {len(data)} bytes is too short for an idx header")
    if data[:2] != b"\0\0" or data[2] != 0x08 or data[3] != ndim:
        raise DataError(
            f"{path}: wrong magic number {data[:4].hex()} (want 000008{ndim:02x}: uint8, {ndim} dimensions)"
        )
    shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    want = int(np.prod(shape)) + 4 + 4 * ndim
    if len(data) != want:
        raise DataError(f"{path}: header promises shape {shape} ({want} bytes) but the file has {len(data)} bytes")
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def _find(folder: Path, stem: str) -> Path:
    for name in (stem + ".gz", stem):
        if (folder / name).is_file():
            return folder / name
    raise DataError(f"{folder}: no {stem}[.gz]; put the dataset's four idx files there or pass --data-dir")


def verify_checksums(folder: Path) -> None:
    """Check every file named in folder/SHA256SUMS (sha256sum format); no list, nothing to check."""
    listing = folder / "SHA256SUMS"
    if not listing.is_file():
        return
    for line in listing.read_text().splitlines():
        if not line.strip():
            continue
        digest, name = line.split(maxsplit=1)
        path = folder / name.lstrip("*")
        if not path.is_file():
            raise DataError(f"{path}: listed in {listing} but missing; restore it (git checkout -- {path})")
        if hashlib.sha256(path.read_bytes()).hexdigest() != digest:
            raise DataError(f"{path}: SHA-256 does not match {listing}; the file is damaged, restore a good copy")


def load_split(folder: Path, split: str) -> Split:
    image_stem, label_stem = IDX_FILES[split]
    ipath, lpath = _find(folder, image_stem), _find(folder, label_stem)
    images = parse_idx(_read_bytes(ipath), ipath, 3)
    labels = parse_idx(_read_bytes(lpath), lpath, 1)
    if len(images) != len(labels):
        raise DataError(f"{ipath} has {len(images)} images but {lpath} has {len(labels)} labels")
    if len(labels) == 0:
        raise DataError(f"{ipath}: the split is empty")
    if labels.max() > 9:
        raise DataError(f"{lpath}: label {int(labels.max())} is outside 0..9")
    return Split(images, labels.astype(np.int64))


def load_dataset(name: str, data_dir: str | None = None) -> Dataset:
    folder = Path(data_dir) if data_dir else REPO_DATA / name
    if not folder.is_dir():
        raise DataError(f"{folder}: no such folder; put the {name} idx files there or pass --data-dir")
    verify_checksums(folder)
    mean, std = NORMALISATION[name]
    return Dataset(name, load_split(folder, "train"), load_split(folder, "test"), mean, std, CLASS_NAMES[name])


def normalise(images: np.ndarray, mean: float, std: float) -> np.ndarray:
    """uint8 (N, H, W) -> float32 (N, 1, H, W), scaled and standardised as one array operation."""
    x = images.astype(np.float32)[:, None]
    x *= 1.0 / (255.0 * std)
    x -= mean / std
    return x


def sampler_epoch(seed: int, epoch: int) -> int:
    """The value for DistributedBatchSampler.set_epoch: Paddle seeds its shuffle with it alone, so fold in the seed."""
    return (seed * 1_000_003 + epoch) % 2**32


def eval_shard(n: int, rank: int, world_size: int) -> range:
    """Contiguous, disjoint shards that cover 0..n-1 exactly once; sizes differ by at most one."""
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


def batches(split: Split, index_batches, mean: float, std: float) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    for idx in index_batches:
        idx = np.asarray(idx)
        yield normalise(split.images[idx], mean, std), split.labels[idx]


def prefetch(it: Iterator, depth: int = 2) -> Iterator:
    """Run a batch iterator in a background thread so batch assembly overlaps the step."""
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
                if not put(item):
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

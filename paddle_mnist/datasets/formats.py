"""Readers for the dataset files: idx (MNIST, Fashion-MNIST), the CIFAR-10 python archive, the course's mnist.json.gz.

Every reader checks what it reads and raises DataError naming the file and the problem; none of them trains on
a partial file. Images come back as uint8 (N, C, H, W), labels as int64 (N,).
"""

from __future__ import annotations

import gzip
import json
import re
import tarfile
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from paddle_mnist.files import safeload

CIFAR_FOLDER = "cifar-10-batches-py"
CIFAR_TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR_TEST = "test_batch"
CIFAR_META = "batches.meta"
CIFAR_SHAPE = (3, 32, 32)


class DataError(ValueError):
    """A dataset file that is missing, damaged or not what it claims to be."""


def read_bytes(path: Path) -> bytes:
    """The file's bytes, gunzipped when they start with the gzip magic number."""
    try:
        raw = Path(path).read_bytes()
        return gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw
    except (OSError, EOFError, zlib.error) as e:
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


def read_idx(path: Path, ndim: int) -> np.ndarray:
    return parse_idx(read_bytes(path), path, ndim)


def check_pair(images: np.ndarray, labels: np.ndarray, where: str, classes: int = 10) -> tuple[np.ndarray, np.ndarray]:
    """The checks every split must pass, whatever its format; labels come back as int64."""
    if len(images) != len(labels):
        raise DataError(f"{where}: {len(images)} images but {len(labels)} labels")
    if len(labels) == 0:
        raise DataError(f"{where}: the split is empty")
    labels = np.asarray(labels)
    if labels.min() < 0 or labels.max() >= classes:
        bad = int(labels.max() if labels.max() >= classes else labels.min())
        raise DataError(f"{where}: label {bad} is outside 0..{classes - 1}")
    return images, labels.astype(np.int64)


# ---- CIFAR-10: pickled dicts inside a tar.gz; loaded without ever running code from the file ----


def safe_unpickle(data: bytes, where: str) -> object:
    try:
        return safeload.loads(data, safeload.NUMPY, encoding="bytes")
    except safeload.Refused as e:
        raise DataError(f"{where}: {e}; CIFAR-10 batches hold only arrays and lists, so this is not one") from e
    except Exception as e:  # a damaged pickle fails in many ways: EOFError, ValueError, KeyError, ...
        raise DataError(f"{where}: not a readable CIFAR-10 batch ({type(e).__name__}: {e})") from e


def _field(batch: dict, key: str, where: str):
    for k in (key.encode(), key):
        if k in batch:
            return batch[k]
    raise DataError(f"{where}: no '{key}' entry; this is not a CIFAR-10 python batch")


def cifar_batch(data: bytes, where: str) -> tuple[np.ndarray, np.ndarray]:
    """One batch file: a dict with 'data' (N, 3072) uint8 and 'labels' (N,) ints."""
    batch = safe_unpickle(data, where)
    if not isinstance(batch, dict):
        raise DataError(f"{where}: holds a {type(batch).__name__}, not a CIFAR-10 batch dict")
    images = _field(batch, "data", where)
    labels = np.asarray(_field(batch, "labels", where))
    if not isinstance(images, np.ndarray) or images.dtype != np.uint8 or images.ndim != 2:
        kind = f"{images.dtype} array of shape {images.shape}" if isinstance(images, np.ndarray) else type(images)
        raise DataError(f"{where}: 'data' is a {kind}, want a uint8 array of shape (N, 3072)")
    if images.shape[1] != int(np.prod(CIFAR_SHAPE)):
        raise DataError(f"{where}: 'data' rows hold {images.shape[1]} values, want 3072 (3 x 32 x 32)")
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise DataError(f"{where}: 'labels' must be a list of integers")
    return check_pair(images.reshape(-1, *CIFAR_SHAPE), labels, where)


class _CifarSource:
    """The batch files of cifar-10-python.tar.gz or of its extracted cifar-10-batches-py/ folder."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.tar: tarfile.TarFile | None = None
        if self.path.is_file():
            try:
                with open(self.path, "rb") as f:
                    gzipped = f.read(2) == b"\x1f\x8b"
                self.tar = tarfile.open(self.path, "r:gz" if gzipped else "r:")
                self.members = {Path(m.name).name: m for m in self.tar.getmembers() if m.isfile()}
            except (tarfile.TarError, OSError, EOFError, zlib.error) as e:
                raise DataError(f"{self.path}: not a readable tar archive ({e}); download it again") from e

    def read(self, name: str) -> bytes:
        if self.tar is None:
            file = self.path / name
            if not file.is_file():
                raise DataError(
                    f"{file}: missing; the CIFAR-10 folder must hold {', '.join(CIFAR_TRAIN)}, {CIFAR_TEST}"
                )
            return file.read_bytes()
        member = self.members.get(name)
        if member is None:
            raise DataError(f"{self.path}: the archive has no member {CIFAR_FOLDER}/{name}; download it again")
        try:
            return self.tar.extractfile(member).read()
        except (tarfile.TarError, OSError, EOFError, zlib.error) as e:
            raise DataError(f"{self.path}: member {member.name} is damaged ({e}); download it again") from e

    def where(self, name: str) -> str:
        return f"{self.path}:{name}" if self.tar is not None else str(self.path / name)

    def close(self) -> None:
        if self.tar is not None:
            self.tar.close()


def read_cifar10(path: Path) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray], tuple[str, ...]]:
    """(train, test, class names) from cifar-10-python.tar.gz or a cifar-10-batches-py/ folder.

    The five training batches are copied into one preallocated array, so the training split is held once.
    """
    source = _CifarSource(path)
    try:
        images = labels = None
        for i, name in enumerate(CIFAR_TRAIN):
            x, y = cifar_batch(source.read(name), source.where(name))
            if images is None:
                per = len(x)
                images = np.empty((per * len(CIFAR_TRAIN), *CIFAR_SHAPE), np.uint8)
                labels = np.empty(len(images), np.int64)
            if len(x) != per:
                first = source.where(CIFAR_TRAIN[0])
                raise DataError(f"{source.where(name)}: {len(x)} images, but {first} has {per}; download it again")
            images[i * per : (i + 1) * per] = x
            labels[i * per : (i + 1) * per] = y
        test = cifar_batch(source.read(CIFAR_TEST), source.where(CIFAR_TEST))
        meta = safe_unpickle(source.read(CIFAR_META), source.where(CIFAR_META))
    finally:
        source.close()
    names = meta.get(b"label_names", meta.get("label_names")) if isinstance(meta, dict) else None
    if not isinstance(names, list) or len(names) != 10:
        raise DataError(f"{source.where(CIFAR_META)}: want 'label_names', a list of the 10 class names")
    classes = tuple(n.decode() if isinstance(n, bytes) else str(n) for n in names)
    return (images, labels), test, classes


# ---- mnist.json.gz of the PaddlePaddle course: [train, valid, eval], each [images, labels] ----

MNIST_JSON_SPLITS = ("train", "valid", "eval")
_SPACE = re.compile(r"[ \t\n\r]*")


class _JsonCursor:
    """Walks the course file's nested lists one image at a time with the standard JSON decoder.

    json.loads of the whole file would build some 55 million Python floats (about 3 GB per worker, and
    the allocator keeps much of it afterwards); decoding image by image keeps only the text and the arrays.
    """

    def __init__(self, text: str, path: Path):
        self.text, self.path, self.pos = text, path, 0
        self.decoder = json.JSONDecoder()

    def fail(self, what: str) -> DataError:
        return DataError(f"{self.path}: not valid JSON for this format: {what} at character {self.pos}")

    def next_char(self) -> str:
        self.pos = _SPACE.match(self.text, self.pos).end()
        return self.text[self.pos : self.pos + 1]

    def take(self, char: str, what: str) -> None:
        if self.next_char() != char:
            raise self.fail(f"expected {char!r} opening {what}")
        self.pos += 1

    def items(self, what: str) -> Iterator[int]:
        """Yield 0, 1, ... with the cursor on each element of a JSON list."""
        self.take("[", what)
        if self.next_char() == "]":
            self.pos += 1
            return
        k = 0
        while True:
            yield k
            k += 1
            char = self.next_char()
            self.pos += 1
            if char == "]":
                return
            if char != ",":
                self.pos -= 1
                raise self.fail(f"expected ',' or ']' in {what}")

    def value(self) -> object:
        self.next_char()
        try:
            value, self.pos = self.decoder.raw_decode(self.text, self.pos)
        except json.JSONDecodeError as e:
            raise DataError(f"{self.path}: not valid JSON ({e}); download or rebuild the file") from e
        return value

    def end(self) -> None:
        if self.next_char():
            raise self.fail("unexpected text after the data")


def _json_row(row: object, where: str, index: int) -> np.ndarray:
    if not isinstance(row, list) or len(row) != 784:
        size = len(row) if isinstance(row, list) else type(row).__name__
        raise DataError(f"{where}: image {index} has {size} values, want 784 (a flat 28 x 28 image)")
    try:
        return np.asarray(row, dtype=np.float32)
    except (ValueError, TypeError) as e:
        raise DataError(f"{where}: image {index} holds something other than numbers ({e})") from e


def _json_images(rows: list[np.ndarray], where: str) -> np.ndarray:
    x = np.stack(rows) if rows else np.zeros((0, 784), np.float32)
    rows.clear()
    if len(x) and (not np.isfinite(x).all() or x.min() < -1.0 or x.max() > 1.0):
        raise DataError(f"{where}: pixel values must lie in [0, 1] or [-1, 1], found {x.min():.3g}..{x.max():.3g}")
    if len(x) and x.min() < 0:  # the [-1, 1] convention
        x += 1.0
        x *= 0.5
    x *= 255.0
    return np.rint(x, out=x).astype(np.uint8).reshape(-1, 1, 28, 28)


def read_mnist_json(path: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{'train', 'valid', 'eval'} -> (uint8 images, int64 labels). Parsed as JSON only, never executed."""
    try:
        text = read_bytes(path).decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not valid JSON (not UTF-8 text: {e}); download or rebuild the file") from e
    cursor = _JsonCursor(text, path)
    out = {}
    for k in cursor.items("the [train, valid, eval] list"):
        if k >= len(MNIST_JSON_SPLITS):
            raise DataError(f"{path}: want a JSON list [train, valid, eval], found more than three splits")
        where = f"{path} ({MNIST_JSON_SPLITS[k]} split)"
        rows: list[np.ndarray] = []
        labels = None
        for part in cursor.items(f"the {MNIST_JSON_SPLITS[k]} split [images, labels]"):
            if part == 0:
                rows = [_json_row(cursor.value(), where, i) for i in cursor.items(f"{where} images")]
            elif part == 1:
                labels = cursor.value()
            else:
                raise DataError(f"{where}: want [images, labels], found more than two parts")
        if labels is None:
            raise DataError(f"{where}: want [images, labels]")
        if not isinstance(labels, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in labels):
            raise DataError(f"{where}: labels must be a list of integers")
        out[MNIST_JSON_SPLITS[k]] = check_pair(_json_images(rows, where), np.asarray(labels, np.int64), where)
    cursor.end()
    if len(out) != len(MNIST_JSON_SPLITS):
        raise DataError(f"{path}: want a JSON list [train, valid, eval], found {len(out)} split(s)")
    return out

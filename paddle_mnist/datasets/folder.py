"""Your own images: DIR/train/<class>/ (val/, test/) listed and checked, decoded once into a memory-mapped cache."""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import logging
import multiprocessing
import os
import re
import shutil
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from paddle_mnist.config import image_size
from paddle_mnist.datasets import augment, data, preprocess
from paddle_mnist.datasets.formats import DataError
from paddle_mnist.files import atomic

CACHE_NAME = ".paddle_mnist-cache"  # inside --data-dir; elsewhere when that is read-only (cache_dir)
MANIFEST = "manifest.json"
FORMAT = 2  # of the cache's files; with preprocess.VERSION in every manifest. 2: one folder per decoded setting
PROGRESS_S = 15.0  # how often a build logs how far it has got
VAL_NAMES = ("val", "valid")
CHUNK = 256  # files per task of the decoding pool
SAMPLE = 1000  # files of train/ whose headers choose the size and channels of the first decoding pass
# without --image-size, a folder of larger images trains at a shorter side of DEFAULT_SIDE pixels and a longer side
# of at most LONGEST_SIDE (default_size); docs/training.md#any-image-size has the measurements behind them
DEFAULT_SIDE, LONGEST_SIDE = 64, 256
CACHE_SHARE = 0.5  # the most of the free disk space a new cache may take
# what follows "<cache name>." in a build's temporary (tmp) or moved-aside (old) folder: the builder's pid and
# host (none in the names of builds before hosts were named)
LEFTOVER = re.compile(r"(?:tmp|old)(\d+)(?:@(.+))?")


@dataclass(frozen=True)
class Entry:
    path: str  # relative to the folder, with forward slashes
    size: int
    mtime_ns: int
    label: int

    @property
    def key(self) -> str:
        """A fixed pseudo-random rank of the file, from its path alone: orders the cache and picks the hold-out."""
        return hashlib.sha1(self.path.encode()).hexdigest()


@dataclass(frozen=True)
class LabelFile:
    """A label file a split was listed from (--labels, datasets/labels.py)."""

    path: Path
    sha256: str  # of its contents: a relabelled row changes the cache's identity, where no image file changed
    rows: int  # rows that name an image, bad ones included
    bad: tuple[str, ...]  # the rows left out, "name:line: why"


@dataclass(frozen=True)
class Listing:
    root: Path  # the folder; for label files, the --labels file's folder, which Entry.path is relative to
    classes: tuple[str, ...]
    splits: dict[str, list[Entry]]  # "train", and "val" (val/ or valid/) and "test" when the folder has them
    ignored: tuple[str, ...]  # files that are not images by their extension (e.g. notes.txt)
    label_files: dict[str, LabelFile] = field(default_factory=dict)  # by split, where listed from label files

    def where(self, split: str) -> str:
        """What a message names for a split's images: its label file, or the split's folder."""
        return str(self.label_files[split].path) if split in self.label_files else str(self.root / split)


@dataclass(frozen=True)
class Request:
    """What the command line asks of the cache. A cache serves every request that decodes to the same pixels: an
    explicit --image-size or --channels equal to what the folder's defaults resolve to reuses it."""

    size: tuple[int, int] | None  # (width, height) of --image-size; None: the most common size in train/
    channels: int  # 1, 3 or 0 (grey when every image is)
    val_split: float
    skip_bad_images: bool

    @classmethod
    def of(cls, cfg) -> Request:
        """The request of a run's flags, --image-size read once here."""
        return cls(image_size(cfg.image_size), cfg.channels, cfg.val_split, cfg.skip_bad_images)


def image_extensions() -> frozenset[str]:
    """The extensions of every format Pillow can open (PNG, JPEG, BMP, GIF, WebP, TIFF, ...)."""
    Image.init()
    return frozenset(ext for ext, fmt in Image.registered_extensions().items() if fmt in Image.OPEN)


def _visible(folder: Path) -> list[Path]:
    """folder's entries but the hidden ones, sorted; none if folder vanished (removed by another program)."""
    try:
        return sorted(p for p in folder.iterdir() if not p.name.startswith("."))
    except FileNotFoundError:
        return []


def _class_files(
    folder: str, rel: str, extensions: frozenset[str], ignored: list[str]
) -> list[tuple[str, int, int]] | None:
    """(relative path, size, mtime_ns) of the image files under folder, at any depth, sorted; the paths of the
    other files go to ignored. rel is folder's path relative to the dataset's root, with forward slashes. None when
    folder itself vanished before it was read; a file or subfolder that vanishes while it is listed is left out: it
    no longer exists.

    os.scandir and plain strings rather than pathlib: a start lists every file, and 70,000 Path objects cost
    seconds."""
    try:
        with os.scandir(folder) as it:
            entries = sorted((e for e in it if not e.name.startswith(".")), key=lambda e: e.name)
    except FileNotFoundError:
        return None
    found = []
    for entry in entries:
        path = f"{rel}/{entry.name}"
        if entry.is_dir():
            found += _class_files(entry.path, path, extensions, ignored) or []
        elif os.path.splitext(entry.name)[1].lower() in extensions:
            try:
                st = entry.stat()
            except FileNotFoundError:  # removed since the folder was read
                continue
            found.append((path, st.st_size, st.st_mtime_ns))
        else:
            ignored.append(path)
    return found


def _split_folder(root: Path, split: str) -> Path | None:
    if split != "val":
        return root / split if (root / split).is_dir() else None
    present = [root / name for name in VAL_NAMES if (root / name).is_dir()]
    if len(present) > 1:
        raise DataError(f"{root} holds both val/ and valid/; keep one of them as the validation split")
    return present[0] if present else None


def list_folder(root: str | Path) -> Listing:
    """Every image under root/train/<class>/ (and val/ or valid/, test/), checked for what training needs.

    Class names are the sorted names of train/'s subfolders. Hidden files and folders are left out, and so are
    files whose extension is not an image format's (listed in Listing.ignored). Raises DataError naming the problem.
    """
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"--data-dir {root}: no such folder; pass the folder that holds train/<class>/")
    train_dir = root / "train"
    extensions = image_extensions()
    if not train_dir.is_dir():
        if why := _split_itself(root, extensions):
            raise DataError(
                f"{root} has no train/ folder and looks like a split itself ({why}); pass the folder that holds "
                f"train/: --data-dir {root.resolve().parent}"
            )
        raise DataError(f"{root} has no train/ folder; put the training images in {train_dir}/<class name>/")
    loose = [p.name for p in _visible(train_dir) if p.is_file() and p.suffix.lower() in extensions]
    if loose:
        raise DataError(
            f"{train_dir / loose[0]} is not in a class folder ({len(loose)} such images); "
            f"move each image into {train_dir}/<class name>/"
        )
    classes = tuple(p.name for p in _visible(train_dir) if p.is_dir())
    _check_classes(train_dir, classes)
    ignored: list[str] = []
    listed: dict[str, dict[str, list[tuple[str, int, int]]]] = {}  # split -> class name -> its files
    for split in ("train", "val", "test"):
        folder = _split_folder(root, split)
        if folder is None:
            continue
        names = list(classes) if split == "train" else [p.name for p in _visible(folder) if p.is_dir()]
        if not names and not folder.is_dir():  # vanished since _split_folder saw it
            continue
        unknown = [name for name in names if name not in classes]
        if unknown:
            raise DataError(
                f"{folder / unknown[0]}: a class that train/ lacks (train/ has {', '.join(classes)}); "
                f"rename it to one of those, or add {train_dir / unknown[0]}/ with training images"
            )
        listed[split] = {}
        for name in names:
            files = _class_files(str(folder / name), f"{folder.name}/{name}", extensions, ignored)
            if files is None:  # the class folder vanished while the dataset was listed: it no longer exists
                continue
            if not files:
                raise DataError(
                    f"{folder / name} holds no images (an image is a file Pillow can open, e.g. .png or .jpg); "
                    "add images or remove the folder"
                )
            listed[split][name] = files
        if split == "train" and len(listed[split]) < len(classes):
            classes = tuple(name for name in classes if name in listed[split])
            _check_classes(train_dir, classes)
    label = {name: i for i, name in enumerate(classes)}  # looked up once per file, not searched for
    splits = {
        split: [
            Entry(path, size, mtime, label[name]) for name, files in by_class.items() for path, size, mtime in files
        ]
        for split, by_class in listed.items()
    }
    return Listing(root, classes, splits, tuple(ignored))


def _split_itself(root: Path, extensions: frozenset[str]) -> str | None:
    """Why root looks like DATA_DIR/train (or val/, test/) rather than DATA_DIR, or None: a user who passes the
    split itself must be told to pass its parent, not to make root/train/ inside it."""
    if root.name.lower() in ("train", *VAL_NAMES, "test"):
        return f"it is named {root.name}/"
    for sub in [p for p in _visible(root) if p.is_dir()][:10]:  # a few: root may be any large folder
        images = [p for p in _visible(sub) if p.is_file() and p.suffix.lower() in extensions]
        if images:  # a class folder holding images, where train/<class name>/ would hold them
            return f"{sub.name}/ holds images such as {images[0].name}, as a class folder does"
    return None


def _check_classes(train_dir: Path, classes: tuple[str, ...]) -> None:
    if not classes:
        raise DataError(f"{train_dir} holds no images; put each class's images in {train_dir}/<class name>/")
    if len(classes) < 2:
        raise DataError(
            f"{train_dir} holds one class folder ({classes[0]}/); a classifier needs at least two: "
            f"add a folder of images for each class"
        )


def numbered(classes: tuple[str, ...], shown: int = 12) -> str:
    """The label of each class, "0=eight, 1=five, ...": the network's output index i is classes[i]. Past shown
    classes, the first and last few with the count between them, so the line stays one line."""
    pairs = [f"{i}={name}" for i, name in enumerate(classes)]
    if len(pairs) > shown:
        head, tail = pairs[: shown - 2], pairs[-2:]
        pairs = [*head, f"... {len(classes) - len(head) - len(tail)} more ...", *tail]
    return ", ".join(pairs)


def plan_splits(listing: Listing, val_split: float) -> dict[str, list[Entry]]:
    """The files of each split of the dataset, in the cache's order (by Entry.key).

    Without val/, each class's val_split share of train/ (rounded, its files first by Entry.key) is held out for
    validation: a choice made from the paths alone, the same on every worker, every resume and every --seed. A
    class keeps at least one training image: at most all but one of its files are held out (none of a single one).
    With val_split 0 nothing is held out, and test/ (which must exist) is scored after each epoch.
    """
    plan = {split: sorted(entries, key=lambda e: e.key) for split, entries in listing.splits.items()}
    if "val" not in plan and val_split == 0:  # nothing held out: test/ is scored after each epoch
        if "test" not in plan:
            raise DataError(
                f"{listing.root}: --val-split 0 holds nothing out of train/, and there is no test/ to score each "
                "epoch on; add a test/ (or val/) folder, or pass --val-split 0.1"
            )
        return plan
    if "val" not in plan:
        by_class = collections.defaultdict(list)
        for entry in plan["train"]:
            by_class[entry.label].append(entry)
        held = set()
        for entries in by_class.values():
            share = min(round(val_split * len(entries)), len(entries) - 1)
            held.update(e.path for e in entries[:share])
        if not held:
            other = "pass --val-labels FILE" if listing.label_files else "add a val/ folder"
            raise DataError(
                f"{listing.where('train')}: --val-split {val_split} of so few images per class holds out none; "
                f"{other}, or raise --val-split"
            )
        plan["val"] = [e for e in plan["train"] if e.path in held]
        plan["train"] = [e for e in plan["train"] if e.path not in held]
    return plan


def default_cache_dir(root: Path) -> Path:
    """root/.paddle_mnist-cache, or, when root is not writable, one under the user's cache folder."""
    root = root.resolve()
    if os.access(root, os.W_OK):
        return root / CACHE_NAME
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return home / "paddle_mnist" / f"folder-{hashlib.sha1(str(root).encode()).hexdigest()[:16]}"


def _identity(listing: Listing) -> dict:
    """What a cache must have been built from to be used: these very files (path, size, mtime), this code, and
    the label files' contents where the labels came from them rather than from the files' folders."""
    identity = {
        "format": FORMAT,
        "preprocess": preprocess.VERSION,
        "classes": list(listing.classes),
        "files": {s: [[e.path, e.size, e.mtime_ns] for e in entries] for s, entries in listing.splits.items()},
    }
    if listing.label_files:  # only then: a folder's caches keep the identity they were built with
        identity["label_files"] = {s: f.sha256 for s, f in listing.label_files.items()}
    return identity


def read_manifest(cache: Path) -> dict | None:
    try:
        return json.loads((cache / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def serves(manifest: dict, listing: Listing, request: Request) -> bool:
    """Whether a cache with this manifest holds the very pixels request asks of these files.

    The size and channels asked for are compared after the folder's defaults are put in, so `--image-size 32` on
    a folder of 32x32 images is the cache its default built. --skip-bad-images changes nothing where no file was
    bad (a build without it fails on the first bad file).
    """
    if manifest.get("identity") != _identity(listing) or manifest.get("val_split") != request.val_split:
        return False
    if manifest.get("skip_bad_images") != request.skip_bad_images and manifest.get("skipped"):
        return False
    size = request.size or default_size(tuple(manifest["default_size"]))
    channels = request.channels or manifest["default_channels"]
    return tuple(manifest["size"]) == tuple(size) and manifest["channels"] == channels


def _variants(caches: Path) -> list[Path]:
    """The cache folders under caches, one per decoded setting (size, channels, hold-out)."""
    try:
        return sorted(p for p in caches.iterdir() if p.is_dir())
    except (FileNotFoundError, NotADirectoryError):
        return []


def find(listing: Listing, request: Request, caches: Path) -> Path | None:
    """The cache under caches that serves request on these files, or None (one must be built)."""
    for variant in _variants(caches):
        manifest = read_manifest(variant)
        if manifest is not None and serves(manifest, listing, request):
            return variant
    return None


def is_fresh(caches: Path, listing: Listing, request: Request) -> bool:
    return find(listing, request, caches) is not None


def _variant_name(size: tuple[int, int], channels: int, request: Request, skipped: bool) -> str:
    """The folder of one decoded setting, e.g. 32x32-rgb-val0.1: what a user sees when deciding what to delete."""
    kind = "grey" if channels == 1 else "rgb"
    return f"{size[0]}x{size[1]}-{kind}-val{request.val_split:g}" + ("-skip" if skipped else "")


# ---- the decoding pool's work: module-level functions, so that the pool's processes can run them ----


def _header(path: str) -> tuple[int, int, bool] | str:
    """(width, height, grey) of an image file, or why it cannot be read."""
    try:
        with preprocess.open_image(path) as im:
            return im.size[0], im.size[1], preprocess.is_grey(im)
    except FileNotFoundError:
        return "vanished after the folder was listed"
    except preprocess.UNREADABLE as e:
        return preprocess.why_unreadable(e)


def _decode(task: tuple[str, int, list[str], int, tuple[int, int]]) -> list[tuple[int, int, bool] | str]:
    """Decode a run of files into rows start.. of the .npy at array; per file its (width, height, grey) as it is
    on disk, or why it cannot be read (its row is then left as zeros)."""
    array, start, paths, channels, size = task
    out = np.load(array, mmap_mode="r+")
    found: list[tuple[int, int, bool] | str] = []
    for row, path in enumerate(paths, start=start):
        try:
            with preprocess.open_image(path) as im:
                header = (im.size[0], im.size[1], preprocess.is_grey(im))
                out[row] = preprocess.to_pixels(im, channels, size)
            found.append(header)
        except FileNotFoundError:
            found.append("vanished after the folder was listed")
        except preprocess.UNREADABLE as e:
            found.append(preprocess.why_unreadable(e))
    out.flush()
    return found


WORKER_SIGNALS = {signal.SIGTERM, signal.SIGINT}  # blocked in a decoding process until _quiet_worker has run


def _quiet_worker() -> None:
    """A decoding process leaves stopping to the trainer: a forked child inherits the trainer's wakeup fd
    (preempt.StopSignals), through which the pool's own SIGTERM to its workers would reach the trainer as a stop."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; it ends the pool
    signal.pthread_sigmask(signal.SIG_UNBLOCK, WORKER_SIGNALS)  # a SIGTERM that came before ends it now


@contextlib.contextmanager
def _pool(processes: int):
    # fork: the workers need only Pillow and numpy, already loaded; spawn would import the trainer anew in each
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    # The workers start with SIGTERM and SIGINT blocked: the pool's SIGTERM (terminate, on an error) can reach a
    # worker still inside fork, whose inherited handlers (Paddle's allocates memory before fork has freed
    # malloc's locks in the child) would hang it, and the pool's join with it.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, WORKER_SIGNALS)
    try:
        pool = multiprocessing.get_context(method).Pool(processes, initializer=_quiet_worker)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    try:
        yield pool
        pool.close()
    finally:
        pool.terminate()
        pool.join()


def _refuse_bad(bad: list[tuple[str, str]], request: Request) -> None:
    if bad and not request.skip_bad_images:
        path, why = bad[0]
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise DataError(
            f"{path}: {why}{more}; remove or replace the file, or pass --skip-bad-images to train without it"
        )


def _sizes(headers: dict, train: list[Entry]) -> collections.Counter:
    """How many files of train/ have each (width, height)."""
    return collections.Counter(headers[e.path][:2] for e in train if e.path in headers)


def _defaults(headers: dict, train: list[Entry]) -> tuple[tuple[int, int], int]:
    """The folder's own ((width, height), channels): the most common size in train/, grey when every image is."""
    grey = all(h[2] for h in headers.values())
    return _sizes(headers, train).most_common(1)[0][0], 1 if grey else 3


def default_size(common: tuple[int, int]) -> tuple[int, int]:
    """The (width, height) a folder trains at without --image-size, from its most common size: that size, or where
    its shorter side is above DEFAULT_SIDE or its longer side above LONGEST_SIDE, that size scaled down until
    neither is, aspect kept (sides rounded, at least 1).

    The time of a step grows with the image's area; a phone's 4032x3024 photo taken as it is would decode into
    36 MB of cache and need gigabytes of activations per image. 64x48 keeps a folder of a few thousand photos
    training in minutes on two cores; --image-size takes any other size.
    """
    width, height = common
    scale = min(1.0, DEFAULT_SIDE / min(width, height), LONGEST_SIDE / max(width, height))
    if scale == 1.0:
        return common
    return max(1, round(width * scale)), max(1, round(height * scale))


def _choose(defaults: tuple, request: Request) -> tuple[tuple[int, int], int]:
    """((width, height), channels): as requested, the folder's defaults where the request leaves them open."""
    return request.size or default_size(defaults[0]), request.channels or defaults[1]


def _log_choice(defaults: tuple, headers: dict, train: list[Entry], request: Request, log: logging.Logger) -> None:
    """Say why the folder's defaults are what they are, where the request left them to the folder."""
    (w, h), channels = defaults
    if not request.size:
        counts = _sizes(headers, train)
        common = f"the most common size in train/ ({counts[(w, h)]} of {sum(counts.values())})"
        width, height = default_size((w, h))
        if (width, height) == (w, h):
            log.info(f"image size {w}x{h}: {common}")
        else:
            log.info(
                f"image size {width}x{height}: {w}x{h} is {common}, scaled down to a shorter side of at most "
                f"{DEFAULT_SIDE} and a longer side of at most {LONGEST_SIDE} pixels, aspect kept; --image-size "
                f"WxH trains at another size (time grows with the area)"
            )
    if not request.channels:
        why = "every image is grey" if channels == 1 else "some images are in colour"
        log.info(f"channels {channels}: {why}")


class _Progress:
    """A build's progress: logged every PROGRESS_S, and handed to report (the other ranks wait on it)."""

    def __init__(self, total: int, log: logging.Logger, report=None, stopped=None):
        self.total, self.log, self.report, self.stopped = total, log, report, stopped
        self.done, self.started = 0, time.monotonic()
        self.logged = self.started

    def add(self, n: int) -> None:
        self.done += n
        if self.report:
            self.report(self.done, self.total)
        if self.stopped and (signum := self.stopped()):
            raise BuildStopped(signum)
        now = time.monotonic()
        if now - self.logged >= PROGRESS_S and self.done < self.total:
            self.logged = now
            rate = self.done / (now - self.started)
            left = (self.total - self.done) / rate if rate else 0
            self.log.info(f"decoded {self.done} of {self.total} images ({rate:.0f} images/s, about {left:.0f} s left)")


class BuildStopped(Exception):
    """A stop signal came while the cache was being built: the partial build was removed."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def build(
    listing: Listing,
    request: Request,
    caches: Path,
    log: logging.Logger,
    processes: int = 0,
    report=None,
    stopped=None,
) -> Path:
    """Decode every image into a new cache folder under caches (<split>.npy, uint8, N x C x H x W, with labels and
    a manifest); its path.

    One pass opens each file once: it decodes to the size and channels that the first SAMPLE files of train/ in
    the cache's order (by the hash of their paths, after the hold-out) call for, and reads every file's size and
    mode on the way; in the rare case that the whole folder's defaults differ from those files', a second pass
    decodes again. report(done, total) hears of every decoded run of files; stopped() (a signal number, 0 for
    none) is asked after each, and a stop raises BuildStopped.

    All of it is written into a temporary folder beside caches and renamed into place at the end, so a cache
    folder is always whole; on any error the temporary folder is removed and the caches are left as they were.
    """
    plan = plan_splits(listing, request.val_split)
    root, started = listing.root, time.perf_counter()
    caches.parent.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(caches)
    tmp = _own(caches, "tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    processes = processes or os.cpu_count() or 1
    progress = _Progress(sum(map(len, plan.values())), log, report, stopped)
    try:
        with _pool(processes) as pool:
            sample = plan["train"][:SAMPLE]
            found = pool.map(_header, [str(root / e.path) for e in sample])
            seen = {e.path: h for e, h in zip(sample, found) if not isinstance(h, str)}
            guess = _choose(_defaults(seen, sample), request) if seen else ((1, 1), 1)
            tmp.mkdir()
            found = _decode_all(pool, root, plan, tmp, guess, progress)
            bad = [(str(root / path), h) for path, h in found.items() if isinstance(h, str)]
            _refuse_bad(bad, request)
            headers = {path: h for path, h in found.items() if not isinstance(h, str)}
            kept = {s: [e for e in entries if e.path in headers] for s, entries in plan.items()}
            _check_not_empty(kept, len(bad))
            _check_every_class_trains(listing, kept["train"], len(bad))
            defaults = _defaults(headers, kept["train"])
            chosen = _choose(defaults, request)
            _log_choice(defaults, headers, kept["train"], request, log)
            if chosen != guess:
                log.info("decoding again: the sample of train/ called for another size or channel count")
                progress = _Progress(sum(map(len, kept.values())), log, report, stopped)
                again = _decode_all(pool, root, kept, tmp, chosen, progress)
                _refuse_bad([(str(root / p), h) for p, h in again.items() if isinstance(h, str)], request)
            elif bad:
                _drop_rows(tmp, plan, {path for path, h in found.items() if isinstance(h, str)})
        decoded = np.load(tmp / "train.npy", mmap_mode="r")
        mean, std = data.channel_stats(decoded)
        asymmetry = augment.mirror_asymmetry(decoded, np.load(tmp / "train-labels.npy"))
        del decoded
        size, channels = chosen
        manifest = {
            "identity": _identity(listing),
            "size": list(size),
            "channels": channels,
            "default_size": list(defaults[0]),
            "default_channels": defaults[1],
            "val_split": request.val_split,
            "skip_bad_images": request.skip_bad_images,
            "counts": {s: len(entries) for s, entries in kept.items()},
            "mean": mean,
            "std": std,
            "mirror_asymmetry": asymmetry,
            "skipped": [f"{path}: {why}" for path, why in bad],
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest) + "\n")
        cache = _publish(tmp, caches, _variant_name(size, channels, request, bool(bad)), listing, log)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    n = sum(manifest["counts"].values())
    seconds = time.perf_counter() - started
    log.info(f"decoded {n} images in {seconds:.1f} s ({n / seconds:.0f} images/s, {processes} processes) into {cache}")
    return cache


def _check_space(folder: Path, nbytes: int) -> None:
    """Refuse a cache of nbytes that would take more than CACHE_SHARE of the free space where it goes, before a
    single image is decoded (the size comes from the headers; checkpoints and logs need room too)."""
    free = shutil.disk_usage(folder).free
    if nbytes > CACHE_SHARE * free:
        raise DataError(
            f"the decoded images would take {nbytes / 2**30:.1f} GiB in {folder.parent}, more than "
            f"{CACHE_SHARE:.0%} of the {free / 2**30:.1f} GiB free there; pass a smaller --image-size, or free space"
        )


def _decode_all(pool, root: Path, plan: dict, tmp: Path, shape: tuple, progress: _Progress) -> dict[str, tuple | str]:
    """Decode every split into tmp/<split>.npy in parallel, to shape ((width, height), channels); per file
    (relative path) its header or why it cannot be read."""
    (width, height), channels = shape
    _check_space(tmp, sum(map(len, plan.values())) * channels * width * height)
    tasks, found = [], {}
    for split, entries in plan.items():
        array = tmp / f"{split}.npy"
        np.lib.format.open_memmap(array, "w+", np.uint8, (len(entries), channels, height, width)).flush()
        np.save(tmp / f"{split}-labels.npy", np.array([e.label for e in entries], np.int64))
        for lo in range(0, len(entries), CHUNK):
            paths = [str(root / e.path) for e in entries[lo : lo + CHUNK]]
            tasks.append(((str(array), lo, paths, channels, (width, height)), entries[lo : lo + CHUNK]))
    for (_, entries), result in zip(tasks, pool.imap(_decode, [task for task, _ in tasks])):
        found.update((e.path, h) for e, h in zip(entries, result))
        progress.add(len(entries))
    return found


def _drop_rows(tmp: Path, plan: dict, dropped: set[str]) -> None:
    """Rewrite each split's arrays and labels without the rows of the dropped files (--skip-bad-images)."""
    for split, entries in plan.items():
        keep = np.array([e.path not in dropped for e in entries])
        if keep.all():
            continue
        old = np.load(tmp / f"{split}.npy", mmap_mode="r")
        with atomic.atomic_path(tmp / f"{split}.npy") as rewritten:
            new = np.lib.format.open_memmap(rewritten, "w+", np.uint8, (int(keep.sum()), *old.shape[1:]))
            at = 0
            for lo in range(0, len(old), 4096):
                block = old[lo : lo + 4096][keep[lo : lo + 4096]]
                new[at : at + len(block)] = block
                at += len(block)
            new.flush()
            del old, new  # both maps closed before the rename
        labels = [e.label for e, k in zip(entries, keep) if k]
        np.save(tmp / f"{split}-labels.npy", np.array(labels, np.int64))


def _check_not_empty(plan: dict, bad: int) -> None:
    empty = [split for split, entries in plan.items() if not entries]
    if empty:
        raise DataError(f"no readable image is left in {empty[0]} ({bad} unreadable files skipped); replace them")


def _check_every_class_trains(listing: Listing, train: list[Entry], bad: int) -> None:
    """--skip-bad-images may have left a class without any training image."""
    left = {e.label for e in train}
    empty = [name for label, name in enumerate(listing.classes) if label not in left]
    if empty and listing.label_files:
        more = f" (and {len(empty) - 1} more)" if len(empty) > 1 else ""
        raise DataError(
            f"{listing.where('train')}: no readable training image of class {empty[0]}{more} is left ({bad} "
            "unreadable files skipped); replace the unreadable files, or remove the class's rows"
        )
    if empty:
        more = f" (and {len(empty) - 1} more classes)" if len(empty) > 1 else ""
        raise DataError(
            f"{listing.root / 'train' / empty[0]}{more}: no readable training image is left ({bad} unreadable files "
            "skipped); add readable images to the class folder, or remove the folder"
        )


def _own(cache: Path, kind: str) -> Path:
    """This build's temporary ("tmp") or moved-aside ("old") folder beside cache, named for its pid and host."""
    return cache.parent / f"{cache.name}.{kind}{os.getpid()}@{socket.gethostname()}"


def _remove_leftovers(cache: Path) -> None:
    """Temporary and old cache folders of this machine's builds whose process is gone (killed while building).

    Another machine's (several machines building on shared storage) are left alone: whether its process lives
    cannot be told from here. A name without a host (from a build before names carried one) is taken for this
    machine's."""
    host = socket.gethostname()
    for path in cache.parent.glob(f"{cache.name}.*"):
        match = LEFTOVER.fullmatch(path.name[len(cache.name) + 1 :])
        if match and match[2] in (None, host) and not _alive(int(match[1])):
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, as another user's
        return True
    return True


def _publish(tmp: Path, caches: Path, name: str, listing: Listing, log: logging.Logger) -> Path:
    """Put the finished tmp folder in caches as name, and say what else is kept there: caches of other settings
    stay (a user may come back to them); caches of files that are no longer there, and an older version's cache,
    are removed."""
    caches.mkdir(exist_ok=True)
    old_format = [p for p in caches.iterdir() if p.is_file()]  # FORMAT 1 kept one cache's files in caches itself
    for path in old_format:
        path.unlink(missing_ok=True)
    if old_format:
        log.info(f"removed the cache of an earlier paddle_mnist version from {caches}")
    cache, old = caches / name, _own(caches, "old")
    if cache.exists():
        os.replace(cache, old)
    try:
        os.replace(tmp, cache)
    except OSError:  # another builder's cache landed first (a second machine on shared storage): keep theirs
        pass
    shutil.rmtree(old, ignore_errors=True)
    others = []
    for variant in _variants(caches):
        if variant == cache:
            continue
        manifest = read_manifest(variant)
        if manifest is None or manifest.get("identity") != _identity(listing):  # of files no longer there
            os.replace(variant, old)
            shutil.rmtree(old, ignore_errors=True)
            log.info(f"removed {variant}: a cache of files that have changed since")
        else:
            others.append(variant)
    if others:
        mib = sum(f.stat().st_size for v in others for f in v.iterdir()) / 2**20
        log.info(
            f"kept {len(others)} cache(s) of other settings beside it ({', '.join(v.name for v in others)}, "
            f"{mib:.0f} MiB): a run with those settings reuses them; delete a folder there to free its space"
        )
    return cache


def ensure_cache(
    listing: Listing, request: Request, caches: Path, log: logging.Logger, report=None, stopped=None
) -> Path:
    """The cache under caches that serves request on these files (see serves): found, or built now."""
    found = find(listing, request, caches)
    if found is not None:
        return found
    reason = "no cache yet" if not _variants(caches) else "none of the caches has these files and settings"
    n = sum(map(len, listing.splits.values()))
    log.info(f"decoding {n} images of {listing.root} into a cache ({reason})")
    return build(listing, request, caches, log, report=report, stopped=stopped)


def load(listing: Listing, request: Request, cache: Path | None) -> tuple[data.Dataset, dict]:
    """The dataset, memory-mapped from cache (one of find's or ensure_cache's), and the cache's manifest;
    DataError if it does not serve request on these files."""
    manifest = read_manifest(cache) if cache is not None else None
    if manifest is None or not serves(manifest, listing, request):
        raise DataError(
            f"{cache}: the cache does not match the files this worker sees in {listing.root}; on several machines, "
            "give each the same files (or put --data-dir on storage they share), then start again"
        )

    def split(name: str) -> data.Split:
        images = np.load(cache / f"{name}.npy", mmap_mode="r")
        return data.Split(images, np.load(cache / f"{name}-labels.npy"))

    counts = manifest["counts"]
    train = split("train")
    val = split("val") if "val" in counts else None  # None: --val-split 0, and the folder has a test/
    test = split("test") if "test" in counts else val
    val = test if val is None else val
    asymmetry = manifest.get("mirror_asymmetry")
    if asymmetry is None:  # a cache built before it was measured
        asymmetry = augment.mirror_asymmetry(train.images, train.labels)
    mean, std = tuple(manifest["mean"]), tuple(manifest["std"])
    ds = data.Dataset("folder", train, val, test, mean, std, listing.classes, asymmetry)
    return ds, manifest

"""Fetch a dataset's official files, check their published MD5s and put them where the trainer looks.

python -m paddle_mnist.download mnist        # or fashion-mnist, cifar10, mnist-json; also paddle-mnist-download
"""

from __future__ import annotations

import argparse
import fcntl
import gzip
import hashlib
import http.client
import io
import json
import os
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from paddle_mnist.config import DATASETS
from paddle_mnist.datasets.datafiles import (
    CIFAR_ARCHIVE,
    IDX_FILES,
    MNIST_JSON,
    REPO_DATA,
    SUMS,
    file_digest,
    read_sums,
)
from paddle_mnist.datasets.formats import DataError, check_pair, read_idx
from paddle_mnist.files import atomic

VALID_SIZE = 10_000  # the course's file: the last 10,000 MNIST training images are its 'valid' split
CHUNK = 1 << 20  # bytes read from the connection at a time
USER_AGENT = "paddle_mnist-download/0.1"
# A file being downloaded or built is .NAME.partial until it is complete and checked: a name without the pid (unlike
# atomic's default), so a download killed halfway is overwritten by the next try instead of left beside it.
PARTIAL = ".partial"
IDX_NAMES = tuple(f"{stem}.gz" for split in ("train", "test") for stem in IDX_FILES[split])  # as published: gzipped


@dataclass(frozen=True)
class Published:
    """Where a dataset's files are hosted (tried in order) and the MD5 its authors published for each file."""

    bases: tuple[str, ...]
    md5: dict[str, str]


PUBLISHED = {
    "mnist": Published(
        ("https://ossci-datasets.s3.amazonaws.com/mnist/", "http://yann.lecun.com/exdb/mnist/"),
        dict(
            zip(
                IDX_NAMES,
                (
                    "f68b3c2dcbeaaa9fbdd348bbdeb94873",
                    "d53e105ee54ea40749a09fcbcd1e9432",
                    "9fb629c4189551a2d022fa330f9573f3",
                    "ec29112dd5afa0611ce80d1b7f02629c",
                ),
            )
        ),
    ),
    "fashion-mnist": Published(
        ("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",),
        dict(
            zip(
                IDX_NAMES,
                (
                    "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
                    "25c81989df183df01b3e8a0aad5dffbe",
                    "bef4ecab320f06d8554ea6380940ec79",
                    "bb300cfdad3c16e7a12a480ee83cd310",
                ),
            )
        ),
    ),
    "cifar10": Published(("https://www.cs.toronto.edu/~kriz/",), {CIFAR_ARCHIVE: "c58f30108f718f92721af3b95e74349a"}),
}


@dataclass(frozen=True)
class Remote:
    name: str
    md5: str
    urls: tuple[str, ...]


class FetchError(Exception):
    """Why a file could not be put in place, worded for the user; unreachable: no host answered at all."""

    def __init__(self, message: str, unreachable: bool = False):
        super().__init__(message)
        self.unreachable = unreachable


def published_for(dataset: str) -> Published:
    return PUBLISHED["mnist" if dataset == "mnist-json" else dataset]


def remote_files(dataset: str, mirror: str | None, md5_overrides: dict[str, str]) -> list[Remote]:
    """The files to fetch; mnist-json is built from the four MNIST files, so those are what it fetches."""
    published = published_for(dataset)
    bases = (mirror,) if mirror else published.bases
    return [
        Remote(name, md5_overrides.get(name, md5), tuple(base.rstrip("/") + "/" + name for base in bases))
        for name, md5 in published.md5.items()
    ]


def read_checksums(path: Path, known: Sequence[str]) -> dict[str, str]:
    """'<md5>  <name>' lines (md5sum's format) that replace published MD5s, e.g. for a mirror of modified files."""
    table = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split(maxsplit=1)
        name = parts[-1].strip().lstrip("*")
        if len(parts) != 2 or len(parts[0]) != 32 or any(c not in "0123456789abcdef" for c in parts[0].lower()):
            raise ValueError(f"{path}:{number}: want '<md5>  <name>', found {line!r}")
        if name not in known:
            raise ValueError(f"{path}:{number}: {name} is not one of this dataset's files ({', '.join(known)})")
        table[name] = parts[0].lower()
    return table


def md5_ok(path: Path, md5: str) -> bool:
    return path.is_file() and file_digest(path, "md5") == md5


def sums_intact(folder: Path, names: Sequence[str]) -> bool:
    """True when folder/SHA256SUMS lists every one of names and each listed file matches it."""
    try:
        listed = read_sums(folder)
    except DataError:  # a damaged list vouches for nothing: the caller fetches or builds again and lists anew
        return False
    if listed is None or not set(names) <= set(listed):
        return False
    return all((folder / n).is_file() and file_digest(folder / n, "sha256") == listed[n] for n in listed)


def write_sums(folder: Path, names: Sequence[str]) -> None:
    """The list the trainer checks on every load, in sha256sum's format."""
    text = "".join(f"{file_digest(folder / n, 'sha256')}  {n}\n" for n in sorted(names))
    with atomic.atomic_write(folder / SUMS, suffix=PARTIAL) as out:
        out.write(text.encode())
    print(f"wrote {folder / SUMS}")


def fetch_url(url: str, remote: Remote, folder: Path, timeout: float) -> int:
    """Stream url into folder/.NAME.partial, check its MD5 and rename it into place; returns the size in bytes.

    Only a verified download is renamed, so a bad one never replaces or sits beside a file the trainer could read.
    Errors of the connection itself propagate; everything after the host answered becomes a FetchError.
    """
    request = urllib.request.Request(url, headers={"User-Agent": USER_AGENT})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        announced = response.headers.get("Content-Length")
        folder.mkdir(parents=True, exist_ok=True)  # only now, so an unreachable host leaves no empty folder behind
        digest = hashlib.new("md5", usedforsecurity=False)
        received = 0
        with atomic.atomic_write(folder / remote.name, suffix=PARTIAL) as out:
            try:
                while block := response.read(CHUNK):
                    out.write(block)
                    digest.update(block)
                    received += len(block)
            except (OSError, http.client.HTTPException) as e:
                raise FetchError(f"{url}: the connection broke after {received} bytes ({e})") from e
            # http.client reports a connection closed early as a normal end, so compare with what was announced
            if announced is not None and received != int(announced):
                raise FetchError(f"{url}: the connection broke after {received} of {announced} bytes")
            if digest.hexdigest() != remote.md5:
                raise FetchError(
                    f"{url}: MD5 is {digest.hexdigest()}, expected {remote.md5}; the download was discarded"
                )
    return received


def cannot_connect(error: Exception) -> bool:
    """True when no server answered at all (no network, refused, timed out), not when one answered 'no'."""
    if isinstance(error, urllib.error.HTTPError):
        return False
    reason = error.reason if isinstance(error, urllib.error.URLError) else error
    return isinstance(reason, OSError) and not isinstance(reason, FileNotFoundError)


def describe(error: Exception) -> str:
    if isinstance(error, urllib.error.HTTPError):
        return f"HTTP {error.code} {error.reason}"
    return str(error.reason if isinstance(error, urllib.error.URLError) else error)


def download(remote: Remote, folder: Path, timeout: float) -> None:
    """Try each URL of the file in order until one gives the right bytes."""
    reasons, unreachable = [], True
    for url in remote.urls:
        try:
            size = fetch_url(url, remote, folder, timeout)
        except FetchError as e:
            reasons.append(str(e))
            unreachable = False
        except (OSError, http.client.HTTPException) as e:
            reasons.append(f"{url}: {describe(e)}")
            unreachable = unreachable and cannot_connect(e)
        else:
            print(f"{remote.name}: fetched {size} bytes from {url}, MD5 {remote.md5} verified")
            return
    raise FetchError(f"{remote.name}: not fetched: " + "; ".join(reasons), unreachable)


def manual_steps(failures: Sequence[FetchError], left: Sequence[Remote], folder: Path) -> str:
    """The error message: what failed, then for each file still missing where to get it and where to put it."""
    if all(f.unreachable for f in failures):
        lines = [f"cannot reach the download host ({failures[0]})"]
        lines.append(f"fetch these files on a machine with network and put them in {folder}{os.sep}:")
    else:
        lines = [str(f) for f in failures]
        lines.append(f"fetch these files (from these URLs or any copy with this MD5) and put them in {folder}{os.sep}:")
    for remote in left:
        lines += [f"  {remote.name}", f"    from {' or '.join(remote.urls)}", f"    MD5  {remote.md5}"]
        lines.append(f"    to   {folder / remote.name}")
    lines.append("then run this command again.")
    return "\n".join(lines)


def fetch_files(files: Sequence[Remote], folder: Path, timeout: float, hint_folder: Path | None = None) -> None:
    """Put every file, MD5-verified, in folder and list them in its SHA256SUMS; raises FetchError with the fix."""
    todo = []
    for remote in files:
        if md5_ok(folder / remote.name, remote.md5):
            print(f"{remote.name}: already in {folder}, MD5 {remote.md5} verified; skipped")
        else:
            todo.append(remote)
    if todo and sums_intact(folder, [r.name for r in files]):
        # e.g. the shipped Fashion-MNIST: Debian re-compressed the files, so their MD5s differ but the data is the same
        print(f"{folder}: the dataset is already in place (its files match {SUMS}); nothing to download")
        return
    failures, left = [], []
    for remote in todo:
        if failures and failures[-1].unreachable:
            left.append(remote)  # the host is down or there is no network: don't wait for every other file to time out
            continue
        try:
            download(remote, folder, timeout)
        except FetchError as e:
            failures.append(e)
            left.append(remote)
    if failures:
        raise FetchError(manual_steps(failures, left, hint_folder or folder), failures[-1].unreachable)
    write_sums(folder, [r.name for r in files])


# ---- mnist.json.gz of the PaddlePaddle course, built from the verified MNIST files ----

PIXEL_TEXT = tuple(json.dumps(round(v / 255, 6)) for v in range(256))  # every uint8 pixel's JSON text, made once


def mnist_splits(folder: Path) -> list[tuple]:
    """[train, valid, eval] as (uint8 (N, 28, 28), int64 (N,)): the course's split of the official MNIST files."""
    pairs = []
    for split in ("train", "t10k"):
        images = read_idx(folder / f"{split}-images-idx3-ubyte.gz", 3)
        labels = read_idx(folder / f"{split}-labels-idx1-ubyte.gz", 1)
        pairs.append(check_pair(images, labels, f"{folder} ({split})"))
    (train_x, train_y), test = pairs
    if train_x.shape[1:] != (28, 28):
        raise DataError(f"{folder}: images are {train_x.shape[1:]}, want 28 x 28")
    if len(train_y) <= VALID_SIZE:
        raise DataError(f"{folder}: {len(train_y)} training images; the last {VALID_SIZE} become 'valid', want more")
    return [(train_x[:-VALID_SIZE], train_y[:-VALID_SIZE]), (train_x[-VALID_SIZE:], train_y[-VALID_SIZE:]), test]


def write_json_splits(splits: Sequence[tuple], out: io.TextIOBase) -> None:
    """Stream [[images, labels], ...] as compact JSON, one image at a time, so no list of 55M floats is built."""
    out.write("[")
    for i, (images, labels) in enumerate(splits):
        out.write(",[[" if i else "[[")
        for j, image in enumerate(images.reshape(len(images), -1)):
            out.write(("[" if j == 0 else ",[") + ",".join([PIXEL_TEXT[p] for p in image.tolist()]) + "]")
        out.write("]," + json.dumps(labels.tolist(), separators=(",", ":")) + "]")
    out.write("]")


def write_mnist_json(source: Path, target: Path) -> None:
    splits = mnist_splits(source)
    target.parent.mkdir(parents=True, exist_ok=True)
    with atomic.atomic_write(target, suffix=PARTIAL) as raw:
        # mtime=0 and no file name in the gzip header: the same MNIST files always build the same bytes
        with gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=6, mtime=0) as packed:
            with io.TextIOWrapper(packed, encoding="ascii") as text:
                write_json_splits(splits, text)
    sizes = ", ".join(f"{name} {len(labels)}" for name, (_, labels) in zip(("train", "valid", "eval"), splits))
    print(f"built {target} ({sizes}) from {source}")


def mnist_in_place(files: Sequence[Remote]) -> bool:
    """True when data/mnist holds the MNIST files: the shipped copy (re-gzipped, so listed in its SHA256SUMS rather
    than matching the published MD5s) or the published files themselves."""
    mnist = REPO_DATA / "mnist"
    return sums_intact(mnist, [r.name for r in files]) or all(md5_ok(mnist / r.name, r.md5) for r in files)


def build_mnist_json(files: Sequence[Remote], folder: Path, timeout: float, local: bool = True) -> None:
    """Build folder/mnist.json.gz from data/mnist when local and its files verify, else from a fresh, verified
    download (a --mirror asks for that)."""
    if sums_intact(folder, [MNIST_JSON]):
        print(f"{folder / MNIST_JSON}: already built (matches {SUMS}); nothing to do")
        return
    mnist = REPO_DATA / "mnist"
    if local and mnist_in_place(files):
        print(f"using the MNIST files in {mnist} (checksums verified)")
        write_mnist_json(mnist, folder / MNIST_JSON)
    else:
        with tempfile.TemporaryDirectory(prefix="mnist-") as scratch:
            # if nothing can be fetched, the user is told to put the files in data/mnist, where a rerun finds them
            fetch_files(files, Path(scratch), timeout, hint_folder=mnist)
            write_mnist_json(Path(scratch), folder / MNIST_JSON)
    write_sums(folder, [MNIST_JSON])


def build_shipped_mnist_json(folder: Path) -> None:
    """For the trainer: build folder/mnist.json.gz from the shipped data/mnist if it is not built yet, never
    downloading. The workers of one job all ask at once: they queue on a lock file, and the first one builds."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when the process dies
        if sums_intact(folder, [MNIST_JSON]):
            return
        files = remote_files("mnist-json", None, {})
        if not mnist_in_place(files):
            raise DataError(
                f"{folder / MNIST_JSON} is built from {REPO_DATA / 'mnist'}, whose files are missing or damaged: "
                "restore them (git checkout data/mnist), or run python -m paddle_mnist.download mnist-json"
            )
        write_mnist_json(REPO_DATA / "mnist", folder / MNIST_JSON)
        write_sums(folder, [MNIST_JSON])


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, dict[str, str]]:
    parser = argparse.ArgumentParser(
        prog="python -m paddle_mnist.download",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("dataset", choices=DATASETS, help="mnist-json is built from the MNIST files")
    parser.add_argument(
        "--data-dir", help=f"where to put the files (default: {REPO_DATA}{os.sep}DATASET, where the trainer looks)"
    )
    parser.add_argument(
        "--mirror", metavar="BASE_URL", help="fetch BASE_URL/NAME instead of the official hosts (http, https, file)"
    )
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for a host (default: 30)")
    parser.add_argument(
        "--checksums",
        metavar="FILE",
        help="expected MD5s instead of the published ones, in md5sum's format (for a mirror of modified files)",
    )
    args = parser.parse_args(argv)
    if args.timeout <= 0:
        parser.error("--timeout must be positive")
    overrides = {}
    if args.checksums:
        try:
            overrides = read_checksums(Path(args.checksums), list(published_for(args.dataset).md5))
        except (OSError, ValueError) as e:
            parser.error(f"--checksums: {e}")
    return args, overrides


def main(argv: Sequence[str] | None = None) -> int:
    args, overrides = parse_args(argv)
    folder = Path(args.data_dir).resolve() if args.data_dir else REPO_DATA / args.dataset
    files = remote_files(args.dataset, args.mirror, overrides)
    try:
        if args.dataset == "mnist-json":
            build_mnist_json(files, folder, args.timeout, local=not args.mirror)
        else:
            fetch_files(files, folder, args.timeout)
    except (FetchError, DataError, OSError) as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

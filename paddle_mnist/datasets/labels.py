"""Label files as a folder run's source (--labels): a CSV or PaddleClas list read into the Listing a class folder
gives, so that the folder's checks, hold-out and cache serve it unchanged."""

from __future__ import annotations

import csv
import hashlib
import os
import re
import stat
from pathlib import Path

from paddle_mnist.config import Config
from paddle_mnist.datasets import folder
from paddle_mnist.datasets.folder import Entry, LabelFile, Listing
from paddle_mnist.datasets.formats import DataError

FLAGS = {"train": "--labels", "val": "--val-labels", "test": "--test-labels"}
# A crawl of images loses a file now and then, and training without it is what a user wants; a share past this
# is a wrong base folder, delimiter or file, whose remainder would train on a different dataset without a word.
# Below 100 rows any bad row is past it: a hand-written list has no file to lose.
BAD_SHARE = 0.01
SHOWN = 5  # bad rows named, with their lines, in the log line and the refusal
INTEGER = re.compile(r"[+-]?\d+")


def source(cfg: Config) -> tuple[Listing, Path]:
    """The listing of a folder run's images and the folder its caches go in: --labels' files, or --data-dir's."""
    if cfg.labels:
        return list_labels(cfg.labels, cfg.val_labels, cfg.test_labels), cache_dir(Path(cfg.labels))
    listing = folder.list_folder(cfg.data_dir)
    return listing, folder.default_cache_dir(listing.root)


def cache_dir(labels: str | Path) -> Path:
    """Beside the --labels file, named for it (.paddle_mnist-cache-train.csv): apart from a folder's own cache and
    another label file's in the same folder, so that neither removes the other as stale. Where that folder is not
    writable, one under the user's cache folder."""
    path = Path(labels).resolve()
    if os.access(path.parent, os.W_OK):
        return path.parent / f"{folder.CACHE_NAME}-{path.name}"
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return home / "paddle_mnist" / f"labels-{hashlib.sha1(str(path).encode()).hexdigest()[:16]}"


def sort_classes(labels: set[str]) -> tuple[str, ...]:
    """The class names in label order: sorted, and by value where every label is an integer ("2" before "10")."""
    if labels and all(INTEGER.fullmatch(label) for label in labels):
        return tuple(sorted(labels, key=lambda label: (int(label), label)))
    return tuple(sorted(labels))


def list_labels(train: str | Path, val: str | Path = "", test: str | Path = "") -> Listing:
    """Every image the label files name, checked as list_folder checks a folder; Entry.path is relative to the
    train file's folder (absolute where the image lies outside it), and the class names are train's labels
    (sort_classes). Bad rows are left out and kept in Listing.label_files; DataError past BAD_SHARE of a file, or
    for a val or test label that train lacks."""
    extensions = folder.image_extensions()
    root = Path(train).parent
    read, files = {}, {}
    for split, name in (("train", train), ("val", val), ("test", test)):
        if name:
            read[split], files[split] = _read(Path(name), split, root, extensions)
    classes = sort_classes({label for *_, label in read["train"]})
    if len(classes) < 2:
        raise DataError(
            f"{train}: every image is labelled {classes[0] if classes else '(none)'}; a classifier needs at least "
            "two classes: add rows of another label"
        )
    index = {name: i for i, name in enumerate(classes)}
    for split, rows in read.items():
        unknown = next(((line, label) for line, *_, label in rows if label not in index), None)
        if unknown:
            shown = ", ".join(classes[:10]) + (" ..." if len(classes) > 10 else "")
            raise DataError(
                f"{files[split].path}:{unknown[0]}: label {unknown[1]!r} is a class that {train} lacks (it has "
                f"{shown}); fix the row, or add training rows labelled {unknown[1]}"
            )
    splits = {s: [Entry(p, size, mtime, index[label]) for _, p, size, mtime, label in rows] for s, rows in read.items()}
    return Listing(root, classes, splits, (), files)


def left_out(listing: Listing) -> str | None:
    """The log line naming the bad rows left out of the label files (the first SHOWN), or None where none was."""
    bad = [row for f in listing.label_files.values() for row in f.bad]
    if not bad:
        return None
    rows = sum(f.rows for f in listing.label_files.values())
    more = f"; and {len(bad) - SHOWN} more" if len(bad) > SHOWN else ""
    return f"warning: left out {len(bad)} of {rows} rows of the label files: {'; '.join(bad[:SHOWN])}{more}"


def _read(path: Path, split: str, root: Path, extensions: frozenset[str]) -> tuple[list[tuple], LabelFile]:
    """(line, Entry.path, size, mtime_ns, label) of each good row of one label file, and what the file was."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DataError(f"{FLAGS[split]} {path}: {e.strerror or e}; pass a label file of path,label rows") from None
    try:
        text = raw.decode("utf-8-sig")  # a spreadsheet's CSV may open with a byte-order mark
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (byte {e.start}); save it as UTF-8") from None
    parsed, bad = _parse(path, text.splitlines())
    base, good, seen = path.parent, [], {}
    for line, name, label in parsed:
        full = os.path.normpath(os.path.join(base, name))
        st = _stat(full, extensions) if full not in seen else f"listed already on line {seen[full]}"
        if isinstance(st, str):
            bad.append((line, f"{st}: {name}"))
            continue
        seen[full] = line
        good.append((line, _relative(full, root), st.st_size, st.st_mtime_ns, label))
    rows = len(good) + len(bad)
    bad.sort()
    named = tuple(f"{path.name}:{line}: {why}" for line, why in bad)
    if not rows:
        raise DataError(f"{path} lists no images; add a row for each image: path,label under a path,label header")
    if len(bad) > BAD_SHARE * rows:
        raise DataError(
            f"{path}: {len(bad)} of its {rows} rows are bad ({'; '.join(named[:SHOWN])}); fix or remove them "
            f"(paths are relative to {base.resolve()}; at most {BAD_SHARE:.0%} of the rows may be left out)"
        )
    digest = hashlib.sha256(raw).hexdigest()
    return good, LabelFile(path, digest, rows, named)


def _parse(path: Path, lines: list[str]) -> tuple[list[tuple[int, str, str]], list[tuple[int, str]]]:
    """(line, path, label) of each row, and (line, why) of each that cannot be parsed; the format is the first
    line's: a header naming path and label columns makes a CSV, else PaddleClas's "path label" lines."""
    rows, bad, columns = [], [], None
    for number, text in enumerate(lines, 1):
        if not text.strip() or text.lstrip().startswith("#"):
            continue
        if columns is None:
            header = [name.strip().lower() for name in next(csv.reader([text]))]
            if "path" in header and "label" in header:
                columns = (header.index("path"), header.index("label"), len(header))
                continue
            if "," in text:
                raise DataError(
                    f"{path}:{number}: a CSV label file opens with a header naming its path and label columns; "
                    "add the line path,label above its rows"
                )
            columns = ()  # PaddleClas: no header
        if columns:
            fields = next(csv.reader([text]))
            if len(fields) != columns[2]:
                bad.append((number, f"{len(fields)} fields where the header has {columns[2]}"))
                continue
            name, label = fields[columns[0]].strip(), fields[columns[1]].strip()
        else:
            fields = text.split()
            if len(fields) != 2:
                why = "a path with spaces needs the CSV format" if len(fields) > 2 else "no label"
                bad.append((number, f"{len(fields)} fields, not a path and a label ({why})"))
                continue
            name, label = fields
        if not name or not label:
            bad.append((number, "an empty path" if not name else "an empty label"))
            continue
        rows.append((number, name, label))
    return rows, bad


def _stat(path: str, extensions: frozenset[str]) -> os.stat_result | str:
    """The image file's stat, or why path is not an image file to list."""
    if os.path.splitext(path)[1].lower() not in extensions:
        return "not an image file by its extension" if os.path.isfile(path) else "no such image file"
    try:
        st = os.stat(path)
    except OSError:
        return "no such file"
    return "a folder, not an image file" if stat.S_ISDIR(st.st_mode) else st


def _relative(path: str, root: Path) -> str:
    """path relative to root with forward slashes, as a folder's Entry.path (whose hash orders the cache and picks
    the hold-out): a label file beside train/ lists a folder's very entries. Absolute where path lies outside root."""
    relative = os.path.relpath(path, root)
    if relative == ".." or relative.startswith(".." + os.sep):
        return Path(os.path.abspath(path)).as_posix()
    return Path(relative).as_posix()

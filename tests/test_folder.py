"""Your own images (--dataset folder): listing, checks, preprocessing, the cache, and real runs on a folder."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from helpers import (
    TRAIN_PY,
    explain,
    launch_env,
    param_digest,
    rank_pid,
    read_metrics,
    reaped,
    run_launch,
    run_single,
    wait_for,
    weights,
    worker_log,
)
from PIL import Image

from paddle_mnist.cli import parse_command
from paddle_mnist.config import ConfigError, parse_args
from paddle_mnist.datasets import augment, data, folder, preprocess
from paddle_mnist.datasets.formats import DataError
from paddle_mnist.training.checkpoints import check_resumable

# Fashion-MNIST labels -> class folder names, with spaces and letters outside ASCII
CLASSES = {0: "T-shirt top", 1: "Trouser", 5: "Sandalé", 9: "Ankle boot ü"}
LOG = logging.getLogger("test_folder")


@pytest.fixture(scope="module")
def fashion() -> data.Split:
    return data.load_dataset("fashion-mnist").train


def write_split(root: Path, split: str, fashion: data.Split, per_class: int, offset: int = 0) -> None:
    """per_class images of each class in CLASSES, every other one PNG, the others JPEG."""
    for label, name in CLASSES.items():
        (root / split / name).mkdir(parents=True, exist_ok=True)
        rows = np.flatnonzero(fashion.labels == label)[offset : offset + per_class]
        for k, row in enumerate(rows):
            ext = "png" if k % 2 == 0 else "jpg"
            Image.fromarray(fashion.images[row, 0]).save(root / split / name / f"{row}.{ext}")


def make_folder(root: Path, fashion: data.Split, train: int = 8, val: int = 0, test: int = 0) -> Path:
    write_split(root, "train", fashion, train)
    if val:
        write_split(root, "val", fashion, val, offset=train)
    if test:
        write_split(root, "test", fashion, test, offset=train + val)
    return root


def request(**kw) -> folder.Request:
    return folder.Request(**{"size": None, "channels": 0, "val_split": 0.25, "skip_bad_images": False, **kw})


def build(root: Path, req: folder.Request | None = None) -> tuple[data.Dataset, dict]:
    listing, req = folder.list_folder(root), req or request()
    cache = folder.ensure_cache(listing, req, folder.default_cache_dir(root), LOG)
    return folder.load(listing, req, cache)


# ---- listing and its checks ----


def test_listing_sorts_classes_and_leaves_out_what_is_not_an_image(tmp_path, fashion):
    root = make_folder(tmp_path / "d", fashion, train=4, val=2)
    (root / "train" / "Trouser" / "notes.txt").write_text("not an image")
    (root / "train" / "Trouser" / ".hidden.png").write_bytes(b"")
    (root / "train" / "Trouser" / "nested").mkdir()
    Image.fromarray(fashion.images[1, 0]).save(root / "train" / "Trouser" / "nested" / "deep.bmp")
    listing = folder.list_folder(root)
    assert listing.classes == tuple(sorted(CLASSES.values()))
    assert len(listing.splits["train"]) == 17 and len(listing.splits["val"]) == 8 and "test" not in listing.splits
    assert listing.ignored == ("train/Trouser/notes.txt",)
    trouser = listing.classes.index("Trouser")
    assert {e.label for e in listing.splits["train"] if "/Trouser/" in e.path} == {trouser}


def test_valid_folder_serves_as_val(tmp_path, fashion):
    root = make_folder(tmp_path / "d", fashion, train=4, val=2)
    (root / "val").rename(root / "valid")
    assert len(folder.list_folder(root).splits["val"]) == 8


def _empty_class(root: Path) -> None:
    (root / "train" / "Empty").mkdir()


def _unknown_val_class(root: Path) -> None:
    (root / "val" / "Hat").mkdir(parents=True)
    (root / "train" / "Trouser").replace(root / "val" / "Hat" / "x")


def _one_class(root: Path) -> None:
    for name in list(CLASSES.values())[1:]:
        for p in (root / "train" / name).iterdir():
            p.unlink()
        (root / "train" / name).rmdir()


def _no_images(root: Path) -> None:
    for name in CLASSES.values():
        for p in (root / "train" / name).iterdir():
            p.unlink()
        (root / "train" / name).rmdir()


def _loose_image(root: Path) -> None:
    Image.new("L", (28, 28)).save(root / "train" / "stray.png")


def _both_val_folders(root: Path) -> None:
    (root / "val" / "Trouser").mkdir(parents=True)
    (root / "valid" / "Trouser").mkdir(parents=True)


def _no_train(root: Path) -> None:
    (root / "train").rename(root / "training")


BAD_LAYOUTS = {
    "empty class": (_empty_class, "train/Empty holds no images"),
    "val class train lacks": (_unknown_val_class, "val/Hat: a class that train/ lacks"),
    "one class": (_one_class, "holds one class folder (T-shirt top/); a classifier needs at least two"),
    "no images": (_no_images, "holds no images; put each class's images in"),
    "image outside a class": (_loose_image, "train/stray.png is not in a class folder"),
    "val and valid": (_both_val_folders, "holds both val/ and valid/"),
    "no train folder": (_no_train, "has no train/ folder"),
}


@pytest.mark.parametrize("case", BAD_LAYOUTS)
def test_bad_layouts_are_refused_with_one_line(tmp_path, fashion, case):
    root = make_folder(tmp_path / "d", fashion, train=2)
    breaks, message = BAD_LAYOUTS[case]
    breaks(root)
    with pytest.raises(DataError) as e:
        folder.list_folder(root)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_the_training_split_itself_is_told_to_pass_its_parent(tmp_path, fashion):
    """--data-dir my_images/train: the fix is the parent folder, not my_images/train/train/<class name>/."""
    root = make_folder(tmp_path / "my_images", fashion, train=2)
    shutil.copytree(root / "train", tmp_path / "digits")  # the split under another name: its class folders tell
    for given, why in ((root / "train", "it is named train/"), (tmp_path / "digits", "holds images such as")):
        with pytest.raises(DataError) as e:
            folder.list_folder(given)
        message = str(e.value)
        assert why in message and message.endswith(f"pass the folder that holds train/: --data-dir {given.parent}")
        assert "train/train" not in message and "\n" not in message


def test_classes_are_numbered_by_label_in_one_short_line():
    assert folder.numbered(("eight", "five", "zero")) == "0=eight, 1=five, 2=zero"
    many = folder.numbered(tuple(f"c{i:03}" for i in range(1000)))
    first = ", ".join(f"{i}=c{i:03}" for i in range(10))
    assert many == f"{first}, ... 988 more ..., 998=c998, 999=c999"


def _vanishing(monkeypatch, files: list[Path], folders: list[Path]) -> None:
    """os.scandir as it is when other programs remove things while the dataset is listed: each of files is
    removed right after scandir has returned its entry (before it is stat'ed), each of folders right before it is
    read (after its parent was listed)."""
    real = os.scandir

    @contextlib.contextmanager
    def scandir(path):
        if not isinstance(path, str):  # shutil.rmtree's own calls, with a file descriptor
            with real(path) as it:
                yield it
            return
        if Path(path) in folders:
            shutil.rmtree(path)
        with real(path) as it:

            def entries():
                for entry in it:
                    yield entry
                    if Path(entry.path) in files:
                        os.unlink(entry.path)

            yield entries()

    monkeypatch.setattr(folder.os, "scandir", scandir)


def test_a_file_or_class_folder_that_vanishes_while_listed_is_left_out(tmp_path, fashion, monkeypatch):
    root = make_folder(tmp_path / "d", fashion, train=2, val=1)
    victim = next((root / "train" / "Trouser").glob("*.png"))
    _vanishing(monkeypatch, [victim], [root / "val" / "Sandalé"])
    listing = folder.list_folder(root)
    assert not victim.exists() and not (root / "val" / "Sandalé").exists()  # both really went mid-listing
    assert [e.path for e in listing.splits["train"] if "/Trouser/" in e.path] == [
        f"train/Trouser/{p.name}" for p in (root / "train" / "Trouser").iterdir()
    ]
    assert len(listing.splits["train"]) == 7 and len(listing.splits["val"]) == 3
    assert not any("/Sandalé/" in e.path for e in listing.splits["val"])
    # a class folder of train/ that vanishes takes its class with it
    other = make_folder(tmp_path / "e", fashion, train=2)
    _vanishing(monkeypatch, [], [other / "train" / "Ankle boot ü"])
    listing = folder.list_folder(other)
    assert listing.classes == ("Sandalé", "T-shirt top", "Trouser") and len(listing.splits["train"]) == 6
    assert all(e.path.split("/")[1] == listing.classes[e.label] for e in listing.splits["train"])


def test_hold_out_is_stratified_and_fixed_by_the_paths(tmp_path, fashion):
    listing = folder.list_folder(make_folder(tmp_path / "d", fashion, train=8))
    plan = folder.plan_splits(listing, 0.25)
    assert len(plan["val"]) == 8 and len(plan["train"]) == 24
    for label in range(4):  # a quarter of every class
        assert sum(e.label == label for e in plan["val"]) == 2
    assert folder.plan_splits(listing, 0.25) == plan
    assert not {e.path for e in plan["val"]} & {e.path for e in plan["train"]}
    with pytest.raises(DataError, match="--val-split 0.05 of so few images per class holds out none"):
        folder.plan_splits(listing, 0.05)


def test_val_split_0_trains_on_all_of_train_and_scores_test_each_epoch(tmp_path, fashion):
    """The record recipe's hold-out: none. test/ then serves as validation, as for the built-in datasets."""
    root = make_folder(tmp_path / "d", fashion, train=8, test=2)
    ds, manifest = build(root, request(val_split=0.0))
    assert len(ds.train) == 32 and len(ds.test) == 8 and ds.val_is_test
    assert set(manifest["counts"]) == {"train", "test"}
    held, _ = build(root, request(val_split=0.25))  # another cache, the default hold-out's
    assert len(held.train) == 24 and len(held.val) == 8 and not held.val_is_test
    with pytest.raises(DataError, match="--val-split 0 holds nothing out of train/, and there is no test/ to score"):
        folder.plan_splits(folder.list_folder(make_folder(tmp_path / "e", fashion, train=8)), 0.0)


def test_hold_out_keeps_a_training_image_in_every_class(tmp_path, fashion):
    """0.75 of 2 images rounds to 2: the whole class would go to validation; a class of one image keeps it."""
    root = make_folder(tmp_path / "d", fashion, train=2)
    next((root / "train" / "Trouser").iterdir()).unlink()
    listing = folder.list_folder(root)
    plan = folder.plan_splits(listing, 0.75)
    single = listing.classes.index("Trouser")
    for label in range(4):
        counts = (sum(e.label == label for e in plan["train"]), sum(e.label == label for e in plan["val"]))
        assert counts == ((1, 0) if label == single else (1, 1)), listing.classes[label]


# ---- preprocessing ----


def test_preprocessing_modes_to_the_same_pixels(tmp_path):
    grey = (np.arange(24 * 32) % 256).astype(np.uint8).reshape(24, 32)
    Image.fromarray(grey).save(tmp_path / "grey.png")
    Image.fromarray(grey.astype(np.uint16) * 257).save(tmp_path / "wide.png")  # 16-bit grey
    rgba = np.zeros((24, 32, 4), np.uint8)  # fully transparent: white after compositing
    Image.fromarray(rgba, "RGBA").save(tmp_path / "clear.png")
    frames = [Image.fromarray(grey).convert("P"), Image.new("P", (32, 24), 7)]
    frames[0].save(tmp_path / "anim.gif", save_all=True, append_images=frames[1:])

    plain = preprocess.load_image(tmp_path / "grey.png", 1, (32, 24))
    assert plain.shape == (1, 24, 32) and plain.dtype == np.uint8
    np.testing.assert_array_equal(plain[0], grey)
    assert Image.open(tmp_path / "wide.png").mode.startswith("I")
    np.testing.assert_array_equal(preprocess.load_image(tmp_path / "wide.png", 1, (32, 24)), plain)
    assert np.all(preprocess.load_image(tmp_path / "clear.png", 3, (32, 24)) == preprocess.BACKGROUND)
    first = preprocess.load_image(tmp_path / "anim.gif", 3, (32, 24))
    assert first.shape == (3, 24, 32) and first[:, 0, 0].tolist() == [0, 0, 0] and first[0, -1, -1] > 200
    small = preprocess.load_image(tmp_path / "grey.png", 1, (16, 12))
    assert small.shape == (1, 12, 16)


def _bomb(path: Path) -> None:
    """A PNG whose header claims 30000 x 30000 pixels: Image.open refuses it before decoding any pixel."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", 30000, 30000, 8, 0, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")
    )


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])


# ---- the cache ----


def test_cache_is_built_once_and_used_while_fresh(tmp_path, fashion):
    root = make_folder(tmp_path / "d", fashion, train=8, val=2)
    ds, manifest = build(root)
    caches = folder.default_cache_dir(root)
    assert caches == root.resolve() / folder.CACHE_NAME
    cache = folder.find(folder.list_folder(root), request(), caches)
    assert cache == caches / "28x28-grey-val0.25"
    assert isinstance(ds.train.images, np.memmap) and ds.image_shape == (1, 28, 28)
    assert (len(ds.train), len(ds.val)) == (32, 8) and ds.val_is_test
    assert ds.classes == tuple(sorted(CLASSES.values())) and manifest["channels"] == 1
    # the PNG rows hold the very pixels of the idx file
    entry = folder.plan_splits(folder.list_folder(root), 0.25)["train"][0]  # row 0 of the cache
    assert entry.label == ds.train.labels[0]
    np.testing.assert_array_equal(ds.train.images[0], preprocess.load_image(root / entry.path, 1, (28, 28)))
    mtime = (cache / folder.MANIFEST).stat().st_mtime_ns
    build(root)
    assert (cache / folder.MANIFEST).stat().st_mtime_ns == mtime  # fresh: not rebuilt


def _add(root: Path) -> None:
    Image.new("L", (28, 28), 9).save(root / "train" / "Trouser" / "new.png")


def _remove(root: Path) -> None:
    next((root / "train" / "Trouser").glob("*.png")).unlink()


def _change(root: Path) -> None:
    path = next((root / "train" / "Trouser").glob("*.png"))
    Image.new("L", (28, 28), 200).save(path)
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))


@pytest.mark.parametrize("edit", [_add, _remove, _change], ids=["added", "removed", "changed"])
def test_cache_goes_stale_when_a_file_changes(tmp_path, fashion, edit):
    root = make_folder(tmp_path / "d", fashion, train=4, val=1)
    before, _ = build(root)
    caches = folder.default_cache_dir(root)
    cache = folder.find(folder.list_folder(root), request(), caches)
    edit(root)
    listing = folder.list_folder(root)
    assert not folder.is_fresh(caches, listing, request())
    with pytest.raises(DataError, match="the cache does not match the files"):
        folder.load(listing, request(), cache)  # a stale cache is never read
    after, _ = build(root)
    assert len(after.train) == len(listing.splits["train"])
    if edit is _change:
        assert {int(x.max()) for x in after.train.images} != {int(x.max()) for x in before.train.images}


def test_other_settings_rebuild_and_defaults_follow_the_files(tmp_path, fashion):
    root = make_folder(tmp_path / "d", fashion, train=4, val=1)
    Image.new("RGB", (40, 30), (200, 10, 10)).save(root / "train" / "Trouser" / "colour.png")
    ds, manifest = build(root)
    assert manifest["size"] == [28, 28] and ds.image_shape == (3, 28, 28)  # the most common size; one is colour
    ds, manifest = build(root, request(size=(20, 12), channels=1))
    assert ds.image_shape == (1, 12, 20) and manifest["size"] == [20, 12]
    assert not list(root.resolve().glob(f"{folder.CACHE_NAME}.*"))  # no temporary or old folder left behind


def test_a_cache_serves_every_request_for_the_same_pixels_and_other_settings_are_kept(tmp_path, fashion, caplog):
    """An explicit --image-size or --channels equal to the folder's defaults reuses the default's cache; a new
    setting builds a cache of its own beside it, and going back to the first reuses that one."""
    root = make_folder(tmp_path / "d", fashion, train=4, val=1)
    caches = folder.default_cache_dir(root)

    def built(req: folder.Request) -> tuple[Path, int]:
        cache = folder.ensure_cache(folder.list_folder(root), req, caches, LOG)
        return cache, (cache / folder.MANIFEST).stat().st_mtime_ns

    default, stamp = built(request())
    for same in (request(size=(28, 28)), request(channels=1), request(skip_bad_images=True)):
        assert built(same) == (default, stamp)  # the same pixels: found, not decoded again
    with caplog.at_level(logging.INFO, logger=LOG.name):
        bigger, _ = built(request(size=(32, 32)))
    assert bigger != default and bigger.name == "32x32-grey-val0.25"
    assert f"kept 1 cache(s) of other settings beside it ({default.name}" in caplog.text
    assert built(request()) == (default, stamp)  # the first setting again: still there, not rebuilt
    assert built(request(size=(32, 32)))[0] == bigger
    assert built(request(val_split=0.5))[0] not in (default, bigger)  # another hold-out: other images, other cache


def test_caches_of_files_that_changed_are_removed_and_an_old_format_cache_too(tmp_path, fashion, caplog):
    root = make_folder(tmp_path / "d", fashion, train=4, val=1)
    caches = folder.default_cache_dir(root)
    caches.mkdir()
    (caches / folder.MANIFEST).write_text("{}")  # FORMAT 1 kept its files in the cache folder itself
    (caches / "train.npy").write_bytes(b"old")
    first = folder.ensure_cache(folder.list_folder(root), request(), caches, LOG)
    other = folder.ensure_cache(folder.list_folder(root), request(size=(20, 20)), caches, LOG)
    assert not (caches / "train.npy").exists() and sorted(caches.iterdir()) == sorted([first, other])
    _add(root)
    with caplog.at_level(logging.INFO, logger=LOG.name):
        now = folder.ensure_cache(folder.list_folder(root), request(), caches, LOG)
    assert sorted(caches.iterdir()) == [now]  # the 20 px cache was of the files before the change
    assert f"removed {other}: a cache of files that have changed since" in caplog.text


def test_a_sample_that_guessed_wrong_is_decoded_again(tmp_path, fashion, monkeypatch, caplog):
    """The first pass decodes to what the first SAMPLE files of train/ call for (here: one grey file); a colour
    image found later makes the whole folder RGB, and the second pass decodes every file again."""
    root = make_folder(tmp_path / "d", fashion, train=4, val=1)
    colour = root / "train" / "Trouser" / "colour.png"
    Image.new("RGB", (28, 28), (200, 10, 10)).save(colour)
    first = folder.plan_splits(folder.list_folder(root), 0.25)["train"][0]
    assert first.path != "train/Trouser/colour.png"  # the sample of one is grey
    monkeypatch.setattr(folder, "SAMPLE", 1)
    with caplog.at_level(logging.INFO, logger=LOG.name):
        ds, manifest = build(root)
    assert "decoding again" in caplog.text and manifest["channels"] == 3
    paths = [e.path for e in folder.plan_splits(folder.list_folder(root), 0.25)["train"]]
    row = paths.index("train/Trouser/colour.png")
    assert ds.train.images[row][:, 0, 0].tolist() == [200, 10, 10]
    np.testing.assert_array_equal(ds.train.images[0], preprocess.load_image(root / first.path, 3, (28, 28)))


@pytest.mark.parametrize(
    "breaks,why",
    [(_truncate, "cannot read the image"), (_bomb, "a decompression bomb"), (Path.unlink, "vanished after")],
    ids=["truncated", "bomb", "vanished"],
)
def test_unreadable_files_are_named_and_the_old_cache_kept(tmp_path, fashion, breaks, why):
    root = make_folder(tmp_path / "d", fashion, train=4, val=1)
    build(root)
    caches = folder.default_cache_dir(root)
    cache = folder.find(folder.list_folder(root), request(), caches)
    old = (cache / folder.MANIFEST).read_text()
    victim = root / "train" / "Trouser" / "bad.png"
    if breaks is _bomb:
        _bomb(victim)
    else:
        Image.fromarray(fashion.images[0, 0]).resize((64, 64)).save(victim)
    listing = folder.list_folder(root)  # listed before it breaks: a file that vanishes after is caught too
    if breaks is not _bomb:
        breaks(victim)
    with pytest.raises(DataError) as e:
        folder.ensure_cache(listing, request(), caches, LOG)
    line = str(e.value)
    assert line.startswith(str(victim)) and why in line and "--skip-bad-images" in line and "\n" not in line
    assert (cache / folder.MANIFEST).read_text() == old
    assert not list(root.resolve().glob(f"{folder.CACHE_NAME}.*"))


def test_a_killed_build_leaves_nothing_behind_for_long(tmp_path, fashion):
    root = make_folder(tmp_path / "d", fashion, train=2, val=1)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    leftover = root / f"{folder.CACHE_NAME}.tmp{int(gone.stdout)}"  # a build whose process no longer exists
    leftover.mkdir()
    (leftover / "train.npy").write_bytes(b"half")
    build(root)
    assert not leftover.exists()
    assert folder.is_fresh(folder.default_cache_dir(root), folder.list_folder(root), request())


def test_a_leftover_of_another_host_is_kept(tmp_path, fashion):
    """On shared storage, another machine's build in progress has a pid this machine cannot check: only this
    host's leftovers whose process is gone are removed."""
    root = make_folder(tmp_path / "d", fashion, train=2, val=1)
    cache = folder.default_cache_dir(root)
    assert folder._own(cache, "tmp").name.endswith(f".tmp{os.getpid()}@{socket.gethostname()}")
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(gone.stdout)  # no process here has it; on another machine, one may
    mine = root / f"{folder.CACHE_NAME}.tmp{pid}@{socket.gethostname()}"
    theirs = [root / f"{folder.CACHE_NAME}.{kind}{pid}@other-node.cluster" for kind in ("tmp", "old")]
    for path in [mine, *theirs]:
        path.mkdir()
        (path / "train.npy").write_bytes(b"half")
    build(root)
    assert not mine.exists() and all((path / "train.npy").exists() for path in theirs)


def test_a_decoding_process_stopped_while_it_starts_runs_none_of_the_trainers_handlers(tmp_path, monkeypatch):
    """On an error the pool SIGTERMs its workers, maybe one still starting: that one must not run the handlers it
    inherited (Paddle's hangs a process still inside fork). Here the worker is slow to start, and the inherited
    handler is the test's own, which would leave a mark."""
    marks = tmp_path / "marks"
    quiet = folder._quiet_worker

    def slow_start() -> None:
        time.sleep(0.5)  # the pool's SIGTERM arrives meanwhile
        quiet()

    def handler(signum, frame) -> None:
        marks.write_text(f"worker {os.getpid()} ran the trainer's handler")
        os._exit(0)

    monkeypatch.setattr(folder, "_quiet_worker", slow_start)
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        with folder._pool(1):
            pass  # ends the pool at once: terminate
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert not marks.exists(), marks.read_text()


def test_skip_bad_images_refuses_a_class_left_without_training_images(tmp_path, fashion):
    root = make_folder(tmp_path / "d", fashion, train=4, val=1)
    for path in (root / "train" / "Trouser").iterdir():
        _truncate(path)
    with pytest.raises(DataError) as e:
        build(root, request(skip_bad_images=True))
    line = str(e.value)
    assert line.startswith(f"{root / 'train' / 'Trouser'}: no readable training image is left (4 unreadable")
    assert "add readable images" in line and "remove the folder" in line and "\n" not in line
    assert not list(root.glob(f"{folder.CACHE_NAME}*"))  # nothing written


def test_skip_bad_images_trains_without_them_and_lists_them(tmp_path, fashion):
    root = make_folder(tmp_path / "d", fashion, train=4, val=1)
    victim = root / "train" / "Trouser" / "bad.jpg"
    Image.fromarray(fashion.images[0, 0]).save(victim)
    _truncate(victim)
    ds, manifest = build(root, request(skip_bad_images=True))
    assert len(ds.train) == 16 and len(ds.train.labels) == 16
    assert len(manifest["skipped"]) == 1 and manifest["skipped"][0].startswith(str(victim))


# ---- flags ----


def test_folder_flags(tmp_path):
    base = ["--dataset", "folder", "--data-dir", str(tmp_path)]
    assert parse_args([*base, "--image-size", "64x48"]).image_size == "64x48"
    assert folder.Request.of(parse_args([*base, "--image-size", "64x48"])).size == (64, 48)  # (width, height)
    square = folder.Request.of(parse_args([*base, "--image-size", "28"]))
    assert square == folder.Request.of(parse_args([*base, "--image-size", "28x28"])) and square.size == (28, 28)
    for argv, message in [
        ([*base, "--image-size", "64x"], "--image-size takes W or WxH"),
        (["--image-size", "64"], "--image-size applies to --dataset folder only"),
        (["--dataset", "folder"], "--dataset folder needs --data-dir"),
        ([*base, "--val-split", "1"], "--val-split is a share"),
        ([*base, "--val-split", "-0.1"], "--val-split is a share of train/ from 0"),
        ([*base, "--tta"], "add --flip if a mirror keeps the class"),
    ]:
        with pytest.raises(ConfigError, match=message):
            parse_command(argv)
    assert parse_command([*base, "--tta", "--flip"]).tta
    grey = (1, 20, 20)
    assert not augment.policy_for("folder", grey).flip and augment.policy_for("folder", grey, flip=True).flip


def test_resume_refuses_another_val_split_on_a_folder(tmp_path):
    """The hold-out chooses a folder's training images; elsewhere --val-split plays no part and is not compared."""
    path = tmp_path / "checkpoints" / "step_4.pdckpt"
    folder_cfg = parse_args(["--dataset", "folder", "--data-dir", str(tmp_path), "--val-split", "0.2"])
    for dataset in ("folder", "fashion-mnist"):  # (--val-split is refused for the other datasets)
        cfg = dataclasses.replace(folder_cfg, dataset=dataset)
        check_resumable(dataclasses.asdict(cfg), cfg, path)
        saved = dataclasses.asdict(dataclasses.replace(cfg, val_split=0.25))
        if dataset != "folder":
            check_resumable(saved, cfg, path)
            continue
        with pytest.raises(ConfigError) as e:
            check_resumable(saved, cfg, path)
        assert str(e.value) == (
            f"--resume: {path} was trained with --val-split 0.25, not 0.2; "
            "pass --val-split 0.25 or another --output-dir"
        )
    cfg = parse_args(["--dataset", "folder", "--data-dir", str(tmp_path)])
    check_resumable({k: v for k, v in dataclasses.asdict(cfg).items() if k != "val_split"}, cfg, path)  # older


# ---- real runs ----

SMALL = ["--dataset", "folder", "--batch-size", "32", "--epochs", "2", "--log-every", "4", "--image-size", "20"]
SMALL += ["--val-split", "0.2", "--save-every-steps", "4"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, fashion):
    """Two workers, then one process, on a folder without val/ (a held-out share) with a test/: the two-worker
    run finds no cache and builds it on rank 0; the one-process run reuses it. The tutorial's CNN without
    augmentation, so the two runs compute the same sums (batch norm's statistics and the augmentation's draws are
    each worker's own); --tta needs --flip on a folder."""
    root = tmp_path_factory.mktemp("runs")
    images = make_folder(root / "images", fashion, train=80, test=10)
    args = [*SMALL, "--data-dir", str(images), "--model", "mnist_cnn", "--tta", "--flip"]
    two = run_launch([*args, "--output-dir", str(root / "two")], cwd=root, log_dir=root / "log")
    assert two.returncode == 0, explain(two, root / "log")
    one = run_single([*args, "--output-dir", str(root / "one")], cwd=root)
    assert one.returncode == 0, explain(one)
    (root / "one.log").write_text(one.stdout + one.stderr)
    return root


@pytest.mark.slow
@pytest.mark.readme
def test_two_workers_equal_one_process_on_a_folder(runs):
    logs = [worker_log(runs / "log", r) for r in (0, 1)]
    assert "decoding 360 images" in logs[0] and "decoding" not in logs[1]  # rank 0 built, rank 1 waited
    for log in logs:  # the label of each class, once, at start-up
        named = "classes (4, labels by sorted folder name): 0=Ankle boot ü, 1=Sandalé, 2=T-shirt top, 3=Trouser;"
        assert log.count(named) == 1, log
    assert "decoding" not in (runs / "one.log").read_text()  # the cache was fresh
    assert param_digest(logs[0]) == param_digest(logs[1])
    one, two = weights(runs / "one" / "model.pdparams"), weights(runs / "two" / "model.pdparams")
    for name in one:
        np.testing.assert_allclose(two[name], one[name], atol=1e-5, rtol=0, err_msg=name)
    rows = read_metrics(runs / "two")
    assert [r["step"] for r in rows] == [8, 16] and rows[-1]["val_count"] == 64
    config = json.loads((runs / "two" / "config.json").read_text())
    assert config["classes"] == sorted(CLASSES.values()) and config["image_size"] == "20x20"
    assert config["channels"] == 1
    assert json.loads((runs / "two" / "results.json").read_text())["test_count"] == 40


@pytest.mark.slow
def test_resume_mid_epoch_on_a_folder_equals_the_uninterrupted_run(runs):
    """With the default network (batch norm) and --augment --flip, in one process."""
    args = [*SMALL, "--data-dir", str(runs / "images"), "--augment", "--flip"]
    full = run_single([*args, "--output-dir", str(runs / "full")], cwd=runs)
    assert full.returncode == 0, explain(full)
    part = run_single([*args, "--output-dir", str(runs / "part"), "--max-steps", "12"], cwd=runs)
    assert part.returncode == 0, explain(part)
    again = run_single([*args, "--output-dir", str(runs / "part"), "--resume"], cwd=runs)
    assert again.returncode == 0, explain(again)
    assert "resumed from" in again.stdout + again.stderr
    a, b = weights(runs / "full" / "model.pdparams"), weights(runs / "part" / "model.pdparams")
    for name in a:
        np.testing.assert_array_equal(b[name], a[name], err_msg=name)
    assert read_metrics(runs / "part")[-1]["val_acc"] == read_metrics(runs / "full")[-1]["val_acc"]


@pytest.mark.slow
def test_predict_names_the_folders_classes(runs):
    root = runs
    meta = json.loads((root / "two" / "inference_meta.json").read_text())
    assert meta["classes"] == sorted(CLASSES.values()) and meta["image_shape"] == [1, 20, 20]
    images = sorted((root / "images" / "test" / "Sandalé").iterdir())[:2]
    cmd = [sys.executable, "-m", "paddle_mnist.predict", "--model", str(root / "two" / "inference"), "--json"]
    proc = subprocess.run([*cmd, "--image", *map(str, images)], env=launch_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout)
    assert [r["image"] for r in results] == [str(p) for p in images]
    for r in results:
        assert {t["name"] for t in r["top"]} <= set(CLASSES.values()) and len(r["top"]) == 3


def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "error:" in line]


@pytest.mark.slow
@pytest.mark.parametrize(
    "breaks,message",
    [
        (lambda root: _truncate(next((root / "train" / "Trouser").glob("*.jpg"))), "cannot read the image"),
        (_unknown_val_class, "a class that train/ lacks"),
        (_empty_class, "holds no images"),
    ],
    ids=["truncated", "val class train lacks", "empty class"],
)
def test_bad_folder_through_the_command(tmp_path, fashion, breaks, message):
    root = make_folder(tmp_path / "d", fashion, train=2, val=1)
    breaks(root)
    proc = run_single(["--dataset", "folder", "--data-dir", str(root), "--output-dir", str(tmp_path / "o")], tmp_path)
    assert proc.returncode == 2, explain(proc)
    (line,) = _error_lines(proc.stdout + proc.stderr)
    assert message in line and "Traceback" not in proc.stderr
    assert not (tmp_path / "o").exists() and not (root / folder.CACHE_NAME).exists()


@pytest.mark.slow
def test_a_small_folder_is_told_the_batch_size_that_fits_and_not_to_raise_a_train_limit_it_never_set(tmp_path, fashion):
    """40 images, 4 held out (--val-split 0.1): 36 train, fewer than the default global batch of 64."""
    root = make_folder(tmp_path / "d", fashion, train=10)
    proc = run_single(["--dataset", "folder", "--data-dir", str(root), "--output-dir", str(tmp_path / "o")], tmp_path)
    assert proc.returncode == 2, explain(proc)
    (line,) = _error_lines(proc.stdout + proc.stderr)
    assert line.endswith(
        "the training split has 36 images, fewer than one global batch of 64: pass --batch-size 36 or less"
    )
    assert "--train-limit" not in line and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_bad_file_stops_both_workers(tmp_path, fashion):
    root = make_folder(tmp_path / "d", fashion, train=2, val=1)
    _truncate(next((root / "train" / "Trouser").glob("*.jpg")))
    args = ["--dataset", "folder", "--data-dir", str(root), "--output-dir", str(tmp_path / "o")]
    proc = run_launch(args, cwd=tmp_path, log_dir=tmp_path / "log")
    assert proc.returncode == 2, explain(proc, tmp_path / "log")
    (own,) = _error_lines(worker_log(tmp_path / "log", 0))
    (other,) = _error_lines(worker_log(tmp_path / "log", 1))
    assert "cannot read the image" in own and "its message is in its log" in other
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_resume_refuses_a_folder_whose_classes_changed(runs, tmp_path):
    images = tmp_path / "images"
    shutil.copytree(runs / "images", images, ignore=shutil.ignore_patterns(folder.CACHE_NAME))
    (images / "train" / "Trouser").rename(images / "train" / "Trousers")
    (images / "test" / "Trouser").rename(images / "test" / "Trousers")
    before = (runs / "one" / "metrics.jsonl").read_text()
    args = [*SMALL, "--data-dir", str(images), "--model", "mnist_cnn", "--output-dir", str(runs / "one"), "--resume"]
    proc = run_single(args, cwd=tmp_path)
    assert proc.returncode == 2, explain(proc)
    (line,) = _error_lines(proc.stdout + proc.stderr)
    assert "was trained on the classes Ankle boot ü, Sandalé, T-shirt top, Trouser" in line and "Trousers" in line
    assert (runs / "one" / "metrics.jsonl").read_text() == before


# ---- a cold cache on real processes: no worker waits in a collective while another decodes ----


def _forked_children(pid: int) -> list[int]:
    """The processes pid forked (the decoding pool's): children running pid's own command line, so not a compiler
    that a first build of the oneDNN operator runs."""
    command = Path(f"/proc/{pid}/cmdline").read_bytes()
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])  # the field after the state
            if parent == pid and (stat.parent / "cmdline").read_bytes() == command:
                found.append(int(stat.parent.name))
        except (OSError, IndexError):
            continue
    return found


@pytest.mark.slow
def test_a_decode_slower_than_gloos_timeout_keeps_three_workers_waiting(tmp_path, fashion):
    """Rank 0's decoding processes are stopped (SIGSTOP) as soon as they exist: ranks 1 and 2 wait in the key-value
    store, saying what they wait for while the decoding stands still, and the job trains once it goes on. Gloo's 30 s
    collective timeout is fixed (Paddle cannot change it), so rather than outlast it the test holds the decoding
    until each waiting rank has logged three more lines (one every 0.5 s here): a rank in a collective logs nothing.
    Before the meeting, they waited in an all-reduce and gloo ended the job."""
    images = make_folder(tmp_path / "images", fashion, train=400, test=5)  # decoded in a second or two
    out = tmp_path / "out"
    args = [*SMALL, "--data-dir", str(images), "--output-dir", str(out), "--max-steps", "4", "--batch-size", "30"]
    log_dir = tmp_path / "log"
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "3", "--log_dir", str(log_dir)]
    env = dict(launch_env(), PADDLE_MNIST_MEETING_REPORT_S="0.5")
    job = subprocess.Popen([*cmd, str(TRAIN_PY), *args], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL)
    waiting = "waiting for the folder's cache: rank 0 at"
    with reaped(job):
        wait_for(job, log_dir / "workerlog.0", "decoding 1620 images")  # the pool starts next
        deadline, stopped = time.monotonic() + 120, []
        while not stopped:
            assert job.poll() is None and time.monotonic() < deadline, "rank 0 never started its decoding processes"
            with contextlib.suppress(AssertionError, OSError):
                stopped = _forked_children(rank_pid(out, 0))
            time.sleep(0.01)
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        before = [worker_log(log_dir, r).count(waiting) for r in (1, 2)]
        deadline = time.monotonic() + 20  # short of gloo's 30 s, so a rank in a collective fails here, not in gloo
        lines = [0, 0]
        while min(lines) < 3:
            assert job.poll() is None, explain(subprocess.CompletedProcess(cmd, job.returncode, "", ""), log_dir)
            assert time.monotonic() < deadline, (
                f"ranks 1 and 2 logged {lines} lines of waiting in 20 s while rank 0's decoding was held, not 3 each "
                "(one every 0.5 s): they wait somewhere else, in a collective that gloo aborts after 30 s"
            )
            time.sleep(0.1)
            lines = [worker_log(log_dir, r).count(waiting) - n for r, n in zip((1, 2), before)]
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        ended = job.wait(timeout=240)
        assert ended == 0, explain(subprocess.CompletedProcess(cmd, ended, "", ""), log_dir)
    logs = [worker_log(tmp_path / "log", r) for r in range(3)]
    assert "decoded 1620 images in" in logs[0]
    for log in logs[1:]:
        assert waiting in log and "decoding" not in log, log
        assert "finished: test accuracy" in log
    assert not list(images.glob(f"{folder.CACHE_NAME}.*"))  # no temporary or old folder left behind


@pytest.mark.slow
def test_a_stop_signal_while_decoding_removes_the_unfinished_cache(tmp_path, fashion):
    """SIGTERM to a one-process run while its decoding processes are held: once they go on, the build stops at the
    next run of files, removes its temporary folder and ends as a stop (128 + 15), naming what to do."""
    images = make_folder(tmp_path / "images", fashion, train=400, test=5)
    out = tmp_path / "out"
    cmd = [sys.executable, str(TRAIN_PY), *SMALL, "--data-dir", str(images), "--output-dir", str(out)]
    job = subprocess.Popen(cmd, cwd=tmp_path, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    with reaped(job):
        deadline, held = time.monotonic() + 120, []
        while not held:
            assert job.poll() is None and time.monotonic() < deadline, "the decoding processes never started"
            if list(images.glob(f"{folder.CACHE_NAME}.tmp*")):  # the pool runs once the temporary folder exists
                with contextlib.suppress(OSError):
                    held = _forked_children(job.pid)
            time.sleep(0.01)
        for pid in held:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        job.send_signal(signal.SIGTERM)
        time.sleep(1)
        for pid in held:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        output = job.communicate(timeout=120)[0].decode()
    assert job.returncode == 128 + signal.SIGTERM, output
    assert "stopped by SIGTERM while decoding the folder; the unfinished cache was removed" in output
    assert not list(images.glob(f"{folder.CACHE_NAME}*")) and not out.exists()


CIFAR_JPEG = Path(__file__).resolve().parents[2] / "shared" / "data" / "cifar10-jpeg" / "cifar10-jpeg.tar.gz"


@pytest.mark.slow
@pytest.mark.skipif(not CIFAR_JPEG.exists(), reason=f"the CIFAR-10 JPEG copy is not at {CIFAR_JPEG}")
def test_the_readme_folder_command_trains_cifar10_from_a_cold_cache(tmp_path):
    """The README's folder command on the 60,000 CIFAR-10 JPEG files, unpacked afresh (a cold cache), with 2 real
    workers: rank 0 decodes them for about a minute while rank 1 waits in the store, then both train."""
    subprocess.run(["tar", "xzf", str(CIFAR_JPEG), "-C", str(tmp_path)], check=True)
    root = tmp_path / "cifar"
    root.mkdir()
    for split in ("train", "test"):
        (tmp_path / split).rename(root / split)
    out = tmp_path / "run"
    args = ["--dataset", "folder", "--data-dir", str(root), "--augment", "--output-dir", str(out)]
    args += ["--max-steps", "10", "--eval-limit", "500"]  # the start is what is tested: a few steps, then the end
    job = run_launch(args, cwd=tmp_path, log_dir=tmp_path / "log", timeout=900)
    assert job.returncode == 0, explain(job, tmp_path / "log")
    logs = [worker_log(tmp_path / "log", r) for r in (0, 1)]
    assert "decoding 60000 images" in logs[0] and re.search(r"decoded 60000 images in [\d.]+ s \(\d+ images/s", logs[0])
    assert "waiting for the folder's cache: rank 0 at" in logs[1] and "decoding" not in logs[1]
    cache = folder.find(folder.list_folder(root), folder.Request(None, 0, 0.1, False), folder.default_cache_dir(root))
    assert cache is not None and cache.name == "32x32-rgb-val0.1"
    manifest = folder.read_manifest(cache)
    assert manifest["counts"] == {"train": 45000, "val": 5000, "test": 10000} and manifest["channels"] == 3
    assert not list(root.glob(f"{folder.CACHE_NAME}.*"))
    assert json.loads((out / "results.json").read_text())["test_count"] == 500


def test_large_images_default_to_a_shorter_side_of_64_pixels_aspect_kept():
    assert folder.default_size((4032, 3024)) == (85, 64)  # a phone's photo, landscape
    assert folder.default_size((3024, 4032)) == (64, 85)  # and portrait
    for small in [(28, 28), (32, 32), (64, 64), (100, 64), (256, 64)]:
        assert folder.default_size(small) == small  # the size the folder has, as before
    assert folder.default_size((128, 128)) == (64, 64)
    assert folder.default_size((2000, 100)) == (256, 13)  # a strip: its longer side capped too


def make_photos(root: Path, count: int = 8, size: tuple[int, int] = (4032, 3024)) -> Path:
    """count JPEG files per class (the shipped MNIST's 3s and 7s) upscaled to size, by default a phone's photo."""
    split = data.load_dataset("mnist").train
    for label, name in ((3, "three"), (7, "seven")):
        (root / "train" / name).mkdir(parents=True)
        for k, row in enumerate(np.flatnonzero(split.labels == label)[:count]):
            big = Image.fromarray(split.images[row, 0]).convert("RGB").resize(size, Image.BILINEAR)
            big.save(root / "train" / name / f"IMG_{k:04d}.jpg", quality=90)
    return root


@pytest.mark.slow
def test_phone_photos_train_at_a_sensible_size_with_the_default_command_and_say_so(tmp_path):
    """16 photos of 4032x3024 without --image-size: decoded at 85x64 (a cache of kilobytes, not 36 MB an image),
    a dense head of the same size as at 64 px, and a start-up line naming the size, why, and the flag."""
    root = make_photos(tmp_path / "photos")
    args = ["--dataset", "folder", "--data-dir", str(root), "--max-steps", "2", "--batch-size", "8"]
    proc = run_single([*args, "--output-dir", str(tmp_path / "o")], tmp_path)
    assert proc.returncode == 0, explain(proc)
    (said,) = [line for line in proc.stdout.splitlines() if "image size" in line]
    assert said.endswith(
        "image size 85x64: 4032x3024 is the most common size in train/ (14 of 14), scaled down to a shorter side "
        "of at most 64 and a longer side of at most 256 pixels, aspect kept; --image-size WxH trains at another "
        "size (time grows with the area)"
    )
    (cache,) = (root / folder.CACHE_NAME).iterdir()
    assert cache.name.startswith("85x64-rgb") and np.load(cache / "train.npy").shape == (14, 3, 64, 85)
    assert "dataset folder (3x64x85, 2 classes)" in proc.stdout
    assert json.loads((tmp_path / "o" / "results.json").read_text())["steps"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_a_model_that_cannot_fit_the_memory_is_refused_before_it_is_built(tmp_path, workers):
    """MiniGoogLeNet on 4096x4096 images needs about 80 GiB an image: one line naming the need and the fixes, exit
    2 on every worker, no weights, where the kernel would otherwise kill a worker without a word."""
    root = make_photos(tmp_path / "photos", count=3, size=(64, 64))
    args = ["--dataset", "folder", "--data-dir", str(root), "--model", "minigooglenet", "--image-size", "4096"]
    args += ["--batch-size", str(2 * workers), "--val-split", "0.2", "--output-dir", str(tmp_path / "o")]
    log_dir = tmp_path / "log"
    proc = run_single(args, tmp_path) if workers == 1 else run_launch(args, tmp_path, log_dir)
    assert proc.returncode == 2, explain(proc, log_dir if workers > 1 else None)
    for rank in range(workers):
        text = proc.stdout + proc.stderr if workers == 1 else worker_log(log_dir, rank)
        (line,) = _error_lines(text)
        assert re.search(
            r"error: --model minigooglenet on 4096x4096 images, 2 a step per worker, needs about [\d.]+ GiB of "
            r"memory( for each of its 2 workers)?; this machine has [\d.]+ GiB available: pass a smaller "
            r"--image-size or --batch-size \(or --accum-steps\), or start fewer workers$",
            line,
        ), line
        assert "model minigooglenet:" not in text  # refused before the model was built and described
    assert "Traceback" not in proc.stderr and not (tmp_path / "o" / "model.pdparams").exists()


@pytest.mark.slow
def test_a_cache_larger_than_half_the_free_disk_is_refused_before_decoding(tmp_path):
    root = make_photos(tmp_path / "photos", count=3, size=(64, 64))
    args = ["--dataset", "folder", "--data-dir", str(root), "--image-size", "200000", "--val-split", "0.2"]
    started = time.monotonic()
    proc = run_single([*args, "--output-dir", str(tmp_path / "o")], tmp_path)
    assert proc.returncode == 2, explain(proc)
    (line,) = _error_lines(proc.stdout + proc.stderr)
    need = 6 * 3 * 200000**2 / 2**30  # 6 images of 3 x 200000 x 200000 bytes
    assert f"the decoded images would take {need:.1f} GiB in " in line and "more than 50% of the " in line
    assert line.endswith("GiB free there; pass a smaller --image-size, or free space"), line
    assert not any((root / folder.CACHE_NAME).glob("*/*.npy")) and time.monotonic() - started < 60

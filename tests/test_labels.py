"""Label files as a folder run's source (--labels): the CSV and PaddleClas formats, bad rows, the cache's identity,
and real runs on the CIFAR-10 JPEG copy that train the weights the same files' class folders train."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import explain, launch_env, param_digest, run_launch, run_single, worker_log
from PIL import Image

from paddle_mnist.cli import parse_command
from paddle_mnist.config import ConfigError
from paddle_mnist.datasets import folder, labels
from paddle_mnist.datasets.formats import DataError

LOG = logging.getLogger("test_labels")
CIFAR_JPEG = Path(__file__).resolve().parents[2] / "shared" / "data" / "cifar10-jpeg" / "cifar10-jpeg.tar.gz"
CIFAR_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def make_folder(root: Path, classes=("cat", "dog", "eel"), train: int = 4, test: int = 2) -> Path:
    """root/train/<class>/ and root/test/<class>/ of small PNGs, each class its own shade."""
    for split, n in (("train", train), ("test", test)):
        for k, name in enumerate(classes):
            (root / split / name).mkdir(parents=True)
            for i in range(n):
                shade = np.full((8, 8), 40 * k + i, np.uint8)
                Image.fromarray(shade).save(root / split / name / f"{i:03d}.png")
    return root


def write_csv(path: Path, listing: folder.Listing, split: str, rows: list[str] | None = None) -> Path:
    """A path,label CSV beside the folder's train/ of one of its splits, or of rows."""
    rows = [f"{e.path},{listing.classes[e.label]}" for e in listing.splits[split]] if rows is None else rows
    path.write_text("path,label\n" + "\n".join(rows) + "\n")
    return path


# ---- the formats ----


def test_a_csv_and_a_paddleclas_list_beside_train_list_the_folders_very_entries(tmp_path):
    root = make_folder(tmp_path / "d")
    by_folder = folder.list_folder(root)
    csv_file = write_csv(root / "train.csv", by_folder, "train")
    index = {name: i for i, name in enumerate(by_folder.classes)}
    paddleclas = root / "train_list.txt"
    paddleclas.write_text("".join(f"{e.path} {index[by_folder.classes[e.label]]}\n" for e in by_folder.splits["train"]))
    for train, classes in ((csv_file, by_folder.classes), (paddleclas, ("0", "1", "2"))):
        listing = labels.list_labels(train)
        assert listing.classes == classes and listing.root == root
        assert listing.splits == {"train": by_folder.splits["train"]}  # same paths, sizes, times, labels
        assert folder.plan_splits(listing, 0.25) == folder.plan_splits(
            folder.Listing(root, by_folder.classes, {"train": by_folder.splits["train"]}, ()), 0.25
        )


def test_csv_columns_by_name_quoted_paths_comments_and_paths_outside_the_files_folder(tmp_path):
    root = make_folder(tmp_path / "d")
    (root / "train" / "cat" / "a, b.png").write_bytes((root / "train" / "cat" / "000.png").read_bytes())
    lists = tmp_path / "lists"
    lists.mkdir()
    outside = str(root / "train" / "dog" / "000.png")  # absolute
    text = (
        "\ufeff# made by hand\n"  # a spreadsheet's byte-order mark, then a comment
        "id, Label ,PATH\n"
        '1,cat,"../d/train/cat/a, b.png"\n'
        "\n"
        "2,eel,../d/train/eel/001.png\n"
        f"3,dog,{outside}\n"
    )
    (lists / "train.csv").write_text(text)
    listing = labels.list_labels(lists / "train.csv")
    assert listing.classes == ("cat", "dog", "eel")
    paths = [(e.path, listing.classes[e.label]) for e in listing.splits["train"]]
    assert paths == [
        (str(root / "train/cat/a, b.png"), "cat"),  # outside the file's folder: absolute
        (str(root / "train/eel/001.png"), "eel"),
        (outside, "dog"),
    ]


def test_labels_sort_by_value_when_every_one_is_an_integer():
    assert labels.sort_classes({"10", "2", "1", "-3", "11"}) == ("-3", "1", "2", "10", "11")
    assert labels.sort_classes({"10", "2", "b", "a"}) == ("10", "2", "a", "b")  # not all integers: as text


def test_a_csv_without_its_header_is_told_to_add_it(tmp_path):
    root = make_folder(tmp_path / "d")
    (root / "train.csv").write_text("# no header\ntrain/cat/000.png,cat\n")
    with pytest.raises(DataError, match=r"train\.csv:2: a CSV label file opens with a header .* add the line path,l"):
        labels.list_labels(root / "train.csv")


# ---- bad rows ----


def test_bad_rows_are_named_with_their_lines_and_left_out_up_to_one_in_a_hundred(tmp_path):
    root = make_folder(tmp_path / "d", train=70)
    by_folder = folder.list_folder(root)
    good = [f"{e.path},{by_folder.classes[e.label]}" for e in by_folder.splits["train"]]  # 210 rows
    (root / "notes.txt").write_text("not an image")
    bad = ["train/cat/missing.png,cat", "train/cat/000.png,cat,extra"]
    write_csv(root / "train.csv", by_folder, "train", rows=good[:10] + bad + good[10:])
    listing = labels.list_labels(root / "train.csv")
    assert len(listing.splits["train"]) == 210
    assert labels.left_out(listing) == (
        "warning: left out 2 of 212 rows of the label files: train.csv:12: no such file: train/cat/missing.png; "
        "train.csv:13: 3 fields where the header has 2"
    )
    more = ["notes.txt,cat", ",dog", "train/cat/000.png,cat"]  # not an image, an empty path, a second listing
    write_csv(root / "train.csv", by_folder, "train", rows=good + bad + more)
    with pytest.raises(DataError) as e:
        labels.list_labels(root / "train.csv")
    line = str(e.value)
    assert (
        line.startswith(f"{root / 'train.csv'}: 5 of its 215 rows are bad (train.csv:212: no such file")
        and "\n" not in line
    )
    for why in ("not an image file by its extension: notes.txt", "an empty path", "listed already on line 2"):
        assert why in line
    assert f"fix or remove them (paths are relative to {root}; at most 1% of the rows may be left out)" in line


def test_one_bad_row_of_a_short_file_is_refused(tmp_path):
    root = make_folder(tmp_path / "d")
    by_folder = folder.list_folder(root)
    rows = [f"{e.path},{by_folder.classes[e.label]}" for e in by_folder.splits["train"]] + ["train/cat/9.png,cat"]
    write_csv(root / "train.csv", by_folder, "train", rows=rows)
    with pytest.raises(DataError, match=r"1 of its 13 rows are bad \(train\.csv:14: no such file: train/cat/9\.png\)"):
        labels.list_labels(root / "train.csv")


def test_a_test_label_that_training_lacks_is_refused(tmp_path):
    root = make_folder(tmp_path / "d")
    by_folder = folder.list_folder(root)
    write_csv(root / "train.csv", by_folder, "train")
    (root / "test.txt").write_text("test/cat/000.png cat\ntest/dog/000.png wolf\n")
    with pytest.raises(DataError) as e:
        labels.list_labels(root / "train.csv", test=root / "test.txt")
    assert str(e.value) == (
        f"{root / 'test.txt'}:2: label 'wolf' is a class that {root / 'train.csv'} lacks (it has cat, dog, eel); "
        "fix the row, or add training rows labelled wolf"
    )


# ---- the cache ----


def test_a_relabelled_row_rebuilds_the_cache_and_a_folders_own_cache_stays(tmp_path, caplog):
    root = make_folder(tmp_path / "d")
    by_folder = folder.list_folder(root)
    request = folder.Request(None, 0, 0.25, False)
    own = folder.ensure_cache(by_folder, request, folder.default_cache_dir(root), LOG)
    rows = [f"{e.path},{by_folder.classes[e.label]}" for e in by_folder.splits["train"]]
    write_csv(root / "train.csv", by_folder, "train", rows=rows)
    caches = labels.cache_dir(root / "train.csv")
    assert caches == root / ".paddle_mnist-cache-train.csv"
    first = folder.ensure_cache(labels.list_labels(root / "train.csv"), request, caches, LOG)
    before = np.concatenate([np.load(first / f"{s}-labels.npy") for s in ("train", "val")])
    assert np.bincount(before).tolist() == [4, 4, 4]
    rows[0] = rows[0].replace(",cat", ",eel")  # the same files: only a label changed
    write_csv(root / "train.csv", by_folder, "train", rows=rows)
    relabelled = labels.list_labels(root / "train.csv")
    assert folder.find(relabelled, request, caches) is None
    with caplog.at_level(logging.INFO, logger="test_labels"):
        again = folder.ensure_cache(relabelled, request, caches, LOG)
    assert "none of the caches has these files and settings" in caplog.text
    after = np.concatenate([np.load(again / f"{s}-labels.npy") for s in ("train", "val")])
    assert np.bincount(after).tolist() == [3, 4, 5]  # cat, dog, eel
    assert folder.find(by_folder, request, folder.default_cache_dir(root)) == own  # the folder's cache is its own


# ---- the flags ----


def test_the_flags_and_their_refusals(tmp_path):
    cfg = parse_command(["--dataset", "folder", "--labels", "a.csv", "--test-labels", "t.csv", "--val-split", "0"])
    assert (cfg.labels, cfg.val_labels, cfg.test_labels, cfg.data_dir) == ("a.csv", "", "t.csv", None)
    base = ["--dataset", "folder", "--labels", "a.csv"]
    for argv, message in [
        ([*base, "--data-dir", "d"], "--labels and --data-dir both name the training images: keep --labels FILE"),
        (["--labels", "a.csv"], "--labels applies to --dataset folder only"),
        (["--dataset", "folder", "--data-dir", "d", "--test-labels", "t"], "--val-labels and --test-labels go with"),
        ([*base, "--val-split", "0"], "--val-split 0 holds none of --labels' rows out, and there is no --test-labels"),
        (["--dataset", "folder"], "--dataset folder needs --data-dir: .* or --labels FILE"),
    ]:
        with pytest.raises(ConfigError, match=message):
            parse_command(argv)


# ---- real runs on the CIFAR-10 JPEG copy ----

SIZES = {"train": 300, "test": 100}  # images of each class
JOB = ["--dataset", "folder", "--max-steps", "4", "--batch-size", "64", "--eval-limit", "200", "--sync-bn"]


@pytest.fixture(scope="module")
def cifar(tmp_path_factory) -> Path:
    """300 training and 100 test images of each CIFAR-10 class in class folders, and beside train/ the same files
    listed in a CSV (class names, with three bad rows) and in a PaddleClas list (labels 1 to 10)."""
    if not CIFAR_JPEG.exists():
        pytest.skip(f"the CIFAR-10 JPEG copy is not at {CIFAR_JPEG}")
    root = tmp_path_factory.mktemp("cifar")
    names = [f"{s}/{c}/{i:04d}.jpg" for s, n in SIZES.items() for c in CIFAR_CLASSES for i in range(n)]
    (root / "members").write_text("\n".join(names) + "\n")
    subprocess.run(["tar", "xzf", str(CIFAR_JPEG), "-C", str(root), "-T", str(root / "members")], check=True)
    for split in SIZES:
        rows = [f"{split}/{c}/{i:04d}.jpg,{c}" for c in CIFAR_CLASSES for i in range(SIZES[split])]
        if split == "train":  # left out, and named with their lines: the training rows stay the folder's
            rows[5:5] = ["train/cat/9999.jpg,cat", "train/dog/0001.jpg dog", "members,cat"]
        (root / f"{split}.csv").write_text("path,label\n" + "\n".join(rows) + "\n")
        listed = [
            f"{split}/{c}/{i:04d}.jpg {k + 1}\n" for k, c in enumerate(CIFAR_CLASSES) for i in range(SIZES[split])
        ]
        (root / f"{split}_list.txt").write_text("".join(listed))
    return root


@pytest.mark.slow
def test_label_files_train_the_weights_their_class_folders_train(cifar, tmp_path):
    """The same files in the same order, held out alike (by their paths' hash: a label file beside train/ lists the
    folder's own paths): the class folders in one process, the CSV on two workers (--sync-bn: N workers train one
    process's weights to the bit), the PaddleClas list in one process; one digest. The list's labels 1 to 10 name the
    classes in the folders' order only when sorted by value, so its digest also says "10" came after "9"."""
    runs = {}
    by_folder = run_single([*JOB, "--data-dir", str(cifar), "--output-dir", str(tmp_path / "folder")], tmp_path)
    assert by_folder.returncode == 0, explain(by_folder)
    runs["folder"] = by_folder.stdout + by_folder.stderr
    job = [*JOB, "--labels", str(cifar / "train.csv"), "--test-labels", str(cifar / "test.csv")]
    two = run_launch([*job, "--output-dir", str(tmp_path / "csv")], tmp_path, tmp_path / "log")
    assert two.returncode == 0, explain(two, tmp_path / "log")
    logs = [worker_log(tmp_path / "log", r) for r in (0, 1)]
    assert "decoding 4000 images" in logs[0] and "decoding" not in logs[1]  # rank 0 built, rank 1 waited
    runs["csv"] = logs[0]
    job = [*JOB, "--labels", str(cifar / "train_list.txt"), "--test-labels", str(cifar / "test_list.txt")]
    listed = run_single([*job, "--output-dir", str(tmp_path / "list")], tmp_path)
    assert listed.returncode == 0, explain(listed)
    runs["list"] = listed.stdout + listed.stderr
    assert len({param_digest(log) for log in [*runs.values(), logs[1]]}) == 1
    for log in logs:  # every rank named the same bad rows in one line
        (line,) = [x for x in log.splitlines() if "rows of the label files" in x]
        assert line.endswith(
            "left out 3 of 4003 rows of the label files: train.csv:7: no such file: train/cat/9999.jpg; "
            "train.csv:8: 1 fields where the header has 2; train.csv:9: not an image file by its extension: members"
        )
    named = "0=airplane, 1=automobile, 2=bird, 3=cat, 4=deer, 5=dog, 6=frog, 7=horse, 8=ship, 9=truck"
    assert f"classes (10, labels by sorted folder name): {named};" in runs["folder"]
    assert f"classes (10, labels by sorted label): {named};" in runs["csv"]
    assert "classes (10, labels by sorted label): 0=1, 1=2, 2=3, 3=4, 4=5, 5=6, 6=7, 7=8, 8=9, 9=10;" in runs["list"]
    configs = {name: json.loads((tmp_path / name / "config.json").read_text()) for name in runs}
    assert configs["folder"]["classes"] == configs["csv"]["classes"] == CIFAR_CLASSES
    assert configs["list"]["classes"] == [str(k) for k in range(1, 11)]
    assert {p.name for p in cifar.glob(".paddle_mnist-cache*")} == {
        ".paddle_mnist-cache",
        ".paddle_mnist-cache-train.csv",
        ".paddle_mnist-cache-train_list.txt",
    }
    # the run's own data again, from its config.json: the test split of test.csv
    scored = subprocess.run(
        [sys.executable, "-m", "paddle_mnist.evaluate", str(tmp_path / "csv")],
        cwd=tmp_path,
        env=launch_env(),
        capture_output=True,
        text=True,
    )
    assert scored.returncode == 0, explain(scored)
    report = json.loads((tmp_path / "csv" / "report" / "report.json").read_text())
    assert report["classes"] == CIFAR_CLASSES and report["data"] == f"{cifar / 'train.csv'}, {cifar / 'test.csv'}"


@pytest.mark.slow
def test_a_label_file_past_its_share_of_bad_rows_or_beside_data_dir_stops_the_run_with_one_line(cifar, tmp_path):
    rows = ["path,label", *(f"train/cat/{i:04d}.jpg,cat" for i in range(40)), "train/dog/0000.jpg,dog"]
    rows += ["train/dog/0001.jpg dog"]  # a PaddleClas row in a CSV: 1 bad row of 42
    (tmp_path / "train.csv").write_text("\n".join(rows).replace("train/", f"{cifar}/train/") + "\n")
    args = ["--dataset", "folder", "--labels", str(tmp_path / "train.csv"), "--output-dir", str(tmp_path / "o")]
    proc = run_single(args, tmp_path)
    assert proc.returncode == 2, explain(proc)
    (line,) = [x for x in (proc.stdout + proc.stderr).splitlines() if "error:" in x]
    assert re.search(r"train\.csv: 1 of its 42 rows are bad \(train\.csv:43: 1 fields where the header has 2\)", line)
    assert "Traceback" not in proc.stderr and not (tmp_path / "o").exists()
    proc = run_single([*args, "--data-dir", str(cifar)], tmp_path)
    assert proc.returncode == 2, explain(proc)
    (line,) = [x for x in (proc.stdout + proc.stderr).splitlines() if "error:" in x]
    assert line.endswith(
        "--labels and --data-dir both name the training images: keep --labels FILE (its paths are "
        "relative to its folder) or --data-dir DIR (DIR/train/<class>/), not both"
    )

"""The evaluation report: the trainer's, from two workers' shares, and python -m paddle_mnist.evaluate's, on the run's
data and on a folder of PNGs, with its one-line refusals."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import REPO, explain, launch_env, read_results, run_launch, small_run
from PIL import Image

from paddle_mnist.datasets import data
from paddle_mnist.files import report

pytestmark = pytest.mark.slow

REPORT_FILES = (report.REPORT_FILE, report.EXAMPLES_FILE, report.CONFUSION_FILE, report.PAIRS_FILE)


def evaluate(*args: str) -> subprocess.CompletedProcess:
    """python -m paddle_mnist.evaluate ARGS, as a user types it."""
    cmd = [sys.executable, "-m", "paddle_mnist.evaluate", *map(str, args)]
    return subprocess.run(cmd, cwd=REPO, env=launch_env(), capture_output=True, text=True, timeout=180)


def read_report(folder: Path) -> dict:
    return json.loads((folder / report.REPORT_FILE).read_text())


@pytest.fixture(scope="module")
def two(tmp_path_factory, dataset) -> Path:
    """A short run of two workers on conftest's 201 test images (101 + 100 a rank), stopped while it is still
    poor, so that the matrix has errors to show."""
    root = tmp_path_factory.mktemp("report")
    out = root / "two"
    args = [*small_run(), "--data-dir", str(dataset), "--output-dir", str(out), "--max-steps", "4"]
    done = run_launch(args, cwd=root, log_dir=root / "log")
    assert done.returncode == 0, explain(done, root / "log")
    return out


def test_the_trainers_report_combines_both_ranks_shares_exactly(two, tmp_path):
    rep, results = read_report(two / report.FOLDER), read_results(two)
    matrix = np.array(rep["confusion"])
    assert matrix.shape == (10, 10)
    assert matrix.sum() == rep["images"] == results["test_count"] == 201  # each test image counted once
    assert np.trace(matrix) / matrix.sum() == results["test_acc"] == rep["accuracy"]
    assert [r["count"] for r in rep["per_class"]] == matrix.sum(axis=1).tolist()
    assert 0 < np.trace(matrix) < 201 and rep["confused_pairs"], "a run this short still confuses classes"
    assert rep["top5_accuracy"] >= rep["accuracy"]
    # the examples are the first of each pair by index over the whole split, from rank 1's share as well as rank 0's
    labels = data.load_split(Path(rep["data"]), "test").labels[:201]
    shown = set()
    for pair in rep["confused_pairs"]:
        assert 0 < len(pair["examples"]) <= min(pair["count"], 4)
        assert all(labels[i] == pair["true"] for i in pair["examples"]) and pair["examples"] == sorted(pair["examples"])
        shown.update(pair["examples"])
    assert max(shown) >= 101, "no example from rank 1's shard (images 101-200)"
    with np.load(two / report.FOLDER / report.EXAMPLES_FILE) as f:
        assert sorted(f["index"].tolist()) == sorted(shown) and f["images"].dtype == np.uint8
    for name in (report.CONFUSION_FILE, report.PAIRS_FILE):
        with Image.open(two / report.FOLDER / name) as im:
            im.verify()
            assert im.format == "PNG" and min(im.size) > 200

    # one process scoring the same weights writes the very same report: the two shares were summed, not averaged
    alone = evaluate(two, "--out", tmp_path / "alone")
    assert alone.returncode == 0, explain(alone)
    assert read_report(tmp_path / "alone") == rep
    assert alone.stdout.splitlines()[1].startswith(f"accuracy {100 * rep['accuracy']:.1f}% on 201 images, top-5 ")
    assert f"report in {tmp_path / 'alone'}" in alone.stdout


def write_folder(root: Path, split: data.Split, classes: list[str]) -> Path:
    """split's images as PNGs in root/train/<class>/ and root/test/<class>/ (each image in both)."""
    for part in ("train", "test"):
        for i, (image, label) in enumerate(zip(split.images, split.labels)):
            if str(label) in classes:
                folder = root / part / str(label)
                folder.mkdir(parents=True, exist_ok=True)
                Image.fromarray(image[0]).save(folder / f"{i:04d}.png")
    return root


def test_evaluate_scores_a_folder_of_the_runs_classes(two, dataset, tmp_path):
    """The run's 201 test images as PNG files in class folders score as the run scored them."""
    test = data.load_split(dataset, "test")
    mine = write_folder(tmp_path / "mine", data.Split(test.images[:201], test.labels[:201]), list(data.DIGITS))
    done = evaluate(two, "--data-dir", mine)
    assert done.returncode == 0, explain(done)
    rep, trained = read_report(two / "report-mine-test"), read_report(two / report.FOLDER)
    assert rep["data"] == str(mine) and rep["images"] == 201
    assert rep["confusion"] == trained["confusion"]  # the same pixels, normalised as the run was: the same scores
    assert [p["count"] for p in rep["confused_pairs"]] == [p["count"] for p in trained["confused_pairs"]]
    assert all((two / "report-mine-test" / name).is_file() for name in REPORT_FILES)


def test_evaluate_refuses_bad_input_in_one_line(two, dataset, tmp_path):
    test = data.load_split(dataset, "test")
    other = write_folder(tmp_path / "other", data.Split(test.images[:40], test.labels[:40]), ["1", "7"])
    cases = [
        (tmp_path, "no config.json here; pass a run's output directory"),  # not an output folder
        (two, "--data-dir", other, "its classes are not the run's (it lacks 0, 2, 3, 4, 5 ...)"),
        (two, "--split", "val", "--split val: mnist has no validation split"),
    ]
    for *args, words in cases:
        done = evaluate(*args)
        assert done.returncode == 2, explain(done)
        assert done.stdout == "" and len(done.stderr.splitlines()) == 1, explain(done)
        assert done.stderr.startswith("error: ") and words in done.stderr, done.stderr
    assert not (other / ".paddle_mnist-cache").exists()  # refused before any image was decoded

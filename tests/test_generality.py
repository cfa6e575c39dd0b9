"""Any folder trains with the default flags: the README's folder command on a folder unlike the shipped datasets,
and the folders scripts/generality.py builds for its matrix."""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import explain, read_metrics, read_results, run_launch, worker_log
from PIL import Image

from paddle_mnist import config
from paddle_mnist.datasets import data
from scripts.generality import Cell, cells, choose, make_folder


def test_the_matrix_varies_one_factor_at_a_time_around_the_base_cell():
    chosen = cells()
    base = Cell()
    assert chosen[0] == base and len({c.name for c in chosen}) == len(chosen)
    for cell in chosen[1:]:
        assert sum(getattr(cell, k) != getattr(base, k) for k in vars(base)) == 1, cell


def test_the_cells_take_the_images_they_say():
    ds = data.load_dataset("mnist")
    rare_train, rare_test = choose(Cell(rare=True), ds.train.labels, ds.test.labels)
    counts = np.bincount(ds.train.labels[rare_train], minlength=10)
    assert counts[0] == counts[1] // 10 and len(set(counts[1:])) == 1 and abs(counts.sum() - 1500) < 15
    assert len(set(np.bincount(ds.test.labels[rare_test]))) == 1  # the test split stays balanced
    pair_train, _ = choose(Cell(classes=2), ds.train.labels, ds.test.labels)
    assert set(ds.train.labels[pair_train]) == {4, 9} and len(pair_train) == 1500


@pytest.mark.slow
def test_the_readme_folder_command_trains_a_small_64_pixel_folder(tmp_path):
    """The failure this guards against: 1,400 small images at 64 px ended at chance, exit 0. 1,000 MNIST digits
    written as 64x64 PNG files (900 to train, 100 held out), trained with the README's folder command as written:
    the first epoch's loss is already below chance (it was 6.4 unscaled), the recipe is stretched to at least
    --min-steps steps and says so, and the 1,000 test digits are classified well (95.8 and 95.3% on two seeds
    of 1,500 digits, docs/results.md)."""
    folder = make_folder(Cell(size=64, train=1000), tmp_path)
    with Image.open(next((folder / "train" / "7").iterdir())) as image:
        assert image.size == (64, 64)
    out, log_dir = tmp_path / "my_run", tmp_path / "log"
    args = ["--dataset", "folder", "--data-dir", str(folder), "--image-size", "64", "--augment"]
    proc = run_launch([*args, "--output-dir", str(out)], cwd=tmp_path, log_dir=log_dir, timeout=1200)
    assert proc.returncode == 0, explain(proc, log_dir)
    rows, results = read_metrics(out), read_results(out)
    assert rows[0]["train_loss"] < math.log(10), rows[0]
    assert results["steps"] >= config.MIN_STEPS and len(rows) > config.RECIPES["mnist_cnn_bn_fc"].epochs
    assert f"stretched to at least --min-steps {config.MIN_STEPS} optimizer steps" in worker_log(log_dir, 0)
    assert results["learned_nothing"] is False and results["test_count"] == 1000
    assert results["test_acc"] >= 0.93, results

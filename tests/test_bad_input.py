"""Bad configuration is caught before training: one clear line, a non-zero exit, nothing overwritten."""

from __future__ import annotations

import pytest
from helpers import make_dataset, run_single

pytestmark = pytest.mark.slow  # every test here starts the trainer in real processes


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("data") / "mnist", n_train=256, n_test=50)


def small(dataset, out) -> list[str]:
    return ["--dataset", "mnist", "--data-dir", str(dataset), "--output-dir", str(out), "--log-every", "0"]


def error_lines(proc) -> list[str]:
    return [line for line in (proc.stdout + proc.stderr).splitlines() if "error:" in line]


def test_training_split_smaller_than_one_batch(dataset, tmp_path):
    proc = run_single([*small(dataset, tmp_path / "o"), "--train-limit", "10"], cwd=tmp_path)
    assert proc.returncode == 2
    (line,) = error_lines(proc)
    assert "10 images, fewer than one global batch of 64: pass --batch-size 10 or less" in line
    assert "--train-limit" in line
    assert not (tmp_path / "o").exists()


def test_output_dir_that_cannot_be_written(dataset, tmp_path):
    (tmp_path / "file").write_text("not a folder")
    proc = run_single(small(dataset, tmp_path / "file" / "o"), cwd=tmp_path)
    assert proc.returncode == 2
    (line,) = error_lines(proc)
    assert "cannot write to --output-dir" in line and "pass a writable folder" in line
    assert (tmp_path / "file").read_text() == "not a folder"


@pytest.mark.parametrize("flag,value", [("--dataset", "imagenet"), ("--model", "resnet9000")])
def test_unknown_dataset_or_model(dataset, tmp_path, flag, value):
    proc = run_single([*small(dataset, tmp_path / "o"), flag, value], cwd=tmp_path)
    assert proc.returncode == 2
    assert f"argument {flag}: invalid choice: '{value}'" in proc.stderr
    assert not (tmp_path / "o").exists()


def test_missing_data_names_the_folder(tmp_path):
    proc = run_single(small(tmp_path / "nowhere", tmp_path / "o"), cwd=tmp_path)
    assert proc.returncode == 2
    (line,) = error_lines(proc)
    assert "nowhere: no such folder" in line and "--data-dir" in line


def test_resume_without_checkpoint(dataset, tmp_path):
    proc = run_single([*small(dataset, tmp_path / "o"), "--resume"], cwd=tmp_path)
    assert proc.returncode == 2
    (line,) = error_lines(proc)
    assert "--resume: no checkpoint in" in line and "drop --resume" in line


def test_checkpoint_from_another_run_is_refused(dataset, tmp_path):
    out = tmp_path / "o"
    first = run_single([*small(dataset, out), "--epochs", "1"], cwd=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    metrics = (out / "metrics.jsonl").read_text()
    resume = ["--output-dir", str(out), "--log-every", "0", "--epochs", "2", "--resume"]
    for args, words in (
        ([*resume, "--dataset", "mnist", "--data-dir", str(dataset), "--batch-size", "32"], "--batch-size 64, not 32"),
        ([*resume, "--dataset", "fashion-mnist"], "was trained with --dataset mnist, not fashion-mnist"),
    ):
        proc = run_single(args, cwd=tmp_path)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        (line,) = error_lines(proc)
        assert words in line
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before
    assert (out / "metrics.jsonl").read_text() == metrics

"""A run that learns nothing says so: the chance levels and verdicts, and real runs on folders of random labels."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest
from helpers import check_read_by_facts, explain, read_metrics, read_results, run_launch, run_single, worker_log
from PIL import Image

from paddle_mnist.datasets import data
from paddle_mnist.files import checkpoint
from paddle_mnist.files.logs import summarise
from paddle_mnist.training import chance

# ---- the pure pieces ----


def test_chance_loss_is_the_entropy_of_the_class_shares():
    balanced = chance.LossLevels.of(np.repeat(np.arange(10), 7), 10)
    assert balanced.chance == pytest.approx(math.log(10)) and balanced.floor == 0
    assert balanced.describe() == "ln 10 = 2.30"
    # one class 10x rarer: a network that learned the shares alone scores 2.23, 0.97 ln 10; ln C would call a
    # network that learned nothing else a learner, since it sits on ln C's threshold
    rare = chance.LossLevels.of(np.concatenate([np.zeros(10), np.repeat(np.arange(1, 10), 100)]), 10)
    assert rare.chance == pytest.approx(2.2336, abs=1e-4)
    assert rare.stalled(2.24) and not rare.stalled(2.1)
    assert rare.describe().startswith("2.23 (the entropy of the class shares; ln 10 = 2.30")
    two = chance.LossLevels.of(np.array([0, 1] * 50), 2)
    assert two.chance == pytest.approx(math.log(2))
    assert two.stalled(0.9) and two.stalled(0.97 * math.log(2)) and not two.stalled(0.96 * math.log(2))
    # a class of the listing that the training split lacks counts in C, with a share of 0
    assert chance.LossLevels.of(np.array([0, 1, 0, 1]), 3).chance == pytest.approx(math.log(2))


@pytest.mark.parametrize("smoothing", [0.1, 0.5, 0.9])
def test_chance_and_floor_with_label_smoothing_are_paddles_losses(smoothing):
    """chance is paddle's loss for the best constant prediction, floor its loss for a perfect network: with
    --label-smoothing 0.9 on 2 classes a perfect network scores 0.688, above 0.97 ln 2, and must not stall."""
    labels = np.array([0] * 30 + [1] * 10 + [2] * 60)
    levels = chance.LossLevels.of(labels, 3, smoothing)
    y = paddle.to_tensor(labels)
    mean_target = (1 - smoothing) * np.bincount(labels) / len(labels) + smoothing / 3
    constant = paddle.to_tensor(np.log(np.tile(mean_target, (len(labels), 1))).astype("float32"))
    assert float(F.cross_entropy(constant, y, label_smoothing=smoothing)) == pytest.approx(levels.chance, rel=1e-5)
    one = (1 - smoothing) * np.eye(3)[labels] + smoothing / 3
    perfect = paddle.to_tensor(np.log(one).astype("float32"))
    assert float(F.cross_entropy(perfect, y, label_smoothing=smoothing)) == pytest.approx(levels.floor, rel=1e-5)
    assert levels.stalled(levels.chance) and not levels.stalled(levels.floor)
    pair = chance.LossLevels.of(np.array([0, 1] * 50), 2, 0.9)
    assert pair.floor > 0.97 * math.log(2) and not pair.stalled(pair.floor + 0.001) and pair.stalled(math.log(2))


def test_the_stall_is_judged_on_epochs_that_begin_well_after_the_warmup():
    assert not chance.stall_judged(0, 0) and not chance.stall_judged(chance.STALL_STEPS - 1, 0)
    assert chance.stall_judged(chance.STALL_STEPS, 0)
    assert not chance.stall_judged(chance.STALL_STEPS, 50) and chance.stall_judged(chance.STALL_STEPS + 50, 50)


def test_chance_accuracy_is_the_commonest_share_plus_three_standard_errors():
    labels = np.array([0] * 50 + [1] * 30 + [2] * 20)
    level = chance.AccuracyLevel.of(labels, 4)
    assert level.share == 0.5 and level.count == 100
    assert level.bound == pytest.approx(0.5 + 3 * math.sqrt(0.25 / 100))
    assert level.at_chance(0.5) and level.at_chance(0.64) and not level.at_chance(0.66)
    # the test split of MNIST (10,000 images, 11.35% ones): chance is 0.1135, judged with a margin of 0.95 points
    mnist = chance.AccuracyLevel.of(np.array([1] * 1135 + [0] * 8865), 2)
    assert mnist.bound - mnist.share == pytest.approx(0.00952, abs=1e-5)


def test_verdicts():
    level = chance.AccuracyLevel.of(np.repeat(np.arange(10), 20), 10)  # share 0.1, bound 0.164
    judge = chance.judge
    assert judge(0.1, level, chance.JUDGE_STEPS - 1, 0, stalled=False) is None  # a smoke run: too few steps
    assert judge(0.1, level, chance.JUDGE_STEPS, 0, stalled=False) is True
    assert judge(0.1, level, chance.JUDGE_STEPS + 10, 20, stalled=False) is None  # the warmup counts apart
    assert judge(0.9, level, 500, 0, stalled=False) is False
    assert judge(0.9, level, 10, 0, stalled=True) is True  # a stall is a verdict of its own
    one_class = chance.AccuracyLevel.of(np.full(50, 3), 10)
    assert one_class.share == 1 and judge(1.0, one_class, 500, 0, stalled=False) is None  # test/ cannot tell
    assert judge(1.0, chance.AccuracyLevel.of(np.array([0, 1, 0, 1]), 2), 500, 0, stalled=False) is None
    fields = chance.Verdict(True, "x", level).fields()
    assert json.loads(json.dumps(fields)) == {
        "learned_nothing": True,
        "chance_acc": 0.1,
        "chance_acc_bound": level.bound,
    }


def test_the_log_reader_names_both_lines(tmp_path):
    levels = chance.LossLevels.of(np.repeat(np.arange(10), 7), 10)
    level = chance.AccuracyLevel.of(np.repeat(np.arange(10), 20), 10)
    lines = {
        "stall": chance.stall_message(levels, 2.301, 250, 6, "out"),
        "final": chance.final_message(level, 0.105, 88, " (training loss 2.302, chance 2.303)", "out"),
    }
    assert lines["stall"].startswith("the training loss stayed at chance level ln 10 = 2.30 after 250 steps")
    for kind, line in lines.items():
        log = tmp_path / kind
        log.mkdir()
        for rank in (0, 1):
            progress = f"12:00:01 [rank {rank}/2] epoch 6/8 done: train loss 2.3010 acc 0.1000 | val loss 2.3\n"
            (log / f"workerlog.{rank}").write_text(progress + f"12:00:02 [rank {rank}/2] error: {line}\n")
        summary = summarise(log)
        assert "rank 0   error" in summary and "workerlog.0  learned nothing" in summary, summary
        assert (
            "cause: the model learned nothing" in summary
            and "fix: start afresh (--overwrite) with a lower --lr" in summary
        )


# ---- real runs ----

FLAGS = ["--dataset", "folder", "--image-size", "16", "--model", "mnist_cnn_bn", "--lr", "0.05", "--batch-size", "64"]
FLAGS += ["--warmup-epochs", "1", "--log-every", "0"]
# 2,881 training images after the 10% hold-out: 45 steps an epoch, a warmup of 45, and epoch 7 (from step 270) is
# the first to begin STALL_STEPS after it. Few passes over many images keep the random labels from being learned by
# heart by then: in trials their loss was 2.29 at epoch 7 here, while 1,150 images (18 steps an epoch) went below
# 0.97 ln 10 at epoch 11, and the stall would have gone unseen (the final verdict still says so)
N_TRAIN, N_TEST = 3200, 200


def write_folder(root: Path, source: data.Dataset, relabel) -> Path:
    for split, images, n in (("train", source.train, N_TRAIN), ("test", source.test, N_TEST)):
        labels = relabel(split, images.labels[:n])
        for i, label in enumerate(labels):
            if label < 0:
                continue
            (root / split / str(label)).mkdir(parents=True, exist_ok=True)
            Image.fromarray(images.images[i, 0]).save(root / split / str(label) / f"{i}.png")
    return root


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """MNIST images: with shuffled labels (train and test), and with their own labels and 0s 10x rarer in train/."""
    mnist, root = data.load_dataset("mnist"), tmp_path_factory.mktemp("chance")
    rng = np.random.RandomState(0)

    def shuffled(split: str, labels: np.ndarray) -> np.ndarray:
        return rng.permutation(labels)

    def rare_zeros(split: str, labels: np.ndarray) -> np.ndarray:
        if split != "train":
            return labels
        return np.where((labels == 0) & (np.arange(len(labels)) % 10 > 0), -1, labels)  # -1: left out

    return {
        "random": write_folder(root / "random", mnist, shuffled),
        "rare": write_folder(root / "rare", mnist, rare_zeros),
    }


@pytest.mark.slow
def test_random_labels_stop_two_workers_at_chance_and_keep_what_was_written(tmp_path, folders):
    out = tmp_path / "o"
    args = [*FLAGS, "--data-dir", str(folders["random"]), "--epochs", "8", "--output-dir", str(out)]
    proc = run_launch(args, cwd=tmp_path, log_dir=tmp_path / "log")
    assert proc.returncode == 2, explain(proc, tmp_path / "log")
    for rank in (0, 1):
        errors = [line for line in worker_log(tmp_path / "log", rank).splitlines() if "error:" in line]
        assert len(errors) == 1, errors
        assert "error: the training loss stayed at chance level ln 10 = 2.30 after 315 steps (epoch 7 mean" in errors[0]
        assert "the model learned nothing; start afresh (--overwrite) with a lower --lr" in errors[0]
    # stopped after epoch 7 of 8, with every file a finished run writes
    assert [row["epoch"] for row in read_metrics(out)] == list(range(1, 8))
    result = read_results(out)
    assert result["learned_nothing"] is True and result["steps"] == 315 and result["test_count"] == N_TEST
    assert result["test_acc"] <= result["chance_acc_bound"]
    assert all((out / name).is_file() for name in ("model.pdparams", "model_best.pdparams", "inference_meta.json"))
    assert checkpoint.checkpoint_path(out, 315).is_file()
    summary = summarise(tmp_path / "log")
    assert "workerlog.0  learned nothing" in summary and "cause: the model learned nothing" in summary, summary
    assert "fix: start afresh (--overwrite) with a lower --lr or a warmup" in summary
    check_read_by_facts(tmp_path / "log", summary)


@pytest.mark.slow
def test_random_labels_end_at_chance_before_the_stall_is_judged(tmp_path, folders):
    """3 epochs, 135 steps: too few for the stall, enough for the final verdict on the test accuracy."""
    out = tmp_path / "o"
    proc = run_single(
        [*FLAGS, "--data-dir", str(folders["random"]), "--epochs", "3", "--output-dir", str(out)], tmp_path
    )
    assert proc.returncode == 2, explain(proc)
    (line,) = [line for line in (proc.stdout + proc.stderr).splitlines() if "error:" in line]
    assert "error: the test accuracy" in line and "on 200 images is no better than chance" in line, line
    assert (
        "after 135 steps (training loss 2." in line
        and "chance 2.30" in line
        and ": the model learned nothing; start afresh" in line
    )
    assert read_results(out)["learned_nothing"] is True and (out / "model.pdparams").is_file()


@pytest.mark.slow
def test_true_labels_with_a_rare_class_are_not_called_chance(tmp_path, folders):
    """The same flags and images with their own labels, 0s 10x rarer: the stall is judged (epoch 7) and passes."""
    out = tmp_path / "o"
    proc = run_single([*FLAGS, "--data-dir", str(folders["rare"]), "--epochs", "7", "--output-dir", str(out)], tmp_path)
    assert proc.returncode == 0, explain(proc)
    assert "learned nothing" not in proc.stdout + proc.stderr and "than chance" not in proc.stdout + proc.stderr
    result = read_results(out)
    assert result["learned_nothing"] is False and result["test_acc"] > 0.9
    per_epoch = result["steps"] // 7
    assert 6 * per_epoch >= per_epoch + chance.STALL_STEPS  # epoch 7 began STALL_STEPS after the warmup: judged

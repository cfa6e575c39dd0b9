"""Every rank agrees on the job before training: the facts compared and the line that names a difference (real
machines that disagree: tests/test_multihost.py)."""

from __future__ import annotations

import numpy as np
import pytest

from paddle_mnist.config import parse_args
from paddle_mnist.training import agreement


def facts(*argv: str, convolutions: str = "oneDNN") -> dict:
    return agreement.job_facts(parse_args(list(argv)), convolutions)


def test_the_same_command_agrees_and_per_machine_flags_may_differ():
    same = facts("--lr", "0.02")
    here = facts("--lr", "0.02", "--data-dir", "/mnt/a", "--output-dir", "/shared/o", "--cpu-threads", "2")
    assert agreement.disagreement([same, same, same]) is None
    assert agreement.disagreement([same, here]) is None


@pytest.mark.parametrize(
    "theirs,named",
    [
        (("--lr", "0.01"), "--lr: 0.05 on rank 0, 0.01 on rank 1;"),
        (("--batch-size", "64"), "--batch-size: 0 on rank 0, 64 on rank 1;"),
        (("--model", "mnist_cnn"), "--model: 'mnist_cnn_bn_fc' on rank 0, 'mnist_cnn' on rank 1;"),
        (("--augment",), "--augment: False on rank 0, True on rank 1;"),
    ],
    ids=["lr", "batch", "model", "augment"],
)
def test_a_differing_flag_is_named_with_both_values(theirs, named):
    line = agreement.disagreement([facts(), facts(*theirs)])
    assert named in line and line.startswith("the ranks disagree on ") and "\n" not in line
    assert "only --data-dir, the label files, --output-dir and --cpu-threads may differ" in line


def test_the_code_paddle_and_convolutions_are_compared_too():
    ours = facts()
    for name, value in [
        ("paddle_mnist's code (a digest of its sources)", "0123456789abcdef"),
        ("Paddle's version", "0.0.0-another"),
        ("the convolutions", "Paddle's"),
    ]:
        line = agreement.disagreement([ours, {**ours, name: value}])
        assert line.startswith(f"the ranks disagree on {name}: ") and f"{value!r} on rank 1" in line


def test_every_rank_that_differs_is_named():
    line = agreement.disagreement([facts(), facts(), facts("--lr", "0.1"), facts("--lr", "0.2")])
    assert "0.05 on rank 0, 0.1 on rank 2; 0.2 on rank 3;" in line


def test_the_data_digest_follows_pixels_and_labels():
    cfg = parse_args([])
    images, labels = np.zeros((10, 1, 4, 4), np.uint8), np.arange(10)
    base = agreement.data_facts(cfg, images, labels)
    moved = images.copy()
    moved[3, 0, 1, 1] = 1
    assert agreement.data_facts(cfg, images.copy(), labels.copy()) == base
    for other in (agreement.data_facts(cfg, moved, labels), agreement.data_facts(cfg, images, labels[::-1].copy())):
        line = agreement.disagreement([base, other])
        assert line.startswith("the ranks disagree on the training images (a digest of their pixels and labels)")

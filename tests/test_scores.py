"""The report's arithmetic: the confusion matrix, precision and recall, top-5, the confused pairs and their images."""

from __future__ import annotations

import numpy as np
import pytest

from paddle_mnist.files import checkpoint
from paddle_mnist.training import evaluate, scores


def test_the_matrix_counts_each_image_once_by_true_row_and_predicted_column():
    labels = np.array([0, 0, 1, 1, 1, 2, 2, 3])
    predicted = np.array([0, 1, 1, 1, 0, 1, 2, 1])
    m = scores.confusion(labels, predicted, 4)
    assert m.dtype == np.int64
    assert m.tolist() == [[1, 1, 0, 0], [1, 2, 0, 0], [0, 1, 1, 0], [0, 1, 0, 0]]
    assert m.sum() == len(labels) and np.trace(m) == (labels == predicted).sum()
    # shards add up to the whole: what the all-reduce of two ranks' matrices gives
    assert (scores.confusion(labels[:3], predicted[:3], 4) + scores.confusion(labels[3:], predicted[3:], 4) == m).all()


def test_precision_and_recall_by_class_with_a_class_never_predicted_and_one_without_images():
    # class 3 is never predicted (precision undefined), class 2 has no images (recall undefined)
    m = np.array([[3, 1, 0, 0], [1, 2, 1, 0], [0, 0, 0, 0], [0, 2, 0, 0]])
    rows = scores.per_class(m, ("a", "b", "c", "d"))
    assert [r["count"] for r in rows] == [4, 4, 0, 2]
    assert [r["predicted"] for r in rows] == [4, 5, 1, 0]
    assert [r["correct"] for r in rows] == [3, 2, 0, 0]
    assert [r["precision"] for r in rows] == [0.75, 0.4, 0.0, None]
    assert [r["recall"] for r in rows] == [0.75, 0.5, None, 0.0]
    rep = scores.report(m, ("a", "b", "c", "d"), None)
    assert rep["accuracy"] == 5 / 10 and rep["images"] == 10 and rep["top5_accuracy"] is None
    assert [r["class"] for r in scores.worst_classes(rep)] == ["d", "b", "a"]  # c has no images: not ranked


def test_top_5_counts_the_true_class_among_the_five_highest_outputs_ties_for_it():
    logits = np.array(
        [
            [9, 8, 7, 6, 5, 4, 3],  # true 4: fifth highest, a hit
            [9, 8, 7, 6, 5, 4, 3],  # true 5: sixth, a miss
            [1, 1, 1, 1, 1, 1, 1],  # all equal: none scores above the true class, a hit
            [0, 5, 5, 5, 5, 5, 5],  # true 0, below six others: a miss
        ],
        dtype=np.float32,
    )
    assert scores.top_k_hits(logits, np.array([4, 5, 6, 0])) == 2
    assert scores.top_k_hits(logits, np.array([0, 0, 0, 0]), k=1) == 3


def test_the_most_confused_pairs_and_their_first_images_by_index():
    labels = np.array([0, 1, 1, 2, 1, 2, 1, 2])
    predicted = np.array([0, 2, 2, 1, 2, 1, 0, 0])
    index = np.arange(100, 108)
    found: dict = {}
    scores.first_wrong(labels[:4], predicted[:4], index[:4], found, k=2)  # batch by batch, in index order
    scores.first_wrong(labels[4:], predicted[4:], index[4:], found, k=2)
    assert found == {(1, 2): [101, 102], (2, 1): [103, 105], (1, 0): [106], (2, 0): [107]}
    m = scores.confusion(labels, predicted, 3)
    # by count, ties by true then predicted class; the diagonal never
    assert scores.worst_pairs(m) == [(1, 2, 3), (2, 1, 2), (1, 0, 1), (2, 0, 1)]
    assert scores.worst_pairs(m, 2) == [(1, 2, 3), (2, 1, 2)]
    rep = scores.report(m, ("x", "y", "z"), None, found, {"split": "test"})
    first = rep["confused_pairs"][0]
    assert first == {
        "true": 1,
        "true_class": "y",
        "predicted": 2,
        "predicted_class": "z",
        "count": 3,
        "examples": [101, 102],
    }
    assert list(rep)[0] == "split"  # what was evaluated comes first
    assert scores.worst_pairs(np.diag([3, 4])) == []  # every image right: no pairs


def test_the_summary_names_the_worst_classes_and_pairs():
    m = np.array([[8, 2, 0, 0, 0, 0], [0, 5, 5, 0, 0, 0]] + [[0] * 6] * 4)
    rep = scores.report(m, tuple("abcdef"), 18)
    lines = scores.summary(rep)
    assert lines[0] == "accuracy 65.0% on 20 images, top-5 90.0%"
    assert lines[1].startswith("worst classes: b (recall 50.0%, precision 71.4%, 10 images); a (recall 80.0%")
    assert lines[2] == "most confused (true -> predicted): b -> c (5); a -> b (2)"


def test_the_command_offers_the_weights_load_model_knows():
    assert evaluate.WHICH == tuple(checkpoint.WHICH)


@pytest.mark.parametrize(
    "data_dir, split, which, name",
    [
        (None, "test", "last", "report"),
        (None, "train", "best", "report-train-best"),
        ("/x/mine", "test", "last", "report-mine-test"),
    ],
)
def test_another_evaluation_never_replaces_the_trainers_report(tmp_path, data_dir, split, which, name):
    assert evaluate.default_out(tmp_path, data_dir, split, which) == tmp_path / name

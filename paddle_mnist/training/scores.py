"""Per-class scores from predictions: the confusion matrix, precision, recall, top-k, the most confused pairs."""

from __future__ import annotations

import numpy as np

TOP_K = 5  # top-5 accuracy, reported where there are more classes than this
EXAMPLES = 4  # images kept per confused pair: the first ones by index in the split
PAIRS = 8  # confused pairs in the report and its picture


def confusion(labels: np.ndarray, predicted: np.ndarray, classes: int) -> np.ndarray:
    """int64 (classes, classes): row the true class, column the predicted one, each image counted once."""
    flat = np.asarray(labels, np.int64) * classes + np.asarray(predicted, np.int64)
    return np.bincount(flat, minlength=classes * classes).reshape(classes, classes)


def top_k_hits(logits: np.ndarray, labels: np.ndarray, k: int = TOP_K) -> int:
    """How many images have their true class among the k highest outputs: fewer than k classes score above it
    (a tie with the true class counts for it, so an image's hit does not depend on the order of equal outputs)."""
    logits = np.asarray(logits)
    true = logits[np.arange(len(labels)), np.asarray(labels, np.int64)]
    return int(((logits > true[:, None]).sum(axis=1) < k).sum())


def first_wrong(labels: np.ndarray, predicted: np.ndarray, index: np.ndarray, found: dict, k: int = EXAMPLES) -> None:
    """Add to found, {(true, predicted): [index, ...]}, the split indices of misclassified images, up to the first k
    of each pair; batches come in index order, so these are the pair's first k in the shard."""
    for i in np.flatnonzero(np.asarray(labels) != np.asarray(predicted)):
        kept = found.setdefault((int(labels[i]), int(predicted[i])), [])
        if len(kept) < k:
            kept.append(int(index[i]))


def worst_pairs(matrix: np.ndarray, n: int = PAIRS) -> list[tuple[int, int, int]]:
    """The n off-diagonal cells with the most images, as (true, predicted, count); ties by true, then predicted
    class, so every rank, and every run of the same predictions, lists the same pairs."""
    off = np.array(matrix, np.int64)
    np.fill_diagonal(off, 0)
    cells = [(int(-off[t, p]), int(t), int(p)) for t, p in zip(*np.nonzero(off))]
    return [(t, p, -c) for c, t, p in sorted(cells)[:n]]


def _share(part: int, whole: int) -> float | None:
    return part / whole if whole else None  # None: undefined (JSON null), not 0, where nothing was counted


def per_class(matrix: np.ndarray, classes: tuple[str, ...] | list[str]) -> list[dict]:
    """Per class: its images (count), how many were predicted as it, how many right, precision and recall (recall
    is the class's accuracy). Precision is None for a class never predicted, recall None for one with no images."""
    matrix = np.asarray(matrix, np.int64)
    rows = []
    for c, name in enumerate(classes):
        count, predicted, correct = int(matrix[c].sum()), int(matrix[:, c].sum()), int(matrix[c, c])
        rows.append(
            {
                "label": c,
                "class": name,
                "count": count,
                "predicted": predicted,
                "correct": correct,
                "precision": _share(correct, predicted),
                "recall": _share(correct, count),
            }
        )
    return rows


def report(
    matrix: np.ndarray,
    classes: tuple[str, ...] | list[str],
    top_k: int | None,
    examples: dict | None = None,
    about: dict | None = None,
) -> dict:
    """The report's JSON: overall accuracy (the matrix's trace over its total) and top-k accuracy (top_k: images
    with the true class among the k highest outputs; None where there are no more classes than TOP_K), each class's
    row, the matrix, and the most confused pairs with the indices of their first images (examples, by pair).
    about: what was evaluated (split, data, weights), put first."""
    matrix = np.asarray(matrix, np.int64)
    total = int(matrix.sum())
    pairs = [
        {
            "true": t,
            "true_class": classes[t],
            "predicted": p,
            "predicted_class": classes[p],
            "count": c,
            "examples": list((examples or {}).get((t, p), [])),
        }
        for t, p, c in worst_pairs(matrix)
    ]
    return {
        **(about or {}),
        "images": total,
        "classes": list(classes),
        "accuracy": _share(int(np.trace(matrix)), total),
        f"top{TOP_K}_accuracy": _share(top_k, total) if top_k is not None else None,
        "per_class": per_class(matrix, classes),
        "confusion": matrix.tolist(),
        "confused_pairs": pairs,
    }


def worst_classes(rep: dict, n: int = 3) -> list[dict]:
    """The n classes of lowest recall among those with an image wrong (ties: the lower label first)."""
    rows = [r for r in rep["per_class"] if r["count"] and r["correct"] < r["count"]]
    return sorted(rows, key=lambda r: (r["recall"], r["label"]))[:n]


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def summary(rep: dict) -> list[str]:
    """The report in three lines for a person: overall, the worst classes, the most confused pairs."""
    top = rep.get(f"top{TOP_K}_accuracy")
    lines = [
        f"accuracy {_pct(rep['accuracy'])} on {rep['images']} images"
        + (f", top-{TOP_K} {_pct(top)}" if top is not None else "")
    ]
    worst = [
        f"{r['class']} (recall {_pct(r['recall'])}, precision {_pct(r['precision'])}, {r['count']} images)"
        for r in worst_classes(rep)
    ]
    lines.append("worst classes: " + ("; ".join(worst) if worst else "none, every image right"))
    pairs = [f"{p['true_class']} -> {p['predicted_class']} ({p['count']})" for p in rep["confused_pairs"][:5]]
    lines.append("most confused (true -> predicted): " + ("; ".join(pairs) if pairs else "none, every image right"))
    return lines

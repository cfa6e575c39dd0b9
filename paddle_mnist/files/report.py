"""The evaluation report's files: report.json and the example images, and the pictures drawn from them alone."""

from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path

import numpy as np

if __package__:
    from paddle_mnist.files import atomic
else:  # run as a file (the trainer's drawing child: python .../report.py), with its own folder on sys.path
    import atomic

FOLDER = "report"  # in a run's output directory: the test split's report, written after training
REPORT_FILE = "report.json"
EXAMPLES_FILE = "examples.npz"  # the confused pairs' images as the dataset holds them: uint8, before normalising
CONFUSION_FILE = "confusion.png"
PAIRS_FILE = "confused.png"
NUMBERED_UP_TO = 60  # classes up to which the matrix's cells show their counts (beyond: colour only)


def write(folder: Path, report: dict, images: dict[int, np.ndarray]) -> None:
    """report.json and, for the pairs' example indices, images {split index: uint8 (C, H, W)}, each atomically:
    the examples first, so that a report.json always finds its images."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    index = np.array(sorted(images), np.int64)
    stacked = np.stack([images[i] for i in index]) if len(index) else np.zeros((0, 1, 1, 1), np.uint8)
    buffer = io.BytesIO()
    np.savez(buffer, index=index, images=stacked.astype(np.uint8))
    atomic.write_bytes(folder / EXAMPLES_FILE, buffer.getvalue())
    atomic.write_text(folder / REPORT_FILE, json.dumps(report, indent=2) + "\n")


def read(folder: Path) -> tuple[dict, dict[int, np.ndarray]]:
    folder = Path(folder)
    report = json.loads((folder / REPORT_FILE).read_text())
    with np.load(folder / EXAMPLES_FILE) as f:
        images = {int(i): image for i, image in zip(f["index"], f["images"])}
    return report, images


def _label(name: str, width: int = 18) -> str:
    return name if len(name) <= width else name[: width - 1] + "…"


def _save(fig, path: Path) -> None:
    with atomic.atomic_write(path) as f:
        fig.savefig(f, format="png", dpi=100)  # a file object: the format cannot come from the name


def draw_confusion(report: dict, path: Path) -> None:
    """The matrix with class names on both axes and each non-zero cell's count; coloured by the share of the true
    class (its row), so that a small class's errors show as plainly as a large one's."""
    import matplotlib.pyplot as plt

    matrix = np.array(report["confusion"], np.int64)
    names = [_label(c) for c in report["classes"]]
    k = len(names)
    rows = matrix.sum(axis=1, keepdims=True)
    share = np.divide(matrix, rows, out=np.zeros(matrix.shape), where=rows > 0)
    side = min(3.0 + 0.36 * k, 40.0)  # inches: about a third of an inch a cell, so 50 classes stay legible
    font = 10 if k <= 12 else 8 if k <= 25 else 6 if k <= NUMBERED_UP_TO else 4
    fig, ax = plt.subplots(figsize=(side + 1.5, side))
    shown = ax.imshow(share, cmap="Blues", vmin=0, vmax=1)
    ax.set_xticks(range(k))
    ax.set_yticks(range(k))
    ax.set_xticklabels(names, rotation=90 if k > 10 or max(map(len, names)) > 4 else 0, fontsize=font)
    ax.set_yticklabels(names, fontsize=font)
    ax.set_xlabel("predicted class")
    ax.set_ylabel("true class")
    if k <= NUMBERED_UP_TO:
        for t, p in zip(*np.nonzero(matrix)):
            colour = "white" if share[t, p] > 0.5 else "black"
            ax.text(p, t, str(matrix[t, p]), ha="center", va="center", fontsize=font, color=colour)
    accuracy = report.get("accuracy")
    title = f"{report.get('split', '')} split, {report['images']} images" + (
        f", accuracy {100 * accuracy:.1f}%" if accuracy is not None else ""
    )
    ax.set_title(title + "\n(counts; colour: share of the true class)", fontsize=10)
    fig.colorbar(shown, ax=ax, fraction=0.04, pad=0.02)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def draw_pairs(report: dict, images: dict[int, np.ndarray], path: Path) -> None:
    """A row per confused pair (true -> predicted, count) with its first images, as the user sees them."""
    import matplotlib.pyplot as plt

    pairs = [p for p in report["confused_pairs"] if any(i in images for i in p["examples"])]
    if not pairs:
        fig, ax = plt.subplots(figsize=(5, 1.2))
        ax.axis("off")
        ax.text(0.5, 0.5, "no confused pairs: every image was classified right", ha="center", va="center")
        _save(fig, path)
        plt.close(fig)
        return
    columns = max(len(p["examples"]) for p in pairs)
    fig, axes = plt.subplots(
        len(pairs),
        columns + 1,
        figsize=(1.5 * columns + 2.2, 1.6 * len(pairs) + 0.6),
        gridspec_kw={"width_ratios": [1.5] + [1] * columns},
        squeeze=False,
    )
    for row, pair in zip(axes, pairs):
        for ax in row:
            ax.axis("off")
        what = f"{_label(pair['true_class'])}\n-> {_label(pair['predicted_class'])}\n({pair['count']} images)"
        row[0].text(1.0, 0.5, what, transform=row[0].transAxes, fontsize=9, ha="right", va="center")
        for ax, i in zip(row[1:], pair["examples"]):
            image = images[i]
            if image.shape[0] == 1:
                ax.imshow(image[0], cmap="gray", vmin=0, vmax=255)
            else:
                ax.imshow(np.transpose(image, (1, 2, 0)))
            ax.set_title(f"#{i}", fontsize=7)
    fig.suptitle("most confused: true -> predicted, the first images by index in the split", fontsize=10)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def draw(folder: Path) -> list[Path]:
    """confusion.png and confused.png in folder, from its report.json and examples.npz; their paths."""
    import matplotlib  # here, not at the top: the trainer imports this module to write the files, not matplotlib

    matplotlib.use("Agg")
    folder = Path(folder)
    report, images = read(folder)
    draw_confusion(report, folder / CONFUSION_FILE)
    draw_pairs(report, images, folder / PAIRS_FILE)
    return [folder / CONFUSION_FILE, folder / PAIRS_FILE]


def main(argv: list[str] | None = None) -> int:
    """The trainer's drawing child: python .../report.py [--low-priority] FOLDER."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--low-priority"]:
        args = args[1:]
        if hasattr(os, "nice"):
            os.nice(19)
    if len(args) != 1 or not (Path(args[0]) / REPORT_FILE).is_file():
        print(f"usage: report.py [--low-priority] FOLDER (a folder holding {REPORT_FILE})", file=sys.stderr)
        return 2
    for path in draw(Path(args[0])):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

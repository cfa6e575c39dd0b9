"""Loss and accuracy curves drawn from a run's metrics.jsonl; usable on its own: python -m paddle_mnist.plots DIR."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

if __package__:
    from paddle_mnist.files import atomic
else:  # run as a file (the trainer's drawing child: python .../plots.py), with its own folder on sys.path
    import atomic

METRICS_FILE = "metrics.jsonl"  # one JSON row per epoch, written by the trainer's rank 0
CURVES_FILE = "curves.png"


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_curves(metrics_path: Path, out_path: Path) -> None:
    import matplotlib  # here, not at the top: the trainer imports this module for its file names, not matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    epochs = [r["epoch"] for r in rows]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    for key, label in (("train_loss", "train"), ("val_loss", "validation")):
        ax_loss.plot(epochs, [r[key] for r in rows], marker="o", label=label)
    for key, label in (("train_acc", "train"), ("val_acc", "validation")):
        ax_acc.plot(epochs, [r[key] for r in rows], marker="o", label=label)
    ax_loss.set(xlabel="epoch", ylabel="loss", title="Loss")
    ax_acc.set(xlabel="epoch", ylabel="accuracy", title="Accuracy")
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend()
    if rows:
        last = rows[-1]
        fig.suptitle(f"{last.get('world_size', '?')} worker(s), global batch {last.get('global_batch_size', '?')}")
    fig.tight_layout()
    with atomic.atomic_write(out_path) as f:
        fig.savefig(f, format="png", dpi=100)  # a file object: the format cannot come from the name
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m paddle_mnist.plots",
        usage="%(prog)s OUTPUT_DIR",
        description="Redraw a run's loss and accuracy curves, the picture the trainer draws as it goes: "
        "OUTPUT_DIR/metrics.jsonl (one row per epoch, written by the trainer's rank 0) into OUTPUT_DIR/curves.png. "
        "It reads files only, so any run can be redrawn, during its training or after; it prints the picture's path.",
    )
    p.add_argument("output_dir", metavar="OUTPUT_DIR", help="the trainer's --output-dir")
    p.add_argument("--low-priority", action="store_true", help=argparse.SUPPRESS)  # the trainer's drawing child
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.low_priority and hasattr(os, "nice"):  # the trainer's drawings yield the CPU to training
        os.nice(19)
    folder = Path(args.output_dir)
    metrics = folder / METRICS_FILE
    if not metrics.is_file():
        print(f"error: {metrics} not found; pass the --output-dir of a run", file=sys.stderr)
        return 1
    plot_curves(metrics, folder / CURVES_FILE)
    print(folder / CURVES_FILE)
    return 0


if __name__ == "__main__":
    sys.exit(main())

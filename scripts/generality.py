"""Generality: does the README's folder command train any folder well with the default flags?

    python -m scripts.generality                       # every cell, 3 seeds, the grid on the first seed
    python -m scripts.generality --cells base size64 --seeds 1 --grid

Folders of PNG files are built from the shipped MNIST and Fashion-MNIST images, one factor at a time around a
base cell (MNIST digits, 32 px, 1,500 training images, grey, 10 balanced classes): Fashion-MNIST's images instead;
image size 16, 64 and 128 px; 500 and 10,000 training images; colour (each image tinted with its own random ink
and paper colours, so colour says nothing of the class); 2 classes (4 and 9, a pair often confused); one class
10x rarer than the others. Every folder has test/ with 1,000 images of its classes from the shipped test split
(balanced, as the shipped one is). Each cell trains as users run the README's folder command, under
python -m paddle.distributed.launch with --workers workers and the default flags, on every seed of --seeds;
then the points of a small grid of hand-set flags (--lr, --warmup-epochs, --epochs) on the first seed. Reported
per cell: the default's test accuracy on each seed, its median wall time and steps, the grid's best and its
flags, and the default's median less the grid's best. Rows are appended to --json as they end, so a run that
is stopped keeps what it measured and a second run goes on where it stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
from PIL import Image

from paddle_mnist.datasets import data

REPO = Path(__file__).resolve().parent.parent
TEST_IMAGES = 1000
HARD_PAIRS = {"mnist": (4, 9), "fashion-mnist": (0, 6)}  # often confused: 2 classes that are not trivial


@dataclass(frozen=True)
class Cell:
    dataset: str = "mnist"
    size: int = 32
    train: int = 1500
    colour: bool = False
    classes: int = 10
    rare: bool = False  # the first class has a tenth of the others' training images

    @property
    def name(self) -> str:
        """What differs from the base cell, e.g. size64, or base."""
        base = Cell()
        changed = {k: v for k, v in asdict(self).items() if v != getattr(base, k)}
        parts = [k if v is True else str(v) if k == "dataset" else f"{k}{v}" for k, v in changed.items()]
        return "-".join(parts) or "base"


def cells() -> list[Cell]:
    """The base cell and its one-factor variations; the dataset is one of the factors."""
    base = Cell()
    return [
        base,
        replace(base, dataset="fashion-mnist"),
        *(replace(base, size=s) for s in (16, 64, 128)),
        *(replace(base, train=n) for n in (500, 10000)),
        replace(base, colour=True),
        replace(base, classes=2),
        replace(base, rare=True),
    ]


def _take(labels: np.ndarray, classes: tuple[int, ...], counts: dict[int, int]) -> np.ndarray:
    """Indices of the first counts[c] images of each class c, in the split's own order."""
    chosen = [np.flatnonzero(labels == c)[: counts[c]] for c in classes]
    return np.sort(np.concatenate(chosen))


def choose(cell: Cell, train_labels: np.ndarray, test_labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The training and test indices of the cell's images."""
    classes = HARD_PAIRS[cell.dataset] if cell.classes == 2 else tuple(range(10))
    if cell.rare:  # n = (k - 1) x per + per / 10 images
        per = round(cell.train / (len(classes) - 1 + 0.1))
        counts = {c: per for c in classes} | {classes[0]: per // 10}
    else:
        counts = {c: cell.train // len(classes) for c in classes}
    test_counts = {c: TEST_IMAGES // len(classes) for c in classes}
    return _take(train_labels, classes, counts), _take(test_labels, classes, test_counts)


def render(image: np.ndarray, cell: Cell, rng: np.random.Generator) -> Image.Image:
    """A 28x28 grey image at the cell's size, tinted with random ink and paper colours when the cell is in colour."""
    picture = Image.fromarray(image).resize((cell.size, cell.size), Image.BILINEAR)
    if not cell.colour:
        return picture
    ink, paper = rng.uniform(0.5, 1.0, 3), rng.uniform(0.0, 0.45, 3)
    g = np.asarray(picture, dtype=np.float32)[..., None] / 255
    return Image.fromarray(np.round(255 * (g * ink + (1 - g) * paper)).astype(np.uint8), "RGB")


def make_folder(cell: Cell, root: Path) -> Path:
    """The cell's folder under root (train/<class>/, test/<class>/), written once."""
    folder = root / cell.name
    if (folder / ".complete").is_file():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    ds = data.load_dataset(cell.dataset)
    names = ds.classes
    rng = np.random.default_rng(0)
    train_idx, test_idx = choose(cell, ds.train.labels, ds.test.labels)
    for split, source, idx in (("train", ds.train, train_idx), ("test", ds.test, test_idx)):
        for i in idx:
            label = int(source.labels[i])
            target = folder / split / names[label].replace("/", " or ")
            target.mkdir(parents=True, exist_ok=True)
            render(source.images[i, 0], cell, rng).save(target / f"{i:05d}.png")
    (folder / ".complete").write_text("")
    return folder


# A small grid of hand-set flags around the default, on the first seed: each point changes the learning rate, the
# warmup or the epochs (the epochs the default planned, from its config.json, or twice as many)
GRID = {
    "lr 0.1": {"lr": 0.1},
    "lr 0.02": {"lr": 0.02},
    "warmup 10%": {"warmup_share": 0.1},
    "2x epochs": {"epochs_factor": 2},
}


def grid_flags(point: dict, default_epochs: int) -> list[str]:
    epochs = default_epochs * point.get("epochs_factor", 1)
    flags = ["--epochs", str(epochs)]
    if "lr" in point:
        flags += ["--lr", str(point["lr"])]
    if "warmup_share" in point:
        flags += ["--warmup-epochs", f"{point['warmup_share'] * epochs:g}"]
    return flags


def train(folder: Path, cell: Cell, seed: int, flags: list[str], work: Path, workers: int, sized: bool = True) -> dict:
    """One run of the README's folder command (with `flags` added), as users start it; its figures. sized: with
    --image-size the cell's size, else at the size the folder's default rule gives."""
    out, log_dir = work / "run", work / "run-log"
    for old in (out, log_dir):
        shutil.rmtree(old, ignore_errors=True)
    launch = [sys.executable] if workers == 1 else [sys.executable, "-m", "paddle.distributed.launch"]
    launch += [] if workers == 1 else ["--nproc_per_node", str(workers), "--log_dir", str(log_dir)]
    cmd = [*launch, str(REPO / "train.py"), "--dataset", "folder", "--data-dir", str(folder)]
    cmd += ["--image-size", str(cell.size)] if sized else []
    cmd += ["--augment", "--output-dir", str(out), "--seed", str(seed), *flags]
    started = time.perf_counter()
    proc = subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True)
    wall = time.perf_counter() - started
    log = (log_dir / "workerlog.0").read_text() if workers > 1 else proc.stdout + proc.stderr
    results = json.loads((out / "results.json").read_text()) if (out / "results.json").is_file() else {}
    used = json.loads((out / "config.json").read_text()) if (out / "config.json").is_file() else {}
    last = [line for line in log.splitlines() if " error: " in line or " finished: " in line]
    return {
        "cell": cell.name,
        "seed": seed,
        "flags": flags,
        "exit": proc.returncode,
        "test_acc": results.get("test_acc"),
        "steps": results.get("steps"),
        "epochs": used.get("epochs"),
        "image_size": used.get("image_size"),
        "wall_s": round(wall, 1),
        "last_line": last[-1].split("] ", 1)[-1][:300] if last else proc.stderr[-300:],
    }


def chance(cell: Cell) -> float:
    """The test accuracy of always answering one class: the test splits are balanced."""
    return 1 / cell.classes


def report(rows: list[dict], chosen: list[Cell]) -> str:
    """The markdown table: each cell's default accuracy by seed, its median time, the grid's best."""
    lines = [
        "| cell | default: test accuracy by seed | median time | steps | grid's best (flags) | default's median "
        "- grid's best |",
        "|---|---|---|---|---|---|",
    ]
    for cell in chosen:
        mine = [r for r in rows if r["cell"] == cell.name]
        default = [r for r in mine if r["kind"] == "default"]
        if not default:
            continue
        accs = [r["test_acc"] or 0.0 for r in default]
        seeds = ", ".join(f"{100 * (r['test_acc'] or 0):.1f}" + ("" if r["exit"] == 0 else "!") for r in default)
        grid = [r for r in mine if r["kind"] != "default"] + [r for r in default if r["seed"] == default[0]["seed"]]
        best = max(grid, key=lambda r: r["test_acc"] or 0.0)
        gap = 100 * (statistics.median(accs) - (best["test_acc"] or 0.0))
        best_text = f"{100 * (best['test_acc'] or 0):.1f} ({best['kind']})" if len(grid) > 1 else "not run"
        gap_text = f"{gap:+.1f}" if len(grid) > 1 else ""
        lines.append(
            f"| {cell.name} | {seeds} | {statistics.median(r['wall_s'] for r in default):.0f} s | "
            f"{default[0]['steps']} | {best_text} | {gap_text} |"
        )
    return "\n".join(lines)


def _grid_plan(chosen: list[Cell], args, done: list[dict]) -> list[tuple[Cell, int, str]]:
    """The grid's runs, cell by cell, the cells whose default ran fastest first: a grid stopped part way has
    covered as many cells as it could."""

    def cost(cell: Cell) -> float:
        times = [r["wall_s"] for r in done if r["cell"] == cell.name and r["kind"] == "default"]
        return statistics.median(times) if times else float("inf")

    return [(cell, args.seeds[0], point) for cell in sorted(chosen, key=cost) for point in args.grid]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.generality", description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, default=Path("/tmp/generality"), help="where the folders and runs go")
    p.add_argument("--cells", nargs="*", help="only these cells (names as in the table, e.g. mnist/size64)")
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    p.add_argument("--grid", nargs="*", default=list(GRID), help="grid points to run on the first seed (none: no grid)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--json", type=Path, default=Path("generality.jsonl"), help="rows are appended here as they end")
    p.add_argument("--table-only", action="store_true", help="print the table of the rows in --json and stop")
    p.add_argument(
        "--default-size", action="store_true", help="leave out --image-size: train at the folder's default size"
    )
    args = p.parse_args(argv)
    chosen = [c for c in cells() if not args.cells or c.name in args.cells]
    done = [json.loads(line) for line in args.json.read_text().splitlines()] if args.json.is_file() else []
    if not args.table_only:
        have = {(r["cell"], r["seed"], r["kind"]) for r in done}
        plan = [(cell, seed, "default") for seed in args.seeds for cell in chosen]
        for cell, seed, kind in plan + _grid_plan(chosen, args, done):
            if (cell.name, seed, kind) in have:
                continue
            folder = make_folder(cell, args.work / "folders")
            flags = []
            if kind != "default":
                first = [r for r in done if r["cell"] == cell.name and r["kind"] == "default" and r["seed"] == seed]
                if not first or not first[0]["epochs"]:
                    continue  # the grid is set around the default's epochs
                flags = grid_flags(GRID[kind], first[0]["epochs"])
            row = {**train(folder, cell, seed, flags, args.work, args.workers, not args.default_size), "kind": kind}
            done.append(row)
            with args.json.open("a") as f:
                f.write(json.dumps(row) + "\n")
            at_chance = row["test_acc"] is None or row["test_acc"] <= chance(cell) + 0.05
            print(
                f"{cell.name} seed {seed} {kind}: test accuracy {row['test_acc']}, {row['wall_s']:.0f} s, "
                f"exit {row['exit']}{' AT CHANCE' if at_chance else ''}",
                flush=True,
            )
    print(report(done, chosen))
    failed = [r for r in done if r["kind"] == "default" and (r["exit"] != 0 or r["test_acc"] is None)]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

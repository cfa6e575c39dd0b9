"""Fine-tuning against training from scratch on a small folder (docs/finetuning.md).

    python -m scripts.finetune_compare prepare ../shared/data/cifar10-jpeg/cifar10-jpeg.tar.gz /tmp/finetune
    python -m scripts.finetune_compare run /tmp/finetune --seeds 1 2 3

`prepare` unpacks the CIFAR-10 JPEG copy once and builds two folders from it: source/, CIFAR-10's first five
classes (airplane, automobile, bird, cat, deer) with all their training and test images, and target/, the other
five (dog, frog, horse, ship, truck) with 200 training and 50 validation images per class (1,000 and 250, taken
in file-name order) and all 5,000 of their test images. `run` trains source/ once (--source-epochs, seed 1), then
trains target/ on each seed from scratch and from the source run's weights (--init-from, under each --arms
recipe), one process each, and prints a Markdown table: test accuracy per seed, their mean, and the median
wall time. Rows are appended to DIR/runs.jsonl as they end; a second `run` skips the runs it finds there, and
`table` prints every model's rows.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SOURCE_CLASSES = ("airplane", "automobile", "bird", "cat", "deer")
TARGET_CLASSES = ("dog", "frog", "horse", "ship", "truck")
TRAIN_PER_CLASS, VAL_PER_CLASS = 200, 50
# what each arm adds to the target's command: scratch; the fine-tuning default; the recipes it was chosen over;
# the default on a shorter schedule (8 epochs, 120 steps, instead of --min-steps' 34 epochs, 510 steps)
ARMS = {
    "scratch": [],
    "init": ["--init-from", "{source}"],
    "init-lr0.1": ["--init-from", "{source}", "--init-lr-scale", "0.1"],
    "init-freeze5": ["--init-from", "{source}", "--freeze-epochs", "5"],
    "init-8-epochs": ["--init-from", "{source}", "--epochs", "8"],
}


def prepare(archive: Path, out: Path) -> None:
    raw = out / "raw"
    if not (raw / "test").is_dir():
        raw.mkdir(parents=True, exist_ok=True)
        with tarfile.open(archive) as tar:
            tar.extractall(raw, filter="data")
    _link_split(raw / "train", out / "source" / "train", SOURCE_CLASSES, slice(None))
    _link_split(raw / "test", out / "source" / "test", SOURCE_CLASSES, slice(None))
    _link_split(raw / "train", out / "target" / "train", TARGET_CLASSES, slice(TRAIN_PER_CLASS))
    held_out = slice(TRAIN_PER_CLASS, TRAIN_PER_CLASS + VAL_PER_CLASS)
    _link_split(raw / "train", out / "target" / "val", TARGET_CLASSES, held_out)
    _link_split(raw / "test", out / "target" / "test", TARGET_CLASSES, slice(None))
    print(f"{out}: source/ and target/ built from {archive}")


def _link_split(src: Path, dst: Path, classes: tuple[str, ...], part: slice) -> None:
    """dst/<class>/ holding hard links to part of src/<class>/'s files in name order (built afresh)."""
    shutil.rmtree(dst, ignore_errors=True)
    for name in classes:
        (dst / name).mkdir(parents=True)
        for f in sorted((src / name).iterdir())[part]:
            os.link(f, dst / name / f.name)


def trainer(args: list[str], log: Path) -> dict:
    """One run of train.py in one process; its results.json and config.json."""
    out = Path(args[args.index("--output-dir") + 1])
    with log.open("w") as f:
        subprocess.run([sys.executable, str(REPO / "train.py"), *args], stdout=f, stderr=subprocess.STDOUT, check=True)
    results = json.loads((out / "results.json").read_text())
    return {**results, "epochs": json.loads((out / "config.json").read_text())["epochs"]}


def run(folder: Path, seeds: list[int], arms: list[str], model: str, source_epochs: int) -> None:
    runs = folder / "runs"
    runs.mkdir(exist_ok=True)
    common = ["--dataset", "folder", "--model", model, "--overwrite", "--log-every", "0"]
    source = runs / f"source-{model}"
    if not (source / "results.json").exists():
        args = [*common, "--data-dir", str(folder / "source"), "--output-dir", str(source), "--seed", "1"]
        done = trainer([*args, "--epochs", str(source_epochs)], runs / f"source-{model}.log")
        print(f"source: test accuracy {done['test_acc']:.4f} in {done['wall_time_s']:.0f} s")
    table = folder / "runs.jsonl"
    rows = [json.loads(line) for line in table.read_text().splitlines()] if table.exists() else []
    for seed in seeds:
        for arm in arms:
            if any(r["model"] == model and r["arm"] == arm and r["seed"] == seed for r in rows):
                continue
            out = runs / f"{model}-{arm}-{seed}"
            extra = [a.format(source=source) for a in ARMS[arm]]
            args = [*common, "--data-dir", str(folder / "target"), "--output-dir", str(out), "--seed", str(seed)]
            done = trainer([*args, *extra], runs / f"{model}-{arm}-{seed}.log")
            row = {"model": model, "arm": arm, "seed": seed, "acc": done["test_acc"], "time_s": done["wall_time_s"]}
            row |= {"steps": done["steps"], "epochs": done["epochs"]}
            rows.append(row)
            with table.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)
    print(markdown([r for r in rows if r["model"] == model and r["arm"] in arms], seeds))


def markdown(rows: list[dict], seeds: list[int]) -> str:
    """The rows as a Markdown table: a row per model and arm, in the order they were first run."""
    lines = ["| model | start | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | median time | steps |"]
    lines.append("|---" * (len(seeds) + 5) + "|")
    for model, arm in dict.fromkeys((r["model"], r["arm"]) for r in rows):
        found = {r["seed"]: r for r in rows if r["model"] == model and r["arm"] == arm and r["seed"] in seeds}
        if not found:
            continue
        accs = [found[s]["acc"] for s in seeds if s in found]
        cells = [f"{100 * found[s]['acc']:.1f}%" if s in found else "-" for s in seeds]
        time_s = statistics.median(r["time_s"] for r in found.values())
        steps = next(iter(found.values()))["steps"]
        mean = 100 * statistics.mean(accs)
        lines.append(f"| `{model}` | {arm} | {' | '.join(cells)} | {mean:.1f}% | {time_s:.0f} s | {steps} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="unpack the archive and build source/ and target/")
    prep.add_argument("archive", type=Path)
    prep.add_argument("folder", type=Path)
    go = sub.add_parser("run", help="train the source once, then the target from scratch and fine-tuned")
    go.add_argument("folder", type=Path)
    go.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    go.add_argument("--arms", nargs="+", default=["scratch", "init"], choices=tuple(ARMS))
    go.add_argument("--model", default="mnist_cnn_bn_fc")
    go.add_argument("--source-epochs", type=int, default=4, help="epochs of the source run (25,000 images)")
    table = sub.add_parser("table", help="the table of every run in DIR/runs.jsonl")
    table.add_argument("folder", type=Path)
    table.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    args = p.parse_args(argv)
    if args.command == "prepare":
        prepare(args.archive, args.folder)
    elif args.command == "run":
        run(args.folder, args.seeds, args.arms, args.model, args.source_epochs)
    else:
        rows = [json.loads(line) for line in (args.folder / "runs.jsonl").read_text().splitlines()]
        print(markdown(rows, args.seeds))


if __name__ == "__main__":
    main()

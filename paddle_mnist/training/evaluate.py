"""python -m paddle_mnist.evaluate OUTPUT_DIR: a trained run's report by class, on a split of its data or of another
folder of the same classes.

Paddle is imported inside the functions that run it, as in start.py: its notes are silenced (quiet_paddle) before
it loads.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from paddle_mnist.config import CONFIG_FILE, FOLDER, Config, ConfigError, image_shape, load_config
from paddle_mnist.datasets import data, folder, labels
from paddle_mnist.datasets.datafiles import REPO_DATA
from paddle_mnist.files import report
from paddle_mnist.files.log import quiet_paddle
from paddle_mnist.training import scores

SPLITS = ("test", "val", "train")
WHICH = ("last", "best")  # checkpoint.WHICH's keys: model.pdparams, model_best.pdparams
META = "inference_meta.json"  # the export's metadata, which records the run's normalisation


@dataclasses.dataclass(frozen=True)
class Source:
    ds: data.Dataset
    where: str  # the folder the images came from (a labels run's: its label files)
    note: str = ""  # what the split stands for, where it is not plain (a folder without test/)


def _log() -> logging.Logger:
    """A folder's first decoding says how it goes, on stderr, as the trainer's log would."""
    log = logging.getLogger("paddle_mnist.evaluate")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    return log


def load_source(cfg: Config, data_dir: str | None, out: Path) -> Source:
    """The images to score: the run's own dataset (data_dir None), or data_dir read by the trainer's own loaders:
        a class folder (DIR/train/<class>/, as --dataset folder), decoded to the run's image size and channels through
        the folder's cache, or else files in the run's built-in format. DataError when they cannot be read or their
    classes are not the run's (a folder's checked before it is decoded)."""
    where = data_dir or cfg.data_dir
    if cfg.dataset != FOLDER and not (data_dir and (Path(data_dir) / "train").is_dir()):
        ds = data.load_dataset(cfg.dataset, where)
        shown = where or str(REPO_DATA / cfg.dataset)
        check_classes(ds.classes, cfg, shown, out)
        return Source(ds, shown)
    own_labels = cfg.labels and not data_dir  # the run's label files, as its config.json names them
    listing, caches = labels.source(cfg) if own_labels else (folder.list_folder(where), None)
    shown = ", ".join(str(f.path) for f in listing.label_files.values()) if own_labels else str(listing.root)
    check_classes(listing.classes, cfg, shown, out)
    channels, height, width = image_shape(cfg)
    request = folder.Request((width, height), channels, cfg.val_split, cfg.skip_bad_images)
    cache = folder.ensure_cache(listing, request, caches or folder.default_cache_dir(listing.root), _log())
    ds, _ = folder.load(listing, request, cache)
    if "test" in listing.splits:
        note = ""
    elif own_labels:
        note = "no --test-labels: the rows held out of --labels, as the run scored"
    else:
        note = "no test/ folder: the images held out of train/, as the run scored"
    return Source(ds, shown, note)


def check_classes(classes: tuple[str, ...], cfg: Config, where: str, out: Path) -> None:
    """The data's labels must mean what the run's outputs mean: the same class names in the same order."""
    if tuple(classes) == tuple(cfg.classes):
        return
    missing = [c for c in cfg.classes if c not in classes]
    extra = [c for c in classes if c not in cfg.classes]
    differ = "; ".join(
        part
        for part in (
            f"it lacks {', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else "") if missing else "",
            f"the run has no {', '.join(extra[:5])}" + (" ..." if len(extra) > 5 else "") if extra else "",
        )
        if part
    )
    raise data.DataError(
        f"{where}: its classes are not the run's ({differ or 'the same names in another order'}); the run in {out} "
        f"learned {len(cfg.classes)} classes ({folder.numbered(tuple(cfg.classes))}): give the folder one "
        "train/<class>/ folder per class of the run, named as in its config.json"
    )


def normalised_as_run(ds: data.Dataset, cfg: Config, out: Path) -> data.Dataset:
    """ds with the run's normalisation: the training mean and std its export recorded, else its own data's."""
    try:
        meta = json.loads((out / META).read_text())
        mean, std = tuple(meta["mean"]), tuple(meta["std"])
    except (OSError, ValueError, KeyError):
        run = load_source(cfg, None, out).ds
        mean, std = run.mean, run.std
    return dataclasses.replace(ds, mean=mean, std=std)


def pick_split(source: Source, name: str, limit: int = 0) -> data.Split:
    """The split asked for (its first limit images, where limit > 0); DataError where the data has no such split
    of its own (a built-in dataset's validation split is its test split)."""
    ds = source.ds
    if name == "train":
        return ds.train
    if ds.val_is_test and name == "val" and not source.note:  # a note: the folder's test is its held-out val
        why = (
            f"{ds.name} has no validation split (the trainer scores its test split after each epoch)"
            if ds.name != FOLDER
            else f"{source.where} has no val/ (or --val-labels) and nothing was held out (--val-split 0)"
        )
        raise data.DataError(f"--split val: {why}; pass --split test")
    return (ds.test if name == "test" else ds.val).head(limit)


def default_out(out: Path, data_dir: str | None, split: str, which: str) -> Path:
    """OUTPUT_DIR/report for the trainer's own report (its test split, last weights), else a name that says what
    was scored, e.g. report-mine-train-best: another evaluation never replaces the trainer's report."""
    if (data_dir, split, which) == (None, "test", "last"):
        return out / report.FOLDER
    parts = [Path(data_dir).resolve().name] if data_dir else []
    parts += [split] + (["best"] if which == "best" else [])
    return out / "-".join([report.FOLDER, *parts])


def evaluate_run(out: Path, data_dir: str | None, split: str, which: str, dest: Path) -> tuple[dict, list[Path]]:
    """Score the run's weights on the split, write the report into dest; (the report, the files written)."""
    from paddle_mnist.deploy.weights import load_model
    from paddle_mnist.files import checkpoint
    from paddle_mnist.runtime.distributed import DistEnv
    from paddle_mnist.training import evaluation

    one = DistEnv(0, 1, 0, 1, "none", "cpu")  # this command is one process: every image is in its one shard
    net = load_model(out, which)  # first: says in one line when out is not a run's output directory
    cfg = load_config(out / CONFIG_FILE)
    source = load_source(cfg, data_dir, out)
    ds = normalised_as_run(source.ds, cfg, out) if data_dir else source.ds
    # the run's own val and test splits as it scored them (--eval-limit); another folder's whole
    images = pick_split(dataclasses.replace(source, ds=ds), split, 0 if data_dir else cfg.eval_limit)
    if not len(images):
        raise data.DataError(f"--split {split}: {source.where} has no images in it; pass another --split")
    _activate_convolutions(cfg)
    stats = evaluation.evaluate(net, images, ds, cfg, one, tta=True)  # as the trainer's final test score: --tta as run
    pairs = scores.worst_pairs(stats.confusion)
    examples = evaluation.confused_examples(stats, pairs, one)
    about = {"split": split, "dataset": ds.name, "data": source.where, "weights": checkpoint.WHICH[which]}
    if source.note and split == "test":
        about["note"] = source.note
    contents = scores.report(stats.confusion, ds.classes, stats.top_k, examples, about)
    report.write(dest, contents, {i: np.asarray(images.images[i]) for found in examples.values() for i in found})
    return contents, [dest / report.REPORT_FILE, *report.draw(dest)]


def _activate_convolutions(cfg: Config) -> None:
    """The convolutions the run scored with (--conv-backend), so the scores are the trainer's to the last bit; Paddle's
    where oneDNN's operator cannot be had here."""
    import paddle

    from paddle_mnist.ops import onednn

    try:
        onednn.activate(onednn.prepare(cfg.conv_backend), paddle.device.get_device())
    except onednn.Unavailable:
        onednn.deactivate()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m paddle_mnist.evaluate",
        description="Score a trained run by class: per-class precision and recall, top-1 and top-5 accuracy, the "
        "confusion matrix (JSON and PNG) and the most confused pairs with their first images.",
        epilog="Exit status: 0 with the report written, 2 when the run, the data or the split cannot be used "
        "(one line says why).",
    )
    p.add_argument("output_dir", metavar="OUTPUT_DIR", help="a run's --output-dir (config.json and model.pdparams)")
    p.add_argument(
        "--data-dir",
        metavar="DIR",
        help="score another folder of the run's classes (DIR/train/<class>/, test/, as --dataset folder) or of "
        "its built-in format (default: the run's own data)",
    )
    p.add_argument("--split", default="test", choices=SPLITS, help="the split to score (default test)")
    p.add_argument(
        "--which",
        default="last",
        choices=WHICH,
        help="last: model.pdparams (default); best: model_best.pdparams",
    )
    p.add_argument(
        "--out",
        metavar="DIR",
        help="where the report goes (default OUTPUT_DIR/report for the test split with the last weights, "
        "else OUTPUT_DIR/report-[DATA-]SPLIT[-best])",
    )
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_paddle()  # before Paddle loads: its C++ INFO lines and notes would bury the summary
    from paddle_mnist.files.checkpoint import CheckpointError

    out = Path(args.output_dir)
    dest = Path(args.out) if args.out else default_out(out, args.data_dir, args.split, args.which)
    try:
        contents, written = evaluate_run(out, args.data_dir, args.split, args.which, dest)
    except (CheckpointError, data.DataError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    head = f"{args.split} split of {contents['data']}" + (f" ({contents['note']})" if contents.get("note") else "")
    print(f"{head}, weights {contents['weights']}")
    for line in scores.summary(contents):
        print(line)
    print(f"report in {dest} ({', '.join(p.name for p in written)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

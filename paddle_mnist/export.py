"""The inference model: the trained network saved by paddle.jit.save with what a predictor needs, and loaded back."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import paddle

from . import preprocess
from .data import Dataset

FORMAT_VERSION = 1
# Not ".meta.json": paddle.jit.load reads PREFIX.NAME.json as the saved method NAME and fails on this file.
META_SUFFIX = "_meta.json"
WHERE_FROM = "the trainer writes <output-dir>/inference at the end of a run"


class ExportError(Exception):
    """An exported model that is missing, incomplete or unreadable; the message names the prefix and the fix."""


def meta_path(prefix: Path) -> Path:
    prefix = Path(prefix)
    return prefix.with_name(prefix.name + META_SUFFIX)


def _read_meta(prefix: Path) -> dict | None:
    try:
        return json.loads(meta_path(prefix).read_text())
    except (OSError, ValueError):
        return None


def export_inference(net: paddle.nn.Layer, ds: Dataset, prefix: Path, weights: str = "") -> None:
    """Save net for inference on a batch of ds-shaped float32 images, normalised as in training.

    paddle.jit.save picks the file names (2.6: .pdmodel/.pdiparams[.info], 3.x under PIR: .json/.pdiparams), so
    they are written into a temporary folder, moved next to prefix, and listed in prefix_meta.json. The meta file
    is written last, atomically: when it is there, the files it lists are complete. weights says which weights
    these are (the last epoch's, or the best one's), for the meta file.
    """
    if isinstance(net, paddle.DataParallel):  # export the network itself, never the wrapper
        net = net._layers
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    meta_file = meta_path(prefix)
    old = _read_meta(prefix) or {}
    staging = Path(tempfile.mkdtemp(prefix=f".{prefix.name}.tmp", dir=prefix.parent))
    was_training = net.training
    try:
        net.eval()
        spec = paddle.static.InputSpec([None, *ds.image_shape], "float32", "image")
        paddle.jit.save(net, str(staging / prefix.name), input_spec=[spec])
        written = sorted(p.name for p in staging.iterdir())
        meta_file.unlink(missing_ok=True)  # from here until the new meta lands, the export reads as incomplete
        for name in written:
            os.replace(staging / name, prefix.parent / name)
        for name in set(old.get("files", [])) - set(written):  # an older Paddle's files of the same prefix
            (prefix.parent / Path(name).name).unlink(missing_ok=True)
        meta = {
            "format": FORMAT_VERSION,
            "dataset": ds.name,
            "classes": list(ds.classes),
            "image_shape": list(ds.image_shape),
            "mean": list(ds.mean),
            "std": list(ds.std),
            "files": written,
            "preprocess": preprocess.SETTINGS,  # the function predict applies to every image (preprocess.to_pixels)
            "paddle": paddle.__version__,
        }
        if weights:
            meta["weights"] = weights
        tmp = meta_file.with_name(f".{meta_file.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(meta, indent=2) + "\n")
        os.replace(tmp, meta_file)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if was_training:
            net.train()


def load_exported(prefix: Path | str) -> tuple[paddle.nn.Layer, dict]:
    """(the network in eval mode, its meta) from export_inference's files; ExportError says what is wrong."""
    prefix = Path(prefix)
    meta_file = meta_path(prefix)
    if not meta_file.is_file():
        raise ExportError(f"{prefix}: no exported model here ({meta_file} is missing); train first ({WHERE_FROM})")
    meta = _read_meta(prefix)
    if meta is None or meta.get("format") != FORMAT_VERSION:
        raise ExportError(
            f"{prefix}: {meta_file} is unreadable or of another format version; train again ({WHERE_FROM})"
        )
    missing = [name for name in meta["files"] if not (prefix.parent / name).is_file()]
    if missing:
        raise ExportError(f"{prefix}: incomplete export, {', '.join(missing)} missing; train again ({WHERE_FROM})")
    try:
        layer = paddle.jit.load(str(prefix))
    except Exception as e:  # Paddle raises many kinds here, with C++ traces; all mean the same to the user
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ExportError(
            f"{prefix}: Paddle {paddle.__version__} cannot load this model (exported with Paddle {meta['paddle']}): "
            f"{first}"
        ) from e
    layer.eval()
    return layer, meta

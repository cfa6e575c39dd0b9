"""The inference model: the trained network saved by paddle.jit.save with what a predictor needs, and loaded back."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from paddle_mnist.datasets import preprocess
from paddle_mnist.files import atomic

if TYPE_CHECKING:  # Paddle is imported where it is used, so reading an export's metadata does not load it
    import paddle

    from paddle_mnist.datasets.data import Dataset

FORMAT_VERSION = 1
# Not ".meta.json": paddle.jit.load reads PREFIX.NAME.json as the saved method NAME and fails on this file.
META_SUFFIX = "_meta.json"
WHERE_FROM = "the trainer writes <output-dir>/inference at the end of a run"


class ExportError(Exception):
    """An exported model that is missing, incomplete or unreadable; the message names the prefix and the fix."""


def meta_path(prefix: Path) -> Path:
    prefix = Path(prefix)
    return prefix.with_name(prefix.name + META_SUFFIX)


def onnx_path(prefix: Path) -> Path:
    prefix = Path(prefix)
    return prefix.with_name(prefix.name + ".onnx")


def background(images: np.ndarray, sample: int = 1000) -> list[int]:
    """Per channel, the median of the outer ring of pixels of (up to `sample`) training images: the ground the
    model learned to see around its subjects (0, black, for MNIST-type data). Transparent parts of an image are
    laid on it before prediction."""
    x = images[:sample]
    ring = np.concatenate([x[:, :, 0, :], x[:, :, -1, :], x[:, :, :, 0], x[:, :, :, -1]], axis=2)
    return [int(np.median(ring[:, c])) for c in range(x.shape[1])]


def contract(ds: Dataset, output_name: str) -> dict:
    """What a deploying program must do to call the exported network, written into the metadata."""
    c, h, w = ds.image_shape
    return {
        "input": {
            "name": "image",
            "dtype": "float32",
            "layout": "NCHW",
            "shape": [-1, c, h, w],
            "channels": "RGB" if c == 3 else "grey (L)",
            "pixels": "x = (pixel / 255 - mean[c]) / std[c], pixel the uint8 value 0-255",
            "resize": f"stretched to {w} x {h} (width x height), bilinear; no crop",
            "alpha": "composited onto `background` (per channel, 0-255) before the channel conversion",
        },
        "output": {"name": output_name, "shape": [-1, len(ds.classes)], "values": "logits (no softmax applied)"},
    }


def program_files(files: list[str]) -> tuple[str, str]:
    """(the program, the weights) among an export's files: .json or .pdmodel (Paddle 3.x or 2.6), .pdiparams."""
    return (
        next(name for name in files if name.endswith((".json", ".pdmodel"))),
        next(name for name in files if name.endswith(".pdiparams")),
    )


def _output_name(staging: Path, files: list[str]) -> str:
    """The name Paddle gave the network's output, as Paddle Inference reports it (differs between versions)."""
    from paddle import inference

    model, params = program_files(files)
    config = inference.Config(str(staging / model), str(staging / params))
    config.disable_glog_info()
    return inference.create_predictor(config).get_output_names()[0]


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
    import paddle

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
        output_name = _output_name(staging, written)
        meta_file.unlink(missing_ok=True)  # from here until the new meta lands, the export reads as incomplete
        for name in written:
            os.replace(staging / name, prefix.parent / name)
        for name in set(old.get("files", [])) - set(written):  # an older Paddle's files of the same prefix
            (prefix.parent / Path(name).name).unlink(missing_ok=True)
        onnx_path(prefix).unlink(missing_ok=True)  # converted from the weights being replaced
        meta = {
            "format": FORMAT_VERSION,
            "dataset": ds.name,
            "classes": list(ds.classes),
            "image_shape": list(ds.image_shape),
            "mean": list(ds.mean),
            "std": list(ds.std),
            # a folder's images were composited onto preprocess.BACKGROUND when its cache was built
            "background": [preprocess.BACKGROUND] * ds.image_shape[0]
            if ds.name == "folder"
            else background(ds.train.images),
            **contract(ds, output_name),
            "files": written,
            "paddle": paddle.__version__,
        }
        if weights:
            meta["weights"] = weights
        _write_meta(meta_file, meta)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if was_training:
            net.train()


def _write_meta(meta_file: Path, meta: dict) -> None:
    atomic.write_text(meta_file, json.dumps(meta, indent=2) + "\n")


def read_export(prefix: Path | str) -> dict:
    """The metadata of export_inference's files, once they are all there; ExportError says what is wrong."""
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
    return meta


def load_exported(prefix: Path | str) -> tuple[paddle.nn.Layer, dict]:
    """(the network in eval mode, its meta) from export_inference's files; ExportError says what is wrong."""
    import paddle

    prefix = Path(prefix)
    meta = read_export(prefix)
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


ONNX_OPSET = 13  # ONNX Runtime runs it everywhere; every operator of the models here exists in it


def export_onnx(prefix: Path | str) -> Path:
    """Convert export_inference's files to PREFIX.onnx with paddle2onnx and list it in the metadata."""
    prefix = Path(prefix)
    meta = read_export(prefix)
    try:
        import paddle2onnx
    except ImportError as e:
        raise ExportError("the ONNX export needs paddle2onnx: pip install -r requirements-onnx.txt") from e
    model, params = program_files(meta["files"])
    target = onnx_path(prefix)
    with atomic.atomic_path(target) as tmp:  # paddle2onnx wants a file name
        # No optimizer pass: paddle2onnx's default (polygraphy) installs packages with pip while it runs, and
        # ONNX Runtime folds constants itself when it loads the model
        paddle2onnx.export(
            str(prefix.parent / model),
            str(prefix.parent / params),
            str(tmp),
            opset_version=ONNX_OPSET,
            auto_upgrade_opset=False,
            enable_onnx_checker=True,
            optimize_tool="None",
        )
        if not tmp.is_file():
            raise ExportError(f"{prefix}: paddle2onnx {paddle2onnx.__version__} wrote no ONNX file")
    meta["onnx"] = {"file": target.name, "opset": ONNX_OPSET, "paddle2onnx": paddle2onnx.__version__}
    _write_meta(meta_path(prefix), meta)
    return target


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m paddle_mnist.export",
        description="Convert a model the trainer exported (OUTPUT_DIR/inference) for other runtimes.",
    )
    p.add_argument("--onnx", required=True, metavar="PREFIX", help="write PREFIX.onnx for ONNX Runtime (opset 13)")
    args = p.parse_args(argv)
    os.environ.setdefault("GLOG_minloglevel", "2")
    try:
        print(f"wrote {export_onnx(args.onnx)}")
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

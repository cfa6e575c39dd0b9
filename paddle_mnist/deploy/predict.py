"""Classify image files with an exported model: python -m paddle_mnist.predict --model PREFIX --image a.png ..."""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from collections.abc import Sequence

import numpy as np

from paddle_mnist.datasets import preprocess
from paddle_mnist.deploy.export import ExportError
from paddle_mnist.deploy.predictor import Predictor

BATCH = 256  # images per forward pass, so memory stays flat however many files are given


def load_image(path: str | os.PathLike, image_shape: Sequence[int], background: Sequence[int] = (0,)) -> np.ndarray:
    """uint8 (C, H, W) as the model of image_shape takes it, from an image file Pillow reads, by the trainer's own
    preprocessing (preprocess.load_image); transparency is composited onto `background` (the export's metadata
    holds the one the model was trained on: black for MNIST-type data)."""
    channels, height, width = image_shape
    return preprocess.load_image(path, channels, (width, height), background)


def predict_images(predictor, paths: Sequence[str], top: int = 3, invert: bool = False) -> list[dict]:
    """Per path, in order: {"image", "top": [{"class", "name", "probability"}, ...]} or {"image", "error"}.

    A file that cannot be read gets an error entry; every other file is still classified, in batches.
    """
    results: list[dict] = []
    for lo in range(0, len(paths), BATCH):
        chunk = [{"image": str(p)} for p in paths[lo : lo + BATCH]]
        loaded = []
        for entry in chunk:
            try:
                image = predictor.pixels(entry["image"])
            except preprocess.UNREADABLE as e:
                entry["error"] = preprocess.why_unreadable(e)
                continue
            loaded.append((entry, 255 - image if invert else image))
        if loaded:
            tops = predictor.predict([image for _, image in loaded], top)
            for (entry, _), best in zip(loaded, tops):
                entry["top"] = best
        results.extend(chunk)
    return results


def format_text(result: dict) -> str:
    best = ", ".join(f"{t['name']} ({t['class']}): {100 * t['probability']:.1f}%" for t in result["top"])
    return f"{result['image']}: {best}"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m paddle_mnist.predict",
        description="Classify image files (PNG, JPEG, ... any size, grey or colour) with a model the trainer "
        "exported. Each image is converted to the model's channels and stretched to its size; transparent "
        "parts are laid on the background the model was trained on (black for MNIST-type data).",
        epilog="Exit status: 0 when every image was classified, 1 when any image could not be read (each gets "
        "an error line; the others are still classified), 2 when the model cannot be loaded.",
    )
    p.add_argument(
        "--model",
        required=True,
        metavar="PREFIX",
        help="the exported model as the trainer wrote it: OUTPUT_DIR/inference",
    )
    p.add_argument("--image", required=True, nargs="+", metavar="PATH", help="one or more image files")
    p.add_argument(
        "--top", type=int, default=3, metavar="K", help="how many of the most likely classes to show (default 3)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON list of results instead of text lines")
    p.add_argument(
        "--invert",
        action="store_true",
        help="invert the pixels first: MNIST-type models learned light strokes on a dark ground, "
        "so pass this for dark writing on light paper",
    )
    p.add_argument(
        "--backend",
        default="auto",
        choices=("auto", "inference", "jit", "onnx"),
        help="auto (default): Paddle Inference, else paddle.jit; onnx: ONNX Runtime on the file that "
        "python -m paddle_mnist.export --onnx writes",
    )
    p.add_argument("--threads", type=int, default=1, metavar="N", help="CPU threads for the network (default 1)")
    args = p.parse_args(argv)
    if args.threads < 1:
        p.error(f"--threads must be at least 1, got {args.threads}")
    if args.top < 1:
        p.error(f"--top must be at least 1, got {args.top}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """0 when every image was classified, 1 when any could not be read, 2 when the model cannot be loaded."""
    args = parse_args(argv)
    # Before Paddle loads (in Predictor.load): its C++ INFO lines and a build-tool warning would bury the results and
    # errors on stderr.
    os.environ.setdefault("GLOG_minloglevel", "2")
    warnings.filterwarnings("ignore", message="No ccache found")
    try:
        predictor = Predictor.load(args.model, backend=args.backend, threads=args.threads)
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    results = predict_images(predictor, args.image, args.top, args.invert)
    for r in results:
        if "error" in r:
            print(f"error: {r['image']}: {r['error']}", file=sys.stderr)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for r in results:
            if "error" not in r:
                print(format_text(r))
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())

"""A trained run's network with its weights, built as the run built it: paddle_mnist.load_model(OUTPUT_DIR)."""

from __future__ import annotations

import os
from pathlib import Path

import paddle

from paddle_mnist.config import CONFIG_FILE, image_shape, load_config
from paddle_mnist.files.checkpoint import WHICH, CheckpointError, load, set_weights
from paddle_mnist.network.models import build_model


def load_model(output_dir: str | os.PathLike, which: str = "last") -> paddle.nn.Layer:
    """The run's network in eval mode with its weights: model.pdparams (which="last") or model_best.pdparams
    ("best"), built as the run built it from its config.json (model, classes, channels and image size).

    Raises CheckpointError, one line, when a file is missing or damaged or the weights do not fit the network.
    """
    if which not in WHICH:
        raise ValueError(f"which must be one of {', '.join(WHICH)}, not {which!r}")
    out = Path(output_dir)
    if not (out / CONFIG_FILE).is_file():
        raise CheckpointError(
            f"{out}: no {CONFIG_FILE} here; pass a run's output directory (the trainer's --output-dir)"
        )
    cfg = load_config(out / CONFIG_FILE)
    net = build_model(cfg.model, len(cfg.classes), image_shape(cfg))
    path = out / WHICH[which]
    fix = (
        f"they are not the weights of the run its {CONFIG_FILE} describes (--model {cfg.model}, "
        f"{len(cfg.classes)} classes, images {image_shape(cfg)}): keep each run's {CONFIG_FILE} and weights together"
    )
    set_weights(net, load(path), path, fix)
    net.eval()
    return net

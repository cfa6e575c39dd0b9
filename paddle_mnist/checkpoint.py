"""Checkpoints and weights: written to a temporary file and renamed, so a crash never leaves half a file."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

import paddle

CKPT_DIR = "checkpoints"
CKPT_NAME = re.compile(r"^step_(\d+)\.pdckpt$")


def save_atomic(obj: object, path: Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        paddle.save(obj, str(tmp))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def checkpoint_path(output_dir: Path, step: int) -> Path:
    """Named by optimizer step, so epoch-end and mid-epoch checkpoints sort together."""
    return Path(output_dir) / CKPT_DIR / f"step_{step:08d}.pdckpt"


def list_checkpoints(output_dir: Path) -> list[Path]:
    folder = Path(output_dir) / CKPT_DIR
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := CKPT_NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def prune(output_dir: Path, keep: int) -> None:
    for old in list_checkpoints(output_dir)[:-keep]:
        old.unlink(missing_ok=True)


def load(path: Path) -> dict:
    return paddle.load(str(path))


def digest(model: paddle.nn.Layer) -> str:
    """SHA-256 of every parameter and buffer, in name order: equal digests mean bit-identical weights."""
    h = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(value.numpy().tobytes())
    return h.hexdigest()

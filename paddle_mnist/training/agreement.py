"""Every rank agrees on the job before it trains: the flags, the code, Paddle, the convolutions and the data.

Ranks started with different commands (another --lr on one machine, an older checkout on another) would train
apart, hang in a collective of another size, or abort inside gloo. Each rank gathers every rank's facts and, where
one differs from rank 0's, every rank stops with the same line naming it and both values.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from pathlib import Path

import numpy as np
import paddle

from paddle_mnist.config import Config, ConfigError
from paddle_mnist.runtime import distributed
from paddle_mnist.runtime.distributed import DistEnv

# flags a machine may set for itself: where its files (and label files) are, and how many of its cores to use
PER_MACHINE = frozenset({"data_dir", "labels", "val_labels", "test_labels", "output_dir", "cpu_threads"})
PACKAGE = Path(__file__).resolve().parents[1]  # the whole package, every room


@functools.cache
def code_digest() -> str:
    """A digest of this package's sources (Python and C++): two checkouts that differ anywhere differ here."""
    h = hashlib.sha256()
    for path in sorted(p for p in PACKAGE.rglob("*") if p.suffix in (".py", ".cc", ".h") and p.is_file()):
        h.update(str(path.relative_to(PACKAGE)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def job_facts(cfg: Config, convolutions: str) -> dict[str, object]:
    """What must be the same on every rank before the data is read: each flag but PER_MACHINE's, and the code."""
    facts: dict[str, object] = {
        f"--{f.name.replace('_', '-')}": getattr(cfg, f.name)
        for f in dataclasses.fields(cfg)
        if f.name not in PER_MACHINE and f.name not in ("classes", "from_recipe", "unset")
    }
    facts["paddle_mnist's code (a digest of its sources)"] = code_digest()
    facts["Paddle's version"] = paddle.__version__
    facts["the convolutions"] = convolutions
    return facts


def data_facts(cfg: Config, images: np.ndarray, labels: np.ndarray) -> dict[str, object]:
    """What must be the same once the data is loaded: the classes, the image size and the training images."""
    h = hashlib.sha256()
    for lo in range(0, len(images), 4096):  # memory-mapped: read a block at a time
        h.update(np.ascontiguousarray(images[lo : lo + 4096]).data)
    h.update(np.ascontiguousarray(labels).data)
    return {
        "the classes": tuple(cfg.classes),
        "the image size": f"{cfg.image_size} ({cfg.channels} channels)" if cfg.image_size else "the dataset's",
        "the training images (a digest of their pixels and labels)": h.hexdigest()[:16],
    }


def disagreement(facts_by_rank: list[dict[str, object]]) -> str | None:
    """The line naming the first fact on which a rank differs from rank 0 (and every such rank), or None."""
    first = facts_by_rank[0]
    for name in first:
        others = {r: f.get(name) for r, f in enumerate(facts_by_rank) if f.get(name) != first[name]}
        if others:
            theirs = "; ".join(f"{_shown(v)} on rank {r}" for r, v in others.items())
            return (
                f"the ranks disagree on {name}: {_shown(first[name])} on rank 0, {theirs}; start every machine with "
                "the same command, code, Paddle and data (only --data-dir, the label files, --output-dir and "
                "--cpu-threads may differ)"
            )
    return None


def _shown(value: object) -> str:
    return "(not set)" if value is None else repr(value) if isinstance(value, str) else str(value)


def agree(facts: dict[str, object], env: DistEnv) -> None:
    """Raise ConfigError on every rank, with the same line, unless every rank's facts equal rank 0's."""
    if env.world_size == 1:
        return
    if problem := disagreement(distributed.gather_objects(facts, env)):
        raise ConfigError(problem)

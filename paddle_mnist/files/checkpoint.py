"""Checkpoints and weights: written atomically with a SHA-256 beside them, read back without running code, and
loaded only into a network they fit."""

from __future__ import annotations

import hashlib
import os
import pickle
import re
from pathlib import Path

import numpy as np
import paddle

from paddle_mnist.files import atomic, safeload

CKPT_DIR = "checkpoints"
CKPT_NAME = re.compile(r"^step_(\d+)\.pdckpt$")
DIGEST_SUFFIX = ".sha256"  # sha256sum's format, so `sha256sum -c step_00000064.pdckpt.sha256` checks one by hand
ASIDE_SUFFIX = ".damaged"
NAME_TABLE = "StructuredToParameterName@@"  # paddle.save's key for the tensor names of a bare state dict
WEIGHTS = "model.pdparams"  # a run's last weights, in its output directory
BEST_WEIGHTS = "model_best.pdparams"  # the weights of the epoch with the highest validation accuracy
WHICH = {"last": WEIGHTS, "best": BEST_WEIGHTS}
LOAD_MODEL_FIX = "build the network as the run did: paddle_mnist.load_model(OUTPUT_DIR) reads its config.json"


class CheckpointError(ValueError):
    """A checkpoint or weights file that is missing, damaged, or holds something other than plain data."""


class WriteError(OSError):
    """A file could not be written; the message names it and the system's reason. No partial file is left."""


def digest_path(path: Path) -> Path:
    path = Path(path)
    return path.with_name(path.name + DIGEST_SUFFIX)


def save_atomic(obj: object, path: Path) -> None:
    """paddle.save to a temporary file, then its SHA-256 beside it, then rename (atomic.atomic_path): a crash, a
    full disk or a signal never leaves half a file under the real name, and never touches the files already there.

    The digest is renamed into place first: a checkpoint never appears without its digest.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic.atomic_path(path) as tmp:
            paddle.save(obj, str(tmp))  # wants a file name, not a file object
            atomic.sync(tmp)  # on disk before its digest is
            digest = hashlib.sha256(tmp.read_bytes()).hexdigest()
            # in place before the checkpoint, which is renamed when this block ends
            atomic.write_bytes(digest_path(path), f"{digest}  {path.name}\n".encode(), fsync=True)
    except OSError as e:
        raise WriteError(e.errno, e.strerror or str(e)) from e  # the system's reason; the caller names the file


def checkpoint_path(output_dir: Path, step: int) -> Path:
    """Named by optimizer step, so epoch-end and mid-epoch checkpoints sort together."""
    return Path(output_dir) / CKPT_DIR / f"step_{step:08d}.pdckpt"


def list_checkpoints(output_dir: Path) -> list[Path]:
    folder = Path(output_dir) / CKPT_DIR
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := CKPT_NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def step_of(path: Path) -> int:
    return int(CKPT_NAME.match(Path(path).name).group(1))


def set_aside(path: Path) -> Path:
    """Rename a damaged checkpoint (and its digest) out of the way, never deleting it; the new name."""
    path = Path(path)
    aside = path.with_name(path.name + ASIDE_SUFFIX)
    n = 1
    while aside.exists():
        n += 1
        aside = path.with_name(f"{path.name}{ASIDE_SUFFIX}{n}")
    os.replace(path, aside)
    if digest_path(path).exists():
        os.replace(digest_path(path), digest_path(aside))
    return aside


def _check_digest(path: Path, data: bytes) -> None:
    """Files written before digests existed have none: they are trusted as far as the restricted loader goes."""
    try:
        recorded = digest_path(path).read_text().split()[0]
    except FileNotFoundError:
        return
    except (OSError, IndexError) as e:
        raise CheckpointError(f"{path}: its digest {digest_path(path).name} is unreadable ({e})") from e
    actual = hashlib.sha256(data).hexdigest()
    if actual != recorded:
        # every pickle ends with its STOP opcode: without it the file was cut short
        damage = "corrupt" if data.endswith(pickle.STOP) else f"truncated ({len(data)} bytes, cut short)"
        raise CheckpointError(
            f"{path}: {damage}: its SHA-256 {actual[:12]}... does not match {recorded[:12]}... "
            f"in {digest_path(path).name}"
        )


def _to_tensors(obj: object) -> object:
    """paddle.save writes a tensor as (name, ndarray); turn those back into tensors, as paddle.load does."""
    if isinstance(obj, tuple) and len(obj) == 2 and isinstance(obj[0], str) and isinstance(obj[1], np.ndarray):
        t = paddle.to_tensor(obj[1])
        t.name = obj[0]
        return t
    if isinstance(obj, dict):
        return type(obj)((k, _to_tensors(v)) for k, v in obj.items())
    if isinstance(obj, list):
        return [_to_tensors(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_to_tensors(v) for v in obj)
    return obj


def load(path: Path) -> dict:
    """A checkpoint or weights file written by save_atomic (or paddle.save), checked against its digest and read
    by the restricted unpickler: dicts, lists, tuples, strings, numbers, arrays, tensors and RNG states only.

    Raises CheckpointError, one line naming the file and what is wrong (damaged, or refused before it could run).
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e.strerror or e})") from e
    _check_digest(path, data)
    try:
        state = safeload.loads(data, safeload.CHECKPOINT, encoding="latin1")  # as paddle.load reads them
    except safeload.Refused as e:
        raise CheckpointError(f"{path}: {e}; a checkpoint holds only tensors, arrays and plain values") from e
    except Exception as e:  # a damaged pickle fails in many ways: EOFError, UnpicklingError, ValueError, ...
        first = (str(e).strip().splitlines() or [""])[0]
        raise CheckpointError(f"{path}: unreadable, truncated or corrupt ({type(e).__name__}: {first})") from e
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: holds a {type(state).__name__}, not a dict of weights or a checkpoint")
    if NAME_TABLE in state:  # paddle.save of a bare state dict (model.pdparams): arrays, their names in a table
        names = state.pop(NAME_TABLE)
        for key, name in names.items():
            if isinstance(state.get(key), np.ndarray):
                state[key] = _to_tensors((name, state[key]))
        return state
    return _to_tensors(state)


def mismatches(net: paddle.nn.Layer, state: dict) -> list[str]:
    """Where state does not fit net, in the network's order, then the file's keys the network lacks."""
    expected, found = net.state_dict(), []
    for key, tensor in expected.items():
        if key not in state:
            found.append(f"{key} (shape {list(tensor.shape)} in the network) is not in the file")
        elif list(state[key].shape) != list(tensor.shape):
            found.append(f"{key} is {list(state[key].shape)} in the file and {list(tensor.shape)} in the network")
    return found + [f"{key} is in the file but not in the network" for key in state if key not in expected]


def set_weights(net: paddle.nn.Layer, state: dict, source: str | os.PathLike, fix: str = LOAD_MODEL_FIX) -> None:
    """net.set_state_dict(state) when every name and shape fits, else CheckpointError naming the first mismatch.

    Paddle's own set_state_dict only prints "Skip loading for ..." for a tensor that does not fit and goes on,
    leaving it as it was: random, in a network just built.
    """
    found = mismatches(net, state)
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise CheckpointError(f"{source}: the weights do not fit this {type(net).__name__}: {found[0]}{more}; {fix}")
    net.set_state_dict(state)


def digest(model: paddle.nn.Layer) -> str:
    """SHA-256 of every parameter and buffer, in name order: equal digests mean bit-identical weights."""
    return digest_state(model.state_dict())


def digest_state(state: dict) -> str:
    """digest() of a state dict, as model.state_dict() gives it or load() reads it from a weights file."""
    h = hashlib.sha256()
    for name, value in sorted(state.items()):
        h.update(name.encode())
        h.update(value.numpy().tobytes())
    return h.hexdigest()

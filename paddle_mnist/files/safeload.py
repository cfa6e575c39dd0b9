"""One restricted unpickler for every pickle the project reads: data batches and checkpoints never run code."""

from __future__ import annotations

import importlib
import io
import pickle
from collections import OrderedDict
from collections.abc import Callable

import numpy as np


class Refused(pickle.UnpicklingError):
    """The pickle asked for something outside the allowed list; the message names it."""


def _latin1_bytes(text: str, encoding: str = "latin1") -> bytes:
    """How a protocol-2 pickle written by Python 3 spells bytes; only that use of codecs is admitted."""
    if not isinstance(text, str) or encoding.replace("-", "") != "latin1":
        raise Refused(f"refused to load _codecs.encode with {encoding!r}: only latin1 text is bytes")
    return text.encode("latin1")


def _numpy_attr(name: str):
    for module in ("numpy._core.multiarray", "numpy.core.multiarray"):  # numpy 2, numpy 1
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
    raise Refused(f"this numpy has no {name}")


# (module, name) -> a function returning the object to admit. Nothing here can run code chosen by the file:
# arrays are rebuilt from their dtype and raw bytes, containers from their items.
NUMPY = {
    ("numpy", "ndarray"): lambda: np.ndarray,
    ("numpy", "dtype"): lambda: np.dtype,
    ("numpy.core.multiarray", "_reconstruct"): lambda: _numpy_attr("_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"): lambda: _numpy_attr("_reconstruct"),
    ("numpy.core.multiarray", "scalar"): lambda: _numpy_attr("scalar"),
    ("numpy._core.multiarray", "scalar"): lambda: _numpy_attr("scalar"),
    ("_codecs", "encode"): lambda: _latin1_bytes,
}  # the CIFAR-10 batches were pickled by Python 2 (protocol 2): arrays come back through _reconstruct


def _generator_state():
    import paddle  # only checkpoints need it; the data readers stay free of Paddle

    return paddle.base.libpaddle.GeneratorState


# What paddle.save writes for a checkpoint: a tensor as tuple((name, ndarray)), a state dict as an OrderedDict,
# Paddle's RNG state as a GeneratorState rebuilt from numbers. Not builtins.eval, which paddle.save uses only
# for static-graph DenseTensors (never in these files) and which would run any code.
CHECKPOINT = {
    **NUMPY,
    ("builtins", "tuple"): lambda: tuple,
    ("collections", "OrderedDict"): lambda: OrderedDict,
    ("paddle.base.libpaddle", "GeneratorState"): _generator_state,
}


class _RestrictedUnpickler(pickle.Unpickler):
    """Everything callable in a pickle goes through find_class, so refusing here means a crafted file cannot
    make the loader import or call anything else (os.system, eval, ...)."""

    def __init__(self, file, allowed: dict[tuple[str, str], Callable[[], object]], **kwargs):
        super().__init__(file, **kwargs)
        self.allowed = allowed

    def find_class(self, module: str, name: str):
        make = self.allowed.get((module, name))
        if make is None:
            raise Refused(f"refused to load {module}.{name}: the file may try to run code")
        return make()


def loads(data: bytes, allowed: dict[tuple[str, str], Callable[[], object]], encoding: str = "ASCII") -> object:
    """Unpickle data admitting only the globals in allowed; Refused names the first other one."""
    return _RestrictedUnpickler(io.BytesIO(data), allowed, encoding=encoding).load()

"""Load an exported model once, then classify batches of images: Paddle Inference, paddle.jit or ONNX Runtime."""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Callable, Union

import numpy as np
from PIL import Image

from paddle_mnist.datasets import preprocess
from paddle_mnist.deploy import export
from paddle_mnist.runtime import cpu

BACKENDS = ("auto", "inference", "jit", "onnx")
BATCH = 256  # images per forward pass, so memory stays flat however many images are given
ImageLike = Union[str, os.PathLike, Image.Image, np.ndarray]
FIRST_AXIS_CHANNELS = (1, 3)  # (C, H, W): grey or RGB, as the network itself takes them
LAST_AXIS_CHANNELS = (1, 3, 4)  # (H, W, C): grey, RGB or RGBA, as Pillow and most image libraries hold them
ONE_IMAGE = "(H, W), (H, W, C) with C 1, 3 or 4, or (C, H, W) with C 1 or 3"


def softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z -= z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def normalise(pixels: np.ndarray, meta: dict) -> np.ndarray:
    """float32 network input from uint8 (N, C, H, W) pixels, as the contract in the metadata says."""
    c = len(meta["mean"])
    mean = np.asarray(meta["mean"], np.float32).reshape(1, c, 1, 1)
    std = np.asarray(meta["std"], np.float32).reshape(1, c, 1, 1)
    return (pixels.astype(np.float32) * np.float32(1 / 255) - mean) / std


def as_uint8(array: np.ndarray) -> np.ndarray:
    """uint8 pixels from uint8 or floats in [0, 1]; anything else is refused, never clipped: 0-255 floats clipped
    to [0, 1] turn almost every stroke white, and the model still answers, wrongly."""
    if array.dtype == np.uint8:
        return array
    if not np.issubdtype(array.dtype, np.floating):
        raise TypeError(
            f"image arrays must be uint8 pixels (0-255) or floats in [0, 1], not {array.dtype}: "
            "pass array.astype(np.uint8) for 0-255 values"
        )
    if array.size:
        lo, hi = float(np.min(array)), float(np.max(array))
        if np.isnan(lo) or np.isnan(hi):
            raise ValueError("float pixels hold NaN: pass floats in [0, 1] or uint8 pixels (0-255)")
        if lo < 0 or hi > 1:
            raise ValueError(
                f"float pixels must lie in [0, 1], and these span {lo:g} to {hi:g}: divide 0-255 values by 255 "
                "(or pass them as uint8), values of another range by its maximum"
            )
    return np.rint(array * 255).astype(np.uint8)


def one_image(array: np.ndarray, image_shape: Sequence[int]) -> np.ndarray:
    """One image's array as the model's (C, H, W), or as (H, W) or (H, W, C) for Pillow to convert and resize.

    A 3-D array is (C, H, W) when its first axis is a channel count and its last is not; else (H, W, C). The
    model's own (C, H, W) passes as it is.
    """
    if array.shape == tuple(image_shape):
        return array
    if array.ndim == 3:
        first, last = array.shape[0] in FIRST_AXIS_CHANNELS, array.shape[2] in LAST_AXIS_CHANNELS
        if first and not last:
            array = array.transpose(1, 2, 0)
        elif not last:
            raise ValueError(
                f"an image array must be {ONE_IMAGE}, not of shape {array.shape}; "
                "a batch is a list of images or an (N, H, W, C) or (N, C, H, W) array"
            )
        if array.shape[2] == 1:
            array = array[:, :, 0]
    elif array.ndim != 2:
        raise ValueError(
            f"an image array must be {ONE_IMAGE}, or a batch (N, H, W, C) or (N, C, H, W), not of shape {array.shape}"
        )
    return array


def split_batch(array: np.ndarray, image_shape: Sequence[int]) -> list[np.ndarray]:
    """An array given as the images argument, as the images it holds (docs/deploy.md, "Arrays").

    4-D is a batch and 2-D one image. A 3-D array is one image for a colour model, and for a grey model a batch of
    N grey images (N, H, W), the idx files' own layout, unless an end axis of 1 makes it one image, (1, H, W) or
    (H, W, 1). For a grey model (3, H, W) and (H, W, 3 or 4) are refused: each could be one colour image or that
    many grey images, and either guess answers for the wrong number of images without a word.
    """
    if array.ndim == 4:
        return list(array)
    if array.ndim != 3 or image_shape[0] != 1 or array.shape == tuple(image_shape):
        return [array]
    n, h, w = array.shape
    if w in (3, 4):
        raise ValueError(
            f"a {array.shape} array is ambiguous for this grey model: one colour image (H, W, {w}) or {w} grey "
            f"images of {n}x{h} stacked on the last axis; add a batch axis, shape (1, {n}, {h}, {w}), for one "
            "colour image, or pass the grey images as (N, H, W) (np.moveaxis(array, -1, 0)) or a list of 2-D arrays"
        )
    if n == 3:
        raise ValueError(
            f"a {array.shape} array is ambiguous for this grey model: 3 grey images of {h}x{w} or one colour image "
            f"(C, H, W); pass the grey images as a list of 2-D arrays or shape (3, {h}, {w}, 1), or add a batch "
            f"axis, shape (1, 3, {h}, {w}), for one colour image"
        )
    if n == 1 or w == 1:
        return [array]
    return list(array)


def _inference_runner(prefix: Path, meta: dict, threads: int, device: str) -> Callable[[np.ndarray], np.ndarray]:
    """Paddle Inference (oneDNN on for the CPU): the engine Paddle ships for deployment."""
    # here, not at the top: Paddle loads only once a backend is chosen, after predict.main has quieted its log
    from paddle import inference

    program, params = export.program_files(meta["files"])
    config = inference.Config(str(prefix.parent / program), str(prefix.parent / params))
    config.disable_glog_info()
    if device.startswith("gpu"):
        config.enable_use_gpu(256, int(device.partition(":")[2] or 0))
    else:
        config.disable_gpu()
        config.enable_mkldnn()
        config.set_cpu_math_library_num_threads(threads)
    predictor = inference.create_predictor(config)
    source = predictor.get_input_handle(predictor.get_input_names()[0])
    sink = predictor.get_output_handle(predictor.get_output_names()[0])

    def run(x: np.ndarray) -> np.ndarray:
        source.reshape(list(x.shape))
        source.copy_from_cpu(np.ascontiguousarray(x))
        predictor.run()
        return sink.copy_to_cpu()

    return run


def _jit_runner(prefix: Path, meta: dict, threads: int, device: str) -> Callable[[np.ndarray], np.ndarray]:
    """The exported program through paddle.jit.load in dygraph: no inference engine needed."""
    import paddle  # here, not at the top: as _inference_runner

    paddle.set_device(device)
    if device == "cpu":
        paddle.base.core.set_num_threads(threads)
    layer, _ = export.load_exported(prefix)

    def run(x: np.ndarray) -> np.ndarray:
        with paddle.no_grad():
            return layer(paddle.to_tensor(x)).numpy()

    return run


def _onnx_runner(prefix: Path, meta: dict, threads: int, device: str) -> Callable[[np.ndarray], np.ndarray]:
    """ONNX Runtime on the file python -m paddle_mnist.export --onnx wrote."""
    try:
        import onnxruntime
    except ImportError as e:
        raise export.ExportError("the onnx backend needs ONNX Runtime: pip install -r requirements-onnx.txt") from e
    onnx_file = export.onnx_path(prefix)
    if "onnx" not in meta or not onnx_file.is_file():
        raise export.ExportError(
            f"{prefix}: no ONNX model here ({onnx_file.name} is missing); convert first: "
            f"python -m paddle_mnist.export --onnx {prefix}"
        )
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    session = onnxruntime.InferenceSession(str(onnx_file), options, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return lambda x: session.run(None, {name: x})[0]


RUNNERS = {"inference": _inference_runner, "jit": _jit_runner, "onnx": _onnx_runner}


class Predictor:
    """An exported model, loaded once: `Predictor.load("output/inference").predict(["shoe.png"])`.

    It takes image files, PIL images or arrays (uint8 pixels 0-255, or floats in [0, 1]; the shapes it takes and
    refuses: split_batch and one_image, and the table in docs/deploy.md), turns each into the model's pixels with
    the trainer's preprocessing, and runs them in batches of up to 256.
    """

    def __init__(self, prefix: Path, meta: dict, backend: str, run: Callable[[np.ndarray], np.ndarray]):
        self.prefix, self.meta, self.backend, self._run = prefix, meta, backend, run

    @classmethod
    def load(cls, prefix: str | os.PathLike, backend: str = "auto", threads: int = 1, device: str = "cpu") -> Predictor:
        """backend: "inference" (Paddle Inference), "jit" (paddle.jit.load), "onnx" (ONNX Runtime, after
        python -m paddle_mnist.export --onnx), or "auto": Paddle Inference, else paddle.jit. A folder is read as
        FOLDER/inference. ExportError says what is missing or unreadable."""
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
        prefix = Path(prefix)
        if prefix.is_dir():
            prefix = prefix / "inference"
        meta = export.read_export(prefix)
        warnings.filterwarnings("ignore", message="No ccache found")  # import paddle's note about building C++
        cpu.prefer_fast_kernels()  # the trainer's MKL setting; MKL reads it at its first call, which comes later
        cpu.steady_malloc()  # the trainer's malloc setting too
        if backend != "auto":
            return cls(prefix, meta, backend, RUNNERS[backend](prefix, meta, threads, device))
        try:
            return cls(prefix, meta, "inference", _inference_runner(prefix, meta, threads, device))
        except Exception:  # an export Paddle Inference cannot take: the dygraph path still can
            return cls(prefix, meta, "jit", _jit_runner(prefix, meta, threads, device))

    @property
    def classes(self) -> list[str]:
        return list(self.meta["classes"])

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return tuple(self.meta["image_shape"])

    def pixels(self, image: ImageLike) -> np.ndarray:
        """One image as the model's uint8 (C, H, W) pixels; an array is one image here (layouts: one_image)."""
        background = tuple(self.meta.get("background", (0,)))
        c, h, w = self.image_shape
        if isinstance(image, (str, os.PathLike)):
            return preprocess.load_image(image, c, (w, h), background)
        if isinstance(image, Image.Image):
            return np.ascontiguousarray(preprocess.to_pixels(image, c, (w, h), background))
        array = one_image(as_uint8(np.asarray(image)), self.image_shape)
        if array.shape == (c, h, w):
            return array
        return np.ascontiguousarray(preprocess.to_pixels(Image.fromarray(array), c, (w, h), background))

    def _images(self, images: ImageLike | Sequence[ImageLike]) -> list[ImageLike]:
        if isinstance(images, np.ndarray):
            return split_batch(images, self.image_shape)
        if isinstance(images, (str, os.PathLike, Image.Image)):
            return [images]
        return list(images)

    def logits(self, pixels: np.ndarray) -> np.ndarray:
        """The network's output for uint8 (N, C, H, W) pixels: logits, (N, classes)."""
        out = [self._run(normalise(pixels[lo : lo + BATCH], self.meta)) for lo in range(0, len(pixels), BATCH)]
        return np.concatenate(out) if out else np.zeros((0, len(self.classes)), np.float32)

    def probabilities(self, images: ImageLike | Sequence[ImageLike]) -> np.ndarray:
        """Class probabilities (softmax of the logits), (N, classes), in the order given."""
        items = self._images(images)
        return softmax(self.logits(np.stack([self.pixels(i) for i in items]) if items else np.zeros((0,))))

    def predict(self, images: ImageLike | Sequence[ImageLike], top: int = 3) -> list[list[dict]]:
        """Per image, its `top` most likely classes: [{"class": index, "name": name, "probability": p}, ...]."""
        probs = self.probabilities(images)
        best = np.argsort(-probs, axis=1, kind="stable")[:, : min(top, len(self.classes))]
        return [
            [{"class": int(k), "name": self.classes[k], "probability": float(p[k])} for k in row]
            for p, row in zip(probs, best)
        ]

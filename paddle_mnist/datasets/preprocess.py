"""The one preprocessing function from an image file to network input pixels: training, evaluation and predict."""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

MODES = {1: "L", 3: "RGB"}
BACKGROUND = 255  # transparent pixels are flattened onto white, as an image viewer shows them
RESAMPLE = Image.Resampling.BILINEAR  # Pillow widens the filter when shrinking, so it averages (no aliasing)
VERSION = 2  # raise when the pixels this module makes change: folder caches built before are then rebuilt
# 2: JPEG files at least twice the size asked for are decoded at a reduced scale (Image.draft) before the resize
SIXTEEN_BIT = ("I;16", "I;16B", "I;16L", "I;16N", "I")  # 16-bit grey (PNG, TIFF) opens as one of these
GREY_MODES = ("1", "L", "LA", "La", "F", *SIXTEEN_BIT)
UNREADABLE = (OSError, SyntaxError, ValueError, Image.DecompressionBombError)  # what Pillow raises on bad files


def open_image(path: str | os.PathLike) -> Image.Image:
    """Image.open with a decompression bomb (more pixels than Image.MAX_IMAGE_PIXELS) an error, not a warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            return Image.open(path)
        except Image.DecompressionBombWarning as e:
            raise Image.DecompressionBombError(str(e)) from None


def is_grey(im: Image.Image) -> bool:
    """A grey image by its mode (a palette image counts as colour: its palette may hold any colour)."""
    return im.mode in GREY_MODES


def _eight_bit(im: Image.Image) -> Image.Image:
    """16-bit grey scaled to 8 bits (Pillow's own convert('L') would clip everything above 255 to white)."""
    if im.mode in SIXTEEN_BIT:
        wide = np.asarray(im, dtype=np.float64)
        return Image.fromarray(np.clip(np.rint(wide / 257.0), 0, 255).astype(np.uint8), "L")
    if im.mode == "F":  # floating-point grey: taken as 0..255
        return Image.fromarray(np.clip(np.rint(np.asarray(im)), 0, 255).astype(np.uint8), "L")
    return im


def to_pixels(
    im: Image.Image, channels: int, size: tuple[int, int], background: Sequence[int] = (BACKGROUND,)
) -> np.ndarray:
    """uint8 (C, H, W) for a model of `channels` channels and size (width, height), from an open Pillow image.

    In order: the first frame (GIF, WebP, TIFF); upright by the EXIF orientation; 16-bit grey scaled to 8 bits;
    transparency (alpha, or a palette's transparent colour) composited onto `background` (one value for every
    channel, or one per channel; white, BACKGROUND, for a folder's images); converted to grey (ITU-R 601
    luma) or RGB; resized to exactly width x height with a bilinear filter (stretched: the aspect ratio is not
    kept, and nothing is cropped away), a large JPEG decoded at a reduced scale first.
    """
    if channels not in MODES:
        raise ValueError(f"models of {channels} channels are not supported; 1 (grey) or 3 (RGB) are")
    im.seek(0)
    if im.format == "JPEG":
        # libjpeg decodes at 1/2, 1/4 or 1/8 scale, still at least this large on both sides (whatever the EXIF
        # rotation), for a fraction of the time and memory of a phone photo's full size; the resize does the rest
        im.draft(im.mode, (max(size), max(size)))
    im = ImageOps.exif_transpose(im)
    im = _eight_bit(im)
    if im.mode in ("P", "PA", "LA", "La", "RGBA", "RGBa") or "transparency" in im.info:
        rgba = im.convert("RGBA")
        fill = tuple(int(v) for v in background) * (3 if len(background) == 1 else 1)
        im = Image.new("RGBA", rgba.size, (*fill, 255))
        im.alpha_composite(rgba)
    im = im.convert(MODES[channels])
    if im.size != tuple(size):
        im = im.resize(tuple(size), RESAMPLE)
    pixels = np.asarray(im, dtype=np.uint8)
    width, height = size
    return pixels.reshape(height, width, channels).transpose(2, 0, 1)


def load_image(
    path: str | os.PathLike, channels: int, size: tuple[int, int], background: Sequence[int] = (BACKGROUND,)
) -> np.ndarray:
    """to_pixels of the image file at path; Pillow's exceptions (OSError, ValueError, ...) pass through."""
    with open_image(path) as im:
        return np.ascontiguousarray(to_pixels(im, channels, size, background))


def why_unreadable(e: Exception) -> str:
    """Pillow's or the system's exception on opening or decoding a file, in a few words."""
    if isinstance(e, FileNotFoundError):
        return "no such file"
    if isinstance(e, IsADirectoryError):
        return "is a directory, not an image file"
    if isinstance(e, PermissionError):
        return "permission denied"
    if isinstance(e, UnidentifiedImageError):
        return "not an image Pillow can read"
    if isinstance(e, Image.DecompressionBombError):
        return f"a decompression bomb ({e})"
    return f"cannot read the image ({type(e).__name__}: {e})"

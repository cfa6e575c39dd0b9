"""--whiten: the first convolution starts as a whitening of the training images' patches, on real images."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np
import paddle
import pytest
from helpers import explain, run_single
from PIL import Image

from paddle_mnist.datasets import data
from paddle_mnist.network import whiten
from paddle_mnist.network.models import build_model

CIFAR_JPEG = Path(__file__).resolve().parents[2] / "shared" / "data" / "cifar10-jpeg" / "cifar10-jpeg.tar.gz"


def cifar_images(every: int) -> np.ndarray:
    """uint8 (N, 3, 32, 32): every `every`th training JPEG of the CIFAR-10 copy (its classes one after another),
    read from its archive."""
    found = []
    with tarfile.open(CIFAR_JPEG) as tar:
        names = (m for m in tar if m.isfile() and m.name.startswith("train/") and m.name.endswith(".jpg"))
        for k, member in enumerate(names):
            if k % every == 0:
                image = Image.open(io.BytesIO(tar.extractfile(member).read())).convert("RGB")
                found.append(np.asarray(image).transpose(2, 0, 1))
    return np.stack(found)


def whitened_outputs(model, images: np.ndarray, mean, std) -> np.ndarray:
    """The first convolution's outputs (without padding) on images, one row per filter, one column per place."""
    conv = whiten.first_conv(model)
    x = paddle.to_tensor(data.normalise(images, mean, std))
    y = paddle.nn.functional.conv2d(x, conv.weight).numpy()
    return y.transpose(1, 0, 2, 3).reshape(y.shape[1], -1)


def check_whitened(images: np.ndarray, mean, std, directions: int) -> None:
    model = build_model("cifar_fast", 10, images.shape[1:])
    seen, unseen = images[0::2], images[1::2]
    said = whiten.whiten(model, seen, mean, std)
    assert f"{model.STEM} filters" in said and f"{min(len(seen), whiten.IMAGES):,} training images" in said
    for images_, tolerance in ((seen, 0.02), (unseen, 0.1)):  # unseen: close eigenvalues trade variance
        leading = np.cov(whitened_outputs(model, images_, mean, std))[:directions, :directions]
        if tolerance < 0.05:  # on the images it was computed from: unit variance and uncorrelated in every direction
            np.testing.assert_allclose(np.diag(leading), 1.0, atol=tolerance)
            assert np.abs(leading - np.diag(np.diag(leading))).max() < 0.01
        else:  # on images it did not see: the same in the whole
            assert abs(np.diag(leading).mean() - 1.0) < tolerance
    weights = whiten.first_conv(model).weight.numpy().reshape(model.STEM, -1)
    d = weights.shape[1]  # more filters than directions: the leading ones again, sign flipped
    np.testing.assert_array_equal(weights[d:], -weights[: model.STEM - d])


def test_the_first_convolution_whitens_real_mnist_patches():
    ds = data.load_dataset("mnist")
    # of 9 directions, the last few have almost no variance in digits (EPS keeps them from being blown up)
    check_whitened(ds.train.images[: 2 * whiten.IMAGES], ds.mean, ds.std, directions=6)


@pytest.mark.skipif(not CIFAR_JPEG.exists(), reason=f"the CIFAR-10 JPEG copy is not at {CIFAR_JPEG}")
def test_the_first_convolution_whitens_real_cifar10_patches():
    images = cifar_images(every=12)  # 4,167 of the 50,000, every class
    mean = tuple(float(m) for m in images.mean(axis=(0, 2, 3)) / 255)
    std = tuple(float(s) for s in images.std(axis=(0, 2, 3)) / 255)
    check_whitened(images, mean, std, directions=10)  # of 27: the finer-grained rest come near EPS


@pytest.mark.slow
def test_cifar_fasts_recipe_whitens_and_no_whiten_does_not(dataset, tmp_path):
    args = ["--data-dir", str(dataset), "--dataset", "mnist", "--model", "cifar_fast", "--max-steps", "3"]
    args += ["--eval-limit", "64"]
    on = run_single([*args, "--output-dir", str(tmp_path / "on")], cwd=tmp_path)
    assert on.returncode == 0, explain(on)
    assert "whitened: the first convolution's 32 filters start as the principal directions of" in on.stdout
    off = run_single([*args, "--no-whiten", "--output-dir", str(tmp_path / "off")], cwd=tmp_path)
    assert off.returncode == 0, explain(off)
    assert "whitened" not in off.stdout

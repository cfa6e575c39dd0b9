"""The exported inference model: predict, run as a user would, gives the in-memory answers and names bad inputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import paddle
import pytest
from helpers import CIFAR_CLASSES, REPO, make_colour_images, make_dataset
from PIL import Image

from paddle_mnist.datasets import data
from paddle_mnist.deploy import export, predict
from paddle_mnist.deploy.predictor import Predictor, softmax
from paddle_mnist.network.models import MnistCNN


def run_predict(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "paddle_mnist.predict", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


def logits_in_memory(net: paddle.nn.Layer, ds: data.Dataset, paths: list[Path]) -> np.ndarray:
    ground = export.background(ds.train.images)
    images = np.stack([predict.load_image(p, ds.image_shape, ground) for p in paths])
    net.eval()
    with paddle.no_grad():
        return net(paddle.to_tensor(data.normalise(images, ds.mean, ds.std))).numpy()


def assert_same_answers(printed: list[dict], logits: np.ndarray, paths: list[Path], classes) -> None:
    probs = softmax(logits)
    assert [r["image"] for r in printed] == [str(p) for p in paths]
    for result, p in zip(printed, probs):
        order = [t["class"] for t in result["top"]]
        assert order == list(np.argsort(-p, kind="stable")[:3])
        for t in result["top"]:
            assert t["name"] == classes[t["class"]]
            assert abs(t["probability"] - p[t["class"]]) < 1e-5


@pytest.fixture(scope="module")
def mnist(tmp_path_factory):
    """An exported, seeded MnistCNN on a small MNIST-format dataset, and a few image files of various kinds."""
    root = tmp_path_factory.mktemp("mnist")
    ds = data.load_dataset("mnist", str(make_dataset(root / "data", n_train=64, n_test=16)))
    paddle.seed(3)
    net = MnistCNN()
    net.train()
    export.export_inference(net, ds, root / "out" / "inference")
    assert net.training, "export must leave the network in the mode it found it"
    rng = np.random.RandomState(0)
    images = root / "images"
    images.mkdir()
    paths = [images / "grey28.png", images / "colour56x40.jpg", images / "palette.png", images / "rgba.png"]
    Image.fromarray(ds.test.images[0, 0]).save(paths[0])
    Image.fromarray(rng.randint(0, 256, (40, 56, 3), dtype=np.uint8)).save(paths[1], quality=90)
    Image.fromarray(ds.test.images[1, 0]).convert("P").resize((70, 70)).save(paths[2])
    rgba = rng.randint(0, 256, (33, 33, 4), dtype=np.uint8)
    Image.fromarray(rgba, "RGBA").save(paths[3])
    return root, ds, net, paths


@pytest.mark.slow
def test_export_then_predict_equals_the_network_in_memory(mnist):
    root, ds, net, paths = mnist
    meta = json.loads(export.meta_path(root / "out" / "inference").read_text())
    assert meta["classes"] == list(ds.classes) and meta["image_shape"] == [1, 28, 28]
    assert all((root / "out" / name).is_file() for name in meta["files"])
    assert not [p.name for p in (root / "out").iterdir() if ".tmp" in p.name], "temporary files left behind"

    proc = run_predict(["--model", str(root / "out" / "inference"), "--json", "--image", *map(str, paths)], cwd=root)
    assert proc.returncode == 0, proc.stderr
    assert not error_lines(proc)
    assert_same_answers(json.loads(proc.stdout), logits_in_memory(net, ds, paths), paths, ds.classes)


@pytest.mark.slow
def test_three_channel_model_takes_a_grey_image(tmp_path):
    images, labels = make_colour_images(32, seed=1)
    mean, std = data.channel_stats(images)
    split = data.Split(images, labels)
    ds = data.Dataset("cifar10", split, split, split, mean, std, tuple(CIFAR_CLASSES))
    paddle.seed(4)
    net = MnistCNN(in_channels=3, image_size=32)
    export.export_inference(net, ds, tmp_path / "out" / "inference")
    grey = tmp_path / "grey.png"
    Image.fromarray(np.random.RandomState(1).randint(0, 256, (50, 20), dtype=np.uint8)).save(grey)
    assert predict.load_image(grey, ds.image_shape).shape == (3, 32, 32)

    proc = run_predict(["--model", str(tmp_path / "out" / "inference"), "--image", str(grey), "--json"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert_same_answers(json.loads(proc.stdout), logits_in_memory(net, ds, [grey]), [grey], ds.classes)


@pytest.mark.slow
def test_unreadable_images_are_named_and_the_others_still_predicted(mnist):
    root, ds, net, paths = mnist
    missing, fake = root / "no-such.png", root / "fake.png"
    fake.write_text("not a picture\n")
    order = [paths[0], missing, fake, paths[1]]
    proc = run_predict(["--model", str(root / "out" / "inference"), "--json", "--image", *map(str, order)], cwd=root)
    assert proc.returncode == 1, proc.stderr
    errors = error_lines(proc)
    assert len(errors) == 2, proc.stderr
    assert str(missing) in errors[0] and "no such file" in errors[0]
    assert str(fake) in errors[1] and "not an image" in errors[1]
    results = json.loads(proc.stdout)
    assert [r["image"] for r in results] == [str(p) for p in order]
    assert "error" in results[1] and "error" in results[2]
    good = [results[0], results[3]]
    assert_same_answers(good, logits_in_memory(net, ds, [paths[0], paths[1]]), [paths[0], paths[1]], ds.classes)


@pytest.mark.slow
def test_missing_model_says_to_train_first(tmp_path):
    image = tmp_path / "a.png"
    Image.new("L", (28, 28)).save(image)
    proc = run_predict(["--model", str(tmp_path / "output" / "inference"), "--image", str(image)], cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), proc.stderr
    assert str(tmp_path / "output" / "inference") in lines[0] and "train first" in lines[0]


def test_incomplete_export_is_refused(mnist, tmp_path):
    root = mnist[0]
    meta = json.loads(export.meta_path(root / "out" / "inference").read_text())
    export.meta_path(tmp_path / "inference").write_text(json.dumps(meta))  # the meta without the files it lists
    with pytest.raises(export.ExportError, match="incomplete export"):
        export.load_exported(tmp_path / "inference")


@pytest.mark.slow
def test_plain_text_shows_class_names(mnist):
    root, ds, net, paths = mnist
    proc = run_predict(["--model", str(root / "out" / "inference"), "--image", str(paths[0]), "--top", "2"], cwd=root)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{paths[0]}: ")
    probs = softmax(logits_in_memory(net, ds, paths[:1]))[0]
    first, second = np.argsort(-probs, kind="stable")[:2]
    expected = f"{ds.classes[first]} ({first}): {100 * probs[first]:.1f}%, {ds.classes[second]} ({second}):"
    assert expected in lines[0]


def test_load_image_converts_mode_and_size(tmp_path):
    path = tmp_path / "wide.png"
    Image.new("RGB", (90, 30), (200, 100, 0)).save(path)
    grey = predict.load_image(path, (1, 28, 28))
    assert grey.shape == (1, 28, 28) and grey.dtype == np.uint8
    assert np.all(grey == round(0.299 * 200 + 0.587 * 100))  # Pillow's ITU-R 601-2 luma
    transparent = tmp_path / "clear.png"
    Image.new("RGBA", (28, 28), (0, 0, 0, 0)).save(transparent)
    assert np.all(predict.load_image(transparent, (1, 28, 28)) == 0)  # laid on the ground given: black by default
    assert np.all(predict.load_image(transparent, (3, 28, 28), (10, 20, 30)).reshape(3, -1).T == (10, 20, 30))


@pytest.mark.slow
def test_a_colour_model_reads_a_3d_array_as_one_image(tmp_path):
    """The colour column of the table in docs/deploy.md, "Arrays": (C, H, W) and (H, W, C) are one image, and an
    (N, H, W) array is refused (for a colour model a 3-D array is one image), its grey images taken as (N, H, W, 1)."""
    images, labels = make_colour_images(8, seed=2)  # (8, 3, 32, 32) uint8
    mean, std = data.channel_stats(images)
    split = data.Split(images, labels)
    ds = data.Dataset("cifar10", split, split, split, mean, std, tuple(CIFAR_CLASSES))
    paddle.seed(5)
    export.export_inference(MnistCNN(in_channels=3, image_size=32), ds, tmp_path / "inference")
    predictor = Predictor.load(tmp_path, backend="jit")
    chw = images[0]
    expected = predictor.probabilities(Image.fromarray(chw.transpose(1, 2, 0)))
    for form in (chw, chw.transpose(1, 2, 0), chw[None], [chw], chw.astype(np.float32) / 255):
        assert np.abs(predictor.probabilities(form) - expected).max() < 1e-6, getattr(form, "shape", form)
    rgba = np.dstack([chw.transpose(1, 2, 0), np.full((32, 32), 255, np.uint8)])  # opaque: the same image
    for form in (rgba, rgba[None]):
        assert np.abs(predictor.probabilities(form) - expected).max() < 1e-6

    grey = images[:5, 0]
    each = predictor.probabilities(list(grey))
    assert each.shape == (5, 10)
    assert np.abs(predictor.probabilities(grey[:, :, :, None]) - each).max() < 1e-6
    for one in (grey[0], grey[0][None], grey[0][:, :, None]):
        assert np.abs(predictor.probabilities(one) - each[:1]).max() < 1e-6
    with pytest.raises(ValueError, match=r"not of shape \(5, 32, 32\); a batch is a list of images or an \(N, H, W"):
        predictor.probabilities(grey)

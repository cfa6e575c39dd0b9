"""Deploying a trained export: the Predictor on each backend, the ONNX conversion, the contract, the docs' snippets."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import paddle
import pytest
from helpers import REPO, TRAIN_PY
from PIL import Image

from paddle_mnist import Predictor, load_model
from paddle_mnist.config import Config
from paddle_mnist.datasets import data
from paddle_mnist.deploy.predictor import softmax
from paddle_mnist.files import checkpoint
from paddle_mnist.network.models import build_model

PADDLE_3 = int(paddle.__version__.split(".")[0]) >= 3
HAS_ONNX = PADDLE_3 and all(importlib.util.find_spec(m) for m in ("paddle2onnx", "onnxruntime"))
NO_ONNX = (
    "paddle2onnx 2.1 has no wheel for this Python (3.8 to 3.12 only), so requirements-onnx.txt installs no converter"
    if PADDLE_3 and sys.version_info >= (3, 13)
    else "paddle2onnx and onnxruntime are not installed here (pip install -r requirements-onnx.txt; CI installs them "
    "beside Paddle 3.x)"
    if PADDLE_3
    else f"Paddle {paddle.__version__} writes .pdmodel exports, and paddle2onnx 2.1 reads Paddle 3.x's (inference.json)"
)
SHOE, SHIRT = 0, 4  # Fashion-MNIST test images 0 (an ankle boot) and 4 (a shirt)


def env() -> dict:
    """The caller's environment: the package as the README's set-up installs it, imported from any folder."""
    return {k: v for k, v in os.environ.items() if k != "GLOG_minloglevel"}


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env(), capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A default model trained for one short epoch by the real command, and two Fashion-MNIST test images."""
    root = tmp_path_factory.mktemp("deploy")
    args = ["--train-limit", "1000", "--eval-limit", "200", "--epochs", "1", "--output-dir", str(root / "output")]
    proc = run([str(TRAIN_PY), *args], cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    test = data.load_dataset("fashion-mnist", None).test
    Image.fromarray(test.images[SHOE, 0]).save(root / "shoe.png")
    Image.fromarray(test.images[SHIRT, 0]).save(root / "shirt.png")
    shutil.copytree(REPO / "data" / "samples", root / "data" / "samples")  # what the docs' snippets open
    return root, test


@pytest.fixture(scope="module")
def onnx_export(trained):
    """The trained export converted to ONNX by the real command (where paddle2onnx is installed)."""
    if not HAS_ONNX:
        pytest.skip(NO_ONNX)
    root, _ = trained
    proc = run(["-m", "paddle_mnist.export", "--onnx", str(root / "output" / "inference")], cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "output" / "inference.onnx"


def network_in_memory(out: Path) -> paddle.nn.Layer:
    config = json.loads((out / "config.json").read_text())
    meta = json.loads((out / "inference_meta.json").read_text())
    net = build_model(config["model"], len(meta["classes"]), tuple(meta["image_shape"]))
    net.set_state_dict(checkpoint.load(out / "model.pdparams"))
    net.eval()
    return net


@pytest.mark.slow
def test_the_contract_in_the_metadata_is_what_paddle_inference_reports(trained):
    root, test = trained
    meta = json.loads((root / "output" / "inference_meta.json").read_text())
    from paddle import inference

    program = next(n for n in meta["files"] if n.endswith((".json", ".pdmodel")))
    config = inference.Config(str(root / "output" / program), str(root / "output" / "inference.pdiparams"))
    config.disable_glog_info()
    engine = inference.create_predictor(config)
    assert engine.get_input_names() == [meta["input"]["name"]] == ["image"]
    assert engine.get_output_names() == [meta["output"]["name"]]
    assert meta["input"]["shape"] == [-1, *meta["image_shape"]] == [-1, 1, 28, 28]
    assert meta["output"]["shape"] == [-1, len(meta["classes"])] and "logits" in meta["output"]["values"]
    assert meta["classes"] == list(data.FASHION) and meta["paddle"] == paddle.__version__
    assert meta["background"] == [0], "Fashion-MNIST's ground is black"
    fields = meta["input"]
    assert fields["dtype"] == "float32" and fields["layout"] == "NCHW", fields
    for key in ("channels", "pixels", "resize", "alpha"):
        assert isinstance(fields.get(key), str) and fields[key], f"the contract's input.{key} is missing"
    assert "255" in fields["pixels"] and "mean" in fields["pixels"], fields["pixels"]
    mean, std = data.channel_stats(data.load_dataset("fashion-mnist", None).train.images)
    assert np.allclose(meta["mean"], mean) and np.allclose(meta["std"], std)


@pytest.mark.slow
def test_paddle_inference_and_jit_give_the_trained_networks_probabilities(trained):
    root, test = trained
    images = test.images[:256]
    net = network_in_memory(root / "output")
    with paddle.no_grad():
        x = paddle.to_tensor(data.normalise(images, *json_stats(root)))
        expected = softmax(net(x).numpy())
    for backend in ("inference", "jit"):
        predictor = Predictor.load(root / "output", backend=backend)
        assert predictor.backend == backend
        got = predictor.probabilities(images)
        assert got.shape == (256, 10)
        assert np.abs(got - expected).max() < 1e-5, backend
    assert Predictor.load(root / "output").backend == "inference", "the default engine is Paddle Inference"


@pytest.mark.slow
def test_auto_falls_back_to_jit_when_paddle_inference_cannot_take_the_export(trained, monkeypatch):
    from paddle_mnist.deploy import predictor as predictor_module

    root, test = trained

    def refuse(*args):
        raise RuntimeError("this build has no inference engine")

    expected = Predictor.load(root / "output", backend="inference").probabilities(test.images[:16])
    monkeypatch.setattr(predictor_module, "_inference_runner", refuse)
    fallback = Predictor.load(root / "output")
    assert fallback.backend == "jit"
    assert np.abs(fallback.probabilities(test.images[:16]) - expected).max() < 1e-5


def json_stats(root: Path) -> tuple[tuple, tuple]:
    meta = json.loads((root / "output" / "inference_meta.json").read_text())
    return tuple(meta["mean"]), tuple(meta["std"])


@pytest.mark.slow
def test_files_pil_images_and_arrays_are_the_same_image_to_the_predictor(trained):
    root, test = trained
    predictor = Predictor.load(root / "output")
    pixels = test.images[SHOE, 0]
    forms = [
        root / "shoe.png",
        str(root / "shoe.png"),
        Image.open(root / "shoe.png"),
        pixels,
        pixels[None],
        pixels[:, :, None],
        pixels.astype(np.float32) / 255,
        test.images[SHOE : SHOE + 1],
    ]
    expected = predictor.probabilities([pixels])
    for form in forms:
        assert np.abs(predictor.probabilities(form) - expected).max() < 1e-6, type(form)
    batch = predictor.probabilities([root / "shoe.png", root / "shirt.png"])
    assert np.abs(batch - predictor.probabilities(test.images[[SHOE, SHIRT]])).max() < 1e-6
    top = predictor.predict(root / "shirt.png", top=3)[0]
    assert [t["name"] for t in top] == [predictor.classes[t["class"]] for t in top]
    assert top[0]["probability"] >= top[1]["probability"] >= top[2]["probability"]
    with pytest.raises(ValueError, match="shape"):
        predictor.probabilities(np.zeros((2, 3, 4, 5, 6), np.uint8))


@pytest.mark.slow
def test_a_grey_model_takes_every_unambiguous_array_and_refuses_the_rest_in_one_line(trained):
    """The table in docs/deploy.md, "Arrays", for a grey model, with the three reported defects: an (N, H, W)
    uint8 batch (the idx files' layout), a (3, H, W) array (3 grey images or one colour image), and floats 0-255."""
    root, test = trained
    predictor = Predictor.load(root / "output")
    grey = test.images[:5, 0]  # (5, 28, 28) uint8
    each = predictor.probabilities(list(grey))
    assert each.shape == (5, 10) and len({tuple(row.round(4)) for row in each}) == 5, "5 different images"
    for batch in (grey, grey[:, None], grey[:, :, :, None], grey.astype(np.float64) / 255):
        assert np.abs(predictor.probabilities(batch) - each).max() < 1e-6, batch.shape
    for one in (grey[0], grey[:1], grey[0][:, :, None], grey[0].astype(np.float32) / 255):
        assert np.abs(predictor.probabilities(one) - each[:1]).max() < 1e-6, one.shape

    # any size, resized as an image file is: (N, H, W) of 40x36 images
    big = [np.asarray(Image.fromarray(g).resize((36, 40), Image.BILINEAR)) for g in grey]
    assert np.abs(predictor.probabilities(np.stack(big)) - predictor.probabilities(big)).max() < 1e-6

    # one colour image, made unambiguous by a batch axis, is read as the PIL image is
    colour = np.stack([grey[0], grey[1], grey[2]], axis=-1)
    as_pil = predictor.probabilities(Image.fromarray(colour))
    for form in (colour[None], colour.transpose(2, 0, 1)[None], [colour], [colour.transpose(2, 0, 1)]):
        assert np.abs(predictor.probabilities(form) - as_pil).max() < 1e-6

    refused = {
        "(3, 28, 28)": (grey[:3], r"3 grey images of 28x28 or one colour image.*\(1, 3, 28, 28\)"),
        "(28, 28, 3)": (colour, r"one colour image \(H, W, 3\) or 3 grey images.*\(1, 28, 28, 3\)"),
        "(28, 28, 4)": (np.dstack([colour, grey[3]]), r"one colour image \(H, W, 4\) or 4 grey images"),
        "floats 0-255": (grey.astype(np.float32), r"span 0 to 255: divide 0-255 values by 255"),
        "floats 0-16": (grey.astype(np.float32) / 16, r"span 0 to 15.9375: .*another range by its maximum"),
        "NaN": (np.full((28, 28), np.nan, np.float32), "NaN"),
        "(5, 28, 7) in a list": ([np.zeros((5, 28, 7), np.uint8)], r"not of shape \(5, 28, 7\)"),
    }
    for case, (form, message) in refused.items():
        with pytest.raises(ValueError, match=message) as e:
            predictor.probabilities(form)
        assert "\n" not in str(e.value), case
    for dtype in (np.int64, np.uint16, bool):
        with pytest.raises(TypeError, match=r"uint8 pixels \(0-255\) or floats in \[0, 1\], not (int64|uint16|bool)"):
            predictor.probabilities(grey.astype(dtype))


@pytest.mark.slow
def test_a_transparent_background_is_laid_on_the_black_the_model_was_trained_on(trained, tmp_path):
    """An MNIST-type image whose black ground is made transparent is classified as the opaque image is. White
    lies under the transparent pixels, so a reader that dropped the alpha channel would see a white ground."""
    root, test = trained
    predictor = Predictor.load(root / "output")
    paths = []
    for i in range(20):
        grey = test.images[i, 0]
        colour = np.where(grey == 0, 255, grey).astype(np.uint8)
        rgba = np.stack([colour, colour, colour, np.where(grey == 0, 0, 255).astype(np.uint8)], axis=-1)
        paths.append(tmp_path / f"{i}.png")
        Image.fromarray(rgba, "RGBA").save(paths[-1])
    opaque = predictor.probabilities(test.images[:20])
    assert np.abs(predictor.probabilities(paths) - opaque).max() < 1e-6
    proc = run(
        ["-m", "paddle_mnist.predict", "--model", str(root / "output" / "inference"), "--json", "--image"]
        + [str(p) for p in paths],
        cwd=root,
    )
    assert proc.returncode == 0, proc.stderr
    assert [r["top"][0]["class"] for r in json.loads(proc.stdout)] == list(opaque.argmax(axis=1))
    assert proc.stderr.strip() == "", f"predict should print nothing to stderr here:\n{proc.stderr[-2000:]}"


@pytest.mark.slow
def test_onnx_runtime_gives_paddles_probabilities_on_real_images(trained, onnx_export):
    root, test = trained
    meta = json.loads((root / "output" / "inference_meta.json").read_text())
    assert meta["onnx"]["file"] == onnx_export.name and onnx_export.is_file()
    images = test.images[:256]
    paddle_probs = Predictor.load(root / "output", backend="jit").probabilities(images)
    onnx_probs = Predictor.load(root / "output", backend="onnx").probabilities(images)
    assert np.abs(onnx_probs - paddle_probs).max() < 1e-5
    prefix = str(root / "output" / "inference")
    proc = run(
        ["-m", "paddle_mnist.predict", "--model", prefix, "--backend", "onnx", "--json", "--image", "shoe.png"],
        cwd=root,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)[0]["top"][0]["class"] == int(paddle_probs[SHOE].argmax())


@pytest.mark.slow
def test_the_onnx_backend_before_a_conversion_is_one_error_line(trained, tmp_path):
    root, _ = trained
    fresh = tmp_path / "output"
    fresh.mkdir()
    for p in (root / "output").glob("inference*"):
        if p.suffix != ".onnx":
            (fresh / p.name).write_bytes(p.read_bytes())
    meta = json.loads((fresh / "inference_meta.json").read_text())
    meta.pop("onnx", None)
    (fresh / "inference_meta.json").write_text(json.dumps(meta))
    proc = run(
        [
            "-m",
            "paddle_mnist.deploy.predict",
            "--model",
            str(fresh / "inference"),
            "--backend",
            "onnx",
            "--image",
            str(root / "shoe.png"),
        ],
        cwd=root,
    )
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and ("export --onnx" in errors[0] or "requirements-onnx.txt" in errors[0]), proc.stderr
    assert "Traceback" not in proc.stderr


def python_blocks(page: Path) -> list[str]:
    """The page's indented code blocks that are Python (they start with an import)."""
    blocks, current = [], []
    for line in page.read_text().splitlines() + [""]:
        if line.startswith("    ") or (current and not line.strip()):
            current.append(line[4:])
            continue
        text = "\n".join(current).strip()
        if text.startswith(("import ", "from ")):
            blocks.append(text + "\n")
        current = []
    return blocks


DOC_PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SNIPPETS = [(page.name, i, block) for page in DOC_PAGES for i, block in enumerate(python_blocks(page))]


def test_the_docs_hold_python_snippets_to_check():
    pages = {name for name, _, _ in SNIPPETS}
    assert {"README.md", "runs.md", "deploy.md"} <= pages
    assert sum(name == "deploy.md" for name, _, _ in SNIPPETS) == 3


@pytest.mark.slow
@pytest.mark.parametrize("page,index,block", SNIPPETS, ids=[f"{n}-{i}" for n, i, _ in SNIPPETS])
def test_every_python_snippet_in_the_docs_runs_on_a_trained_run(trained, onnx_ready, page, index, block):
    """Each snippet runs as written in a folder outside the clone holding output/ (a real run) and data/samples/;
    where it prints a class for an image, that is the Predictor's class for it."""
    root, _ = trained
    if "onnxruntime" in block:
        onnx_ready()
    proc = run(["-c", block], cwd=root)
    assert proc.returncode == 0, f"{page} snippet {index}:\n{block}\n{proc.stderr[-3000:]}"
    # a snippet that loads weights into the wrong network still exits 0, with Paddle's "Skip loading" warnings
    skipped = [line for line in proc.stderr.splitlines() if "Skip loading" in line]
    assert not skipped, f"{page} snippet {index} loads weights into another network:\n" + "\n".join(skipped[:5])
    predictor = Predictor.load(root / "output")
    for line in proc.stdout.splitlines():
        match = re.match(r"(\S+\.(?:png|jpg)) (.+)", line)
        if match:
            expected = predictor.predict(root / match[1], top=1)[0][0]["name"]
            assert match[2].startswith(expected), (page, index, line, expected)


@pytest.fixture
def onnx_ready(request):
    def need() -> None:
        request.getfixturevalue("onnx_export")

    return need


def test_every_name_the_docs_import_exists():
    """Every import line of the docs' Python snippets resolves (the fast half of the check above)."""
    for page, index, block in SNIPPETS:
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.ImportFrom) and node.module.startswith("paddle_mnist"):
                module = __import__(node.module, fromlist=["_"])
                for alias in node.names:
                    assert hasattr(module, alias.name), f"{page} snippet {index}: {node.module}.{alias.name}"


def fake_run(out: Path, image_size: str, weights_shape: tuple[int, int, int]) -> Path:
    """An output directory as a folder run of mnist_cnn writes it: its config.json (image_size WxH, grey, 3
    classes) and model.pdparams, here of a network built for weights_shape."""
    out.mkdir(parents=True)
    cfg = Config(dataset="folder", model="mnist_cnn", image_size=image_size, channels=1, classes=("a", "b", "c"))
    (out / "config.json").write_text(cfg.to_json())
    paddle.seed(7)
    checkpoint.save_atomic(build_model("mnist_cnn", 3, weights_shape).state_dict(), out / "model.pdparams")
    return out


def test_load_model_builds_the_runs_network_from_its_config(tmp_path):
    out = fake_run(tmp_path / "run", "24x16", (1, 16, 24))
    net = load_model(out)
    assert not net.training, "load_model returns the network in eval mode"
    assert checkpoint.digest(net) == checkpoint.digest_state(checkpoint.load(out / "model.pdparams"))
    assert list(net.fc.weight.shape) == [20 * 4 * 6, 3]  # 16x24 images, 3 classes
    with pytest.raises(checkpoint.CheckpointError, match="model_best.pdparams: cannot be read"):
        load_model(out, which="best")


def test_weights_that_do_not_fit_are_one_error_not_paddles_warning(tmp_path, capfd):
    """Weights of 28x28 images into the network of the run's 24x16: Paddle alone prints "Skip loading" and
    leaves the dense layer random."""
    out = fake_run(tmp_path / "run", "24x16", (1, 28, 28))
    with pytest.raises(checkpoint.CheckpointError) as e:
        load_model(out)
    message = str(e.value)
    assert "\n" not in message and message.startswith(str(out / "model.pdparams"))
    assert "fc.weight is [980, 3] in the file and [480, 3] in the network" in message, message
    assert "Skip loading" not in capfd.readouterr().err
    net = build_model("mnist_cnn", 3, (1, 16, 24))
    state = net.state_dict()
    state.pop("features.0.bias")
    with pytest.raises(checkpoint.CheckpointError, match=r"features.0.bias \(shape \[20\] in the network\) is not"):
        checkpoint.set_weights(net, state, "a dict")
    with pytest.raises(checkpoint.CheckpointError, match="extra is in the file but not in the network"):
        checkpoint.set_weights(net, {**net.state_dict(), "extra": paddle.zeros([1])}, "a dict")


@pytest.mark.slow
def test_load_model_of_a_folder_run_predicts_as_its_export(tmp_path):
    """A run on a folder of 28x28 images trained at 24x16: load_model's network gives the exported model's
    probabilities on the same images; which="best" loads model_best.pdparams."""
    fashion = data.load_dataset("fashion-mnist", None).test
    for label, name in ((0, "top"), (1, "trouser"), (7, "sneaker")):
        (tmp_path / "images" / "train" / name).mkdir(parents=True)
        for row in np.flatnonzero(fashion.labels == label)[:24]:
            Image.fromarray(fashion.images[row, 0]).save(tmp_path / "images" / "train" / name / f"{row}.png")
    out = tmp_path / "output"
    args = ["--dataset", "folder", "--data-dir", str(tmp_path / "images"), "--image-size", "24x16"]
    args += ["--epochs", "2", "--min-steps", "0", "--batch-size", "16", "--output-dir", str(out)]
    proc = run([str(TRAIN_PY), *args], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    predictor = Predictor.load(out)
    assert predictor.image_shape == (1, 16, 24) and predictor.classes == ["sneaker", "top", "trouser"]
    images = fashion.images[:32, 0]
    net = load_model(out)
    with paddle.no_grad():
        x = data.normalise(np.stack([predictor.pixels(i) for i in images]), *json_stats(tmp_path))
        probs = softmax(net(paddle.to_tensor(x)).numpy())
    assert np.abs(probs - predictor.probabilities(images)).max() < 1e-5
    best = load_model(out, which="best")
    assert checkpoint.digest(best) == checkpoint.digest_state(checkpoint.load(out / "model_best.pdparams"))

"""--init-from and --pretrained: what fits is loaded and the rest starts anew, the loaded layers' learning rate, the
refusals in one line, and real runs (two workers, a resume, resnet18 from a weights file, the offline message)."""

from __future__ import annotations

import hashlib
import logging
import shutil
from pathlib import Path

import numpy as np
import paddle
import pytest
from helpers import (
    explain,
    free_port,
    make_images,
    param_digest,
    run_launch,
    run_single,
    small_run,
    weights,
    worker_log,
)
from PIL import Image

from paddle_mnist import config
from paddle_mnist.files import checkpoint
from paddle_mnist.files.checkpoint import CheckpointError
from paddle_mnist.network import backbones
from paddle_mnist.network.models import build_model
from paddle_mnist.runtime.distributed import DistEnv
from paddle_mnist.training import finetune

# ---- what fits, and the refusals ----


def saved(net: paddle.nn.Layer, path: Path) -> Path:
    checkpoint.save_atomic(net.state_dict(), path)
    return path


def test_what_fits_is_loaded_and_the_classifier_of_other_classes_starts_anew(tmp_path):
    paddle.seed(1)
    source = build_model("mnist_cnn_bn_fc", 10, (1, 28, 28))
    path = saved(source, tmp_path / "w.pdparams")
    paddle.seed(2)
    net = build_model("mnist_cnn_bn_fc", 4, (1, 28, 28))
    fresh_fc = net.fc.weight.numpy().copy()
    done = finetune.load(net, path, classes=tuple("abcd"), source_classes=())
    assert finetune.layers_of(done.new) == ["fc"] and len(done.loaded) == 12
    for name in done.loaded:
        np.testing.assert_array_equal(net.state_dict()[name].numpy(), source.state_dict()[name].numpy())
    np.testing.assert_array_equal(net.fc.weight.numpy(), fresh_fc)

    # the same number of classes, but others: the classifier fits and still starts anew, and the line says why
    same = build_model("mnist_cnn_bn_fc", 10, (1, 28, 28))
    done = finetune.load(same, path, classes=tuple("abcdefghij"), source_classes=tuple("0123456789"))
    assert finetune.layers_of(done.new) == ["fc"] and "other classes, 0, 1" in done.classifier_note
    line = finetune.describe(done, config.parse_args(["--init-from", str(path)]))
    assert "loaded 12 of 14 tensors" in line and "new: fc" in line and "every layer trains at the learning rate" in line
    assert "(the fine-tuning default, docs/finetuning.md: --init-lr-scale 1 --freeze-epochs 0)" in line


def test_nothing_that_fits_and_a_damaged_file_are_refused_in_one_line(tmp_path):
    path = saved(build_model("mnist_cnn", 10, (1, 28, 28)), tmp_path / "w.pdparams")
    with pytest.raises(CheckpointError, match="no tensor of it fits this ResNet18") as e:
        finetune.load(build_model("resnet18", 10, (1, 28, 28)), path, (), ())
    assert "\n" not in str(e.value)
    path.write_bytes(path.read_bytes()[:500])  # cut short: its digest no longer matches
    with pytest.raises(CheckpointError, match="truncated") as e:
        finetune.load(build_model("mnist_cnn", 10, (1, 28, 28)), path, (), ())
    assert "\n" not in str(e.value)


def test_long_layer_names_are_shortened_in_the_middle():
    names = ["blocks.10.conv.expand_conv_with_a_very_long_name_indeed.weight", "fc.bias"]
    long, short = finetune.layers_of(names)
    assert len(long) <= finetune.NAME_CHARS and long.startswith("blocks.10") and long.endswith("indeed")
    assert short == "fc"


def test_loaded_layers_train_at_their_scale_and_stay_frozen_for_the_freeze_epochs():
    def moved(args: list[str], epoch: int) -> tuple[float, float]:
        paddle.seed(0)
        net = paddle.nn.Linear(3, 2)
        finetune.set_rates(net, ("weight",), config.parse_args(["--init-from", "x", *args]), epoch)
        opt = paddle.optimizer.Momentum(learning_rate=0.5, momentum=0.9, parameters=net.parameters())
        w, b = net.weight.numpy().copy(), net.bias.numpy().copy()
        for _ in range(2):
            net(paddle.ones([4, 3])).sum().backward()
            opt.step()
            opt.clear_grad()
        return float(np.abs(net.weight.numpy() - w).max()), float(np.abs(net.bias.numpy() - b).max())

    full, _ = moved(["--init-lr-scale", "1"], 0)
    scaled, bias = moved(["--init-lr-scale", "0.1"], 0)
    assert scaled == pytest.approx(full / 10, rel=1e-5) and bias == moved(["--init-lr-scale", "1"], 0)[1]
    assert moved(["--init-lr-scale", "1", "--freeze-epochs", "2"], 1)[0] == 0.0
    assert moved(["--init-lr-scale", "1", "--freeze-epochs", "2"], 2)[0] == pytest.approx(full, rel=1e-6)
    cfg = config.parse_args(["--init-from", "x", "--freeze-epochs", "2"])
    assert "start to train" in finetune.set_rates(paddle.nn.Linear(3, 2), ("weight",), cfg, 2)


def test_start_flags_defaults_and_refusals():
    assert (config.Config().init_lr_scale, config.Config().freeze_epochs) == (1.0, 0)
    cfg = config.parse_args(["--init-from", "out"])
    assert (cfg.init_lr_scale, cfg.freeze_epochs) == (config.FINETUNE_LR_SCALE, config.FINETUNE_FREEZE_EPOCHS)
    assert config.parse_args(["--model", "resnet18", "--pretrained"]).pretrained == config.IMAGENET
    assert config.parse_args(["--model", "resnet18", "--pretrained", "w.pdparams"]).pretrained == "w.pdparams"
    refused = {
        "--init-lr-scale applies to the layers loaded": ["--init-lr-scale", "0.5"],
        "--freeze-epochs applies": ["--freeze-epochs", "1"],
        "both choose the starting weights": ["--model", "resnet18", "--pretrained", "--init-from", "out"],
        "exist for --model resnet18 and mobilenet_v3_small, not mnist_cnn": ["--model", "mnist_cnn", "--pretrained"],
        "0 \\(frozen\\) or more": ["--init-from", "out", "--init-lr-scale", "-1"],
    }
    for message, argv in refused.items():
        with pytest.raises(config.ConfigError, match=message):
            config.parse_args(argv)
    assert set(config.PRETRAINED_MODELS) == set(backbones.IMAGENET_WEIGHTS)


def test_the_imagenet_urls_are_paddles_own():
    """The URLs --pretrained names are those paddle.vision.models' pretrained=True downloads."""
    for model, (url, md5) in backbones.IMAGENET_WEIGHTS.items():
        assert url.startswith("https://paddle-hapi.bj.bcebos.com/models/") and url.endswith(".pdparams")
        assert len(md5) == 32 and finetune.cached_path(model).name == url.rsplit("/", 1)[-1]


def test_imagenet_weights_are_read_from_paddles_cache_when_whole(tmp_path, monkeypatch):
    """A file in Paddle's weights folder with the MD5 Paddle's table gives is used as it is, nothing downloaded;
    one that differs (cut short) is not whole."""
    from paddle.utils import download

    made = tmp_path / "weights" / "resnet18.pdparams"
    made.parent.mkdir()
    paddle.save(build_model("resnet18", 1000, (3, 32, 32)).state_dict(), str(made))
    url, _ = backbones.IMAGENET_WEIGHTS["resnet18"]
    monkeypatch.setattr(download, "WEIGHTS_HOME", str(made.parent))
    monkeypatch.setitem(backbones.IMAGENET_WEIGHTS, "resnet18", (url, hashlib.md5(made.read_bytes()).hexdigest()))
    cfg = config.parse_args(["--model", "resnet18", "--pretrained"])
    one = DistEnv(0, 1, 0, 1, "none", "cpu")
    assert finetune.weights_file(cfg, one, logging.getLogger("test"), lambda: 0) == (made, ())
    made.write_bytes(made.read_bytes()[:-1])
    assert not finetune._intact(made, backbones.IMAGENET_WEIGHTS["resnet18"][1])


# ---- real runs ----


def write_folder(root: Path, classes: int = 4, train: int = 32, test: int = 8) -> Path:
    """PNG class folders of the tests' MNIST-like images: the first `classes` classes only."""
    images, labels = make_images(20 * (train + test), seed=5)
    for c in range(classes):
        rows = np.flatnonzero(labels == c)[: train + test]
        for k, row in enumerate(rows):
            split = root / ("train" if k < train else "test") / f"c{c}"
            split.mkdir(parents=True, exist_ok=True)
            Image.fromarray(images[row]).save(split / f"{row}.png")
    return root


@pytest.fixture(scope="module")
def source(tmp_path_factory, dataset):
    """A finished run of mnist_cnn on the 10 classes of the MNIST-format test data."""
    root = tmp_path_factory.mktemp("source")
    args = [*small_run(train_limit=256, epochs=1), "--data-dir", str(dataset), "--output-dir", str(root / "out")]
    proc = run_single(args, cwd=root)
    assert proc.returncode == 0, explain(proc)
    return root / "out"


FOLDER_RUN = ["--dataset", "folder", "--val-split", "0", "--model", "mnist_cnn", "--warmup-epochs", "0"]
FOLDER_RUN += ["--batch-size", "32", "--epochs", "2", "--log-every", "2"]


@pytest.mark.slow
def test_init_from_a_run_into_two_workers_with_other_classes(tmp_path, source):
    """Four classes from a 10-class run on 2 workers, the loaded layers frozen (--init-lr-scale 0): after training
    the convolutions are the source's to the bit, the classifier is new, and both ranks hold the same weights."""
    data = write_folder(tmp_path / "folder")
    out = tmp_path / "out"
    args = [*FOLDER_RUN, "--data-dir", str(data), "--output-dir", str(out), "--init-from", str(source)]
    proc = run_launch([*args, "--init-lr-scale", "0"], cwd=tmp_path, log_dir=tmp_path / "log")
    assert proc.returncode == 0, explain(proc, tmp_path / "log")
    logs = [worker_log(tmp_path / "log", rank) for rank in (0, 1)]
    assert all("--init-from: loaded 4 of 6 tensors" in log and "new: fc;" in log for log in logs)
    assert param_digest(logs[0]) == param_digest(logs[1])
    before, after = weights(source / checkpoint.WEIGHTS), weights(out / checkpoint.WEIGHTS)
    for name in ("features.0.weight", "features.0.bias", "features.3.weight", "features.3.bias"):
        np.testing.assert_array_equal(after[name], before[name])
    assert after["fc.weight"].shape == (980, 4) and before["fc.weight"].shape == (980, 10)


@pytest.mark.slow
def test_a_weights_file_frozen_then_trained_resumes_to_the_uninterrupted_run(tmp_path, source):
    """--init-from a .pdparams file with --freeze-epochs 1: stopped in epoch 2 and resumed (which does not read the
    file again), the run ends with the weights of the run that never stopped."""
    data = write_folder(tmp_path / "folder")
    file = tmp_path / "start.pdparams"
    shutil.copy(source / checkpoint.WEIGHTS, file)  # without its digest: a file from elsewhere
    args = [*FOLDER_RUN, "--data-dir", str(data), "--init-from", str(file), "--freeze-epochs", "1"]
    whole = run_single([*args, "--output-dir", str(tmp_path / "whole")], cwd=tmp_path)
    assert whole.returncode == 0, explain(whole)
    said = whole.stdout + whole.stderr
    assert "stay as loaded for 1 epochs" in said and "epoch 2: the loaded layers start to train" in said
    part = [*args, "--output-dir", str(tmp_path / "part")]
    first = run_single([*part, "--max-steps", "6"], cwd=tmp_path)
    assert first.returncode == 0, explain(first)
    file.unlink()  # the resume continues the checkpoint: the start is not needed
    rest = run_single([*part, "--resume"], cwd=tmp_path)
    assert rest.returncode == 0, explain(rest)
    assert "is not read: the run continues from its checkpoint" in rest.stdout + rest.stderr
    assert param_digest(rest.stdout + rest.stderr) == param_digest(said)


@pytest.mark.slow
def test_a_start_that_fits_nothing_or_is_damaged_stops_every_rank_with_one_line(tmp_path, source, dataset):
    args = [*small_run(train_limit=128, eval_limit=64), "--data-dir", str(dataset), "--max-steps", "2"]
    args += ["--output-dir", str(tmp_path / "out"), "--model", "resnet18", "--init-from", str(source)]
    proc = run_launch(args, cwd=tmp_path, log_dir=tmp_path / "log")
    assert proc.returncode == 2, explain(proc, tmp_path / "log")
    for rank in (0, 1):
        errors = [line for line in worker_log(tmp_path / "log", rank).splitlines() if "error:" in line]
        assert len(errors) == 1 and "no tensor of it fits this ResNet18" in errors[0], errors
    damaged = tmp_path / "damaged"
    shutil.copytree(source, damaged)
    weights_file = damaged / checkpoint.WEIGHTS
    weights_file.write_bytes(weights_file.read_bytes()[:-100])
    args = [*small_run(train_limit=128, eval_limit=64), "--data-dir", str(dataset), "--init-from", str(damaged)]
    proc = run_single([*args, "--output-dir", str(tmp_path / "out2")], cwd=tmp_path)
    assert proc.returncode == 2, explain(proc)
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "error:" in line]
    assert len(errors) == 1 and f"{weights_file}: truncated" in errors[0], errors


@pytest.mark.slow
def test_resnet18_starts_from_a_pretrained_file_and_names_the_url_when_offline(tmp_path, dataset):
    """Grey MNIST-format images into resnet18 from a file of its ImageNet shape (1,000 classes), made here; then
    --pretrained without a file, offline (a proxy that refuses), with an empty cache: one line naming both."""
    paddle.seed(3)
    made = build_model("resnet18", 1000, (3, 224, 224))
    file = tmp_path / "resnet18.pdparams"
    paddle.save(made.state_dict(), str(file))  # as Paddle's own files are written: no digest
    args = [*small_run(train_limit=64, eval_limit=32, batch_size=32, tutorial_cnn=False), "--data-dir", str(dataset)]
    args += ["--model", "resnet18", "--max-steps", "2", "--init-lr-scale", "0"]
    proc = run_single([*args, "--pretrained", str(file), "--output-dir", str(tmp_path / "out")], cwd=tmp_path)
    assert proc.returncode == 0, explain(proc)
    said = proc.stdout + proc.stderr
    assert "--pretrained: loaded 100 of 102 tensors" in said and "new: fc;" in said
    after = weights(tmp_path / "out" / checkpoint.WEIGHTS)
    np.testing.assert_array_equal(after["conv1.weight"], made.state_dict()["conv1.weight"].numpy())
    assert after["fc.weight"].shape == (512, 10)

    port = free_port()  # nothing listens: every download is refused at once
    offline = {"HOME": str(tmp_path / "home"), "HTTPS_PROXY": f"http://127.0.0.1:{port}", "NO_PROXY": ""}
    offline |= {"https_proxy": offline["HTTPS_PROXY"], "no_proxy": ""}
    args += ["--conv-backend", "paddle"]  # another HOME: oneDNN's operator would be built again, for nothing
    proc = run_single([*args, "--pretrained", "--output-dir", str(tmp_path / "off")], cwd=tmp_path, env=offline)
    assert proc.returncode == 2, explain(proc)
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "error:" in line]
    url, _ = backbones.IMAGENET_WEIGHTS["resnet18"]
    cached = tmp_path / "home" / ".cache" / "paddle" / "hapi" / "weights" / "resnet18.pdparams"
    assert len(errors) == 1 and url in errors[0] and str(cached) in errors[0], errors

"""The export after --sync-bn (export.py, trainer._export): plain batch norm, the same weights, runs on CPU."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from paddle_mnist.config import Config
from paddle_mnist.datasets import data
from paddle_mnist.deploy import export
from paddle_mnist.deploy.predictor import Predictor, normalise
from paddle_mnist.files import checkpoint
from paddle_mnist.network.models import build_model
from paddle_mnist.runtime import distributed
from paddle_mnist.runtime.distributed import DistEnv
from paddle_mnist.training import trainer
from paddle_mnist.training.outputs import RunFiles


def sync_bn_network() -> paddle.nn.Layer:
    """mnist_cnn_bn_fc after --sync-bn's conversion (which runs on CPU; only the forward pass needs a GPU)."""
    paddle.seed(1)
    net = build_model("mnist_cnn_bn_fc")
    stats = net.state_dict()  # statistics that differ from a fresh network's, so the copy is seen to carry them
    for name, value in stats.items():
        if name.endswith(("_mean", "_variance")):
            paddle.assign(paddle.rand(value.shape) + 0.5, output=value)
    return paddle.nn.SyncBatchNorm.convert_sync_batchnorm(net)


def test_the_export_after_sync_bn_holds_plain_batch_norm_with_the_same_weights(tmp_path):
    paddle.set_device("cpu")
    synced = sync_bn_network()
    assert any(isinstance(layer, paddle.nn.SyncBatchNorm) for layer in synced.sublayers())
    plain = distributed.plain_batch_norm(synced, build_model("mnist_cnn_bn_fc"))
    assert not any(isinstance(layer, paddle.nn.SyncBatchNorm) for layer in plain.sublayers())
    assert checkpoint.digest(plain) == checkpoint.digest(synced)
    split = data.Split(np.zeros((2, 1, 28, 28), np.uint8), np.zeros(2, np.int64))
    ds = data.Dataset("mnist", split, split, split, mean=(0.5,), std=(0.25,), classes=data.DIGITS)
    export.export_inference(plain, ds, tmp_path / "inference")
    loaded, _ = export.load_exported(tmp_path / "inference")
    x = paddle.randn([3, 1, 28, 28])
    plain.eval()
    assert np.allclose(loaded(x).numpy(), plain(x).numpy(), atol=1e-5)
    unconverted = build_model("mnist_cnn_bn_fc")
    assert distributed.plain_batch_norm(unconverted, build_model("mnist_cnn_bn_fc")) is unconverted


def test_the_runs_export_after_sync_bn_has_no_sync_batch_norm_and_classifies_on_cpu(tmp_path):
    """trainer._export, as the end of a --sync-bn run calls it with the converted network: the export it writes runs on
    CPU through the predictor and gives the plain network's logits (exporting the converted one fails on CPU)."""
    paddle.set_device("cpu")
    synced = sync_bn_network()
    cfg = Config(model="mnist_cnn_bn_fc", sync_bn=True, output_dir=str(tmp_path / "out"))
    one = DistEnv(0, 1, 0, 1, "none", "cpu")
    files = RunFiles(cfg, one)
    pixels = np.random.RandomState(0).randint(0, 256, (4, 1, 28, 28)).astype(np.uint8)
    split = data.Split(pixels[:2], np.zeros(2, np.int64))
    ds = data.Dataset("mnist", split, split, split, mean=(0.5,), std=(0.25,), classes=data.DIGITS)
    assert trainer._export(cfg, files, synced, ds, best=None) is None
    meta = export.read_export(tmp_path / "out" / "inference")
    program = tmp_path / "out" / export.program_files(meta["files"])[0]
    if program.suffix == ".json":  # 3.x's program as text; 2.6's .pdmodel also names every registered operator
        text = program.read_text()
        assert "batch_norm" in text and "sync_batch_norm" not in text
    predictor = Predictor.load(tmp_path / "out", backend="jit")
    plain = build_model("mnist_cnn_bn_fc")
    plain.set_state_dict(synced.state_dict())
    plain.eval()
    expected = plain(paddle.to_tensor(normalise(pixels, meta))).numpy()
    assert np.allclose(predictor.logits(pixels), expected, atol=1e-5)
    assert [p[0]["class"] for p in predictor.predict(pixels, top=1)] == list(expected.argmax(axis=1))


def test_the_sync_bn_network_itself_cannot_be_exported_on_cpu(tmp_path):
    """Why the plain copy: Paddle's CPU build has no sync_batch_norm kernel, and jit.save fails on it (3.3.1: a
    TypeError; 2.6.2: ValueError, "Operator sync_batch_norm has not been registered")."""
    paddle.set_device("cpu")
    synced = sync_bn_network()
    synced.eval()
    spec = paddle.static.InputSpec([None, 1, 28, 28], "float32", "image")
    with pytest.raises((TypeError, ValueError)):
        paddle.jit.save(synced, str(tmp_path / "synced"), input_spec=[spec])

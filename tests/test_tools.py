"""Gradient clipping, the best model and --export best, the model summary and the profiler window."""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import paddle
import pytest
from helpers import (
    explain,
    read_metrics,
    read_results,
    run_one_and_two,
    run_single,
    small_run,
    weights,
    worker_log,
)

from paddle_mnist.config import Config, ConfigError, parse_args
from paddle_mnist.datasets.transfer import Feed
from paddle_mnist.deploy import export
from paddle_mnist.files import checkpoint
from paddle_mnist.network import summary
from paddle_mnist.network.models import MnistCNN, build_model, count_parameters
from paddle_mnist.training import engine
from paddle_mnist.training.state import TrainState, make_optimizer

SMALL = small_run(log_every=0, lr=None)
CLIP = 0.5  # below the gradient norms of the first epochs here, so every step clips


@pytest.fixture(scope="module")
def one_and_two(dataset, tmp_path_factory):
    """One job, 2 epochs of 8 steps, in one process and in two workers: clipping, profiling, exporting the best."""
    root = tmp_path_factory.mktemp("runs")
    args = [*SMALL, "--data-dir", str(dataset), "--batch-size", "64", "--epochs", "2", "--lr", "0.05"]
    args += ["--clip-grad-norm", str(CLIP), "--profile-steps", "3:5", "--export", "best", "--keep-checkpoints", "5"]
    return run_one_and_two(root, args)


def test_clipping_scales_the_step_to_the_norm_and_reports_the_norm_before():
    """With plain SGD (no momentum, no decay) a clipped step moves the weights by exactly lr x the clip norm."""
    cfg = dataclasses.replace(Config(), clip_grad_norm=CLIP, momentum=0.0, weight_decay=0.0, lr=0.1, batch_size=16)
    paddle.seed(3)
    model = MnistCNN()
    opt, sched = make_optimizer(cfg, model, total_steps=10)
    rng = np.random.RandomState(0)
    images = rng.randn(16, 1, 28, 28).astype("float32")
    labels = rng.randint(0, 10, size=16).astype("int64")

    probe = MnistCNN()  # the same weights, to measure the unclipped gradient's norm
    probe.set_state_dict(model.state_dict())
    paddle.nn.functional.cross_entropy(probe(paddle.to_tensor(images)), paddle.to_tensor(labels)).backward()
    expected = np.sqrt(sum(float((p.grad.numpy().astype(np.float64) ** 2).sum()) for p in probe.parameters()))
    assert expected > CLIP

    before = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    state = TrainState(cfg, model, opt, sched, None, None)
    norm = engine.train_step(state, images, labels, cfg, Feed("cpu"), engine.ONE_PROCESS).norm
    assert float(norm) == pytest.approx(expected, rel=1e-5)
    moved = np.sqrt(sum(((v.numpy() - before[k]).astype(np.float64) ** 2).sum() for k, v in model.state_dict().items()))
    assert moved == pytest.approx(cfg.lr * CLIP, rel=1e-4)


@pytest.mark.slow
def test_clipped_two_workers_equal_one_process_and_log_how_often(one_and_two):
    one, two = weights(one_and_two / "one" / "model.pdparams"), weights(one_and_two / "two" / "model.pdparams")
    for name in one:
        np.testing.assert_allclose(two[name], one[name], atol=1e-5, rtol=0, err_msg=name)
    rows = read_metrics(one_and_two / "two")
    assert [r["clipped_share"] for r in rows] == [1.0, 1.0]
    assert all(r["grad_norm"] > CLIP for r in rows)
    for text in (worker_log(one_and_two / "log", 0), worker_log(one_and_two / "log", 1)):
        lines = re.findall(r"gradient clipping at norm 0\.5: clipped (\d+) of (\d+) steps", text)
        assert lines == [("8", "8"), ("8", "8")], text[-2000:]


@pytest.mark.slow
def test_best_epoch_is_kept_and_exported(one_and_two):
    out = one_and_two / "two"
    rows = read_metrics(out)
    results = read_results(out)
    first_best = max(range(len(rows)), key=lambda i: (rows[i]["val_acc"], -i))  # the earliest of equal bests
    assert results["best"] == {
        "epoch": rows[first_best]["epoch"],
        "step": rows[first_best]["step"],
        "val_acc": rows[first_best]["val_acc"],
        "val_loss": rows[first_best]["val_loss"],
    }
    assert results["exported"] == "best"
    best = checkpoint.load(checkpoint.checkpoint_path(out, results["best"]["step"]))["model"]
    saved = checkpoint.load(out / "model_best.pdparams")
    assert checkpoint.digest_state(saved) == checkpoint.digest_state(best)

    net = MnistCNN()
    net.set_state_dict(saved)
    net.eval()
    exported, meta = export.load_exported(out / "inference")
    assert (
        meta["weights"]
        == f"best: epoch {results['best']['epoch']}, validation accuracy {results['best']['val_acc']:.4f}"
    )
    x = paddle.to_tensor(np.random.RandomState(1).randn(8, 1, 28, 28).astype("float32"))
    np.testing.assert_allclose(exported(x).numpy(), net(x).numpy(), atol=1e-5)


@pytest.mark.slow
def test_resume_keeps_the_best_so_far(dataset, tmp_path):
    """A run stopped after its first epoch and resumed ends with the same best as an uninterrupted one, even when
    model_best.pdparams was lost in between (a stop after the checkpoint, before the best weights were written)."""
    args = [*SMALL, "--data-dir", str(dataset), "--batch-size", "64", "--epochs", "3", "--lr-schedule", "constant"]
    whole = run_single([*args, "--output-dir", str(tmp_path / "whole")], cwd=tmp_path)
    assert whole.returncode == 0, explain(whole)
    part = run_single([*args, "--output-dir", str(tmp_path / "part"), "--max-steps", "8"], cwd=tmp_path)
    assert part.returncode == 0, explain(part)
    (tmp_path / "part" / "model_best.pdparams").unlink()
    rest = run_single([*args, "--output-dir", str(tmp_path / "part"), "--resume", "auto"], cwd=tmp_path)
    assert rest.returncode == 0, explain(rest)
    assert "] warning:" not in rest.stdout + rest.stderr  # the trainer's own warnings; Paddle's are not ours
    a = read_results(tmp_path / "whole")
    b = read_results(tmp_path / "part")
    assert a["best"] == b["best"] and a["exported"] == b["exported"] == "last"
    assert checkpoint.digest_state(checkpoint.load(tmp_path / "whole" / "model_best.pdparams")) == (
        checkpoint.digest_state(checkpoint.load(tmp_path / "part" / "model_best.pdparams"))
    )


def test_summary_counts_parameters_and_multiply_adds():
    described = summary.describe("mnist_cnn", 10, (1, 28, 28))
    assert described.parameters == described.trainable == count_parameters(MnistCNN())
    # 5x5 convs: 28x28x20 outputs of 1x25 products, 14x14x20 of 20x25; the dense layer: 10 outputs of 980
    assert described.macs == 28 * 28 * 20 * 25 + 14 * 14 * 20 * 500 + 10 * 980
    bn = summary.describe("mnist_cnn_bn", 10, (1, 28, 28))
    assert bn.trainable == count_parameters(build_model("mnist_cnn_bn", 10, (1, 28, 28)))
    assert bn.parameters - bn.trainable == 2 * 2 * 20  # running mean and variance of two 20-channel norms


@pytest.mark.slow
def test_summary_is_logged_once_by_rank_zero(one_and_two):
    first, second = worker_log(one_and_two / "log", 0), worker_log(one_and_two / "log", 1)
    headline = f"model mnist_cnn: {count_parameters(MnistCNN()):,} trained parameters; forward pass 4.72 MFLOPs"
    assert first.count(headline) == 1, first[:3000]
    assert "Layer (type)" not in first and "Layer (type)" not in second  # the table is a file, not log lines
    table = (one_and_two / "two" / "model_summary.txt").read_text()
    assert re.search(r"Conv2D-\d+ +\[\[1, 20, 14, 14\]\] +\[1, 20, 14, 14\] +10,020", table), table
    assert f"its layers: {one_and_two / 'two' / 'model_summary.txt'}" in first, first[:3000]
    assert headline not in second


@pytest.mark.slow
def test_profile_window_writes_every_ranks_trace_and_names_the_costliest_operators(one_and_two):
    for rank in (0, 1):
        folder = one_and_two / "two" / "profile"
        trace = json.loads((folder / f"trace.rank{rank}.json").read_text())
        events = trace["traceEvents"] if isinstance(trace, dict) else trace
        assert sum(e.get("cat") == "ProfileStep" for e in events) == 3  # steps 3, 4 and 5
        assert "Operator Summary" in (folder / f"operators.rank{rank}.txt").read_text()
        line = re.search(r"profile of steps 3-5: costliest operators (.*)", worker_log(one_and_two / "log", rank))
        assert line, worker_log(one_and_two / "log", rank)[-2000:]
        parts = line.group(1).split(", ")
        # Paddle's conv2d, onednn_conv2d, or exact.py's _Conv2D (GradNodePyLayer__Conv2D) where the sums are exact
        assert len(parts) == 5 and any("conv2d" in p.lower() for p in parts), parts
    assert not list((one_and_two / "two" / "profile").glob(".rank*"))  # no staging folder left


@pytest.mark.parametrize("text", ["5:3", "0:2", "4", "a:b", "3:"])
def test_a_bad_profile_window_is_refused(text):
    with pytest.raises(ConfigError, match="--profile-steps takes two step numbers A:B"):
        parse_args(["--profile-steps", text])


def test_a_negative_clip_norm_is_refused():
    with pytest.raises(ConfigError, match="--clip-grad-norm"):
        parse_args(["--clip-grad-norm", "-1"])

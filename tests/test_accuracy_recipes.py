"""The flags of the fast recipes: --ema, --lookahead, --tta, --target-acc, and the time column they are judged by."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import paddle
import pytest
from helpers import explain, launch_env, make_dataset, read_metrics, read_results, run_single

from paddle_mnist import cli, config
from paddle_mnist.datasets import data
from paddle_mnist.files import checkpoint
from paddle_mnist.network.models import MnistCNN, build_model
from paddle_mnist.runtime.distributed import DistEnv
from paddle_mnist.training.ema import WeightAverage, ema_decay
from paddle_mnist.training.evaluation import evaluate
from paddle_mnist.training.lookahead import Lookahead, lookahead_decay

ONE = DistEnv(0, 1, 0, 1, "none", "cpu")


@pytest.fixture(scope="module")
def fashion_dir(tmp_path_factory):
    """Synthetic images in Fashion-MNIST's files, so the Fashion-MNIST rules (flips) apply."""
    return make_dataset(tmp_path_factory.mktemp("data") / "fashion-mnist", n_train=512, n_test=64)


def test_ema_decay_ramps_up_then_holds():
    assert ema_decay(0.999, 1) == pytest.approx(2 / 11)
    assert ema_decay(0.999, 90) == pytest.approx(0.91 / 1.0, rel=1e-3)
    assert ema_decay(0.999, 100_000) == 0.999


def test_weight_average_follows_its_formula():
    paddle.seed(1)
    net = build_model("mnist_cnn_bn")
    avg = WeightAverage(net, build_model("mnist_cnn_bn"), decay=0.5)
    start = {k: v.numpy().copy() for k, v in net.state_dict().items()}
    with paddle.no_grad():
        for p in net.parameters():
            paddle.assign(p + 1.0, output=p)  # weights and batch norm statistics all move by one
    avg.update(step=1000)  # past the ramp: d = 0.5
    for key, value in avg.state_dict().items():
        np.testing.assert_allclose(value.numpy(), start[key] + 0.5, rtol=1e-6, atol=1e-6, err_msg=key)


def test_lookahead_pulls_every_fifth_step_and_ends_on_the_slow_copy():
    paddle.seed(1)
    net = build_model("mnist_cnn_bn")
    ahead = Lookahead(net)
    params = {k: p for k, p in net.named_parameters() if not p.stop_gradient}
    assert "features.1._mean" not in params and "fc.weight" in params  # statistics have no slow copy, weights do
    assert set(ahead.state_dict()) == set(params)
    slow = {k: p.numpy().copy() for k, p in params.items()}
    planned = 12
    for step in range(1, planned + 1):
        with paddle.no_grad():
            for p in net.parameters():
                paddle.assign(p + 1.0, output=p)  # a "training step" that moves every weight by one
        moved = {k: p.numpy().copy() for k, p in params.items()}
        ahead.update(step, planned)
        now = {k: p.numpy() for k, p in params.items()}
        if step % 5 == 0:
            d = 0.95**5 * (step / planned) ** 3
            assert d == pytest.approx(lookahead_decay(step, planned))
            for k in slow:
                slow[k] = d * slow[k] + (1 - d) * moved[k]
                np.testing.assert_allclose(now[k], slow[k], rtol=1e-5, atol=1e-5, err_msg=f"{k} at step {step}")
        elif step == planned:  # the last step: the weights become the slow copy, which does not move
            for k in slow:
                np.testing.assert_allclose(now[k], slow[k], rtol=1e-5, atol=1e-5, err_msg=f"{k} at the end")
        else:
            for k in slow:
                np.testing.assert_array_equal(now[k], moved[k], err_msg=f"{k} at step {step}")
    assert lookahead_decay(planned, planned) == pytest.approx(0.95**5)


@pytest.mark.slow
def test_ema_run_evaluates_saves_and_checkpoints_the_average(fashion_dir, tmp_path):
    out = tmp_path / "o"
    args = ["--data-dir", str(fashion_dir), "--epochs", "2", "--batch-size", "64", "--ema", "0.9"]
    proc = run_single([*args, "--log-every", "0", "--output-dir", str(out)], cwd=tmp_path)
    assert proc.returncode == 0, explain(proc)
    saved = paddle.load(str(out / "model.pdparams"))
    ckpt = paddle.load(str(checkpoint.list_checkpoints(out)[-1]))
    for key in saved:
        np.testing.assert_array_equal(saved[key].numpy(), ckpt["ema"][key].numpy(), err_msg=key)
    assert not np.array_equal(saved["fc.weight"].numpy(), ckpt["model"]["fc.weight"].numpy())
    net = build_model(config.Config().model)  # the run's: the default model
    net.set_state_dict(saved)
    ds = data.load_dataset("fashion-mnist", str(fashion_dir))
    again = evaluate(net, ds.test, ds, config.Config(), ONE)
    result = read_results(out)
    assert again.acc == result["test_acc"] == read_metrics(out)[-1]["val_acc"]


def test_tta_is_refused_for_digits():
    with pytest.raises(config.ConfigError, match="not mirror-symmetric"):
        cli.parse_command(["--dataset", "mnist", "--tta"])


def test_tta_scores_the_mean_of_each_image_and_its_mirror(fashion_dir):
    paddle.seed(2)
    net = MnistCNN()
    ds = data.load_dataset("fashion-mnist", str(fashion_dir))
    images, labels = next(data.batches(ds.test, ds, [np.arange(len(ds.test))]))
    x = paddle.to_tensor(images)
    with paddle.no_grad():
        mean_logits = ((net(x) + net(paddle.to_tensor(images[..., ::-1].copy()))) / 2).numpy()
    expected = float((mean_logits.argmax(axis=1) == labels).mean())
    cfg = config.Config(tta=True, eval_batch_size=16)
    got = evaluate(net, ds.test, ds, cfg, ONE, tta=True)
    plain = evaluate(net, ds.test, ds, cfg, ONE)  # the scores after each epoch: no TTA, even with --tta
    assert got.acc == expected and got.count == len(ds.test)
    assert got.loss != plain.loss  # the mirror images did change the outputs
    assert plain == evaluate(net, ds.test, ds, config.Config(eval_batch_size=16), ONE, tta=True)


def test_tta_shift_adds_the_pairs_moved_one_pixel_each_way(fashion_dir):
    """Six views: the image and its mirror at half the weight, the pair moved 1 px up-left and the pair moved 1 px
    down-right (edge rows and columns reflected) at a quarter each."""
    paddle.seed(3)
    net = MnistCNN()
    ds = data.load_dataset("fashion-mnist", str(fashion_dir))
    images, labels = next(data.batches(ds.test, ds, [np.arange(len(ds.test))]))
    padded = np.pad(images, [(0, 0), (0, 0), (1, 1), (1, 1)], mode="reflect")
    up_left, down_right = padded[..., :-2, :-2], padded[..., 2:, 2:]

    def pair(a):
        return net(paddle.to_tensor(a.copy())) + net(paddle.to_tensor(a[..., ::-1].copy()))

    with paddle.no_grad():
        mean_logits = (pair(images) / 4 + pair(up_left) / 8 + pair(down_right) / 8).numpy()
    expected = float((mean_logits.argmax(axis=1) == labels).mean())
    cfg = config.Config(tta=True, tta_shift=True, eval_batch_size=16)
    got = evaluate(net, ds.test, ds, cfg, ONE, tta=True)
    assert got.acc == expected
    flips = evaluate(net, ds.test, ds, config.Config(tta=True, eval_batch_size=16), ONE, tta=True)
    assert got.loss != flips.loss
    with pytest.raises(config.ConfigError, match="--tta-shift adds moved views to --tta's: add --tta"):
        config.parse_args(["--dataset", "fashion-mnist", "--tta-shift"])


@pytest.mark.slow
def test_tta_scores_the_final_test_and_each_epoch_only_where_a_target_judges_it(fashion_dir, tmp_path):
    """Fashion-MNIST's test split is its validation split. Without --target-acc the epochs' scores are plain and
    the final score is --tta's (another loss); with it, every epoch is scored with --tta and the last is reused."""
    args = ["--data-dir", str(fashion_dir), "--epochs", "1", "--train-limit", "1024", "--eval-limit", "500"]
    args += ["--augment", "--tta", "--log-every", "0"]
    for target, same in ((None, False), ("0.999", True)):
        out = tmp_path / f"target{target}"
        more = ["--target-acc", target] if target else []
        proc = run_single([*args, *more, "--output-dir", str(out)], cwd=tmp_path)
        assert proc.returncode == 0, explain(proc)
        last, result = read_metrics(out)[-1], read_results(out)
        assert (result["test_loss"] == last["val_loss"]) is same, (target, result["test_loss"], last["val_loss"])


@pytest.fixture(scope="module")
def four_epochs(fashion_dir, tmp_path_factory):
    """(the arguments, the output folder) of one 4-epoch run, for the tests that read its rows."""
    root = tmp_path_factory.mktemp("full")
    args = ["--data-dir", str(fashion_dir), "--epochs", "4", "--batch-size", "64", "--log-every", "0"]
    full = run_single([*args, "--output-dir", str(root / "o")], cwd=root)
    assert full.returncode == 0, explain(full)
    return args, root / "o"


@pytest.mark.slow
def test_target_acc_ends_the_run_at_the_first_evaluation_that_reaches_it(four_epochs, tmp_path):
    args, full = four_epochs
    accs = [r["val_acc"] for r in read_metrics(full)]
    # epoch 2's accuracy, which epoch 1 fell short of: a run that stops too early (after epoch 1) or too late (at
    # the end, epoch 4) fails, as does one that compares with > instead of >=
    target = accs[1]
    assert len(accs) == 4 and accs[0] < target, f"epoch 1 already reached epoch 2's accuracy: {accs}"
    stop = run_single([*args, "--target-acc", str(target), "--output-dir", str(tmp_path / "stop")], cwd=tmp_path)
    assert stop.returncode == 0, explain(stop)
    assert [r["epoch"] for r in read_metrics(tmp_path / "stop")] == [1, 2]
    assert f"reached --target-acc {target:g}" in stop.stdout
    result = read_results(tmp_path / "stop")
    assert result["test_acc"] == accs[1]
    assert (tmp_path / "stop" / "model.pdparams").is_file() and (tmp_path / "stop" / "inference_meta.json").is_file()


@pytest.mark.slow
def test_metrics_rows_carry_seconds_since_the_command_started(four_epochs):
    rows = read_metrics(four_epochs[1])
    times, epochs = [r["time_s"] for r in rows], [r["epoch_time_s"] for r in rows]
    assert times[0] > epochs[0] > 0  # the clock started before the data was loaded and the first epoch ran
    assert all(later - earlier >= epoch for earlier, later, epoch in zip(times, times[1:], epochs[1:]))


@pytest.mark.slow
def test_time_to_accuracy_script_reports_every_seed(fashion_dir, tmp_path):
    train = ["--data-dir", str(fashion_dir), "--epochs", "2", "--batch-size", "64"]
    cmd = [sys.executable, "-m", "scripts.time_to_accuracy", "--target", "0.15", "0.2", "--seeds", "1", "2"]
    cmd += ["--workers", "1"]
    cmd += ["--json", str(tmp_path / "t.json"), "--work-dir", str(tmp_path / "runs"), "--", *train]
    proc = subprocess.run(cmd, cwd=tmp_path, env=launch_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "t.json").read_text())
    assert [r["seed"] for r in report["runs"]] == [1, 2]
    for r in report["runs"]:
        metrics = read_metrics(tmp_path / "runs" / f"seed{r['seed']}")
        for k, target in enumerate((0.15, 0.2)):
            first = next(m for m in metrics if m["val_acc"] >= target)
            assert r["reached"][k] == {"target": target, "time_s": first["time_s"], "epoch": first["epoch"]}
        assert r["time_to_target_s"] == first["time_s"] and r["epoch_at_target"] == first["epoch"]
        assert r["final_acc"] == read_results(tmp_path / "runs" / f"seed{r['seed']}")["test_acc"]
    assert "reached 0.15 in 2 of 2 runs" in proc.stdout and "reached 0.2 in 2 of 2 runs" in proc.stdout

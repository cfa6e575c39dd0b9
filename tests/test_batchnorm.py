"""Batch norm over the global batch on CPU (--sync-bn, network/batchnorm.py): what it computes, its operators, and
that N workers, micro-batches and a resume on another number of workers train one process's weights to the bit."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest
from helpers import explain, param_digest, run_launch, run_single, weights, worker_log

from paddle_mnist.datasets import data
from paddle_mnist.network import batchnorm, models
from paddle_mnist.ops import fastpath

# the default model on Fashion-MNIST as shipped, batch 96, 15 steps (the job), with --sync-bn
JOB = ["--dataset", "fashion-mnist", "--model", "mnist_cnn_bn_fc", "--max-steps", "15", "--batch-size", "96"]
JOB += ["--train-limit", "3000", "--eval-limit", "600", "--seed", "7", "--sync-bn"]
CIFAR_JPEG = Path(__file__).resolve().parents[2] / "shared" / "data" / "cifar10-jpeg" / "cifar10-jpeg.tar.gz"
LINE = "batch norm: statistics over the global batch of 96 images, on every worker (--sync-bn)"


def test_the_operators_give_the_fallbacks_scalings_to_the_bit_and_its_sums_to_float64s_rounding(op):
    rng = np.random.default_rng(3)
    x, g = (paddle.to_tensor(rng.standard_normal((6, 5, 7, 9)).astype("float32") * 3 + 1) for _ in range(2))
    a, b, c = (paddle.to_tensor(rng.standard_normal(5).astype("float32")) for _ in range(3))
    fast = [fastpath.affine(x, a, b), fastpath.affine(x, a, b, g=g, c=c)]
    sums = [fastpath.plane_sums(x).numpy(), fastpath.plane_sums(g, x).numpy()]
    with fastpath.plain_layers():
        plain = [fastpath.affine(x, a, b), fastpath.affine(x, a, b, g=g, c=c)]
    for mine, paddles in zip(fast, plain):
        assert np.array_equal(mine.numpy(), paddles.numpy())
    xs, gs = x.numpy().astype(np.float64), g.numpy().astype(np.float64)
    expected = [
        np.concatenate([xs.sum((2, 3)), (xs * xs).sum((2, 3))], 1),
        np.concatenate([gs.sum((2, 3)), (gs * xs).sum((2, 3))], 1),
    ]
    for mine, exact in zip(sums, expected):
        assert mine.shape == (6, 10) and mine.dtype == np.float64
        np.testing.assert_allclose(mine, exact, rtol=1e-13)
    # an image's sums are its own, whatever the batch around it
    assert np.array_equal(fastpath.plane_sums(x[2:3]).numpy(), sums[0][2:3])


@pytest.mark.parametrize("fast", [True, False])
def test_in_one_process_it_normalises_and_moves_the_statistics_as_paddles_batch_norm(op, fast):
    """Output, input gradient, weight and bias gradients and running statistics against nn.BatchNorm2D's, by the
    operators and by Paddle's (the fallback where they do not build)."""
    rng = np.random.default_rng(4)
    x_np = (rng.standard_normal((8, 6, 5, 5)) * 2 + 0.5).astype("float32")
    dy_np = rng.standard_normal((8, 6, 5, 5)).astype("float32")
    gamma = rng.uniform(0.5, 1.5, 6).astype("float32")
    results = []
    for spans in (False, True):
        paddle.seed(1)
        layer = batchnorm.BatchNorm2D(6)
        layer.weight.set_value(paddle.to_tensor(gamma))
        if spans:
            assert batchnorm.over_global_batch(layer) == 1
        x = paddle.to_tensor(x_np, stop_gradient=False)
        with batchnorm.meeting(batchnorm.Meeting(lambda t: None, 0, 8)):
            if fast:
                y = layer(x)
            else:
                with fastpath.plain_layers():
                    y = layer(x)
            (y * paddle.to_tensor(dy_np)).sum().backward()
        results.append([y.numpy(), x.grad.numpy(), layer.weight.grad.numpy(), layer.bias.grad.numpy()])
        results[-1] += [layer._mean.numpy(), layer._variance.numpy()]
    for paddles, mine in zip(*results):
        np.testing.assert_allclose(mine, paddles, rtol=2e-5, atol=2e-5)


def test_global_batch_norm_needs_a_meeting_and_is_paddles_in_evaluation():
    paddle.seed(1)
    net = models.build_model("mnist_cnn_bn_fc")
    assert not models.sums_exactly(net) and not batchnorm.spans_global_batch(net)
    assert batchnorm.over_global_batch(net) == 2
    assert batchnorm.spans_global_batch(net) and models.sums_exactly(net)
    x = paddle.randn([4, 1, 28, 28])
    net.eval()
    kept = net(x).numpy()
    with batchnorm.meeting(batchnorm.Meeting(lambda t: None, 0, 4)):
        assert np.array_equal(net(x).numpy(), kept)  # evaluation: the running statistics, as Paddle's
    # Paddle's own batch norm (the ImageNet backbones') is made this module's, with the same state
    backbone = models.build_model("resnet18", 5, (3, 32, 32))
    names = sorted(backbone.state_dict())
    assert batchnorm.over_global_batch(backbone) > 10 and batchnorm.spans_global_batch(backbone)
    assert sorted(backbone.state_dict()) == names


def test_a_meeting_puts_each_workers_rows_at_its_places():
    added = []
    rows = paddle.to_tensor(np.arange(6, dtype=np.float64).reshape(3, 2))
    out = batchnorm.Meeting(added.append, 3, 9, lead=False, world=3).rows(rows)
    assert added and added[0] is out
    expected = np.zeros((9, 2))
    expected[3:6] = rows.numpy()
    assert np.array_equal(out.numpy(), expected)
    assert batchnorm.Meeting(added.append, 0, 3).rows(rows) is rows and len(added) == 1  # one process: no meeting


def test_micro_batch_i_of_every_worker_is_the_global_micro_batch_i():
    for world, accum in ((1, 1), (2, 1), (2, 3), (3, 2)):
        per_worker = 12 // world
        places = [data.worker_places(per_worker, r, world, accum) for r in range(world)]
        assert sorted(np.concatenate(places)) == list(range(12))
        micro = 12 // accum
        for i in range(accum):
            chunk = per_worker // accum
            together = np.concatenate([p[i * chunk : (i + 1) * chunk] for p in places])
            assert list(together) == list(range(i * micro, (i + 1) * micro))


def trained_alone(root: Path, extra: list[str]) -> Path:
    """The job in one process (with extra flags): its output folder."""
    proc = run_single([*JOB, *extra, "--output-dir", str(root)], cwd=root.parent)
    assert proc.returncode == 0, explain(proc)
    assert LINE.replace("96 images", "32 images (a micro-batch)" if extra else "96 images") in proc.stdout
    return root


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> Path:
    return trained_alone(tmp_path_factory.mktemp("alone") / "whole", [])


@pytest.fixture(scope="module")
def micro(tmp_path_factory) -> Path:
    return trained_alone(tmp_path_factory.mktemp("alone") / "micro", ["--accum-steps", "3"])


def same_weights(a: Path, b: Path) -> None:
    one, other = weights(a / "model.pdparams"), weights(b / "model.pdparams")
    assert one.keys() == other.keys() and len(one) == 14  # 10 trained, 4 running statistics
    for name in one:
        assert np.array_equal(one[name], other[name]), f"{name}: {np.abs(one[name] - other[name]).max():.2g} apart"


@pytest.mark.slow
@pytest.mark.parametrize("split", ["2 workers", "3 workers", "2 workers x 3 micro-batches"])
def test_workers_train_one_processs_weights_and_statistics_with_batch_norm(request, tmp_path, split):
    """Fails without --sync-bn's global statistics: each worker would normalise by its own 48 or 32 images. Every
    rank's digest covers its running statistics, which no average evenened out (none is taken)."""
    workers = int(split.split()[0])
    extra = ["--accum-steps", "3"] if "micro" in split else []
    args = [*JOB, *extra, "--output-dir", str(tmp_path / "out")]
    proc = run_launch(args, tmp_path, tmp_path / "log", ["--nproc_per_node", str(workers)])
    assert proc.returncode == 0, explain(proc, tmp_path / "log")
    same_weights(request.getfixturevalue("micro" if extra else "whole"), tmp_path / "out")
    digests = {param_digest(worker_log(tmp_path / "log", r)) for r in range(workers)}
    assert len(digests) == 1


@pytest.mark.slow
def test_without_sync_bn_two_workers_train_other_weights(whole, tmp_path):
    """The check above can fail: per-worker statistics part from one process's within 15 steps."""
    args = [a for a in JOB if a != "--sync-bn"] + ["--output-dir", str(tmp_path / "out")]
    proc = run_launch(args, tmp_path, tmp_path / "log")
    assert proc.returncode == 0, explain(proc, tmp_path / "log")
    assert "batch norm: statistics of each worker's 48 images; --sync-bn normalises" in worker_log(tmp_path / "log", 0)
    with pytest.raises(AssertionError, match="apart"):
        same_weights(whole, tmp_path / "out")


@pytest.mark.slow
def test_a_checkpoint_of_two_workers_resumes_on_three_to_one_processs_bits(whole, tmp_path):
    out = tmp_path / "out"
    first = run_launch([*JOB, "--output-dir", str(out), "--max-steps", "7"], tmp_path, tmp_path / "l2")
    assert first.returncode == 0, explain(first, tmp_path / "l2")
    three = ["--nproc_per_node", "3"]
    again = run_launch([*JOB, "--output-dir", str(out), "--resume"], tmp_path, tmp_path / "l3", three)
    assert again.returncode == 0, explain(again, tmp_path / "l3")
    assert "resumed from" in worker_log(tmp_path / "l3", 2)
    same_weights(whole, out)


@pytest.mark.slow
@pytest.mark.skipif(not CIFAR_JPEG.exists(), reason=f"the CIFAR-10 JPEG copy is not at {CIFAR_JPEG}")
def test_cifar_fast_on_two_workers_equals_one_process_on_the_cifar10_copy(tmp_path):
    subprocess.run(["tar", "xzf", str(CIFAR_JPEG), "-C", str(tmp_path)], check=True)
    root = tmp_path / "cifar"
    root.mkdir()
    for split, keep in (("train", 300), ("test", 30)):  # of each class: what the job reads, decoded in seconds
        (tmp_path / split).rename(root / split)
        for kept in (root / split).iterdir():
            for extra in sorted(kept.iterdir())[keep:]:
                extra.unlink()
    job = ["--dataset", "folder", "--data-dir", str(root), "--model", "cifar_fast", "--max-steps", "6"]
    job += ["--batch-size", "96", "--train-limit", "3000", "--eval-limit", "300", "--seed", "7", "--sync-bn"]
    one = run_single([*job, "--output-dir", str(tmp_path / "one")], cwd=tmp_path, timeout=600)
    assert one.returncode == 0, explain(one)
    two = run_launch([*job, "--output-dir", str(tmp_path / "two")], tmp_path, tmp_path / "log")
    assert two.returncode == 0, explain(two, tmp_path / "log")
    a, b = weights(tmp_path / "one" / "model.pdparams"), weights(tmp_path / "two" / "model.pdparams")
    assert a.keys() == b.keys() and len(a) == 7 * 6 + 1  # 7 conv modules (6 tensors each), the classifier
    for name in a:
        assert np.array_equal(a[name], b[name]), name


def test_the_exact_path_hands_over_every_batch_norm_gradient(op):
    """One step's float64 sums cover every trained tensor of the default model once its batch norm spans the
    global batch (exact.Sums.gradients refuses a model where one is missing)."""
    from paddle_mnist.network import exact

    paddle.seed(2)
    net = models.build_model("mnist_cnn_bn_fc")
    batchnorm.over_global_batch(net)
    x, y = paddle.randn([8, 1, 28, 28]), paddle.randint(0, 10, [8])
    sums = exact.Sums()
    with exact.summing(sums), batchnorm.meeting(batchnorm.Meeting(lambda t: None, 0, 8)):
        F.cross_entropy(net(x), y).backward()
    sums.gradients(net.parameters(), lambda t: None)
    trained = [p for p in net.parameters() if not p.stop_gradient]
    assert {id(p) for p in trained} == set(sums.by_param) and len(trained) == 10


@pytest.mark.slow
def test_paddles_own_batch_norm_gets_the_global_statistics_on_the_float32_path(tmp_path):
    """resnet18 (Paddle's layers: no exact path): its batch norm layers are made global by --sync-bn, and each worker
    returns 1/N of the weight's and bias's global gradient sums, which DataParallel's average makes whole. After one
    step at a high rate, 2 workers move them as one process does, to float32's rounding; a factor of N off, or per
    worker statistics, would move them otherwise."""
    job = ["--dataset", "mnist", "--model", "resnet18", "--max-steps", "1", "--batch-size", "32", "--train-limit"]
    job += ["512", "--eval-limit", "100", "--seed", "3", "--sync-bn", "--lr", "0.5", "--warmup-epochs", "0"]
    job += ["--weight-decay", "0"]
    one = run_single([*job, "--output-dir", str(tmp_path / "one")], cwd=tmp_path)
    assert one.returncode == 0, explain(one)
    two = run_launch([*job, "--output-dir", str(tmp_path / "two")], tmp_path, tmp_path / "log")
    assert two.returncode == 0, explain(two, tmp_path / "log")
    assert "gradients: each step's summed in float64" not in worker_log(tmp_path / "log", 0)
    a, b = weights(tmp_path / "one" / "model.pdparams"), weights(tmp_path / "two" / "model.pdparams")
    norms = [k for k in a if ".bn" in k or k.startswith("bn")]
    assert len(norms) == 17 * 4  # the stem's and two a block (the downsampling ones are named otherwise)
    for name in (k for k in norms if k.endswith((".weight", ".bias"))):
        start = 1.0 if name.endswith("weight") else 0.0
        moved = np.abs(a[name] - start).sum()
        assert moved > 1e-2, name  # the step moved it
        np.testing.assert_allclose(b[name], a[name], atol=2e-5 * max(1.0, moved), err_msg=name)

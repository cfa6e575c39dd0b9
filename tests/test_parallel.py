"""Real multi-process runs through paddle.distributed.launch on CPU (gloo), checked by what they produce."""

from __future__ import annotations

import concurrent.futures
import json
from pathlib import Path

import numpy as np
import paddle
import pytest
from helpers import (
    REAL_JOB,
    explain,
    free_port,
    param_digest,
    read_metrics,
    read_results,
    run_launch,
    run_one_and_two,
    run_single,
    small_run,
    weights,
    worker_log,
)

from paddle_mnist.config import Config
from paddle_mnist.datasets import data
from paddle_mnist.network.models import MnistCNN
from paddle_mnist.runtime.distributed import DistEnv
from paddle_mnist.training.evaluation import evaluate

pytestmark = pytest.mark.slow  # every test here starts the trainer in real processes

SMALL = small_run()


@pytest.fixture(scope="module")
def one_and_two(dataset, tmp_path_factory):
    """The same job, global batch 64 for 2 epochs (16 steps), in one process and in two workers."""
    root = tmp_path_factory.mktemp("runs")
    args = [*SMALL, "--data-dir", str(dataset), "--batch-size", "64", "--epochs", "2"]
    return run_one_and_two(root, args)


@pytest.mark.readme
def test_every_rank_ends_with_identical_parameters(one_and_two):
    logs = [worker_log(one_and_two / "log", r) for r in (0, 1)]
    assert param_digest(logs[0]) == param_digest(logs[1])


@pytest.mark.readme
def test_two_workers_equal_one_process_with_the_same_global_batch(one_and_two):
    one = weights(one_and_two / "one" / "model.pdparams")
    two = weights(one_and_two / "two" / "model.pdparams")
    assert one.keys() == two.keys() and len(one) == 6
    for name in one:
        np.testing.assert_allclose(two[name], one[name], atol=1e-5, rtol=0, err_msg=name)
    m1, m2 = read_metrics(one_and_two / "one"), read_metrics(one_and_two / "two")
    assert [r["step"] for r in m2] == [8, 16]
    for a, b in zip(m1, m2):
        assert b["train_loss"] == pytest.approx(a["train_loss"], abs=1e-4)
        assert b["train_acc"] == pytest.approx(a["train_acc"], abs=1e-9)


def trained_alone(tmp_path_factory, name: str, job: list[str]) -> Path:
    """The output folder of `job` trained by one process."""
    out = tmp_path_factory.mktemp(name) / "one"
    proc = run_single([*job, "--output-dir", str(out)], cwd=out.parent)
    assert proc.returncode == 0, explain(proc)
    return out


def check_launched_equals(one: Path, job: list[str], tmp_path: Path, workers: int, parameters: int) -> str:
    """Train `job` on `workers` workers and check every weight against one process's, to the bit; rank 0's log."""
    args = [*job, "--output-dir", str(tmp_path / "out")]
    proc = run_launch(args, tmp_path, tmp_path / "log", ["--nproc_per_node", str(workers)])
    assert proc.returncode == 0, explain(proc, tmp_path / "log")
    check_same_bits(one, tmp_path / "out", parameters)
    return worker_log(tmp_path / "log", 0)


@pytest.fixture(scope="module")
def real_one(tmp_path_factory) -> Path:
    return trained_alone(tmp_path_factory, "real", REAL_JOB)


@pytest.mark.parametrize("workers", [2, 3])
def test_workers_equal_one_process_on_real_mnist_with_its_default_recipe(real_one, tmp_path, workers):
    """Each image gets the same shift on any number of workers, so N workers train the one process's step."""
    log = check_launched_equals(real_one, REAL_JOB, tmp_path, workers, parameters=6)
    assert "augmentation random shifts of up to 2 px" in log  # as the recipe says


# The oldest check's job, as issue #54 found it parting: Fashion-MNIST as shipped, mnist_cnn, batch 96, 15 steps,
# seed 7, with oneDNN held to its AVX2 kernels (ONEDNN_MAX_CPU_ISA), those of the AMD EPYC where it showed. While
# each worker and micro-batch summed its gradients in float32, 2 workers and 3 micro-batches ended 5.0e-3 from one
# process (a max-pool's near-tie in step 4 amplified the rounding); summed in float64 and rounded once
# (network/exact.py), the weights are the same bits (2026-11-27).
FASHION_JOB = ["--dataset", "fashion-mnist", "--model", "mnist_cnn", "--max-steps", "15", "--batch-size", "96"]
FASHION_JOB += ["--train-limit", "3000", "--eval-limit", "600", "--seed", "7"]
AVX2_KERNELS = {"ONEDNN_MAX_CPU_ISA": "AVX2"}
EXACT_LINE = "gradients: each step's summed in float64 and rounded once"


def check_same_bits(one: Path, split: Path, parameters: int) -> None:
    alone, split_run = weights(one / "model.pdparams"), weights(split / "model.pdparams")
    assert alone.keys() == split_run.keys() and len(alone) == parameters
    for name in alone:
        gap = float(np.abs(split_run[name] - alone[name]).max())
        assert np.array_equal(split_run[name], alone[name]), f"{name}: {gap:.2g} from one process's"


def run_split(job: list[str], tmp_path: Path, split: str, env: dict | None = None) -> str:
    """Train job on "N workers" or "N micro-batches" into tmp_path/out; rank 0's log (or the process's)."""
    args = [*job, "--output-dir", str(tmp_path / "out")]
    count, kind = split.split()
    if kind == "micro-batches":
        proc = run_single([*args, "--accum-steps", count], cwd=tmp_path, env=env)
        assert proc.returncode == 0, explain(proc)
        return proc.stdout + proc.stderr
    proc = run_launch(args, tmp_path, tmp_path / "log", ["--nproc_per_node", count], env=env)
    assert proc.returncode == 0, explain(proc, tmp_path / "log")
    return worker_log(tmp_path / "log", 0)


@pytest.fixture(scope="module")
def fashion_one(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fashion") / "one"
    proc = run_single([*FASHION_JOB, "--output-dir", str(out)], cwd=out.parent, env=AVX2_KERNELS)
    assert proc.returncode == 0, explain(proc)
    assert EXACT_LINE in proc.stdout + proc.stderr
    return out


@pytest.mark.parametrize("split", [pytest.param("2 workers", marks=pytest.mark.readme), "3 workers", "3 micro-batches"])
def test_workers_and_micro_batches_train_one_process_weights_to_the_bit(fashion_one, tmp_path, split):
    """The same global batch of 96 split among workers or micro-batches trains one process's weights, the same
    bits, with oneDNN's convolutions: each image's gradient is the same in any batch (tests/test_onednn.py) and
    the step's sums are rounded once (network/exact.py)."""
    log = run_split(FASHION_JOB, tmp_path, split, AVX2_KERNELS)
    assert "convolutions: oneDNN" in log  # not Paddle's, which a failed build or check would fall back to
    assert EXACT_LINE in log
    check_same_bits(fashion_one, tmp_path / "out", parameters=6)


# cifar_cnn's three dropout layers on real MNIST, 15 steps, seed 1: while the sums were float32, from step 4 on a
# unit near ReLU's 0 took a different side in the two runs, and 2 and 3 workers ended 1.9e-2 and 1.7e-2 apart
DROPOUT_JOB = ["--dataset", "mnist", "--model", "cifar_cnn", "--max-steps", "15", "--batch-size", "96"]
DROPOUT_JOB += ["--train-limit", "3000", "--eval-limit", "600", "--seed", "1"]


@pytest.fixture(scope="module")
def dropout_one(tmp_path_factory) -> Path:
    return trained_alone(tmp_path_factory, "dropout", DROPOUT_JOB)


@pytest.mark.parametrize("split", ["2 workers", "3 workers"])
def test_workers_drop_what_one_process_drops(dropout_one, tmp_path, split):
    """Each image's dropout masks are drawn by its place in the global batch (paddle_mnist.network.dropout): with
    paddle.nn.Dropout the same runs ended 0.041 (2 workers) and 0.058 (3) apart after 6 steps."""
    run_split(DROPOUT_JOB, tmp_path, split)
    check_same_bits(dropout_one, tmp_path / "out", parameters=12)


@pytest.mark.readme
def test_worker_logs_are_rank_tagged(one_and_two):
    for rank in (0, 1):
        text = worker_log(one_and_two / "log", rank)
        assert f"[rank {rank}/2] rank {rank} of world size 2" in text
        assert "backend gloo, device cpu" in text
        assert "batch: 32 per worker, 64 global" in text
        assert f"[rank {rank}/2] epoch 2/2 done" in text


@pytest.mark.readme
def test_a_two_worker_run_writes_every_output_file(one_and_two):
    """What is written; that only rank 0 writes is test_two_nodes_on_loopback_equal_one_process's check."""
    out = one_and_two / "two"
    for name in ("config.json", "metrics.jsonl", "model.pdparams", "curves.png", "results.json", "inference_meta.json"):
        assert (out / name).is_file(), name
    assert (out / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert len(list((out / "checkpoints").glob("step_*.pdckpt"))) == 2
    assert json.loads((out / "config.json").read_text())["batch_size"] == 64
    row = read_metrics(out)[-1]
    for key in ("epoch", "train_loss", "train_acc", "val_loss", "val_acc", "images_per_sec", "epoch_time_s", "lr"):
        assert key in row
    assert row["world_size"] == 2 and row["global_batch_size"] == 64 and row["images_per_sec"] > 0


@pytest.mark.readme
def test_distributed_evaluation_counts_each_image_once(one_and_two, dataset):
    """201 test images over 2 workers (101 + 100): the reported totals equal a one-process evaluation."""
    out = one_and_two / "two"
    assert all(r["val_count"] == 201 for r in read_metrics(out))
    reported = read_results(out)
    assert reported["test_count"] == 201

    model = MnistCNN()  # a bare model, no DataParallel: the saved keys carry no _layers. prefix
    model.set_state_dict(paddle.load(str(out / "model.pdparams")))
    ds = data.load_dataset("mnist", str(dataset))
    local = evaluate(model, ds.test.head(201), ds, Config(), DistEnv(0, 1, 0, 1, "none", "cpu"))
    assert local.count == 201
    assert local.acc == reported["test_acc"]
    assert local.loss == pytest.approx(reported["test_loss"], rel=1e-5)
    assert reported["test_acc"] > 0.5  # the synthetic classes are learnable: training did something


@pytest.mark.parametrize(
    "model",
    [
        pytest.param("mnist_cnn", marks=pytest.mark.readme),
        "mnist_cnn_bn",
        "mnist_cnn_bn_fc --ema 0.9",
        "mnist_cnn_bn --lookahead",
        "mnist_cnn_bn_fc --opt adamw --sched cosine --warmup-epochs 1 --augment photo --mixup 0.2 --cutmix 1",
    ],
)
def test_resume_mid_epoch_equals_an_uninterrupted_run(dataset, tmp_path, model):
    # with batch norm each rank's running statistics are its own until they are averaged, which happens at
    # every checkpoint, so all ranks restart from the state they had at that step; with --ema the moving average
    # (what model.pdparams then holds) is checkpointed too, as is --lookahead's slow copy (steps 5 and 10 pulled
    # the weights to it before the stop at 12; 15 and 20 pull them after it, and the last step, 24, ends on it);
    # AdamW's moments and the cosine's step are checkpointed; photo augmentation's crops, colours, erasing and
    # mixed pairs are drawn from the batch's coordinates alone
    args = [*SMALL, "--data-dir", str(dataset), "--batch-size", "64", "--epochs", "3", "--model", *model.split()]
    args += ["--save-every-steps", "4"]
    full = run_launch([*args, "--output-dir", str(tmp_path / "full")], cwd=tmp_path, log_dir=tmp_path / "l1")
    assert full.returncode == 0, explain(full, tmp_path / "l1")
    # stop after 12 steps (epoch 2, batch 4 of 8), then continue with the same command plus --resume
    part = run_launch(
        [*args, "--output-dir", str(tmp_path / "part"), "--max-steps", "12"], cwd=tmp_path, log_dir=tmp_path / "l2"
    )
    assert part.returncode == 0, explain(part, tmp_path / "l2")
    assert read_metrics(tmp_path / "part")[-1]["step"] == 12
    again = run_launch(
        [*args, "--output-dir", str(tmp_path / "part"), "--resume"], cwd=tmp_path, log_dir=tmp_path / "l3"
    )
    assert again.returncode == 0, explain(again, tmp_path / "l3")
    assert "resumed from" in worker_log(tmp_path / "l3", 1)

    a, b = weights(tmp_path / "full" / "model.pdparams"), weights(tmp_path / "part" / "model.pdparams")
    for name in a:
        np.testing.assert_array_equal(b[name], a[name], err_msg=name)
    full_rows, resumed_rows = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "part")
    assert [r["epoch"] for r in resumed_rows] == [1, 2, 3]
    for key in ("val_loss", "val_acc", "lr"):
        assert resumed_rows[2][key] == full_rows[2][key]
    assert resumed_rows[0]["train_loss"] == full_rows[0]["train_loss"]


def test_batch_that_does_not_split_stops_every_worker(dataset, tmp_path):
    proc = run_launch(
        [*SMALL, "--data-dir", str(dataset), "--batch-size", "63", "--output-dir", str(tmp_path / "o")],
        cwd=tmp_path,
        log_dir=tmp_path / "log",
    )
    assert proc.returncode != 0
    for rank in (0, 1):
        assert "--batch-size 63 does not divide by the 2 workers" in worker_log(tmp_path / "log", rank)
    assert not (tmp_path / "o").exists()


def test_existing_results_are_not_overwritten(dataset, tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"epoch": 1}\n')
    proc = run_launch(
        [*SMALL, "--data-dir", str(dataset), "--output-dir", str(out)], cwd=tmp_path, log_dir=tmp_path / "log"
    )
    assert proc.returncode != 0
    assert "already holds a run's results" in worker_log(tmp_path / "log", 0)
    assert "rank 0 refused --output-dir" in worker_log(tmp_path / "log", 1)
    assert (out / "metrics.jsonl").read_text() == '{"epoch": 1}\n'


@pytest.mark.skipif(paddle.is_compiled_with_cuda(), reason="checks the CPU-only build's handling of GPU flags")
def test_gpu_flags_on_a_cpu_build_are_refused(dataset, tmp_path):
    proc = run_launch(
        [*SMALL, "--data-dir", str(dataset), "--output-dir", str(tmp_path / "o")],
        cwd=tmp_path,
        log_dir=tmp_path / "log",
        launch_args=["--selected_gpus=0,1,2,3"],
    )
    assert proc.returncode != 0
    text = (tmp_path / "log" / "workerlog.0").read_text()
    assert "launched with --selected_gpus=0,1,2,3, but this Paddle build has no CUDA" in text
    assert "--nproc_per_node 4" in text
    assert not (tmp_path / "o").exists()


def test_two_nodes_on_loopback_equal_one_process(one_and_two, dataset, tmp_path):
    """Two launchers (--nnodes 2, one worker each) meeting on 127.0.0.1 train the same weights as one process."""
    port = free_port()
    args = [*SMALL, "--data-dir", str(dataset), "--batch-size", "64", "--epochs", "2"]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [
            pool.submit(
                run_launch,
                [*args, "--output-dir", str(tmp_path / f"node{node}")],
                tmp_path,
                tmp_path / f"log{node}",
                ["--nnodes", "2", "--master", f"127.0.0.1:{port}", "--rank", str(node), "--nproc_per_node", "1"],
            )
            for node in (0, 1)
        ]
        results = [f.result() for f in futures]
    for node, proc in enumerate(results):
        assert proc.returncode == 0, explain(proc, tmp_path / f"log{node}")
    logs = [worker_log(tmp_path / f"log{node}", 0) for node in (0, 1)]  # each node numbers its own logs
    assert "rank 1 of world size 2 (local rank 0 of 1)" in logs[1]
    assert param_digest(logs[0]) == param_digest(logs[1])
    one = weights(one_and_two / "one" / "model.pdparams")
    two = weights(tmp_path / "node0" / "model.pdparams")
    for name in one:
        np.testing.assert_allclose(two[name], one[name], atol=1e-5, rtol=0, err_msg=name)
    assert not (tmp_path / "node1").exists()  # only global rank 0 writes


def test_timing_every_step_leaves_the_training_unchanged(one_and_two, dataset, tmp_path):
    """--timing-every 1 times every step's phases, the all-reduce left inside backward where DataParallel runs it:
    the weights are the untimed run's to the bit, and every worker logs where its step time went."""
    args = [*SMALL, "--data-dir", str(dataset), "--batch-size", "64", "--epochs", "2", "--timing-every", "1"]
    proc = run_launch([*args, "--output-dir", str(tmp_path / "timed")], cwd=tmp_path, log_dir=tmp_path / "log")
    assert proc.returncode == 0, explain(proc, tmp_path / "log")
    untimed = weights(one_and_two / "two" / "model.pdparams")
    timed = weights(tmp_path / "timed" / "model.pdparams")
    for name in untimed:
        np.testing.assert_array_equal(timed[name], untimed[name], err_msg=name)
    for rank in (0, 1):
        text = worker_log(tmp_path / "log", rank)
        line = next(x for x in text.splitlines() if f"[rank {rank}/2] epoch 2 time per step" in x)
        for phase in ("forward", "backward+all-reduce", "optimizer", "input wait", "logging/checkpoints", "other"):
            assert f" {phase} " in line, line
        assert "(8 sampled steps)" in line
    shares = read_metrics(tmp_path / "timed")[-1]["step_time_shares"]
    assert set(shares) == {"forward", "backward", "optimizer", "input_wait", "logging", "other"}
    # each phase measured (forward was 0.099 of mnist_cnn's step on a Zen 4 with its maps NHWC, 2026-11-29)
    assert shares["forward"] > 0.04 and shares["backward"] > 0.2 and shares["optimizer"] > 0
    assert sum(shares.values()) == pytest.approx(1.0)
    # the default samples every 25th step: 8 steps per epoch means none was timed, and the log says only what it saw
    default_line = next(x for x in worker_log(one_and_two / "log", 0).splitlines() if "epoch 2 time per step" in x)
    assert "all-reduce" not in default_line and "input wait" in default_line and "(0 sampled steps)" in default_line

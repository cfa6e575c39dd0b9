"""scripts/bench_torch.py's trainer side: each cell runs the trainer on the cell's number of workers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import launch_env, run_single, small_run

from scripts import bench_torch

pytestmark = pytest.mark.slow  # the trainer runs in real processes


@pytest.mark.parametrize("workers", [1, 3])
def test_a_cell_runs_the_trainer_on_its_own_number_of_workers(tmp_path, workers):
    """A 3x1 cell once launched 2 workers with 3 workers' batch; run_trainer now checks the world size it ran."""
    data = ["--dataset", "fashion-mnist", "--train-limit", "960"]
    rates = bench_torch.run_trainer("mnist_cnn", workers, 1, (6, 2), data, tmp_path, launch_env())
    assert len(rates) == 2 and all(rate > 0 for rate in rates)
    log = (tmp_path / "trainer-log" / "workerlog.0").read_text() if workers > 1 else None
    if log is not None:
        assert f"of world size {workers} " in log


def test_scaling_cells_go_up_to_the_cores_then_one_process_on_all_of_them():
    assert bench_torch.scaling_cells(16) == [(1, 1), (2, 1), (4, 1), (8, 1), (16, 1), (1, 16)]
    assert bench_torch.scaling_cells(6) == [(1, 1), (2, 1), (4, 1), (6, 1), (1, 6)]
    assert bench_torch.scaling_cells(2) == [(1, 1), (2, 1), (1, 2)]
    assert bench_torch.scaling_cells(1) == [(1, 1)]
    assert bench_torch.parse_cells("1x1,2x1") == [(1, 1), (2, 1)]
    assert bench_torch.parse_cells("2x") == [] and bench_torch.parse_cells("0x1") == []


def test_the_limit_runs_one_independent_trainer_per_worker_side_by_side(tmp_path):
    """The no-collective limit: two single-process trainers at once, each with its own seed, log and rate."""
    data = ["--dataset", "fashion-mnist", "--train-limit", "960"]
    rates = bench_torch.run_alone("mnist_cnn", 2, 1, (6, 2), data, tmp_path, launch_env())
    assert len(rates) == 2 and all(rate > 0 for rate in rates)
    logs = [(tmp_path / f"alone{i}.log").read_text() for i in range(2)]
    assert all("of world size 1 " in log for log in logs)
    seeds = [json.loads((tmp_path / f"alone{i}" / "config.json").read_text())["seed"] for i in range(2)]
    assert seeds == [1, 2]


def test_one_process_on_more_than_two_threads_is_told_the_workers_command(tmp_path, dataset):
    """The start-up line of #55's item 4: one CPU process on many threads names the launcher's command and the
    measured factor; 2 threads (this VM's cores) stay quiet."""
    args = [*small_run(train_limit=128, eval_limit=64), "--data-dir", str(dataset), "--max-steps", "1"]
    said = {}
    for threads in (2, 4):
        out = tmp_path / f"t{threads}"
        proc = run_single([*args, "--cpu-threads", str(threads), "--output-dir", str(out)], cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-2000:]
        said[threads] = proc.stdout + proc.stderr
    assert "workers of one thread each" not in said[2]
    line = next(x for x in said[4].splitlines() if "workers of one thread each" in x)
    assert "--nproc_per_node 4 train.py ... --batch-size 256" in line and "3.6 times as fast" in line


def test_the_float32_contender_turns_the_float64_sums_off_and_nothing_else(tmp_path):
    """trainer-f32 prices exactness: its environment takes mnist_cnn off the float64 sums (the start-up line that
    says them is gone), where the plain trainer has them; both train, on oneDNN's operators."""
    args = ["--model", "mnist_cnn", "--train-limit", "640", "--max-steps", "4", "--eval-limit", "64", "--no-augment"]
    logs = {}
    for name in ("trainer", "trainer-f32"):
        proc = run_single(
            [*args, "--output-dir", str(tmp_path / name)], tmp_path, env=bench_torch.TRAINER_ENV.get(name)
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        logs[name] = proc.stdout
    assert "summed in float64" in logs["trainer"] and "summed in float64" not in logs["trainer-f32"]
    assert all("convolutions: oneDNN" in log for log in logs.values())


def test_the_nchw_contender_holds_cifar_cnns_maps_nchw_and_nothing_else():
    """trainer-nchw prices cifar_cnn's blocked maps: its environment turns them off in a new network, the plain
    trainer's keeps them."""
    code = (
        "from paddle_mnist.network import models; print(models.build_model('cifar_cnn', 10, (3, 32, 32)).blocked_maps)"
    )
    printed = {}
    for name in ("trainer", "trainer-nchw"):
        env = launch_env() | bench_torch.TRAINER_ENV.get(name, {})
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        printed[name] = proc.stdout.split()[-1]
    assert printed == {"trainer": "True", "trainer-nchw": "False"}


def test_op_table_puts_every_operator_in_a_row_and_finds_the_unrecorded_forward_passes(tmp_path):
    """scripts/op_table's trainer side on mnist_cnn: the convolutions' backward passes (the float64 path's PyLayer),
    the forward passes paddle.profiler does not record (the custom operators), a rate; and names to rows."""
    from scripts import op_table

    side = op_table.trainer_part("mnist_cnn", 1, 5, ["--train-limit", "3200"], launch_env())
    rows = {op_table.row_of(name, False) for name in side["ops"]}
    assert {"convolution backward", "max-pool backward", op_table.FORWARD_UNRECORDED} <= rows, side["ops"]
    assert side["ops"][op_table.FORWARD_UNRECORDED] > 0 and side["rate"] > 0 and side["exact"]
    assert (
        op_table.row_of("ReluGradNode", False) == "ReLU backward" and op_table.row_of("relu", False) == "ReLU forward"
    )
    assert op_table.row_of("aten::native_batch_norm_backward", True) == "batch norm backward"
    assert op_table.row_of("aten::add_", True) == "optimizer" and op_table.row_of("aten::add", True).startswith("bias")

"""Random generator states per rank (rng.py), given the states a GPU job saves: kept, restored, dropped with a line."""

from __future__ import annotations

import numpy as np
import paddle
import pytest
from helpers import cifar_members, explain, param_digest, run_single, write_cifar_archive

from paddle_mnist.datasets import data
from paddle_mnist.files import checkpoint
from paddle_mnist.runtime import distributed
from paddle_mnist.runtime.distributed import DistEnv
from paddle_mnist.training import rng

GeneratorState = paddle.base.libpaddle.GeneratorState


def generator_state(device: int, seed: int) -> GeneratorState:
    """A GeneratorState as a GPU build's generator of `device` gives it (-1: the CPU's), rebuilt the way
    unpickling a checkpoint rebuilds one: the CPU generator's own fields, with the device and seed replaced."""
    fields = paddle.base.core.default_cpu_generator().get_state().__getstate__()
    state = GeneratorState.__new__(GeneratorState)
    state.__setstate__((device, seed, *fields[2:]))
    return state


def saved_by(devices: list[str]) -> list[dict]:
    """What a job with one worker per device saves: rank r's CPU state (seed 100 + r) and its GPU's (200 + r)."""
    visible = [generator_state(i, 200 + i) for i in range(8)]  # a GPU worker's process holds one per visible GPU
    return [rng.own_states(d, generator_state(-1, 100 + r), visible) for r, d in enumerate(devices)]


def seed_of(state) -> int | None:
    return None if state is None else state.current_seed()


FOUR_GPUS = ["gpu:0", "gpu:1", "gpu:2", "gpu:3"]


def test_a_gpu_worker_saves_its_own_gpu_generator_and_the_cpu_one():
    visible = [generator_state(i, 200 + i) for i in range(8)]  # 4 workers on an 8-GPU node: 8 in every process
    own = rng.own_states("gpu:2", generator_state(-1, 7), visible)
    assert own["device"] == "gpu:2" and seed_of(own["gpu"]) == 202 and seed_of(own["cpu"]) == 7
    assert rng.own_states("cpu", generator_state(-1, 7), [])["gpu"] is None


def test_the_same_layout_restores_each_ranks_own_states_without_a_warning():
    saved = saved_by(FOUR_GPUS)
    for rank in range(4):
        chosen, warning = rng.to_restore(saved, rank, 4, f"gpu:{rank}")
        assert warning is None
        assert (seed_of(chosen["cpu"]), seed_of(chosen["gpu"])) == (100 + rank, 200 + rank)


def test_four_gpu_states_resume_on_two_gpus_dropping_ranks_2_and_3_with_one_line():
    saved = saved_by(FOUR_GPUS)
    for rank in range(2):
        chosen, warning = rng.to_restore(saved, rank, 2, f"gpu:{rank}")
        assert (seed_of(chosen["cpu"]), seed_of(chosen["gpu"])) == (100 + rank, 200 + rank)
        assert warning.startswith("warning: ") and "\n" not in warning
        assert "the states of ranks 2-3 are dropped (4 workers saved, 2 now)" in warning
        assert warning.endswith("every generator of this job gets its own saved state back")
    _, warning = rng.to_restore(saved, 0, 3, "gpu:0")
    assert "the states of rank 3 are dropped" in warning


@pytest.mark.parametrize("world", [1, 2])
def test_four_gpu_states_resume_on_cpu_keeping_the_cpu_generators(world):
    saved = saved_by(FOUR_GPUS)
    for rank in range(world):
        chosen, warning = rng.to_restore(saved, rank, world, "cpu")
        assert seed_of(chosen["cpu"]) == 100 + rank and chosen["gpu"] is None
        assert f"rank {rank}'s GPU generator state is dropped (saved on gpu:{rank}, now on CPU)" in warning
        assert "\n" not in warning


def test_more_workers_than_saved_and_cpu_states_on_a_gpu_are_named():
    chosen, warning = rng.to_restore(saved_by(["cpu", "cpu"]), 3, 4, "gpu:3")
    assert chosen == {"cpu": None, "gpu": None}
    assert "no state is saved for ranks 2-3 (2 workers saved, 4 now)" in warning
    assert "start from --seed" in warning
    chosen, warning = rng.to_restore(saved_by(["cpu", "cpu"]), 1, 2, "gpu:1")
    assert seed_of(chosen["cpu"]) == 101 and chosen["gpu"] is None
    assert "rank 1's GPU generator has no saved state (saved on cpu)" in warning


def test_applying_a_saved_cpu_state_continues_its_dropout_stream():
    paddle.set_device("cpu")
    paddle.seed(3)
    saved = rng.current("cpu")
    drop = paddle.nn.Dropout(0.5)
    ones = paddle.ones([64])
    expected = drop(ones).numpy()
    rng.apply(rng.to_restore([saved], 0, 1, "cpu")[0], "cpu")
    assert np.array_equal(drop(ones).numpy(), expected)
    assert not np.array_equal(drop(ones).numpy(), expected)  # the stream moved on: the comparison can fail


def test_rng_states_travel_through_the_gather_and_the_checkpoint(tmp_path):
    one = DistEnv(0, 1, 0, 1, "none", "cpu")
    states = distributed.gather_objects(saved_by(["gpu:0"])[0], one)
    assert seed_of(states[0]["gpu"]) == 200 and states[0]["gpu"].__getstate__()[0] == 0
    checkpoint.save_atomic({"rng": {"by_rank": saved_by(FOUR_GPUS)}}, tmp_path / "c.pdckpt")
    back = checkpoint.load(tmp_path / "c.pdckpt")["rng"]["by_rank"]
    assert [(seed_of(e["cpu"]), seed_of(e["gpu"]), e["device"]) for e in back] == [
        (100 + r, 200 + r, f"gpu:{r}") for r in range(4)
    ]


@pytest.mark.slow
def test_a_four_gpu_checkpoint_resumes_on_cpu_bit_for_bit(tmp_path):
    """A checkpoint whose rank 0 entry is the run's own CPU state, plus GPU states and three more ranks' as a 4-GPU
    job writes them, resumes in one CPU process with one warning and ends with the weights of the run that never
    stopped, on Paddle 2.6 too (whose pickled CPU state restarts from its seed): cifar_cnn's dropout draws its masks
    by batch place (paddle_mnist.network.dropout), not from the generators."""
    write_cifar_archive(tmp_path / "c" / data.CIFAR_ARCHIVE, cifar_members(n_per_batch=16, n_test=8))
    args = ["--dataset", "cifar10", "--data-dir", str(tmp_path / "c"), "--model", "cifar_cnn", "--batch-size", "16"]
    args += ["--epochs", "2", "--lr", "0.01"]
    whole = run_single([*args, "--output-dir", str(tmp_path / "whole")], cwd=tmp_path)
    assert whole.returncode == 0, explain(whole)
    part = run_single([*args, "--max-steps", "5", "--output-dir", str(tmp_path / "part")], cwd=tmp_path)
    assert part.returncode == 0, explain(part)
    path = checkpoint.checkpoint_path(tmp_path / "part", 5)
    contents = checkpoint.load(path)
    own = contents["rng"]["by_rank"][0]
    gpu_job = saved_by(FOUR_GPUS)
    gpu_job[0]["cpu"] = own["cpu"]
    contents["rng"]["by_rank"] = gpu_job
    checkpoint.save_atomic(contents, path)
    resumed = run_single([*args, "--resume", "auto", "--output-dir", str(tmp_path / "part")], cwd=tmp_path)
    assert resumed.returncode == 0, explain(resumed)
    warnings = [line for line in resumed.stdout.splitlines() if "random generator states" in line]
    assert len(warnings) == 1, resumed.stdout
    assert "ranks 1-3 are dropped" in warnings[0] and "rank 0's GPU generator state is dropped" in warnings[0]
    assert param_digest(resumed.stdout) == param_digest(whole.stdout)

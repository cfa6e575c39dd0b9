"""The GPU path's logic, run on CPU with the inputs a GPU machine would give: RNG states per rank, the launch
layout, AMP on a given compute capability, gradient norms with overflow steps, the export after --sync-bn, and
the host-to-device feed (its CPU path unchanged)."""

from __future__ import annotations

import json
import logging
import threading

import numpy as np
import paddle
import pytest
from helpers import cifar_members, explain, param_digest, run_single, write_cifar_archive

from paddle_mnist import checkpoint, data, distributed, engine, export, launch, rng, session, trainer, transfer
from paddle_mnist.config import Config
from paddle_mnist.distributed import DistEnv
from paddle_mnist.models import build_model
from paddle_mnist.outputs import RunFiles
from paddle_mnist.predictor import Predictor, normalise
from paddle_mnist.state import TrainState

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
# Paddle 2.6's GeneratorState pickles (device, seed, offset) only, without the CPU generator's mt19937 engine:
# read back from a checkpoint, a CPU state restarts the stream from its seed. 3.x pickles the engine too.
PICKLED_CPU_STATE_IS_WHOLE = len(paddle.base.core.default_cpu_generator().get_state().__getstate__()) > 3


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
    """cifar_cnn draws dropout masks from the CPU generator. A checkpoint whose rank 0 entry is the run's own CPU
    state, plus GPU states and three more ranks' as a 4-GPU job writes them, resumes in one CPU process with one
    warning and ends with the weights of the run that never stopped (Paddle 3.x; see PICKLED_CPU_STATE_IS_WHOLE)."""
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
    if PICKLED_CPU_STATE_IS_WHOLE:
        assert param_digest(resumed.stdout) == param_digest(whole.stdout)
    else:  # docs/training.md says so; a 2.6 that pickles the whole state fails here, and the docs need changing
        assert param_digest(resumed.stdout) != param_digest(whole.stdout)


def test_the_legacy_launchers_two_machine_layout_counts_this_machines_workers():
    """fleet.launch (--selected_gpus without --master) on 2 machines x 4 GPUs: no PADDLE_LOCAL_SIZE, and the
    endpoints list all 8 workers (start_local_trainers in paddle/distributed/fleet/launch_utils.py)."""
    endpoints = [f"10.0.0.{m}:{6070 + i}" for m in (1, 2) for i in range(4)]
    worker = {
        "PADDLE_TRAINER_ID": "5",
        "PADDLE_CURRENT_ENDPOINT": "10.0.0.2:6071",
        "PADDLE_TRAINERS_NUM": "8",
        "PADDLE_TRAINER_ENDPOINTS": ",".join(endpoints),
        "PADDLE_RANK_IN_NODE": "1",
        "FLAGS_selected_gpus": "1",
    }
    layout = launch.launch_layout(worker)
    assert layout == launch.Layout(world=8, local_rank=1, local_size=4)
    assert launch.gpu_shortfall(layout.local_size, 4) is None


def test_the_current_launchers_layout_and_no_launcher():
    """paddle.distributed.launch --nnodes 2 --gpus 0,1,2,3 (CollectiveController._build_pod_with_master in
    paddle/distributed/launch/controllers/collective.py), and a plain python train.py."""
    endpoints = [f"10.0.0.{m}:{6070 + i}" for m in (1, 2) for i in range(4)]
    worker = {
        "PADDLE_GLOBAL_SIZE": "8",
        "PADDLE_LOCAL_SIZE": "4",
        "PADDLE_GLOBAL_RANK": "6",
        "PADDLE_LOCAL_RANK": "2",
        "PADDLE_TRAINERS_NUM": "8",
        "PADDLE_TRAINER_ENDPOINTS": ",".join(endpoints),
        "PADDLE_CURRENT_ENDPOINT": "10.0.0.2:6072",
    }
    assert launch.launch_layout(worker) == launch.Layout(world=8, local_rank=2, local_size=4)
    assert launch.launch_layout({}) == launch.Layout(world=1, local_rank=0, local_size=1)
    assert launch.gpu_shortfall(8, 4) is not None  # what the old count (every endpoint) ran into


def test_a_worker_notices_that_master_dropped_selected_gpus():
    launcher = ["python", "-m", "paddle.distributed.launch", "--master", "10.0.0.1:8090", "--nnodes", "2"]
    flag = "--selected_gpus=0,1"
    problem = launch.gpu_request_problem(flag, [*launcher, flag, "train.py"], local_size=8)
    assert "ignores --selected_gpus" in problem and "--gpus 0,1" in problem and "8 worker(s)" in problem
    assert launch.gpu_request_problem(flag, ["python", "-m", "paddle.distributed.launch", flag], 2) is None
    assert launch.gpu_request_problem("--gpus 0,1,2,3", [*launcher, "--gpus", "0,1,2,3"], 4) is None
    assert launch.gpu_request_problem(None, launcher, 8) is None


@pytest.mark.parametrize(
    ("amp", "device", "capability", "refused"),
    [
        ("bf16", "gpu:0", (7, 0), "compute capability 8.0 or higher, and gpu:0 has 7.0"),  # V100
        ("bf16", "gpu:1", (7, 5), "use --amp fp16 or --amp off"),  # T4
        ("fp16", "gpu:0", (6, 1), "compute capability 7.0 or higher, and gpu:0 has 6.1"),  # P40
        ("fp16", "cpu", None, "--amp fp16 needs a GPU"),
        ("bf16", "gpu:0", (8, 0), None),  # A100
        ("fp16", "gpu:0", (7, 0), None),
        ("off", "gpu:0", (6, 0), None),
        ("bf16", "cpu", None, "--amp bf16 needs a GPU"),  # auto_cast stays float32 on CPU (test_recipes.py)
    ],
)
def test_amp_problem(amp, device, capability, refused):
    problem = launch.amp_problem(amp, device, capability)
    if refused is None:
        assert problem is None
    else:
        assert refused in problem and "\n" not in problem


def gradients_with(value: float | None) -> list:
    """A small network's real gradients; value (inf, NaN) injected into one element, as an fp16 overflow leaves
    them after GradScaler.unscale_."""
    paddle.seed(0)
    net = paddle.nn.Linear(4, 3)
    net(paddle.randn([8, 4])).sum().backward()
    if value is not None:
        grad = net.weight.grad.numpy()
        grad[1, 2] = value
        paddle.assign(paddle.to_tensor(grad), output=net.weight.grad)
    return net.parameters()


def test_overflow_steps_are_left_out_of_the_norm_figures_and_counted_as_skipped():
    finite = engine.global_grad_norm(gradients_with(None))
    tally = engine.NormTally(clip=float(finite) / 2)  # every finite step is clipped
    for value in (None, float("inf"), None, float("nan")):
        norm = engine.global_grad_norm(gradients_with(value))
        assert bool(paddle.isfinite(norm)) == (value is None)
        tally.add(norm)
    assert (int(tally.clipped), int(tally.skipped)) == (2, 2)
    assert tally.mean() == pytest.approx(float(finite), rel=1e-6)
    fields = {"loss": 0, "acc": 0, "images": 0, "seconds": 1, "input_wait": 0, "own_seconds": 1}
    stats = engine.EpochStats(**fields, steps=4, phase_shares={}, samples=0, clipped=2, grad_norm=1.0, skipped=2)
    assert stats.clipped_share == 1.0


def test_skipped_steps_reach_the_metrics_row_and_the_epoch_log_line(caplog):
    """An fp16 epoch of 6 steps with --clip-grad-norm: 2 overflow steps, 2 of the other 4 clipped. The row of
    metrics.jsonl and the clipping line count the skipped steps, and the clipped share is 2 of 4, not 2 of 6."""
    paddle.set_device("cpu")
    cfg = Config(model="mnist_cnn", clip_grad_norm=1.0, epochs=2)
    one = DistEnv(0, 1, 0, 1, "none", "cpu")
    state = TrainState.create(cfg, 10, (1, 28, 28), one, 6)
    state.epoch, state.step = 0, 6
    fields = {"loss": 0.5, "acc": 0.8, "images": 96, "seconds": 2.0, "input_wait": 0.1, "own_seconds": 2.0}
    stats = engine.EpochStats(**fields, steps=6, phase_shares={}, samples=0, clipped=2, grad_norm=0.75, skipped=2)
    val = engine.EvalStats(loss=0.4, acc=0.9, count=100)
    row = json.loads(json.dumps(session.epoch_row(cfg, one, state, stats, val)))  # as metrics.jsonl holds it
    assert (row["skipped_steps"], row["clipped_share"], row["grad_norm"]) == (2, 0.5, 0.75)
    log = logging.getLogger("test_gpu_path.epoch")
    with caplog.at_level(logging.INFO, logger=log.name):
        session.log_epoch(log, cfg, row, stats)
    clipping = [r.getMessage() for r in caplog.records if "gradient clipping" in r.getMessage()]
    assert len(clipping) == 1, caplog.text
    assert "clipped 2 of 4 steps (50%)" in clipping[0] and "mean norm before clipping 0.750" in clipping[0]
    assert "2 step(s) skipped with inf/NaN gradients (fp16 overflow)" in clipping[0]
    unclipped = session.epoch_row(Config(model="mnist_cnn", epochs=2), one, state, stats, val)
    assert not {"skipped_steps", "clipped_share", "grad_norm"} & set(unclipped)  # the row without clipping, as before


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
    files = RunFiles(cfg, one, checkpoint.CheckpointStore(cfg.output_dir, cfg.keep_checkpoints))
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


def test_batches_go_through_pinned_memory_on_gpus_only():
    assert [transfer.pins(d) for d in ("cpu", "gpu:0", "gpu:3")] == [False, True, True]
    assert not transfer.Feed("cpu").pinned and transfer.Feed("gpu:1").pinned


def test_the_cpu_feed_is_paddle_to_tensor_of_each_micro_batch_as_before():
    rs = np.random.RandomState(0)
    images, labels = rs.rand(8, 1, 4, 4).astype(np.float32), rs.randint(0, 10, 8).astype(np.int64)
    feed = transfer.Feed("cpu")
    assert feed.host((images, labels))[0] is images  # nothing happens in the prefetch thread on CPU
    for k in (1, 2, 4):
        got = feed.micro_batches(images, labels, k)
        want = [(paddle.to_tensor(x), paddle.to_tensor(y)) for x, y in zip(np.split(images, k), np.split(labels, k))]
        assert len(got) == k
        for (x, y), (wx, wy) in zip(got, want):
            assert x.place.is_cpu_place() and x.dtype == wx.dtype and y.dtype == wy.dtype
            assert np.array_equal(x.numpy(), wx.numpy()) and np.array_equal(y.numpy(), wy.numpy())


def test_the_gpu_feeds_split_of_a_copied_batch_matches_the_split_of_its_arrays():
    """On a GPU the whole batch is copied, then split on the device: the same micro-batches (run here on CPU
    tensors, which take the same paddle.split)."""
    images, labels = np.arange(48, dtype=np.float32).reshape(6, 2, 4), np.arange(6, dtype=np.int64)
    on_device = transfer.split(paddle.to_tensor(images), paddle.to_tensor(labels), 3)
    for (x, y), (wx, wy) in zip(on_device, transfer.split(images, labels, 3)):
        assert np.array_equal(x.numpy(), wx) and np.array_equal(y.numpy(), wy)


def test_the_prefetch_stage_runs_in_the_background_thread():
    threads = []

    def stage(item):
        threads.append(threading.current_thread())
        return item * 10

    assert list(data.prefetch(iter([1, 2, 3]), stage=stage)) == [10, 20, 30]
    assert len(threads) == 3 and threading.main_thread() not in threads

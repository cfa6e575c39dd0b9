"""Fast tests of the pure pieces: configuration, idx parsing, checksums, shards, sampler coverage."""

from __future__ import annotations

import dataclasses
import gzip
import io
import sys
import types

import numpy as np
import paddle
import pytest
from helpers import REPO, idx_bytes, make_dataset, write_idx

from paddle_mnist import config, data, distributed, formats, start
from paddle_mnist.models import MODELS, MnistCNN, count_parameters


def test_default_global_batch_is_64_per_worker():
    cfg = config.parse_args([])
    assert config.resolve_for_world(cfg, 1).batch_size == 64
    assert config.resolve_for_world(cfg, 4).batch_size == 256


def test_batch_that_does_not_split_is_refused():
    cfg = config.parse_args(["--batch-size", "63"])
    with pytest.raises(config.ConfigError, match="does not divide by the 2 workers"):
        config.resolve_for_world(cfg, 2)
    assert config.resolve_for_world(cfg, 1).batch_size == 63


def test_resume_and_overwrite_together_are_refused():
    with pytest.raises(config.ConfigError, match="contradict"):
        config.parse_args(["--resume", "--overwrite"])


def test_each_model_trains_with_its_own_recipe_unless_a_flag_says_otherwise():
    assert set(config.RECIPES) == set(MODELS)
    for name, recipe in config.RECIPES.items():
        cfg = config.parse_args(["--model", name])
        assert {f: getattr(cfg, f) for f in config.RECIPE_FLAGS} == dataclasses.asdict(recipe)
    flags = ["--lr", "0.01", "--warmup-epochs", "0", "--epochs", "3", "--weight-decay", "0", "--batch-size", "32"]
    cfg = config.parse_args(["--model", "mnist_cnn", *flags])
    assert (cfg.lr, cfg.warmup_epochs, cfg.epochs, cfg.weight_decay, cfg.batch_size) == (0.01, 0.0, 3, 0.0, 32)
    assert config.parse_args([]) == config.Config()  # a Config built in code holds the default model's recipe


def test_help_lists_every_recipe():
    text = config.build_parser().format_help()
    for name, r in config.RECIPES.items():
        row = next(line.split() for line in text.splitlines() if line.split()[:1] == [name])
        assert [float(v) for v in row[1:5]] == [r.lr, r.warmup_epochs, r.epochs, r.weight_decay]


def test_config_round_trips_through_json(tmp_path):
    cfg = config.parse_args(["--epochs", "3", "--lr", "0.1", "--train-limit", "100"])
    (tmp_path / "c.json").write_text(cfg.to_json())
    assert config.load_config(tmp_path / "c.json") == cfg


@pytest.mark.parametrize("compress", [True, False])
def test_idx_files_load_gzipped_or_plain(tmp_path, compress):
    make_dataset(tmp_path, n_train=30, n_test=7, compress=compress)
    split = data.load_split(tmp_path, "test")
    assert split.images.shape == (7, 1, 28, 28) and split.images.dtype == np.uint8
    assert split.labels.dtype == np.int64 and len(split) == 7


def test_wrong_magic_number_names_the_file(tmp_path):
    raw = bytearray(idx_bytes(np.zeros((3, 28, 28), np.uint8)))
    raw[3] = 2
    with pytest.raises(data.DataError, match="wrong magic number"):
        formats.parse_idx(bytes(raw), tmp_path / "x", 3)


def test_truncated_file_is_refused(tmp_path):
    raw = idx_bytes(np.zeros((3, 28, 28), np.uint8))
    with pytest.raises(data.DataError, match="header promises"):
        formats.parse_idx(raw[:-5], tmp_path / "x", 3)


def test_truncated_gzip_is_refused(tmp_path):
    make_dataset(tmp_path, n_train=30, n_test=7)
    path = tmp_path / "t10k-images-idx3-ubyte.gz"
    path.write_bytes(path.read_bytes()[:-20])
    (tmp_path / "SHA256SUMS").unlink()
    with pytest.raises(data.DataError, match="t10k-images-idx3-ubyte.gz"):
        data.load_split(tmp_path, "test")


def test_label_count_must_match_image_count(tmp_path):
    make_dataset(tmp_path, n_train=30, n_test=7)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte", np.zeros(6, np.uint8))
    with pytest.raises(data.DataError, match="7 images but 6 labels"):
        data.load_split(tmp_path, "test")


def test_checksum_mismatch_is_refused(tmp_path):
    make_dataset(tmp_path, n_train=30, n_test=7)
    path = tmp_path / "t10k-labels-idx1-ubyte.gz"
    path.write_bytes(gzip.compress(idx_bytes(np.ones(7, np.uint8))))
    with pytest.raises(data.DataError, match="SHA-256 does not match"):
        data.load_dataset("mnist", str(tmp_path))


def test_shipped_fashion_mnist_is_intact():
    ds = data.load_dataset("fashion-mnist")
    assert (len(ds.train), len(ds.test)) == (60000, 10000)
    assert np.bincount(ds.test.labels).tolist() == [1000] * 10
    assert (REPO / "data" / "fashion-mnist" / "LICENSE").is_file()


def test_normalise_uses_the_training_statistics():
    ds = data.load_dataset("fashion-mnist")
    x = data.normalise(ds.train.images[:20000], ds.mean, ds.std)
    assert x.shape == (20000, 1, 28, 28) and x.dtype == np.float32
    assert abs(float(x.mean())) < 0.02 and abs(float(x.std()) - 1) < 0.02


@pytest.mark.parametrize("n", [0, 1, 7, 10000, 10001])
@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_eval_shards_cover_every_image_once(n, world):
    seen = np.concatenate([np.arange(n)[data.eval_shard(n, r, world)] for r in range(world)])
    assert sorted(seen.tolist()) == list(range(n))


def test_sampler_gives_each_worker_its_part_of_every_global_batch():
    """Rank r's k-th batch is the r-th slice of the one-process k-th global batch."""
    n, global_batch = 1000, 96
    one = data.make_sampler(n, global_batch, 0, 1)
    two = [data.make_sampler(n, global_batch // 2, r, 2) for r in range(2)]
    for s in (one, *two):
        s.set_epoch(data.sampler_epoch(7, 3))
    full, halves = list(one), [list(s) for s in two]
    assert len(full) == len(halves[0]) == len(halves[1]) == n // global_batch
    for k, batch in enumerate(full):
        assert halves[0][k] + halves[1][k] == batch


def test_seed_changes_the_data_order():
    orders = []
    for seed in (1, 2):
        s = data.make_sampler(100, 10, 0, 1)
        s.set_epoch(data.sampler_epoch(seed, 0))
        orders.append(next(iter(s)))
    assert orders[0] != orders[1]


def test_mnist_cnn_shape_and_size():
    model = MnistCNN()
    # conv1 1*20*25+20, conv2 20*20*25+20, fc 980*10+10
    assert count_parameters(model) == 520 + 10020 + 9810
    assert model(paddle.zeros([3, 1, 28, 28])).shape == [3, 10]


def test_prefetch_passes_errors_through():
    def broken():
        yield 1
        raise data.DataError("bad batch")

    it = data.prefetch(broken())
    assert next(it) == 1
    with pytest.raises(data.DataError, match="bad batch"):
        next(it)


def test_more_workers_than_gpus_is_refused_with_the_fix():
    """The GPU check's logic; the GPU path itself cannot run on these CPU-only machines."""
    from paddle_mnist.launch import gpu_shortfall

    assert gpu_shortfall(4, 4) is None and gpu_shortfall(2, 8) is None
    message = gpu_shortfall(4, 2)
    assert "4 workers were started on this node but only 2 GPU(s) are visible" in message
    assert "list at most 2 of the visible GPUs' labels in --gpus" in message


def test_step_time_shares_use_sampled_means_for_timed_phases():
    from paddle_mnist import timing

    # 10 steps in 2.0 s (0.2 s each); 2 sampled steps spent 0.2 s in forward, 0.04 s in backward, 0.02 s in the
    # optimizer; every step waited 0.001 s for input and 0.002 s logging
    seconds = {"forward": 0.2, "backward": 0.04, "optimizer": 0.02, "input_wait": 0.01, "logging": 0.02}
    got = timing.shares(seconds, samples=2, steps=10, elapsed=2.0)
    want = {"forward": 0.5, "backward": 0.1, "optimizer": 0.05, "input_wait": 0.005, "logging": 0.01}
    for phase, value in want.items():
        assert got[phase] == pytest.approx(value)
    assert got["other"] == pytest.approx(1 - sum(want.values()))
    unsampled = timing.shares(seconds, samples=0, steps=10, elapsed=2.0)
    assert unsampled["forward"] is None and unsampled["other"] is None
    assert unsampled["input_wait"] == pytest.approx(0.005)


def test_step_timer_samples_every_nth_step(monkeypatch):
    from paddle_mnist import timing

    syncs = []
    timer = timing.StepTimer(every=3, sync=lambda: syncs.append(1))
    assert [s for s in range(1, 10) if timer.wants(s)] == [3, 6, 9]
    assert not any(timing.StepTimer(every=0, sync=lambda: None).wants(s) for s in range(1, 10))
    # the module's clock, read at begin() and at each mark(): two sampled steps, each phase a known span
    clock = iter([10.0, 10.5, 10.75, 11.0, 20.0, 20.25, 20.5, 20.625])
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    for _ in range(2):
        timer.begin()
        for phase in timing.SAMPLED:
            timer.mark(phase)
    assert timer.samples == 2 and len(syncs) == 8  # the device is synchronised at every phase boundary
    want = {"forward": 0.75, "backward": 0.5, "optimizer": 0.375, "input_wait": 0.0, "logging": 0.0}
    assert timer.seconds == want


def test_shift_and_label_smoothing_flags_are_checked():
    cfg = config.parse_args(["--augment", "--shift", "0", "--label-smoothing", "0.1"])
    assert cfg.shift == 0 and cfg.label_smoothing == 0.1
    assert config.parse_args([]).shift is None
    with pytest.raises(config.ConfigError, match="add --augment"):
        config.parse_args(["--shift", "1"])
    with pytest.raises(config.ConfigError, match="--label-smoothing must be at least 0 and below 1"):
        config.parse_args(["--label-smoothing", "1"])
    with pytest.raises(SystemExit):
        config.parse_args(["--augment", "--shift", "-1"])


def test_shift_zero_leaves_only_flips():
    from paddle_mnist import augment

    policy = augment.policy_for("fashion-mnist", 0)
    assert policy == augment.Augment(pad=0, flip=True) and augment.policy_for("cifar10").pad == 4
    images = np.random.default_rng(0).integers(0, 256, (64, 1, 28, 28), dtype=np.uint8)
    out = augment.shift_and_flip(images, policy, augment.batch_rng(0, 0, 0, 0))
    same = [np.array_equal(o, i) for o, i in zip(out, images)]
    mirrored = [np.array_equal(o, i[:, :, ::-1]) for o, i in zip(out, images)]
    assert all(s or m for s, m in zip(same, mirrored))
    assert 10 < sum(mirrored) < 54  # about half flipped
    assert augment.describe(policy) == "horizontal flips"


def test_datasets_are_read_from_the_checkouts_data_folder():
    """Run from a checkout (pyproject.toml beside the package), the default is the shipped data/ there."""
    assert data.REPO_DATA == REPO / "data" and (data.REPO_DATA / "fashion-mnist" / data.SUMS).is_file()


def test_paddles_log_level_is_quieted_unless_the_user_chose_one():
    for given, level in (({}, "1"), ({"GLOG_minloglevel": "0"}, "0"), ({"GLOG_v": "3"}, None)):
        environ = dict(given)
        start.quiet_paddle(environ)
        assert environ.get("GLOG_minloglevel") == level, given
    assert start.announce({}, ["train.py"]) is None  # not launched: no worker log to mark
    line = start.announce({"PADDLE_TRAINER_ID": "1", "PADDLE_TRAINERS_NUM": "2"}, ["train.py", "--epochs", "1"])
    assert line.endswith("[rank 1/2] started: " + " ".join([sys.executable, "train.py", "--epochs", "1"]))


def test_the_flags_banner_is_dropped_unless_it_names_a_flag_the_user_set():
    banner = [f"{distributed.BANNER} ===\n", "FLAGS(name='FLAGS_enable_pir_in_executor', ...)", "\n", "=" * 71 + "\n"]
    for user, kept in ((set(), False), ({"FLAGS_check_nan_inf"}, False), ({"FLAGS_enable_pir_in_executor"}, True)):
        out = io.StringIO()
        filtered = distributed._BannerFilter(out, user)
        for text in ["before\n", *banner, "after\n"]:
            filtered.write(text)
        assert out.getvalue() == "before\n" + ("".join(banner) if kept else "") + "after\n"

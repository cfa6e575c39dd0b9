"""Step timing (timing.py): the sampled phases' shares of a step, and which steps are sampled."""

from __future__ import annotations

import logging
import time
import types

import paddle
import pytest
from helpers import make_images

from paddle_mnist.config import Config
from paddle_mnist.datasets import data
from paddle_mnist.datasets.transfer import Feed
from paddle_mnist.runtime.distributed import DistEnv
from paddle_mnist.training import engine, timing
from paddle_mnist.training.state import TrainState


def test_step_time_shares_split_every_steps_compute_as_the_sampled_steps_did():
    # an epoch of 2.0 s: every step's compute summed to 1.8 s, 2 sampled steps' to 0.3 s, of which 0.15 s forward,
    # 0.09 s backward, 0.03 s the optimizer (0.03 s the scheduler and bookkeeping); 0.01 s input wait, 0.02 s logging
    seconds = {"forward": 0.15, "backward": 0.09, "optimizer": 0.03, "input_wait": 0.01, "logging": 0.02}
    got = timing.shares(seconds, elapsed=2.0, compute=1.8, sampled_compute=0.3)
    want = {"forward": 0.45, "backward": 0.27, "optimizer": 0.09, "input_wait": 0.005, "logging": 0.01}
    for phase, value in want.items():
        assert got[phase] == pytest.approx(value)
    assert got["other"] == pytest.approx(1 - sum(want.values()))  # 0.09 of compute and 0.085 outside it
    unsampled = timing.shares(seconds, elapsed=2.0, compute=1.8, sampled_compute=0.0)
    assert unsampled["forward"] is None and unsampled["other"] is None
    assert unsampled["input_wait"] == pytest.approx(0.005)


def test_shares_stay_whole_when_sampled_steps_outlast_the_average():
    """A user saw "other -6.5%": the sampled phases were shares of the average step, which a sampled step can
    outlast (its device syncs, a busy machine). Here 2 sampled steps of 10 took 0.2 s of compute each, the others
    0.07 s: the sampled phases' mean (0.195 s) is 195% of the mean step (0.1 s), so "other" came out at -98%."""
    seconds = {"forward": 0.16, "backward": 0.2, "optimizer": 0.03, "input_wait": 0.01, "logging": 0.02}
    got = timing.shares(seconds, elapsed=1.0, compute=2 * 0.2 + 8 * 0.07, sampled_compute=2 * 0.2)
    assert got["forward"] == pytest.approx(0.384) and got["backward"] == pytest.approx(0.48)
    assert got["optimizer"] == pytest.approx(0.072) and got["other"] == pytest.approx(0.034)
    assert sum(got.values()) == pytest.approx(1.0) and min(got.values()) >= 0


@pytest.mark.slow
def test_an_epoch_whose_sampled_steps_are_slow_reports_whole_shares(monkeypatch):
    """A real epoch of 12 steps where each sampled step's 4 device syncs take 5 ms (a GPU's, say): its phases
    outlast an unsampled step several times over, and still the shares add up to 100% with none below zero."""
    paddle.set_device("cpu")
    monkeypatch.setattr(engine, "device_sync", lambda env: lambda: time.sleep(0.005))
    cfg = Config(model="mnist_cnn", batch_size=8, timing_every=3, log_every=0, augment=False, epochs=1)
    env = DistEnv(0, 1, 0, 1, "none", "cpu")
    images, labels = make_images(96, seed=1)
    train = data.Split(images[:, None], labels.astype("int64"))
    ds = data.Dataset("mnist", train, train, train, *data.channel_stats(train.images), data.DIGITS)
    batches = data.TrainBatches(train, ds, cfg.batch_size, 0, 1, cfg)
    state = TrainState.create(cfg, 10, ds.image_shape, env, len(batches))
    epoch = engine.Epoch(state, batches.epoch(0, 0, len(batches)), cfg, env, logging.getLogger("t"), Feed("cpu"))
    assert sum(1 for _ in epoch) == 12
    got = epoch.stats.phase_shares
    assert epoch.stats.samples == 4 and sum(got.values()) == pytest.approx(1.0), got
    assert min(got.values()) >= 0 and got["forward"] + got["backward"] + got["optimizer"] > 0.5, got


def test_step_timer_samples_every_nth_step(monkeypatch):
    syncs = []
    timer = timing.StepTimer(every=3, sync=lambda: syncs.append(1))
    assert [s for s in range(1, 10) if timer.sampling(s) is timer] == [3, 6, 9]
    assert all(timer.sampling(s) is timing.UNTIMED for s in (1, 2, 4, 5, 7, 8))
    assert not any(timing.StepTimer(every=0, sync=lambda: None).wants(s) for s in range(1, 10))
    # the module's clock, read as each phase begins and ends: two sampled steps, each phase a known span
    clock = iter([10.0, 10.5, 10.5, 10.75, 10.75, 11.0, 20.0, 20.25, 20.5, 20.75, 20.75, 20.875])
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    for _ in range(2):
        for phase in timing.SAMPLED:
            with timer.phase(phase):
                pass
    assert timer.samples == 2 and len(syncs) == 12  # the device is synchronised as every phase begins and ends
    want = {"forward": 0.75, "backward": 0.5, "optimizer": 0.375, "input_wait": 0.0, "logging": 0.0}
    assert timer.seconds == want
    with timing.UNTIMED.phase("forward"):  # an unsampled step's phases: nothing timed, no sync
        pass
    assert timer.seconds == want and len(syncs) == 12

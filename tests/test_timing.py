"""Step timing (timing.py): the sampled phases' shares of a step, and which steps are sampled."""

from __future__ import annotations

import types

import pytest

from paddle_mnist import timing


def test_step_time_shares_use_sampled_means_for_timed_phases():
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

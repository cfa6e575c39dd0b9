"""The one owner of a run's checkpoints (checkpoints.py), on one process: the newest kept, the best weights, a damaged
checkpoint set aside on resume, a resumed state equal to the saved one, and the line a failed write gives."""

from __future__ import annotations

import logging

import numpy as np
import paddle
import pytest

from paddle_mnist.config import Config, ConfigError
from paddle_mnist.files import checkpoint
from paddle_mnist.runtime.distributed import DistEnv
from paddle_mnist.training import checkpoints as checkpoints_module
from paddle_mnist.training import evaluation
from paddle_mnist.training.checkpoints import Checkpoints
from paddle_mnist.training.outputs import BEST_WEIGHTS, RunFiles
from paddle_mnist.training.state import TrainState

ONE = DistEnv(0, 1, 0, 1, "none", "cpu")
LOG = logging.getLogger("test_checkpoints")


def owner(cfg: Config) -> tuple[Checkpoints, TrainState]:
    paddle.set_device("cpu")
    state = TrainState.create(cfg, 10, (1, 28, 28), ONE, 4)
    return Checkpoints(cfg, ONE, LOG, RunFiles(cfg, ONE)), state


def test_epoch_ends_keep_the_newest_and_the_best_then_a_resume_skips_a_damaged_one(tmp_path, caplog):
    cfg = Config(model="mnist_cnn", epochs=4, output_dir=str(tmp_path), keep_checkpoints=2, resume="auto")
    saver, state = owner(cfg)
    for epoch, acc in enumerate((0.5, 0.7, 0.6), start=1):  # the second epoch is the best
        state.step, state.batch_in_epoch = 4 * epoch, 4
        state.end_epoch(4)
        if epoch == 2:
            best_digest = checkpoint.digest(state.model)
        saver.save_epoch_end(state, evaluation.EvalStats(loss=1 - acc, acc=acc, count=10), epoch, started=0.0)
        with paddle.no_grad():
            state.model.parameters()[0].add_(paddle.ones_like(state.model.parameters()[0]))
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step_00000008.pdckpt", "step_00000012.pdckpt"]
    assert (state.best["epoch"], state.best["step"], state.best["digest"]) == (2, 8, best_digest)
    assert checkpoint.digest_state(checkpoint.load(tmp_path / BEST_WEIGHTS)) == best_digest
    newest = checkpoint.list_checkpoints(tmp_path)[-1]
    newest.write_bytes(newest.read_bytes()[:-10])  # cut short: its digest no longer matches

    resumer, fresh = owner(cfg)
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        chosen = resumer.choose()
    assert chosen == checkpoint.checkpoint_path(tmp_path, 8)
    assert "set aside as step_00000012.pdckpt.damaged" in caplog.text
    resumer.resume(fresh, chosen)
    assert (fresh.epoch, fresh.batch_in_epoch, fresh.step) == (2, 0, 8)
    assert checkpoint.digest(fresh.model) == best_digest and fresh.best["epoch"] == 2  # model_best still holds it


def test_no_intact_checkpoint_stops_the_resume_and_a_failed_write_names_the_last_good_one(tmp_path):
    cfg = Config(model="mnist_cnn", epochs=2, output_dir=str(tmp_path), resume="auto")
    saver, state = owner(cfg)
    assert saver.choose() is None  # nothing to resume from: a fresh start
    state.step = 3
    saver.save_mid_epoch(state, 1.0, started=0.0, for_stop=False)
    assert not saver.failed()
    saver.files.failure = "cannot write x: No space left on device (ENOSPC)"  # as RunFiles.writing records one
    assert saver.failed()
    assert str(saver.failure()).startswith(
        f"cannot write x: No space left on device (ENOSPC); the last good checkpoint "
        f"{checkpoint.checkpoint_path(tmp_path, 3)} is intact"
    )
    only = checkpoint.checkpoint_path(tmp_path, 3)
    only.write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match="no intact checkpoint"):
        Checkpoints(cfg, ONE, LOG, RunFiles(cfg, ONE)).choose()


def test_a_stop_checkpoint_from_before_the_rename_still_gives_each_rank_its_statistics():
    """Stop checkpoints kept every rank's batch norm statistics as untrained_by_rank until 2026-11-28, now as
    running_statistics_by_rank: a resume reads either, the new name first."""
    old, new = [np.arange(3.0)], [np.ones(3)]
    assert checkpoints_module._by_rank({"untrained_by_rank": old}, "running_statistics_by_rank") is old
    assert checkpoints_module._by_rank({"ema_untrained_by_rank": old}, "ema_running_statistics_by_rank") is old
    both = {"untrained_by_rank": old, "running_statistics_by_rank": new}
    assert checkpoints_module._by_rank(both, "running_statistics_by_rank") is new
    assert checkpoints_module._by_rank({}, "running_statistics_by_rank") == []

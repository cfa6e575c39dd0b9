"""What happens around the steps (session.py): the epoch's metrics row and log line, clipped and skipped steps."""

from __future__ import annotations

import json
import logging

import paddle

from paddle_mnist import engine, session
from paddle_mnist.config import Config
from paddle_mnist.distributed import DistEnv
from paddle_mnist.state import TrainState


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
    log = logging.getLogger("test_session.epoch")
    with caplog.at_level(logging.INFO, logger=log.name):
        session.log_epoch(log, cfg, row, stats)
    clipping = [r.getMessage() for r in caplog.records if "gradient clipping" in r.getMessage()]
    assert len(clipping) == 1, caplog.text
    assert "clipped 2 of 4 steps (50%)" in clipping[0] and "mean norm before clipping 0.750" in clipping[0]
    assert "2 step(s) skipped with inf/NaN gradients (fp16 overflow)" in clipping[0]
    unclipped = session.epoch_row(Config(model="mnist_cnn", epochs=2), one, state, stats, val)
    assert not {"skipped_steps", "clipped_share", "grad_norm"} & set(unclipped)  # the row without clipping, as before

"""What happens around the steps (session.py): the epoch's metrics row and log line, clipped and skipped steps, the
estimate of the run's time, --patience."""

from __future__ import annotations

import json
import logging
import re

import numpy as np
import paddle
import pytest
from helpers import (
    explain,
    param_digest,
    read_metrics,
    read_results,
    run_launch,
    run_single,
    small_run,
    weights,
    worker_log,
)

from paddle_mnist.config import Config
from paddle_mnist.files import checkpoint
from paddle_mnist.runtime.distributed import DistEnv
from paddle_mnist.training import engine, evaluation, session
from paddle_mnist.training.state import TrainState


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
    val = evaluation.EvalStats(loss=0.4, acc=0.9, count=100)
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


def _line(text: str, pattern: str) -> str:
    found = [line for line in text.splitlines() if re.search(pattern, line)]
    assert len(found) == 1, f"{pattern!r}: {found}\n{text[-3000:]}"
    return found[0]


@pytest.mark.slow
def test_max_steps_and_resume_are_told_in_the_estimate_and_the_epoch_line(dataset, tmp_path):
    """--max-steps 30 in epochs of 32 steps: the estimate counts 30 steps and 1 evaluation, and the epoch line
    says where it stopped, never "done"; resumed to --max-steps 60, the estimate counts only the 30 steps left,
    with the evaluation it has timed, and the epoch the resume finished is "done"."""
    args = [*small_run(batch_size=16, epochs=8, log_every=10), "--data-dir", str(dataset), "--output-dir", "out"]
    first = run_single([*args, "--max-steps", "30"], cwd=tmp_path)
    assert first.returncode == 0, explain(first)
    estimate = _line(first.stdout, "estimated time: ")
    assert "for 30 steps (--max-steps; 8 epochs would be 256) and 1 evaluation of 201 images (" in estimate
    assert re.search(r"a step so far, an evaluation guessed at [\d.]+ s\); ends about \d\d:\d\d$", estimate)
    # the estimate's step time is the run's, whatever the machine's load (a factor of 5 either way)
    per_step = float(re.search(r"\((\d+) ms a step", estimate).group(1))
    timed = float(re.search(r"epoch 1 time per step ([\d.]+) ms", first.stdout).group(1))
    assert timed / 5 < per_step < timed * 5, (estimate, timed)
    assert "epoch 1/8 stopped at --max-steps 30 (batch 30 of 32): train loss" in first.stdout
    assert "epoch 1/8 done" not in first.stdout

    second = run_single([*args, "--max-steps", "60", "--resume", "auto"], cwd=tmp_path)
    assert second.returncode == 0, explain(second)
    estimate = _line(second.stdout, "estimated time: ")
    assert "for the 30 steps left to --max-steps 60 and 2 evaluations of 201 images (" in estimate
    assert re.search(r"ms a step, [\d.]+ s an evaluation so far\); ends about \d\d:\d\d$", estimate)
    assert "epoch 1/8 done: train loss" in second.stdout  # its last 2 steps
    assert "epoch 2/8 stopped at --max-steps 60 (batch 28 of 32): train loss" in second.stdout
    # the cut epoch's row (step 30) gave way to the resumed epoch's whole one
    assert [row["step"] for row in read_metrics(tmp_path / "out")] == [32, 60]


@pytest.mark.slow
def test_patience_ends_the_run_on_the_best_epochs_weights_on_every_rank(dataset, tmp_path):
    """Two epochs in one process learn the synthetic classes whole (validation accuracy 1), so no later epoch can
    be higher: resumed on 2 workers with --patience 2, the run ends two epochs after the best one, and the test
    score, model.pdparams and every rank's weights are the best epoch's (rank 0 reads them and sends them), not the
    last epoch's."""
    out = tmp_path / "o"
    args = [*small_run(batch_size=64, log_every=0), "--data-dir", str(dataset), "--output-dir", str(out)]
    args += ["--lr-schedule", "constant"]
    first = run_single([*args, "--epochs", "2"], cwd=tmp_path)
    assert first.returncode == 0, explain(first)
    rows = read_metrics(out)
    best = max(rows, key=lambda row: row["val_acc"])  # the first of the highest, as the run keeps it
    assert best["val_acc"] == 1.0, rows
    best_weights = weights(out / "model_best.pdparams")
    again = run_launch([*args, "--epochs", "8", "--patience", "2", "--resume", "yes"], tmp_path, tmp_path / "l")
    assert again.returncode == 0, explain(again, tmp_path / "l")
    rows = read_metrics(out)
    assert [row["epoch"] for row in rows] == list(range(1, best["epoch"] + 3))  # stopped 2 epochs after the best
    for rank in (0, 1):
        text = worker_log(tmp_path / "l", rank)
        said = f"--patience 2: no higher validation accuracy since epoch {best['epoch']} (1.0000)"
        assert said in text, text[-3000:]
        assert param_digest(text) == param_digest(worker_log(tmp_path / "l", 0))
    final = weights(out / "model.pdparams")
    for name, value in best_weights.items():
        np.testing.assert_array_equal(final[name], value, err_msg=name)
    last = checkpoint.load(checkpoint.list_checkpoints(out)[-1])["model"]  # the last epoch's weights moved on
    assert any(not np.array_equal(np.asarray(last[name]), value) for name, value in best_weights.items())
    assert read_results(out)["test_acc"] == 1.0  # the test split is the validation split here

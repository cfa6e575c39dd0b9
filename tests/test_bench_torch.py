"""scripts/bench_torch.py's trainer side: each cell runs the trainer on the cell's number of workers."""

from __future__ import annotations

import pytest
from helpers import launch_env

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

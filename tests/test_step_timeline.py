"""scripts/step_timeline.py: every rank's phases timed in real 2-worker runs, with and without the meeting."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import REPO, launch_env

pytestmark = pytest.mark.slow  # real workers under paddle.distributed.launch


def test_each_mode_times_both_ranks_and_only_the_coupled_modes_meet(tmp_path):
    out = tmp_path / "timeline.json"
    cmd = [sys.executable, "-m", "scripts.step_timeline", "--steps", "26", "--rounds", "1"]
    cmd += ["--modes", "none,pause,lockstep,allreduce,overlap", "--nice", "19", "--spin", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=launch_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    for mode in ("none", "pause", "lockstep", "allreduce", "overlap"):
        (got,) = results[mode]
        assert len(got["rank_rates"]) == 2 and all(rate > 0 for rate in got["rank_rates"])
        assert got["forward"] > 0 and got["backward"] > 0 and got["images_per_sec"] > 0
    for alone in ("none", "pause", "lockstep"):  # ms: nothing is carried without a collective
        assert results[alone][0]["all-reduce"] < 0.05
    assert results["pause"][0]["wait"] >= 1.0  # ms: the pause mode's sleep, where a meeting would be
    assert results["allreduce"][0]["all-reduce"] > 0.05  # 1 MB of gradients carried every step
    assert "of none" in proc.stdout and "overlap" in proc.stdout and "nice 19, a spinning thread a rank" in proc.stdout


def test_a_nice_value_out_of_range_is_refused_before_any_worker_starts():
    cmd = [sys.executable, "-m", "scripts.step_timeline", "--nice", "20"]
    proc = subprocess.run(cmd, cwd=REPO, env=launch_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--nice 0 to 19" in proc.stderr

"""Seconds from SIGTERM to the end of a real 2-worker job: python -m scripts.stop_time [--at REGEX] [trainer args].

Starts python -m paddle.distributed.launch --nproc_per_node 2 train.py (the default model and data unless
trainer args say otherwise), sends SIGTERM to the launcher once worker 0's log matches --at, and prints how long
the launcher took to exit, its exit status and worker 0's stop line. --at "epoch 1 step 50/" stops mid-epoch;
--at "epoch 1 step (\\d+)/\\1 " as the first epoch's last step is logged, so the workers first finish evaluating.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--at", default=r"epoch 1 step 50/", help="send SIGTERM when worker 0's log matches this")
    args, trainer = p.parse_known_args()
    work = Path(tempfile.mkdtemp(prefix="stop_time"))
    log_dir = work / "log"
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2", "--log_dir", str(log_dir)]
    cmd += [str(REPO / "train.py"), "--output-dir", str(work / "output"), "--log-every", "10", *trainer]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    job = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log0 = log_dir / "workerlog.0"
    while not (log0.exists() and re.search(args.at, log0.read_text())):
        if job.poll() is not None:
            print(f"the job ended (exit {job.returncode}) before its log matched {args.at!r}; see {log_dir}")
            return 1
        time.sleep(0.01)
    sent = time.time()
    job.send_signal(signal.SIGTERM)
    code = job.wait(timeout=120)
    took = time.time() - sent
    stop = [line for line in log0.read_text().splitlines() if "] stopped by" in line]
    print(f"launcher exited with {code}, {took:.2f} s after SIGTERM; worker 0: {stop[-1] if stop else 'no stop line'}")
    print(f"logs and outputs in {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

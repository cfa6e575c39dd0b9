"""--profile-steps A:B: paddle.profiler over a window of optimizer steps; its trace, tables and costliest operators."""

from __future__ import annotations

import collections
import contextlib
import io
import json
import logging
import re
from pathlib import Path

import paddle.profiler as profiler

from paddle_mnist.runtime.distributed import DistEnv

PROFILE_DIR = "profile"
TOP = 5
_TIME_IN_NAME = re.compile(r"\[[\d.]+ ?[mun]?s\]$")  # Paddle appends each event's duration to its name


def operator_times(trace: Path) -> list[tuple[str, float]]:
    """(operator, total milliseconds) from a Chrome trace that paddle.profiler wrote, costliest first.

    Only top-level operator events count ("Operator"; the kernels inside one are "OperatorInner"), so no time is
    counted twice. A forward operator is named like "conv2d dygraph", its backward like "Conv2dGradNodeFinal".
    """
    events = json.loads(trace.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    totals: collections.Counter = collections.Counter()
    for e in events:
        if e.get("cat") == "Operator" and "dur" in e:
            name = _TIME_IN_NAME.sub("", e["name"]).removesuffix(" dygraph").removeprefix("Global_")
            totals[name] += e["dur"] / 1000  # microseconds in the trace
    return totals.most_common()


class ProfileWindow:
    """Records optimizer steps first..last (counted from 1 over the whole run) on this worker.

    Every worker records, not rank 0 alone: the profiler slows the steps it records, and a rank 0 slowed alone
    would make the others wait at each all-reduce, which the trace would then show as time in the all-reduce.
    Each worker writes its own files, named by rank: trace.rankN.json (chrome://tracing or Perfetto) and
    operators.rankN.txt (paddle.profiler's summary tables).
    """

    def __init__(self, window: tuple[int, int] | None, output_dir: str, env: DistEnv, log: logging.Logger):
        self.first, self.last = window or (0, -1)
        self.folder = Path(output_dir) / PROFILE_DIR
        self.env, self.log = env, log
        self.prof: profiler.Profiler | None = None
        self.done = window is None

    def begin(self, steps_done: int) -> None:
        """Called before training with the steps already done (a resumed run starts past 0)."""
        if self.done:
            return
        if steps_done >= self.first:
            self.log.warning(
                f"warning: --profile-steps {self.first}:{self.last} starts at or before step {steps_done}, where this "
                "run starts (it resumed): nothing is profiled; pick a later window"
            )
            self.done = True
        elif steps_done == self.first - 1:
            self._start()

    def after_step(self, step: int) -> None:
        if self.done:
            return
        if self.prof is not None:
            if step >= self.last:
                self.finish()  # stop() closes the last step's record; a step() first would open an empty one
            else:
                self.prof.step()
        elif step == self.first - 1:
            self._start()

    def _start(self) -> None:
        targets = [profiler.ProfilerTarget.CPU]
        if self.env.device.startswith("gpu"):
            targets.append(profiler.ProfilerTarget.GPU)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.prof = profiler.Profiler(targets=targets, on_trace_ready=self._export)
        self.prof.start()

    def _export(self, prof: profiler.Profiler) -> None:
        staging = self.folder / f".rank{self.env.rank}"
        profiler.export_chrome_tracing(str(staging), worker_name=f"rank{self.env.rank}")(prof)
        written = sorted(staging.glob("*.json"), key=lambda p: p.stat().st_mtime)
        written[-1].replace(self.folder / f"trace.rank{self.env.rank}.json")
        for leftover in staging.iterdir():
            leftover.unlink()
        staging.rmdir()

    def finish(self) -> None:
        """Stop recording (at step last, or when training ended first), write the files, log the costliest ops."""
        if self.prof is None:
            self.done = True
            return
        prof, self.prof, self.done = self.prof, None, True
        prof.stop()
        tables = io.StringIO()
        with contextlib.redirect_stdout(tables):  # paddle.profiler prints its summary
            prof.summary(sorted_by=profiler.SortedKeys.CPUTotal, op_detail=False, thread_sep=False, time_unit="ms")
        (self.folder / f"operators.rank{self.env.rank}.txt").write_text(tables.getvalue())
        trace = self.folder / f"trace.rank{self.env.rank}.json"
        ops = operator_times(trace)
        total = sum(ms for _, ms in ops) or 1.0
        top = ", ".join(f"{name} {ms:.0f} ms ({100 * ms / total:.0f}%)" for name, ms in ops[:TOP])
        self.log.info(f"profile of steps {self.first}-{self.last}: costliest operators {top}")
        self.log.info(
            f"profile written: {trace} (open in chrome://tracing or ui.perfetto.dev) and operator tables in "
            f"{self.folder / f'operators.rank{self.env.rank}.txt'}"
        )

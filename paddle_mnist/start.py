"""The trainer's entry point: Paddle's start-up notes kept out of the workers' logs, a first line, then cli.main.

Paddle reads its C++ log level (glog's GLOG_minloglevel) once, when its library loads, and warns that ccache is
missing while it imports; so this module loads no Paddle, and imports the command line (which does) only once the
settings are in place. A setting the user made is kept.
"""

from __future__ import annotations

import os
import shlex
import sys
import time
from collections.abc import Mapping

from paddle_mnist.files import events
from paddle_mnist.files.log import quiet_paddle


def announce(environ: Mapping[str, str], argv: list[str]) -> str | None:
    """A launched worker's first line, before Paddle loads: the launcher appends a run to the worker logs of an
    earlier one when --log_dir is reused, and this line is where python -m paddle_mnist.logs finds each run's
    start (logs.RUN_START), even for a run that died before its first line of training. None outside a launch."""
    if "PADDLE_TRAINER_ID" not in environ:
        return None
    tag = f"rank {environ['PADDLE_TRAINER_ID']}/{environ.get('PADDLE_TRAINERS_NUM', '?')}"
    return f"{time.strftime('%H:%M:%S')} [{tag}] started: {shlex.join([sys.executable, *argv])}"


def begin_events(environ: Mapping[str, str], line: str) -> None:
    """The worker's event log (files/events.py), its start paired with the started line by the line's clock."""
    events.begin(environ["PADDLE_TRAINER_ID"], environ.get("PADDLE_TRAINERS_NUM", "?"), line.split(" ", 1)[0])


def main(argv: list[str] | None = None) -> int:
    quiet_paddle()
    if line := announce(os.environ, sys.argv if argv is None else [sys.argv[0], *argv]):
        print(line, flush=True)
        begin_events(os.environ, line)
    from paddle_mnist.cli import (
        main as run,  # here, not above: importing cli loads Paddle, which must find the settings made
    )

    return run(argv)

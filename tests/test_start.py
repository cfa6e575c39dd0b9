"""The start of a process (start.py): Paddle's log level, and the line that marks a worker's start."""

from __future__ import annotations

import sys

from paddle_mnist import start


def test_paddles_log_level_is_quieted_unless_the_user_chose_one():
    for given, level in (({}, "1"), ({"GLOG_minloglevel": "0"}, "0"), ({"GLOG_v": "3"}, None)):
        environ = dict(given)
        start.quiet_paddle(environ)
        assert environ.get("GLOG_minloglevel") == level, given
    assert start.announce({}, ["train.py"]) is None  # not launched: no worker log to mark
    line = start.announce({"PADDLE_TRAINER_ID": "1", "PADDLE_TRAINERS_NUM": "2"}, ["train.py", "--epochs", "1"])
    assert line.endswith("[rank 1/2] started: " + " ".join([sys.executable, "train.py", "--epochs", "1"]))

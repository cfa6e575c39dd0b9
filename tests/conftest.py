"""Fixtures shared by the test modules; a module's own fixture of the same name takes precedence."""

from __future__ import annotations

import pytest
from helpers import make_dataset

from paddle_mnist.ops import fastpath, onednn


@pytest.fixture(scope="session")
def dataset(tmp_path_factory):
    """A small MNIST-format dataset in idx files: 512 training images, 201 test images."""
    return make_dataset(tmp_path_factory.mktemp("data") / "mnist", n_train=512, n_test=201)


@pytest.fixture(scope="module")
def op():
    """The operators' module, built or found as the trainer does; the tests fail, naming why, where it cannot be
    had."""
    prepared = onednn.prepare("auto")
    assert prepared.library is not None, f"the operator did not build here: {prepared.reason}"
    line = onednn.activate(prepared, "cpu")
    assert line.startswith("convolutions: oneDNN"), line
    yield fastpath._ops
    onednn.deactivate()


# Tests whose verdict depends on time passing as expected: a watchdog or gloo timeout raced against a stopped
# (SIGSTOP) or slowed rank, a signal sent at a chosen moment, a restart loop's clock. They are marked `alone`: CI
# runs the other slow tests two at a time (pytest-xdist) and these one by one, with nothing beside them that could
# make a deadline pass early. (The benchmarks' tests assert what ran and that its rates are positive, not how fast,
# so they share the cores.)
ALONE = (
    "tests/test_recovery.py",  # stopped and slowed ranks against --collective-timeout
    "tests/test_logs.py",  # stalled, stopped and killed ranks, read from their logs
    "tests/test_preempt.py",  # SIGTERM/SIGINT at chosen moments, and a stop window
    "tests/test_relaunch.py",  # the restart loop's backoff and signals
    "tests/test_lock.py",  # a lock held while a run is interrupted
    "tests/test_multi.py",  # a stopped worker against gloo's fixed 30 s timeout; preflight between namespaces
    "tests/test_multihost.py",  # two machines in network namespaces, a link cut mid-run
    "tests/test_elastic.py",  # etcd leases and the elastic launcher's restarts
    "tests/test_folder.py::test_a_decode_slower_than_gloos_timeout_keeps_three_workers_waiting",
    "tests/test_folder.py::test_a_stop_signal_while_decoding_removes_the_unfinished_cache",
)


def pytest_collection_modifyitems(items):
    for item in items:
        if item.nodeid.startswith(ALONE):
            item.add_marker(pytest.mark.alone)

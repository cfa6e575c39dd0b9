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

"""Fixtures shared by the test modules; a module's own fixture of the same name takes precedence."""

from __future__ import annotations

import pytest
from helpers import make_dataset


@pytest.fixture(scope="session")
def dataset(tmp_path_factory):
    """A small MNIST-format dataset in idx files: 512 training images, 201 test images."""
    return make_dataset(tmp_path_factory.mktemp("data") / "mnist", n_train=512, n_test=201)

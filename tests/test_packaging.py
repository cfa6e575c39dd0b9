"""The console commands pip installs (pyproject.toml's [project.scripts]) call the modules' own main functions."""

from __future__ import annotations

import importlib
import importlib.metadata as metadata

import pytest
from helpers import REPO

COMMANDS = {  # command -> the module that `python -m` runs for the same job
    "paddle-mnist-train": "paddle_mnist.cli",
    "paddle-mnist-predict": "paddle_mnist.predict",
    "paddle-mnist-logs": "paddle_mnist.logs",
    "paddle-mnist-download": "paddle_mnist.download",
}


def resolve(target: str):
    module, function = target.split(":")
    return getattr(importlib.import_module(module), function)


def test_console_commands_resolve_to_the_modules_main():
    """As declared in pyproject.toml and, where the package is installed (CI: pip install -e .), as pip made them."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+, as the tests run
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert set(declared) == set(COMMANDS)
    for name, module in COMMANDS.items():
        assert resolve(declared[name]) is importlib.import_module(module).main, name
    try:
        dist = metadata.distribution("paddle_mnist")
    except metadata.PackageNotFoundError:
        return  # not installed here; the declared commands were checked
    installed = {ep.name: ep.value for ep in dist.entry_points if ep.group == "console_scripts"}
    assert installed == declared

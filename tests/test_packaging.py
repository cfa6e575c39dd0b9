"""The console commands pip installs (pyproject.toml's [project.scripts]) call the modules' own main functions."""

from __future__ import annotations

import importlib
import importlib.metadata as metadata

import pytest

COMMANDS = {  # command -> the module that `python -m` runs for the same job
    "paddle-mnist-train": "paddle_mnist.cli",
    "paddle-mnist-predict": "paddle_mnist.predict",
    "paddle-mnist-logs": "paddle_mnist.logs",
    "paddle-mnist-download": "paddle_mnist.download",
}


def installed_commands() -> dict[str, metadata.EntryPoint]:
    try:
        dist = metadata.distribution("paddle_mnist")
    except metadata.PackageNotFoundError:
        pytest.skip("the package is not installed: pip install -e . (CI does) to check its console commands")
    return {ep.name: ep for ep in dist.entry_points if ep.group == "console_scripts"}


def test_console_commands_resolve_to_the_modules_main():
    found = installed_commands()
    assert set(found) == set(COMMANDS)
    for name, module in COMMANDS.items():
        assert found[name].load() is importlib.import_module(module).main, name

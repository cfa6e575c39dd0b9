"""The console commands pip installs (pyproject.toml's [project.scripts]) call the modules' own main functions."""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO

COMMANDS = {  # command -> the module that `python -m` runs for the same job
    "paddle-mnist-train": "paddle_mnist.start",
    "paddle-mnist-predict": "paddle_mnist.deploy.predict",
    "paddle-mnist-logs": "paddle_mnist.files.logs",
    "paddle-mnist-download": "paddle_mnist.datasets.download",
    "paddle-mnist-export": "paddle_mnist.deploy.export",
    "paddle-mnist-preflight": "paddle_mnist.runtime.preflight",
}


def toml(text: str) -> dict:
    try:
        import tomllib  # Python 3.11+
    except ImportError:  # 3.9 and 3.10: the copy pip carries
        from pip._vendor import tomli as tomllib
    return tomllib.loads(text)


def resolve(target: str):
    module, function = target.split(":")
    return getattr(importlib.import_module(module), function)


def test_console_commands_resolve_to_the_modules_main():
    """As declared in pyproject.toml and as pip made them: the README's set-up installs the package."""
    declared = toml((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert set(declared) == set(COMMANDS)
    for name, module in COMMANDS.items():
        assert resolve(declared[name]) is importlib.import_module(module).main, name
    dist = metadata.distribution("paddle_mnist")  # not installed: the README's `pip install -r requirements.txt -e .`
    installed = {ep.name: ep.value for ep in dist.entry_points if ep.group == "console_scripts"}
    assert installed == declared


def documented_scripts() -> set[str]:
    """Every `python -m scripts.NAME` that the README and docs/ tell a reader to run."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    return {name for page in pages for name in re.findall(r"python -m (scripts\.[a-z0-9_]+)", page.read_text())}


def test_the_top_level_holds_the_design_cards_names():
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    top = {path.split("/")[0] for path in tracked}
    card = {"paddle_mnist", "data", "scripts", "tests", "requirements.txt", "README.md"}
    python_project = {"docs", "train.py", "pyproject.toml", ".ci", ".gitignore", "LICENSE"}
    assert card <= top
    extra = top - card - python_project
    assert all(name.startswith("requirements-") for name in extra), extra


@pytest.mark.slow
@pytest.mark.parametrize("module", sorted(documented_scripts()))
def test_every_documented_script_runs_as_written_from_the_repository_root(module):
    """Each script the docs name starts from a checkout's root and prints its usage (no sys.path edits needed)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout


def test_the_package_imports_from_any_folder(tmp_path):
    """After the README's set-up (`pip install -r requirements.txt -e .`) a snippet runs outside the clone."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = "import paddle_mnist; from paddle_mnist import Predictor; print(paddle_mnist.__file__)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert Path(proc.stdout.strip()).parent.name == "paddle_mnist"


def test_every_way_to_install_for_the_cpu_gets_onednns_headers():
    """pip install ".[cpu]" once installed Paddle without oneDNN's headers, so the trainer ran Paddle's own
    convolutions (about half the speed) where requirements.txt gave the fast path: both must name the same."""
    wanted = [
        line.strip()
        for line in (REPO / "requirements.txt").read_text().splitlines()
        if line.startswith("onednn-devel-cpu-gomp")
    ]
    extras = toml((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert len(wanted) == 1 and wanted[0] in extras["cpu"], extras["cpu"]

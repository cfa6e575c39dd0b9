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
from helpers import REPO, launch_env

COMMANDS = {  # command -> the module that `python -m` runs for the same job
    "paddle-mnist-train": "paddle_mnist.start",
    "paddle-mnist-predict": "paddle_mnist.deploy.predict",
    "paddle-mnist-logs": "paddle_mnist.files.logs",
    "paddle-mnist-download": "paddle_mnist.datasets.download",
    "paddle-mnist-export": "paddle_mnist.deploy.export",
    "paddle-mnist-preflight": "paddle_mnist.runtime.preflight",
    "paddle-mnist-evaluate": "paddle_mnist.training.evaluate",
    "paddle-mnist-plots": "paddle_mnist.files.plots",
    "paddle-mnist-launch": "paddle_mnist.runtime.launch",
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
    assert installed == declared, "pyproject.toml's [project.scripts] changed since the install: pip install -e ."


def documented_commands() -> set[str]:
    """Every `python -m paddle_mnist.NAME` that the README and docs/ tell a reader to run, as NAME."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    return {name for page in pages for name in re.findall(r"python -m paddle_mnist\.([a-z_]+)", page.read_text())}


def test_every_command_the_docs_name_has_a_console_command_running_the_same_main():
    """`python -m paddle_mnist.NAME` is also paddle-mnist-NAME, and `python train.py` paddle-mnist-train: the same
    function, importable and callable, whichever way a user starts it."""
    declared = toml((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    names = documented_commands()
    assert {"evaluate", "launch", "logs", "plots", "predict"} <= names  # the pattern still finds the docs' commands
    for name in sorted(names):
        assert f"paddle-mnist-{name}" in declared, f"python -m paddle_mnist.{name} has no paddle-mnist-{name}"
        target = resolve(declared[f"paddle-mnist-{name}"])
        assert callable(target) and target is importlib.import_module(f"paddle_mnist.{name}").main, name
    assert resolve(declared["paddle-mnist-train"]) is importlib.import_module("paddle_mnist.start").main
    assert "from paddle_mnist.start import main" in (REPO / "train.py").read_text()


def command_help(name: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", f"paddle_mnist.{name}", "--help"]
    return subprocess.run(cmd, cwd=REPO, env=launch_env(), capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name", sorted(documented_commands() - {"launch"}))
def test_every_command_the_docs_name_has_a_help_of_its_own(name):
    """Its own usage line first, and a description: a bare usage line told a reader nothing of what it does."""
    proc = command_help(name)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith(f"usage: python -m paddle_mnist.{name} "), proc.stdout[:200]
    assert len(proc.stdout.split("\n\n")) >= 3, proc.stdout  # the usage, a description, the arguments


@pytest.mark.slow
def test_the_launchers_help_says_what_it_checks_then_gives_paddles():
    """python -m paddle_mnist.launch --help once printed Paddle's launcher's help alone, nothing of its checks."""
    proc = command_help("launch")
    assert proc.returncode == 0, proc.stderr[-2000:]
    ours, _, paddles = proc.stdout.partition(
        "Paddle's launcher's options (python -m paddle.distributed.launch --help):"
    )
    assert ours.startswith("usage: python -m paddle_mnist.launch ") and "GLOO_SOCKET_IFNAME" in ours, ours
    assert "--nproc_per_node" in paddles and "training_script" in paddles, paddles[:500]


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

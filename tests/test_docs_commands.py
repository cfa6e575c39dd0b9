"""Every shell command in README.md and docs/ runs as written, in the state the README leaves a newcomer in.

The README's commands run in the order a reader meets them, in one folder laid out like a clone (its files linked,
the environment these tests run in activated: its bin/ first on PATH). Each docs page then runs in a copy of the
folder the README left. What a command needs and a reader would have is made first: `my_images/` (a small folder
of PNG digits, the README's folder example) and `launcher.out` (the README's Train command's console output).

How each command is checked is a rule below, chosen by the command's text, so a new command in the docs fails
`test_every_documented_command_has_a_rule` until it gets one:
- run: as written, to exit 0;
- train: as written plus SHORT appended (the run's schedule unchanged, stopped after a few steps and scored on a
  few images), to exit 0;
- serve: VisualDL's server, as written, until it answers on its page;
- pip: as written with --dry-run: the requirement files resolve on this Python;
- parse: not run (no GPU, no second machine, no etcd, no internet here, or a benchmark of minutes to hours): every
  flag is read by the parser the command would meet (Paddle's launcher's, the trainer's, the script's);
- elsewhere: run by .ci/run or another test, named in the rule.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from helpers import REPO
from PIL import Image

from paddle_mnist.datasets import formats

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PROGRAMS = ("python", "python3", "pip", "visualdl", "srun", "apt-get", "chromium")
SHORT = ["--max-steps", "45", "--eval-limit", "200"]  # below chance.JUDGE_STEPS: a smoke run is not judged
PLACEHOLDERS = {"DIR": "my_images", "LOG": "log_b", "OUT": "out_b", "[--visualdl]": ""}
VARIABLES = {"JOB_COMPLETION_INDEX": "0"}  # Kubernetes sets it in each pod
VISUALDL_RUNS = "http://127.0.0.1:8040/app/api/runs"  # the runs the dashboard lists, as JSON


@dataclass(frozen=True)
class Command:
    page: str
    line: int
    text: str  # one logical line: continuations joined, a leading "$ " and a trailing comment dropped


def commands(page: Path) -> list[Command]:
    """The shell commands in the page's indented code blocks, in order."""
    found, pending, start = [], "", 0
    for number, raw in enumerate(page.read_text().splitlines(), 1):
        if not raw.startswith("    "):
            pending = ""
            continue
        line = raw.strip()
        if not pending:
            start = number
        pending = f"{pending} {line}".strip()
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip()
            continue
        text, pending = _drop_comment(pending.removeprefix("$ ")), ""
        words = [w for w in text.split() if not re.fullmatch(r"[A-Z_]+=\S*", w)]  # VAR=value before the program
        if words and words[0] in PROGRAMS:
            found.append(Command(page.name, start, text))
    return found


def _drop_comment(text: str) -> str:
    """The command without a trailing `# comment` (a # outside quotes, after a space)."""
    quote = None
    for i, ch in enumerate(text):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and i and text[i - 1] == " ":
            return text[:i].rstrip()
    return text


# (pattern searched in the command, how it is checked, why); the first rule that matches decides
RULES = [
    (r"^python3 -m venv \.venv && \. \.venv/bin/activate$", "elsewhere", ".ci/run's set-up runs this line"),
    (r"^pip install -r requirements\.txt -e \.$", "elsewhere", ".ci/run's set-up runs this line"),
    (r"^pip install ruff", "elsewhere", ".ci/run's lint step runs this line"),
    (r"^python -m pytest", "elsewhere", "this suite: .ci/run runs it"),
    (r"^pip install", "pip", ""),
    (r"^apt-get ", "elsewhere", "a system package: .ci/run's elastic stage installs it"),
    (r"^chromium ", "elsewhere", "the dashboard in a browser: tests/test_visualdl.py, .ci/run's browser stage"),
    (r"^srun ", "elsewhere", "needs a SLURM cluster; its launcher flags are those of the multi-machine lines"),
    (r"^python -m scripts\.relaunch .* -- srun ", "elsewhere", "needs a SLURM cluster; tests/test_relaunch.py"),
    (r"scripts\.relaunch .* --nnodes", "parse", "several machines: tests/test_multihost.py runs loops on two"),
    (r"^python -m scripts\.relaunch .* train\.py", "train", ""),
    (r"^python -m scripts\.restart_trials", "parse", "20 trials of minutes each, as root"),
    (r"--master etcd://", "parse", "needs etcd: tests/test_elastic.py runs it in .ci/run's elastic stage"),
    (r"^python -m paddle_mnist\.preflight", "parse", "asks the master's machine: tests/test_multi.py runs it on two"),
    (r"--nnodes", "parse", "several machines: tests/test_parallel.py runs two launchers on one"),
    (r"--gpus|--selected_gpus", "parse", "no GPU here"),
    (r"--pretrained(?! \S+\.pdparams)", "parse", "downloads Paddle's ImageNet weights from the internet"),
    (r"^python -m paddle_mnist\.download cifar10", "parse", "downloads from the internet"),
    (r"^python -m scripts\.gpu_estimate", "run", ""),
    (r"^python -m scripts\.", "parse", "a benchmark or a study of minutes to hours"),
    (r"train\.py --help", "run", ""),
    (r"train\.py", "train", ""),
    (r"^visualdl ", "serve", ""),
    (r"--backend onnx|--onnx", "onnx", ""),
    (r"^python -m paddle_mnist\.", "run", ""),
]


def rule(command: Command) -> tuple[str, str]:
    for pattern, kind, why in RULES:
        if re.search(pattern, command.text):
            return kind, why
    raise LookupError(f"{command.page}:{command.line}: no rule for {command.text!r}")


ALL = [c for page in PAGES for c in commands(page)]


def test_every_documented_command_has_a_rule():
    assert len(ALL) > 50 and {c.page for c in ALL} >= {"README.md", "deploy.md", "distributed.md", "visualdl.md"}
    for command in ALL:
        kind, why = rule(command)
        assert kind in ("run", "train", "serve", "pip", "parse", "elsewhere", "onnx")
        assert why or kind not in ("parse", "elsewhere"), command  # what is not run says why
    kinds = {rule(c)[0] for c in ALL}
    assert {"run", "train", "serve", "pip", "parse"} <= kinds


def test_commands_are_read_as_a_shell_reads_them(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "    python -m a --x 1 \\\n        --y 'two # not a comment'   # a comment\n"
        "    $ pip install b\n    not a command\n\n    GRPC=0 python -m c &\n"
    )
    found = [c.text for c in commands(page)]
    assert found == ["python -m a --x 1 --y 'two # not a comment'", "pip install b", "GRPC=0 python -m c &"]


# ---------------------------------------------------------------------------------------------------------------
# The folder a reader works in


def _clone(root: Path) -> Path:
    """A folder laid out like the clone (its tracked top-level files linked), with the files a reader would have."""
    root.mkdir()
    for name in ("train.py", "paddle_mnist", "data", "scripts", "docs", "pyproject.toml", ".ci"):
        (root / name).symlink_to(REPO / name)
    for req in REPO.glob("requirements*.txt"):
        (root / req.name).symlink_to(req)
    _digits(root / "my_images")
    return root


def _digits(folder: Path, per_class: int = 24, test_per_class: int = 6) -> None:
    """The README's `my_images`: a train/ and a test/ folder of shipped MNIST digits as PNG files, by class."""
    images = formats.read_idx(REPO / "data/mnist/t10k-images-idx3-ubyte.gz", 3)
    labels = formats.read_idx(REPO / "data/mnist/t10k-labels-idx1-ubyte.gz", 1)
    for digit in range(10):
        chosen = np.flatnonzero(labels == digit)[: per_class + test_per_class]
        for i, index in enumerate(chosen):
            split = "train" if i < per_class else "test"
            (folder / split / str(digit)).mkdir(parents=True, exist_ok=True)
            Image.fromarray(images[index]).save(folder / split / str(digit) / f"{index}.png")


def _env() -> dict[str, str]:
    """An activated environment: this Python's bin/ first on PATH, as `. .venv/bin/activate` leaves it."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "GLOG_minloglevel")}
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    env["VIRTUAL_ENV"] = str(Path(bin_dir).parent)
    return env


def _shell(text: str, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-c", text], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout
    )  # fmt: skip


def _with_placeholders(text: str) -> str:
    for name, value in PLACEHOLDERS.items():
        text = re.sub(rf"(?<![\w-]){re.escape(name)}(?![\w-])", value, text)
    return text


def _split_tail(text: str) -> tuple[str, str]:
    """The command and what follows it on the line (`&& break`, a trailing `&`)."""
    for tail in (" && break", " &"):
        if text.endswith(tail):
            return text[: -len(tail)], tail
    return text, ""


PARSER_CHECK = r"""
import argparse, json, runpy, sys
checks, failures, inside, handed_on = json.loads(sys.argv[1]), [], [], []
class Parsed(Exception):
    pass
plain, known = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args
def parse_args(self, args=None, namespace=None):
    inside.append(self)
    try:
        plain(self, args, namespace)
    finally:
        inside.pop()
    raise Parsed
def parse_known_args(self, args=None, namespace=None):
    result = known(self, args, namespace)
    if inside:
        return result
    if result[1] and not handed_on:  # Paddle's launcher hands flags it does not know to its legacy launcher
        handed_on.append(result[1])
        return result
    unknown = [a for a in result[1] if not (a.startswith("--selected_gpus") and cpu_build())]
    if unknown:
        raise SystemExit(f"unrecognized arguments: {' '.join(unknown)}")
    raise Parsed
def cpu_build():  # Paddle's legacy launcher has --selected_gpus only in its CUDA build
    import paddle
    return not paddle.is_compiled_with_cuda()
for what, target, argv in checks:
    try:
        if what == "trainer":  # the trainer's own checks too (flags that contradict each other), as it runs them
            argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = plain, known
            from paddle_mnist.cli import parse_command
            parse_command(argv)
            continue
        argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = parse_args, parse_known_args
        sys.argv, handed_on[:] = [target, *argv], []
        runpy.run_module(target, run_name="__main__", alter_sys=True)
        failures.append([target, argv, "ran past its parser"])
    except Parsed:
        pass
    except SystemExit as e:
        failures.append([target, argv, f"exit {e.code}"])
    except Exception as e:
        failures.append([target, argv, f"{type(e).__name__}: {e}"])
print("PARSER_CHECK " + json.dumps(failures))
"""


def _parse_checks(text: str) -> list[tuple[str, str, list[str]]]:
    """What a parse-only command's parsers are given: Paddle's launcher and the trainer, or one module."""
    words = shlex.split(_expand(text))
    words = [w for w in words if not re.fullmatch(r"[A-Z_]+=\S*", w)]
    assert words[:2] == ["python", "-m"], text
    module, argv = words[2], words[3:]
    if module == "scripts.relaunch" and "--" in argv:  # the loop's flags, then the command it reruns
        return [("module", module, argv), *_parse_checks(shlex.join(argv[argv.index("--") + 1 :]))]
    if module != "paddle.distributed.launch":
        return [("module", module, argv)]
    at = argv.index("train.py")
    return [("module", module, argv[: at + 1]), ("trainer", "train.py", argv[at + 1 :])]


def _expand(text: str) -> str:
    text = _with_placeholders(text)
    for name, value in VARIABLES.items():
        text = text.replace(f'"${name}"', value).replace(f"${name}", value)
    return text


def _serve(text: str, cwd: Path) -> str | None:
    """Start VisualDL as written; None once it lists the run its --logdir holds, else what went wrong."""
    command, _ = _split_tail(text)
    with open(cwd / "visualdl.out", "w") as out:
        server = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=cwd, env=_env(), stdout=out, stderr=out)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and server.poll() is None:
            try:
                with urllib.request.urlopen(VISUALDL_RUNS, timeout=5) as page:
                    runs = json.loads(page.read())["data"] if page.status == 200 else None
                if runs:
                    return None
            except OSError:
                time.sleep(1)
        return f"no run listed at {VISUALDL_RUNS} (exit {server.poll()}): {(cwd / 'visualdl.out').read_text()[-1500:]}"
    finally:
        server.terminate()
        server.wait(timeout=30)


def _onnx_unavailable() -> str | None:
    import paddle

    if not paddle.__version__.startswith("3"):
        return f"paddle2onnx 2.1 converts Paddle 3.x exports; this is Paddle {paddle.__version__}"
    try:
        import paddle2onnx  # noqa: F401
    except ImportError:
        return "paddle2onnx is not installed here (requirements-onnx.txt; it has no wheel for Python 3.13)"
    return None


def run_page(commands_: list[Command], cwd: Path) -> tuple[list[str], list[str]]:
    """Run or check each command in order in cwd: (failures, commands not run with the reason)."""
    failures, not_run, parse = [], [], []
    for command in commands_:
        kind, why = rule(command)
        where = f"{command.page}:{command.line}: {command.text}"
        if kind == "onnx" and _onnx_unavailable():
            not_run.append(f"{where} ({_onnx_unavailable()})")
            continue
        if kind in ("run", "onnx"):
            proc = _shell(_expand(command.text), cwd)
        elif kind == "train":
            line, tail = _split_tail(_expand(command.text))
            proc = _shell(f"{line} {shlex.join(SHORT)}{'' if tail == ' &' else tail}", cwd)
        elif kind == "pip":
            proc = _shell(command.text.replace("pip install", "pip install --dry-run --quiet", 1), cwd)
        elif kind == "serve":
            problem = _serve(_expand(command.text), cwd)
            if problem:
                failures.append(f"{where}\n{problem}")
            continue
        elif kind == "parse":
            parse += [(where, check) for check in _parse_checks(command.text)]
            not_run.append(f"{where} (flags checked, not run: {why})")
            continue
        else:
            not_run.append(f"{where} ({why})")
            continue
        if proc.returncode != 0:
            failures.append(f"{where}\nexit {proc.returncode}\n{proc.stdout[-1500:]}\n{proc.stderr[-2500:]}")
    if parse:
        proc = subprocess.run(
            [sys.executable, "-c", PARSER_CHECK, json.dumps([check for _, check in parse])],
            cwd=cwd, env=_env(), capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        reported = [line for line in proc.stdout.splitlines() if line.startswith("PARSER_CHECK ")]
        assert reported, proc.stderr[-3000:]
        for target, argv, problem in json.loads(reported[-1].removeprefix("PARSER_CHECK ")):
            failures.append(f"{target} {shlex.join(argv)}: {problem}\n{proc.stderr[-2000:]}")
    return failures, not_run


@pytest.fixture(scope="module")
def after_readme(tmp_path_factory):
    """The folder a reader has after the README, and what its commands did there."""
    root = _clone(tmp_path_factory.mktemp("docs") / "clone")
    readme = commands(REPO / "README.md")
    failures, not_run = run_page(readme, root)
    train = next(c for c in readme if rule(c)[0] == "train")
    line, _ = _split_tail(train.text)
    out = _shell(f"{line} --output-dir console_run {shlex.join(SHORT)}", root)  # the console a reader saw
    (root / "launcher.out").write_text(out.stdout + out.stderr)
    return root, failures, not_run


@pytest.mark.slow
@pytest.mark.readme
def test_the_readme_runs_as_written_in_order(after_readme):
    root, failures, not_run = after_readme
    assert not failures, "\n\n".join(failures)
    assert (root / "output" / "inference_meta.json").exists() and (root / "vdl_run" / "visualdl").is_dir()
    print("not run here:\n" + "\n".join(not_run))


@pytest.mark.slow
@pytest.mark.parametrize("page", [p.name for p in PAGES[1:] if commands(p)])  # pages with shell commands
def test_each_docs_page_runs_as_written_after_the_readme(after_readme, page, tmp_path):
    root, _, _ = after_readme
    found = commands(REPO / "docs" / page)
    cwd = tmp_path / "clone"
    shutil.copytree(root, cwd, symlinks=True)
    failures, not_run = run_page(found, cwd)
    assert not failures, "\n\n".join(failures)
    print("not run here:\n" + "\n".join(not_run))


@pytest.mark.slow
def test_a_command_with_a_wrong_flag_fails_its_check(tmp_path):
    """The checks can fail: a misspelt flag for the trainer, the launcher or a script, and a failing command."""
    wrong = [
        Command("page.md", 1, "python -m paddle.distributed.launch --nnodes 2 --gpus 0 train.py --epochz 3"),
        Command("page.md", 2, "python -m paddle.distributed.launch --nnodes 2 --procs_per_node 2 train.py"),
        Command("page.md", 3, "python -m scripts.bench_torch --no-such-flag"),
        Command("page.md", 4, "python -m paddle_mnist.logs no_such_log_dir"),
    ]
    failures, _ = run_page(wrong, tmp_path)
    assert len(failures) == 4, "\n\n".join(failures)
    for wrong_part in ("--epochz", "--procs_per_node", "--no-such-flag", "no_such_log_dir"):
        assert sum(wrong_part in failure.splitlines()[0] for failure in failures) == 1, (wrong_part, failures)

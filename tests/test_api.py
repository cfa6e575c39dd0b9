"""paddle_mnist.train(): the trainer in the calling process, as the command line trains, twice in one process; a
callback that ends the run, resumed afterwards to an uninterrupted run's weights; errors raised, not exits; and the
docs' example as written."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import pytest
from helpers import REPO, explain, launch_env, param_digest, run_single

from paddle_mnist.config import ConfigError
from paddle_mnist.training.api import train

# a short job on the shipped MNIST (the default model and recipe, shifted batches): 1,280 images make 20 steps of 64
JOB = dict(dataset="mnist", train_limit=1280, eval_limit=300, seed=3)
FLAGS = ["--dataset", "mnist", "--train-limit", "1280", "--eval-limit", "300", "--seed", "3"]

SCRIPT = """
import json, sys
from paddle_mnist import train

job = json.loads(sys.argv[1])
stopped_at = []

class StopAfterFirst:
    def on_epoch_end(self, epoch, metrics):
        stopped_at.append((epoch, metrics["step"], round(metrics["val_acc"], 4)))
        return epoch == 1

for out in ("api_a", "api_b"):
    r = train(**job, epochs=2, output_dir=out)
    print("RESULT", out, r.test_acc, r.results["steps"], r.weights, r.best_weights, r.report["accuracy"])
cut = train(**job, epochs=2, output_dir="api_cut", callbacks=[StopAfterFirst(), lambda epoch, metrics: None])
print("CUT", stopped_at, cut.results["steps"])
rest = train(**job, epochs=2, output_dir="api_cut", resume="auto")
print("REST", rest.results["steps"])
"""


@pytest.mark.slow
def test_train_in_python_twice_equals_the_command_line_and_a_callback_ends_a_run_that_resumes(tmp_path):
    cli = run_single([*FLAGS, "--epochs", "2", "--output-dir", "cli"], cwd=tmp_path)
    assert cli.returncode == 0, explain(cli)

    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(JOB)],
        cwd=tmp_path,
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, explain(done)
    digests = re.findall(r"parameters sha256 ([0-9a-f]{64})", done.stdout)
    # api_a, api_b, api_cut after epoch 1, api_cut resumed to the end
    assert len(digests) == 4, done.stdout[-3000:]
    assert digests[0] == digests[1] == param_digest(cli.stdout)  # two runs in one process, and the command's
    assert digests[2] != digests[0] and digests[3] == digests[0]  # cut short, then resumed to the same weights
    lines = [line.split() for line in done.stdout.splitlines() if line.startswith(("RESULT", "CUT", "REST"))]
    (_, _, acc, steps, weights, best, report_acc), second, cut, rest = lines
    assert float(acc) == float(report_acc) > 0.5 and steps == "40" and second[2:4] == [acc, steps]
    assert (weights, best) == ("api_a/model.pdparams", "api_a/model_best.pdparams")
    assert cut[:3] == ["CUT", "[(1,", "20,"] and cut[-1] == "20" and rest == ["REST", "40"]  # one epoch of 20 steps
    assert "a callback ended the run after epoch 1" in done.stdout
    header = (tmp_path / "api_a" / "args.yaml").read_text().splitlines()[1]
    called = "train(dataset='mnist', train_limit=1280, eval_limit=300, seed=3, epochs=2, output_dir='api_a')"
    assert header.endswith(f"by: paddle_mnist.{called}"), header


def test_a_bad_option_raises_config_error_with_the_command_lines_message_and_nothing_is_written(tmp_path):
    with pytest.raises(ConfigError, match=r"^train\(\): bach_size is no option of the trainer; did you mean batch"):
        train(bach_size=64, output_dir=str(tmp_path / "out"))
    with pytest.raises(ConfigError, match=r"^--epochs must be at least 1$"):
        train(epochs=0, output_dir=str(tmp_path / "out"))
    with pytest.raises(TypeError, match="on_epoch_end"):
        train(output_dir=str(tmp_path / "out"), callbacks=[object()])
    assert not (tmp_path / "out").exists()


def _example() -> str:
    """The Python block of docs/python.md, as a reader copies it."""
    text = (REPO / "docs" / "python.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 1, "docs/python.md: one Python example"
    return textwrap.dedent(blocks[0])


@pytest.mark.slow
def test_the_docs_example_trains_from_python_as_written(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", _example()], cwd=tmp_path, env=launch_env(), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, explain(done)
    epochs = re.findall(r"^epoch (\d): validation accuracy (0\.\d+)$", done.stdout, re.M)
    assert epochs and [int(e) for e, _ in epochs] == list(range(1, len(epochs) + 1))
    reached = [float(acc) >= 0.8 for _, acc in epochs]
    assert reached[:-1] == [False] * (len(epochs) - 1) and (reached[-1] or len(epochs) == 4)  # stopped at the goal
    assert re.search(r"^test accuracy 0\.\d{4}, weights in run_py/model.pdparams$", done.stdout, re.M)
    assert re.search(r"^lowest recall: \S.* 0\.\d{3}$", done.stdout, re.M)
    assert (tmp_path / "run_py" / "inference_meta.json").is_file()

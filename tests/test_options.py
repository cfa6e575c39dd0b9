"""--config FILE and a run's args.yaml: options read from a file as the flags would read them, refused in one line
naming the key, and a run replayed from its output folder to the bit."""

from __future__ import annotations

import dataclasses
import json

import pytest
import yaml
from helpers import REAL_JOB, explain, param_digest, run_launch, run_single, worker_log

from paddle_mnist.config import ConfigError, parse_args
from paddle_mnist.files import options
from paddle_mnist.training.api import configure


def test_a_config_file_sets_options_and_a_flag_on_the_command_line_wins(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("lr: 0.1\nepochs: 3\nsync-bn: true\nweight_decay: 1e-4\nmodel: cifar_cnn\naugment: false\n")
    cfg = configure(["--config", str(path), "--lr", "0.2"])
    given = (cfg.lr, cfg.epochs, cfg.sync_bn, cfg.weight_decay, cfg.model, cfg.augment)
    assert given == (0.2, 3, True, 1e-4, "cifar_cnn", False)
    assert "lr" not in cfg.from_recipe and "epochs" not in cfg.from_recipe
    assert cfg.warmup_epochs == 0.2 and "warmup_epochs" in cfg.from_recipe  # cifar_cnn's recipe, left to it
    (tmp_path / "run.json").write_text(json.dumps({"batch-size": 128, "model": "mnist_cnn", "lr": None}))
    cfg = configure(["--config", str(tmp_path / "run.json")])
    assert (cfg.batch_size, cfg.model, cfg.lr) == (128, "mnist_cnn", 0.05)  # null: the recipe's rate
    (tmp_path / "empty.yaml").write_text("# nothing yet\n")
    assert configure(["--config", str(tmp_path / "empty.yaml")]) == parse_args([])
    (tmp_path / "photo.yaml").write_text("augment: photo\ndataset: folder\ndata_dir: photos\n")
    photo = ["--dataset", "folder", "--data-dir", "photos", "--augment", "photo"]
    assert configure(["--config", str(tmp_path / "photo.yaml")]) == parse_args(photo)  # a preset in a file
    assert configure(["--config", str(tmp_path / "photo.yaml"), "--no-augment"]).augment is False


@pytest.mark.parametrize(
    "text, message",
    [
        ("bach_size: 64\n", "bach_size is no option of the trainer; did you mean batch_size?"),
        ("zzz: 1\n", "zzz is no option of the trainer; python train.py --help lists the options"),
        ("lr: fast\n", "lr takes a number, got 'fast'"),
        ("lr: true\n", "lr takes a number as --lr does, got True"),
        ("image_size: [64, 48]\n", "image_size takes a text as --image-size does, got [64, 48]"),
        ("epochs: 2.5\n", "epochs takes a whole number, got 2.5"),
        ("epochs: -1\n", "epochs: --epochs must be >= 0, got -1"),
        ("model: resnet\n", "model is one of mnist_cnn, "),
        ("sync_bn: 1\n", "sync_bn is true or false, got 1"),
        ("augment: fancy\n", "augment is true or false or photo, got 'fancy'"),
        ("seed: [1, 2]\n", "seed takes a whole number as --seed does, got [1, 2]"),
        ("eval_batch_size: null\n", "eval_batch_size has no value; give one (its default is 1000) or drop the key"),
        ("config: other.yaml\n", "config names another file; a file of options cannot: merge the two"),
        ("- lr\n- 0.1\n", "holds list, not options; write one key: value a line"),
        ("lr: [0.1\n", "not valid YAML ("),
    ],
)
def test_a_bad_key_or_value_is_refused_in_one_line_naming_it(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as refused:
        configure(["--config", str(path)])
    assert str(refused.value).startswith(f"--config {path}: ") and message in str(refused.value)
    assert "\n" not in str(refused.value)


def test_a_missing_config_file_is_refused_naming_it(tmp_path):
    with pytest.raises(ConfigError, match=r"--config .*nowhere.yaml: no such file; pass a YAML or JSON file"):
        configure(["--config", str(tmp_path / "nowhere.yaml")])


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--model", "cifar_fast", "--dataset", "cifar10", "--lr", "0.3", "--no-augment", "--sync-bn"],
        ["--dataset", "folder", "--data-dir", "photos", "--image-size", "64", "--flip", "--val-split", "0.25"],
        ["--model", "resnet18", "--dataset", "folder", "--data-dir", "p", "--pretrained", "--freeze-epochs", "1"],
        ["--weight-decay", "5e-05", "--warmup-epochs", "0.3", "--collective-timeout", "20", "--resume", "auto"],
        ["--seed", "7", "--profile-steps", "3:5", "--tta", "--ema", "0.999", "--target-acc", "0.9123456789"],
        ["--dataset", "folder", "--data-dir", "photos", "--augment", "photo", "--erase", "0.5"],
        ["--dataset", "cifar10", "--augment", "--jitter", "0.2"],
    ],
)
def test_args_yaml_reads_back_to_the_same_configuration(tmp_path, argv):
    """Every field, the record of what the recipe and the run's defaults decide included: the replayed run
    resolves its configuration as the first did."""
    cfg = configure(argv)
    path = tmp_path / options.ARGS_FILE
    path.write_text(options.args_yaml(cfg, "python train.py"))
    assert configure(["--config", str(path)]) == cfg
    written = yaml.safe_load(path.read_text())
    assert {key for key, value in written.items() if value is None} == set(cfg.unset)
    assert set(written) == {f.name for f in dataclasses.fields(cfg)} - {"classes", "from_recipe", "unset"}


def test_the_command_refuses_a_bad_config_file_before_it_trains(tmp_path):
    (tmp_path / "bad.yaml").write_text("max_step: 5\n")
    done = run_single(["--config", "bad.yaml", "--output-dir", "out"], cwd=tmp_path, timeout=120)
    assert done.returncode == 2, explain(done)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: --config bad.yaml: max_step is no option of the trainer; did you mean max_steps?"]
    assert not (tmp_path / "out").exists()


def _replayed(root, first, second, launch: bool) -> tuple[str, str]:
    """The weights' digests of the job REAL_JOB run into `first`, and of its replay from first/args.yaml."""
    digests = []
    for out, flags in ((first, REAL_JOB), (second, ["--config", f"{first}/args.yaml"])):
        args = [*flags, "--output-dir", out]
        if launch:
            done = run_launch(args, cwd=root, log_dir=root / f"log_{out}")
            assert done.returncode == 0, explain(done, root / f"log_{out}")
            digests.append(param_digest(worker_log(root / f"log_{out}", 0)))
        else:
            done = run_single(args, cwd=root)
            assert done.returncode == 0, explain(done)
            digests.append(param_digest(done.stdout))
    return digests[0], digests[1]


@pytest.mark.slow
def test_a_run_replays_from_its_args_yaml_to_the_bit_on_one_process_and_on_two_workers(tmp_path):
    """REAL_JOB on the shipped MNIST: mnist_cnn with its recipe's warmup (stretched), shifts by the dataset's
    default, a batch of 96; replayed with only --config and --output-dir."""
    one, replay_one = _replayed(tmp_path, "one", "one_again", launch=False)
    assert one == replay_one
    two, replay_two = _replayed(tmp_path, "two", "two_again", launch=True)
    assert two == replay_two
    first = (tmp_path / "two" / "args.yaml").read_text().splitlines()[2:]
    again = (tmp_path / "two_again" / "args.yaml").read_text().splitlines()[2:]
    assert [line for line in again if line not in first] == ["output_dir: two_again"]  # it replays itself

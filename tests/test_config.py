"""The configuration (config.py): defaults, the recipes per model, the checks on flags, the JSON round trip."""

from __future__ import annotations

import dataclasses

import pytest

from paddle_mnist import cli, config
from paddle_mnist.datasets import data
from paddle_mnist.network.models import MODELS

FASHION = config.DataFacts(("t-shirt", "trouser"), 60000)  # two of its class names are enough here


def test_default_global_batch_is_64_per_worker():
    cfg = config.parse_args([])
    assert config.global_batch(cfg, 1) == config.resolve(cfg, 1, FASHION).batch_size == 64
    assert config.global_batch(cfg, 4) == config.resolve(cfg, 4, FASHION).batch_size == 256


def test_batch_that_does_not_split_is_refused():
    cfg = config.parse_args(["--batch-size", "63"])
    for refused in (lambda: config.global_batch(cfg, 2), lambda: config.resolve(cfg, 2, FASHION)):
        with pytest.raises(config.ConfigError, match="does not divide by the 2 workers"):
            refused()
    assert config.resolve(cfg, 1, FASHION).batch_size == 63


def test_the_configuration_is_resolved_once_with_the_datas_facts():
    """resolve fills in what the command line leaves open: the class names, a folder's decoded size and channels;
    resolving its result again changes nothing. Every other field is the command line's."""
    argv = ["--dataset", "folder", "--data-dir", "d", "--train-limit", "100", "--epochs", "3"]
    flags = config.parse_args(argv)
    cfg = config.resolve(flags, 2, config.DataFacts(("cat", "dog"), 1000, "64x48", 3))
    assert (cfg.classes, cfg.image_size, cfg.channels, cfg.batch_size) == (("cat", "dog"), "64x48", 3, 128)
    assert config.image_shape(cfg) == (3, 48, 64)
    assert config.resolve(cfg, 2, config.DataFacts(("cat", "dog"), 1000, "64x48", 3)) == cfg
    left = {"classes", "image_size", "channels", "batch_size"}
    assert {f: getattr(cfg, f) for f in vars(cfg) if f not in left} == {
        f: getattr(flags, f) for f in vars(flags) if f not in left
    }
    builtin = config.resolve(config.parse_args([]), 1, FASHION)
    assert (builtin.classes, builtin.image_size, builtin.channels) == (FASHION.classes, "", 0)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_the_steps_of_an_epoch_are_the_samplers(world_size):
    """resolve counts an epoch's steps (for --min-steps) as the training sampler does, without building one."""
    for images in (0, 1, 63, 64, 127, 128, 129, 500, 1350, 60000):
        for per_worker in (1, 7, 32, 64):
            sampler = data.make_sampler(images, per_worker, 0, world_size) if images else []
            batch = per_worker * world_size
            assert config.steps_per_epoch(images, batch, world_size) == len(sampler), (images, per_worker)


def test_resume_and_overwrite_together_are_refused():
    with pytest.raises(config.ConfigError, match="contradict"):
        config.parse_args(["--resume", "--overwrite"])


def test_each_model_trains_with_its_own_recipe_unless_a_flag_says_otherwise():
    assert set(config.RECIPES) == set(MODELS)
    for name, recipe in config.RECIPES.items():
        cfg = config.parse_args(["--model", name])
        assert {f: getattr(cfg, f) for f in config.RECIPE_FLAGS} == dataclasses.asdict(recipe)
    flags = ["--lr", "0.01", "--warmup-epochs", "0", "--epochs", "3", "--weight-decay", "0", "--batch-size", "32"]
    cfg = config.parse_args(["--model", "mnist_cnn", *flags])
    assert (cfg.lr, cfg.warmup_epochs, cfg.epochs, cfg.weight_decay, cfg.batch_size) == (0.01, 0.0, 3, 0.0, 32)
    assert config.parse_args([]) == config.Config()  # a Config built in code holds the default model's recipe


def test_a_config_built_in_code_for_a_model_holds_that_models_recipe():
    """Config(model="mnist_cnn") once had the default model's warmup (0.0, not 0.2) and said it came from the
    recipe: tests and scripts built Configs that way. The dataclass fills the recipe in, as the parser does."""
    for name, recipe in config.RECIPES.items():
        cfg = config.Config(model=name)
        assert cfg == config.parse_args(["--model", name]), name
        assert {f: getattr(cfg, f) for f in config.RECIPE_FLAGS} == dataclasses.asdict(recipe), name
        assert cfg.from_recipe == config.RECIPE_FLAGS
    given = config.Config(model="cifar_fast", lr=0.1, whiten=False)
    assert (given.lr, given.whiten, given.batch_size) == (0.1, False, 256)
    assert "lr" not in given.from_recipe and "whiten" not in given.from_recipe and "batch_size" in given.from_recipe
    assert dataclasses.replace(given, model="mnist_cnn").lr == 0.1  # a value, once set, stays


def test_help_lists_every_recipe():
    text = config.build_parser().format_help().split("default recipes by --model")[1]  # the table, not a flag's help
    for name, r in config.RECIPES.items():
        row = next(line.split() for line in text.splitlines() if line.split()[:1] == [name])
        assert [float(v) for v in row[1:5]] == [r.lr, r.warmup_epochs, r.epochs, r.weight_decay]


def test_help_says_each_default_in_words_and_fits_80_columns(monkeypatch):
    """An option whose default the run works out (None in the parser) or that is off as '' says its default in
    words: argparse's own "(default: None)" (14 options printed it) and "(default: )" told a reader nothing."""
    monkeypatch.setenv("COLUMNS", "80")  # argparse wraps to the terminal's width
    parser = config.build_parser()
    text = parser.format_help()
    flat = " ".join(text.split())  # a wrapped "(default:\n None)" too
    assert "(default: None)" not in flat and "(default: )" not in flat
    worked_out = [a for a in parser._actions if a.default is None or a.default == ""]
    assert {a.dest for a in worked_out} >= set(config.OPEN_DEFAULTS)
    for action in worked_out:
        assert "(default: " in action.help, action.option_strings
    assert "(default: 1000)" in flat and "(default: fashion-mnist)" in flat  # the others keep argparse's
    assert max(len(line) for line in text.splitlines()) <= 80, [line for line in text.splitlines() if len(line) > 80]


def test_config_round_trips_through_json(tmp_path):
    cfg = config.parse_args(["--epochs", "3", "--lr", "0.1", "--train-limit", "100"])
    (tmp_path / "c.json").write_text(cfg.to_json())
    assert config.load_config(tmp_path / "c.json") == cfg


def test_shift_and_label_smoothing_flags_are_checked():
    cfg = config.parse_args(["--augment", "--shift", "0", "--label-smoothing", "0.1"])
    assert cfg.shift == 0 and cfg.label_smoothing == 0.1
    assert config.parse_args([]).shift is None
    with pytest.raises(config.ConfigError, match="add --augment"):
        config.parse_args(["--shift", "1"])
    with pytest.raises(config.ConfigError, match="--label-smoothing must be at least 0 and below 1"):
        config.parse_args(["--label-smoothing", "1"])
    with pytest.raises(SystemExit):
        config.parse_args(["--augment", "--shift", "-1"])


def test_augment_photo_fills_in_its_operations_where_their_flags_are_not_given(tmp_path):
    folder = ["--dataset", "folder", "--data-dir", str(tmp_path)]
    cfg = config.parse_args([*folder, "--augment", "photo", "--jitter", "0.1"])
    assert (cfg.augment, cfg.crop_scale, cfg.jitter, cfg.erase, cfg.shift, cfg.flip) == (True, 0.35, 0.1, 0.25, 0, True)
    assert {"crop_scale", "jitter", "erase", "shift", "min_steps"}.isdisjoint(cfg.unset)  # args.yaml records them
    assert cfg.min_steps == 1000 and config.parse_args(["--augment", "photo", "--min-steps", "600"]).min_steps == 600
    cifar = config.parse_args(["--dataset", "cifar10", "--augment", "photo", "--shift", "2"])
    assert (cifar.crop_scale, cifar.shift, cifar.flip) == (0.35, 2, False)  # --flip: a folder's
    plain = config.parse_args(["--dataset", "cifar10", "--augment"])
    assert (plain.crop_scale, plain.jitter, plain.erase, plain.shift, plain.min_steps) == (0.0, 0.0, 0.0, None, 500)
    assert config.parse_args(["--augment", "photo", "--no-augment"]).augment is False
    for argv, message in [
        (["--jitter", "0.2"], "--jitter is an operation of --augment: add --augment (or --augment photo), or drop it"),
        (["--erase", "0.2", "--crop-scale", "0.5"], "--crop-scale, --erase are operations of --augment"),
        (["--augment", "--crop-scale", "1.5"], "--crop-scale is the smallest share of the area a crop keeps"),
        (["--augment", "--jitter", "1"], "--jitter is below 1 and --erase a chance from 0 to 1"),
        (["--augment", "--erase", "1.5"], "--jitter is below 1 and --erase a chance from 0 to 1"),
    ]:
        with pytest.raises(config.ConfigError) as refused:
            config.parse_args(argv)
        assert str(refused.value).startswith(message), argv
    with pytest.raises(config.ConfigError, match="^--mixup is an operation of --augment"):
        config.parse_args(["--mixup", "0.2"])
    with pytest.raises(config.ConfigError, match="^--mixup and --cutmix take Beta's a, above 0"):
        config.parse_args(["--augment", "--cutmix", "-1"])
    mixing = config.parse_args(["--augment", "--cutmix", "1", "--batch-size", "96", "--accum-steps", "3"])
    assert config.global_batch(mixing, 2) == 96  # micro-batches of 16
    odd = config.parse_args(["--augment", "--cutmix", "1", "--batch-size", "90", "--accum-steps", "3"])
    with pytest.raises(config.ConfigError) as refused:
        config.global_batch(odd, 2)  # micro-batches of 15
    assert str(refused.value) == (
        "--mixup and --cutmix mix pairs of images in each worker's micro-batch, of 15 images here: pass a "
        "--batch-size that is a multiple of 12, e.g. --batch-size 96"
    )
    for argv in (["--augment", "sharp"], ["--no-augment", "photo"]):
        with pytest.raises(SystemExit):
            config.parse_args(argv)


def test_tta_on_a_folder_needs_flip(tmp_path):
    """--tta mirrors the evaluation images: on a folder it goes with --flip, which trains on mirrored ones. The
    command line's checks (cli.parse_command) ask the augmentation's policy, which the configuration cannot."""
    base = ["--dataset", "folder", "--data-dir", str(tmp_path), "--tta"]
    assert cli.parse_command([*base, "--flip"]).tta
    with pytest.raises(config.ConfigError) as e:
        cli.parse_command(base)
    assert str(e.value) == (
        "--tta mirrors the evaluation images, which goes with training on mirrored ones: add --flip if a mirror "
        "keeps the class, or drop --tta"
    )
    with pytest.raises(config.ConfigError, match="^--flip applies to --dataset folder only"):
        cli.parse_command(["--dataset", "cifar10", "--flip"])
    with pytest.raises(config.ConfigError, match="mnist's classes are not mirror-symmetric"):
        cli.parse_command(["--dataset", "mnist", "--tta"])
    assert cli.parse_command(["--dataset", "cifar10", "--tta"]).tta

"""The run's configuration: one frozen dataclass, parsed from the command line, checked, then resolved once. Every
flag lives here with its default, its model recipe and its check, so --help, the checks and config.json read one
source."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

DATASETS = ("fashion-mnist", "mnist", "cifar10", "mnist-json")  # built in: downloaded or shipped in data/
FOLDER = "folder"  # the user's own images (folder.py)
# (channels, height, width) of the built-in datasets' images; a folder's run records its own in config.json
IMAGE_SHAPES = {"fashion-mnist": (1, 28, 28), "mnist": (1, 28, 28), "mnist-json": (1, 28, 28), "cifar10": (3, 32, 32)}
CONFIG_FILE = "config.json"  # the run's Config, in its output directory
AUGMENTED_BY_DEFAULT = ("cifar10", "mnist", "mnist-json")  # shifts lift MNIST past 99.3% (docs/results.md)
# --augment photo: the photo operations in place of shifts (docs/datasets.md, "Augmentation for photos")
# and twice the steps: on a small folder they cost accuracy over 500 steps and paid over 1,000
AUGMENT_PRESETS = {"photo": {"crop_scale": 0.35, "jitter": 0.4, "erase": 0.25, "shift": 0, "min_steps": 1000}}
PHOTO_OPERATIONS = ("crop_scale", "jitter", "erase", "mixup", "cutmix")  # each 0 when off
LR_SCHEDULES = ("poly", "cosine", "constant")
OPTIMIZERS = ("sgd", "adamw")
CLASS_WEIGHTS = ("none", "balanced")
LR_SCALING = ("none", "linear")
AMP = ("off", "fp16", "bf16")
EXPORTS = ("last", "best")  # which weights --export writes for inference
PER_WORKER_BATCH = 64  # the tutorials' per-GPU batch; the default global batch is this times the workers
MIN_STEPS = 500  # a recipe's run trains at least this many optimizer steps (docs/training.md#small-training-sets)
PRETRAINED_MODELS = ("resnet18", "mobilenet_v3_small")  # the models with Paddle's ImageNet weights (backbones.py)
IMAGENET = "imagenet"  # --pretrained without a file: Paddle's ImageNet weights, from its cache or downloaded
# the fine-tuning recipe when --init-from or --pretrained is given: every layer at the full rate from the start,
# which beat 0.1 x the rate for the loaded layers and tied 5 frozen epochs (docs/finetuning.md)
FINETUNE_LR_SCALE = 1.0
FINETUNE_FREEZE_EPOCHS = 0
# --opt adamw's rate and decoupled weight decay where the command gives none: a recipe's are SGD's (docs/training.md)
ADAMW_DEFAULTS = {"lr": 0.004, "weight_decay": 0.05, "nesterov": False}


@dataclass(frozen=True)
class Recipe:
    """A model's default training recipe: what --lr, --warmup-epochs, --epochs, --weight-decay and --batch-size
    are when not given. Chosen by measurement on MNIST and Fashion-MNIST (docs/results.md), except minigooglenet's:
    the former defaults, too slow to measure on a 2-core machine."""

    lr: float
    warmup_epochs: float
    epochs: int
    weight_decay: float
    batch_size: int = 0  # 0 = PER_WORKER_BATCH x world size
    label_smoothing: float = 0.0
    whiten: bool = False  # the first convolution starts as a whitening of the training patches (whiten.py)
    nesterov: bool = False  # Nesterov momentum


# The warmup is what keeps a start from stalling: at the full rate from the first step, the first updates are
# large enough to push every ReLU of mnist_cnn below zero for good on some seeds (docs/training.md#recipes-by-model)
RECIPES = {
    "mnist_cnn": Recipe(lr=0.05, warmup_epochs=0.2, epochs=10, weight_decay=5e-4),
    "mnist_cnn_bn": Recipe(lr=0.05, warmup_epochs=0.2, epochs=8, weight_decay=5e-4),
    "mnist_cnn_bn_fc": Recipe(lr=0.05, warmup_epochs=0.0, epochs=8, weight_decay=5e-4),
    "minigooglenet": Recipe(lr=0.05, warmup_epochs=0.0, epochs=8, weight_decay=5e-4),
    "cifar_cnn": Recipe(lr=0.02, warmup_epochs=0.2, epochs=8, weight_decay=1e-4),
    "cifar_fast": Recipe(
        lr=0.4,
        warmup_epochs=0.5,
        epochs=10,
        weight_decay=5e-4,
        batch_size=256,
        label_smoothing=0.1,
        whiten=True,
        nesterov=True,
    ),
    # not measured: the default model's rates for these two; the warmup as for the other networks without a long run
    "resnet18": Recipe(lr=0.05, warmup_epochs=0.2, epochs=8, weight_decay=5e-4),
    "mobilenet_v3_small": Recipe(lr=0.05, warmup_epochs=0.2, epochs=8, weight_decay=1e-4),
}
RECIPE_FLAGS = tuple(f.name for f in dataclasses.fields(Recipe))
# the options whose default the run works out (None in the parser), in Config's order: what a bare command leaves
OPEN_DEFAULTS = ("data_dir", "augment", "shift", "epochs", "batch_size", "lr", "warmup_epochs", "label_smoothing")
OPEN_DEFAULTS += ("whiten", "nesterov", "weight_decay", "init_lr_scale", "freeze_epochs", "collective_timeout")


def recipe_table() -> str:
    """The recipes as --help shows them."""
    width = max(map(len, RECIPES))
    lines = ["default recipes by --model (a flag given on the command line wins):"]
    lines.append(f"  {'model':<{width}} {'lr':>6} {'warmup':>7} {'epochs':>7} {'weight decay':>13}  batch")
    for name, r in RECIPES.items():
        batch = r.batch_size or f"{PER_WORKER_BATCH} x workers"
        lines.append(f"  {name:<{width}} {r.lr:>6g} {r.warmup_epochs:>7g} {r.epochs:>7} {r.weight_decay:>13g}  {batch}")
    for name, r in RECIPES.items():  # the rest of a recipe below the table, whose rows stay within 80 columns
        more = [f"--label-smoothing {r.label_smoothing:g}"] if r.label_smoothing else []
        more += ["--whiten"] * r.whiten + ["--nesterov"] * r.nesterov
        lines += [f"  {name} also: {', '.join(more)}"] if more else []
    lines.append("Without --epochs a small training split trains more epochs than the table says:")
    lines.append(f"the schedule, warmup included, stretches to --min-steps ({MIN_STEPS}) optimizer steps.")
    return "\n".join(lines)


class ConfigError(ValueError):
    """A configuration the run cannot start with; the message names the problem and the fix."""


@dataclass(frozen=True)
class Config:
    dataset: str = "fashion-mnist"
    data_dir: str | None = None
    model: str = "mnist_cnn_bn_fc"
    augment: bool = False  # parse_args fills in the dataset's default when neither flag is given
    shift: int | None = None  # largest random shift in pixels when augmenting; None: the dataset's policy
    crop_scale: float = 0.0  # random resized crops of [crop_scale, 1] of the area when augmenting (0: none)
    jitter: float = 0.0  # colour jitter when augmenting: brightness, contrast, saturation times [1 - j, 1 + j]
    erase: float = 0.0  # random erasing when augmenting: each image's chance of a painted-over rectangle
    mixup: float = 0.0  # mixup's Beta(a, a) when augmenting: each image blended with its partner (0: none)
    cutmix: float = 0.0  # cutmix's Beta(a, a) when augmenting: a rectangle of its partner pasted in (0: none)
    # RECIPE_FLAGS left None take the model's recipe (RECIPES, __post_init__)
    epochs: int | None = None
    max_steps: int = 0
    batch_size: int | None = None  # global batch of one optimizer step; 0 = PER_WORKER_BATCH x world size
    eval_batch_size: int = 1000
    lr: float | None = None
    lr_schedule: str = "poly"
    optimizer: str = "sgd"  # "adamw": its lr and weight decay, where not given, are ADAMW_DEFAULTS
    warmup_epochs: float | None = None
    lr_scaling: str = "none"  # "linear": lr x global batch / reference_batch
    reference_batch: int = PER_WORKER_BATCH
    accum_steps: int = 1  # micro-batches per optimizer step
    sync_bn: bool = False
    amp: str = "off"
    momentum: float = 0.9
    label_smoothing: float | None = None
    class_weights: str = "none"  # "balanced": each image's loss weighs n / (classes x its class's training images)
    whiten: bool | None = None  # the first convolution starts as a whitening of the training images' patches
    nesterov: bool | None = None  # Nesterov momentum
    weight_decay: float | None = None
    clip_grad_norm: float = 0.0  # largest global gradient norm, after the all-reduce (0: no clipping)
    ema: float = 0.0  # decay of the weights' moving average, evaluated and saved when on (0: off)
    lookahead: bool = False  # every 5 steps the weights are pulled back to a slow copy of them (lookahead.py)
    tta: bool = False  # the final test score (each epoch's too with target_acc) averages image and mirror image
    tta_shift: bool = False  # with tta: also with the image and its mirror moved 1 px both ways (6 views)
    target_acc: float = 0.0  # end the run at the first evaluation at least this accurate (0: train every epoch)
    patience: int = 0  # end the run after this many epochs without a better validation accuracy, on the best (0: off)
    init_from: str = ""  # another run's output directory, or a .pdparams file, whose fitting weights start this run
    pretrained: str = ""  # IMAGENET: Paddle's ImageNet weights of --model; or a .pdparams file of them ("": none)
    init_lr_scale: float = 1.0  # the loaded layers' learning rate, times --lr (FINETUNE_LR_SCALE with a start)
    freeze_epochs: int = 0  # the loaded layers stay as loaded for this many epochs (FINETUNE_FREEZE_EPOCHS with one)
    seed: int = 42
    train_limit: int = 0
    eval_limit: int = 0
    output_dir: str = "output"
    export: str = "last"  # the weights exported for inference: the last epoch's, or the best validation epoch's
    resume: str = "no"  # "no", "yes" (a checkpoint must exist) or "auto" (resume if one exists)
    overwrite: bool = False
    save_every_steps: int = 0
    keep_checkpoints: int = 3
    log_every: int = 50
    visualdl: bool = False  # VisualDL scalars in OUTPUT_DIR/visualdl (the optional visualdl package)
    collective_timeout: float | None = None  # None: the backend's default (watchdog.timeout_for)
    cpu_threads: int = 0  # 0 = the machine's cores divided among this node's workers
    conv_backend: str = "auto"  # CPU training's convolutions: oneDNN's custom operator where it works (onednn.py)
    cpu_sums: str = "shared-memory"  # what carries CPU workers' sums within one machine (runtime/local_sum.py)
    timing_every: int = 25  # time the phases of every Nth step (0: off)
    profile_steps: str = ""  # "A:B": record optimizer steps A to B with paddle.profiler ("": off)
    # --dataset folder only (docs/datasets.md, "Your own images")
    image_size: str = ""  # "W" or "WxH"; "": folder.default_size of the most common size (the run records it)
    channels: int = 0  # 1 or 3; 0: 1 when every training image is grey, else 3 (the run records the choice)
    val_split: float = 0.1  # share of each class of train/ held out for validation when there is no val/
    flip: bool = False  # the classes are mirror-symmetric: --augment flips and --tta is allowed
    skip_bad_images: bool = False  # leave unreadable images out (listed in the log) instead of refusing the folder
    labels: str = ""  # in place of data_dir: the training images' label file (datasets/labels.py)
    val_labels: str = ""  # with labels: the validation images' label file ("": val_split of its rows held out)
    test_labels: str = ""  # with labels: the test images' label file ("": none)
    min_steps: int = MIN_STEPS  # the recipe's epochs rise until the run trains at least this many steps (0: never)
    classes: tuple[str, ...] = ()  # not a flag: the dataset's class names, filled in by resolve
    from_recipe: tuple[str, ...] | None = None  # not a flag: the RECIPE_FLAGS left to the recipe (None: the ones None)
    unset: tuple[str, ...] = OPEN_DEFAULTS  # not a flag: the options left to a default the run works out (args.yaml)

    def __post_init__(self) -> None:
        """The one place a Config takes its model's recipe, for the parser, the tests and the scripts alike: each of
        RECIPE_FLAGS left None becomes the recipe's value, and from_recipe (when not given) names them."""
        recipe = RECIPES.get(self.model)
        left = tuple(name for name in RECIPE_FLAGS if getattr(self, name) is None)
        if left and recipe is None:
            raise ConfigError(f"model {self.model!r} has no recipe: choose one of {', '.join(RECIPES)}")
        adamw = ADAMW_DEFAULTS if self.optimizer == "adamw" else {}
        for name in left:
            object.__setattr__(self, name, adamw.get(name, getattr(recipe, name)))
        if self.from_recipe is None:
            object.__setattr__(self, "from_recipe", left)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)


def _non_negative(name: str):
    def parse(text: str) -> int:
        value = int(text)
        if value < 0:
            raise argparse.ArgumentTypeError(f"{name} must be >= 0, got {value}")
        return value

    return parse


def _add_count(p: argparse.ArgumentParser, flag: str, help: str) -> None:
    """A whole-number flag whose default is the Config field of the same name."""
    field = flag[2:].replace("-", "_")
    p.add_argument(flag, type=_non_negative(flag), default=getattr(Config(), field), help=help)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in the help, but None and '' (a default the run works out, or off), which the help says in words."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None or action.default == "" else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """The trainer's parser: one function per group of flags, each adding its flags in --help's order (the last two
    add the argument groups --help shows apart)."""
    p = argparse.ArgumentParser(
        prog="train.py",
        description=(
            "Data-parallel image classification with PaddlePaddle.\nStart it as any Paddle job:\n"
            "  python -m paddle.distributed.launch --nproc_per_node 2 --log_dir log \\\n      train.py [options]"
        ),
        epilog=recipe_table(),
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "--config",
        default=argparse.SUPPRESS,
        metavar="FILE",
        help="a YAML or JSON file of options (keys as the flags', - or _), e.g. a run's OUTPUT_DIR/args.yaml; "
        "a flag on the command line wins over the file",
    )
    d = Config()
    for add in (_data, _length, _batch, _gpus, _optimiser, _evaluation, _sample, _outputs, _runtime, _start, _folder):
        add(p, d)
    return p


def _data(p: argparse.ArgumentParser, d: Config) -> None:
    p.add_argument("--dataset", default=d.dataset, choices=(*DATASETS, FOLDER), help="dataset to train on")
    p.add_argument(
        "--data-dir",
        default=d.data_dir,
        help="folder (or the archive or .json.gz file itself) holding the dataset "
        "(default: data/<dataset> in this repository, where python -m paddle_mnist.download puts it)",
    )
    p.add_argument(
        "--augment",
        "--no-augment",
        action=_AugmentAction,
        nargs="?",
        metavar="PRESET",
        default=None,
        help="random shifts (and flips where the classes allow) on each training batch; --augment photo: random "
        "resized crops, colour jitter and random erasing (and flips on a folder) in their place "
        f"(default: on for {', '.join(AUGMENTED_BY_DEFAULT)}, off otherwise)",
    )
    p.add_argument(
        "--shift",
        type=_non_negative("--shift"),
        default=d.shift,
        help="with --augment: largest random shift in pixels, 0 for flips only "
        "(default: 4 for cifar10, 2 for the 28x28 datasets; a folder: 1/14 of the image's shorter side, rounded down, "
        "at least 1)",
    )
    photo = AUGMENT_PRESETS["photo"]
    p.add_argument(
        "--crop-scale",
        type=float,
        help="with --augment: random resized crops, each of a share of the image's area from this to 1 and an aspect "
        f"ratio from 3/4 to 4/3, resized back (default: {photo['crop_scale']} with --augment photo, else 0: none)",
    )
    p.add_argument(
        "--jitter",
        type=float,
        help="with --augment: colour jitter, each image's brightness, contrast and saturation times a factor from "
        f"1 - J to 1 + J (default: {photo['jitter']} with --augment photo, else 0)",
    )
    p.add_argument(
        "--erase",
        type=float,
        help="with --augment: random erasing, each image's chance of a rectangle of 2%% to 25%% of its area painted "
        f"one random colour (default: {photo['erase']} with --augment photo, else 0)",
    )
    mixing = (
        "by a weight drawn from Beta(A, A), the loss mixed alike (default: 0, none; with both, each image takes one)"
    )
    p.add_argument(
        "--mixup", type=float, metavar="A", help=f"with --augment: each image blended with its partner {mixing}"
    )
    p.add_argument(
        "--cutmix", type=float, metavar="A", help=f"with --augment: a rectangle of its partner pasted in {mixing}"
    )
    # a partner: its neighbour in the global batch (augment.mix_pairs)


class _AugmentAction(argparse.Action):
    """--augment [PRESET] and --no-augment: the dataset's policy, a preset by name (AUGMENT_PRESETS), or off."""

    presets = ("photo",)

    def __call__(self, parser, namespace, value, option_string=None) -> None:
        if option_string == "--no-augment" and value is not None:
            parser.error(f"argument --no-augment takes no value, got {value!r}")
        if value is not None and value not in self.presets:
            parser.error(f"argument --augment: its presets are {', '.join(self.presets)}; got {value!r}")
        setattr(namespace, self.dest, option_string != "--no-augment" and (value or True))


def _fill_augment(ns: argparse.Namespace) -> None:
    """--augment PRESET turns augmentation on with the preset's operations and --min-steps, each where its flag is
    not given (on a folder it flips too: photos are mirror-symmetric); the photo operations not given are off."""
    preset = AUGMENT_PRESETS.get(ns.augment) if isinstance(ns.augment, str) else None
    if preset is not None:
        filled = {key: value for key, value in preset.items() if getattr(ns, key) is None}
        ns.__dict__.update(filled, augment=True, flip=ns.flip or ns.dataset == FOLDER)
    for key in PHOTO_OPERATIONS:  # 0: off; args.yaml records the values, the preset's included
        setattr(ns, key, getattr(ns, key) or 0.0)
    ns.min_steps = MIN_STEPS if ns.min_steps is None else ns.min_steps
    filled = (*PHOTO_OPERATIONS, "shift", "min_steps")
    ns.unset = tuple(key for key in ns.unset if key not in filled or getattr(ns, key) is None)
    given = [f"--{key.replace('_', '-')}" for key in PHOTO_OPERATIONS if getattr(ns, key)]
    if given and not ns.augment:
        raise ConfigError(
            f"{', '.join(given)} {'are operations' if len(given) > 1 else 'is an operation'} of --augment: add "
            "--augment (or --augment photo), or drop it"
        )
    if not 0 <= ns.crop_scale <= 1:
        raise ConfigError(
            f"--crop-scale is the smallest share of the area a crop keeps: at most 1 (0: no crops), got {ns.crop_scale}"
        )
    if ns.mixup < 0 or ns.cutmix < 0:
        raise ConfigError(f"--mixup and --cutmix take Beta's a, above 0 (0: off); got {ns.mixup} and {ns.cutmix}")
    if not 0 <= ns.jitter < 1 or not 0 <= ns.erase <= 1:
        raise ConfigError(
            f"--jitter is below 1 and --erase a chance from 0 to 1, both at least 0; got {ns.jitter} and {ns.erase}"
        )


def _length(p: argparse.ArgumentParser, d: Config) -> None:
    models = f"network to train: {', '.join(RECIPES)}; its recipe: the table at the end"
    p.add_argument("--model", default=d.model, choices=tuple(RECIPES), metavar="MODEL", help=models)
    p.add_argument(
        "--epochs",
        type=_non_negative("--epochs"),
        help="passes over the training split (default: the model's recipe, more on a small training split: "
        "--min-steps); with --resume, another value re-plans the schedule from the checkpoint's step over this many "
        "epochs, logged (poly: the rate jumps to the new plan's and decays to 0 at the new end), e.g. to extend a "
        "finished run",
    )
    p.add_argument(
        "--min-steps",
        type=_non_negative("--min-steps"),
        help="without --epochs: when the recipe's epochs would train fewer optimizer steps than this (a small training "
        "split), train as many epochs as it takes, the warmup stretched alike, 0 for the recipe's epochs as they are "
        f"(default: {MIN_STEPS}, {AUGMENT_PRESETS['photo']['min_steps']} with --augment photo)",
    )
    _add_count(
        p,
        "--max-steps",
        "stop after this many optimizer steps in all; the schedule stays planned over --epochs (0: no limit)",
    )


def _batch(p: argparse.ArgumentParser, d: Config) -> None:
    p.add_argument(
        "--batch-size",
        type=_non_negative("--batch-size"),
        help="global batch of one optimizer step, split evenly across workers "
        f"(default: the model's recipe; 0: {PER_WORKER_BATCH} x workers)",
    )
    _add_count(p, "--eval-batch-size", "per-worker eval batch")
    p.add_argument("--lr", type=float, help="base learning rate (default: the model's recipe)")
    p.add_argument(
        "--lr-schedule",
        "--sched",
        default=d.lr_schedule,
        choices=LR_SCHEDULES,
        help="poly: linear decay to 0 over the planned steps (power 1); cosine: half a cosine from the peak to 0; "
        "constant: no decay",
    )
    p.add_argument(
        "--warmup-epochs",
        type=float,
        help="raise the learning rate linearly from 0 over this many epochs, then decay as --lr-schedule says "
        "(default: the model's recipe)",
    )
    p.add_argument(
        "--lr-scaling",
        default=d.lr_scaling,
        choices=LR_SCALING,
        help="linear: multiply --lr by global batch / --reference-batch (for a global batch that grows with workers)",
    )
    _add_count(p, "--reference-batch", "the global batch --lr was tuned for (used by --lr-scaling linear)")
    _add_count(
        p,
        "--accum-steps",
        "build each optimizer step from this many micro-batches per worker (memory per micro-batch shrinks; "
        "gradients are all-reduced once per step)",
    )


def _gpus(p: argparse.ArgumentParser, d: Config) -> None:
    p.add_argument(
        "--sync-bn",
        action="store_true",
        help="batch norm over the global batch (with --accum-steps: the global micro-batch), not each worker's shard; "
        "on CPU, in one process or on any number of workers, its sums in float64, so N workers train one process's "
        "weights to the bit (docs/exactness.md); on GPUs, Paddle's SyncBatchNorm across them. Exports plain batch norm",
    )
    p.add_argument(
        "--amp",
        default=d.amp,
        choices=AMP,
        help="mixed precision on GPUs: fp16 (compute capability 7.0+, with loss scaling) or bf16 (8.0+); off: float32",
    )


def _optimiser(p: argparse.ArgumentParser, d: Config) -> None:
    p.add_argument(
        "--opt",
        dest="optimizer",
        default=d.optimizer,
        choices=OPTIMIZERS,
        help="sgd: momentum SGD, L2 weight decay on every parameter; adamw: Adam with decoupled weight decay, none on "
        f"biases and batch norm (its --lr and --weight-decay default to {ADAMW_DEFAULTS['lr']:g} and "
        f"{ADAMW_DEFAULTS['weight_decay']:g}, not the recipe's)",
    )
    p.add_argument("--momentum", type=float, default=d.momentum, help="SGD momentum")
    p.add_argument(
        "--nesterov",
        action=argparse.BooleanOptionalAction,
        help="Nesterov momentum (the step looks ahead along the momentum); --no-nesterov: plain momentum "
        "(default: the model's recipe, plain but for cifar_fast)",
    )
    p.add_argument("--weight-decay", type=float, help="L2 weight decay (default: the model's recipe)")
    p.add_argument(
        "--clip-grad-norm",
        type=float,
        default=d.clip_grad_norm,
        help="scale the gradients down whenever their global norm over all parameters exceeds this (after the "
        "all-reduce, so every worker clips alike; the epoch line says how often it did); 0: no clipping",
    )
    p.add_argument(
        "--label-smoothing",
        type=float,
        help="share of each training target spread evenly over all classes, 0 for plain cross-entropy (default: "
        "the model's recipe, 0 but for cifar_fast)",
    )
    p.add_argument(
        "--class-weights",
        default=d.class_weights,
        choices=CLASS_WEIGHTS,
        help="balanced: an image's loss weighs N / (C x N_c): N training images, C classes, N_c in its class",
    )
    p.add_argument(
        "--whiten",
        action=argparse.BooleanOptionalAction,
        help="start the first convolution as a whitening of the training images' patches (its filters the patches' "
        "principal directions, scaled to unit variance); --no-whiten: as built (default: the model's recipe)",
    )
    p.add_argument(
        "--ema",
        type=float,
        default=d.ema,
        help="keep an exponential moving average of the weights with this decay (e.g. 0.999) and evaluate, save and "
        "export it instead of the last weights (0: off)",
    )
    p.add_argument(
        "--lookahead",
        action="store_true",
        help="every 5 steps pull the weights back to a slow copy of them that follows them ever more slowly as the "
        "run goes on, and end the run on the slow copy (airbench94's lookahead)",
    )


def _evaluation(p: argparse.ArgumentParser, d: Config) -> None:
    p.add_argument(
        "--tta",
        action="store_true",
        help="test-time augmentation: the final test score averages the outputs of each image and its mirror image "
        "(datasets whose classes are mirror-symmetric: fashion-mnist, cifar10, a folder with --flip); the scores "
        "after each epoch do so too only with --target-acc, which judges them",
    )
    p.add_argument(
        "--tta-shift",
        action="store_true",
        help="with --tta: also the image and its mirror moved by 1 px up-left and down-right (6 views, the unmoved "
        "pair weighted half; three times the plain score's cost)",
    )
    p.add_argument(
        "--target-acc",
        type=float,
        default=d.target_acc,
        help="end the run, with checkpoint, weights and results, at the first evaluation whose accuracy reaches this "
        "(e.g. 0.91; 0: train all --epochs)",
    )
    _add_count(
        p,
        "--patience",
        "end the run after this many epochs in a row without a higher validation accuracy, and finish on the best "
        "epoch's weights: the test score, model.pdparams and the export are the best epoch's (0: train all --epochs)",
    )


def _sample(p: argparse.ArgumentParser, d: Config) -> None:
    p.add_argument("--seed", type=int, default=d.seed, help="seed for weights and data order (same on every rank)")
    _add_count(p, "--train-limit", "use only the first N training images (0: all)")
    _add_count(p, "--eval-limit", "score only the first N validation images and the first N test images (0: all)")


def _outputs(p: argparse.ArgumentParser, d: Config) -> None:
    p.add_argument("--output-dir", default=d.output_dir, help="where rank 0 writes metrics, checkpoints and weights")
    p.add_argument(
        "--export",
        default=d.export,
        choices=EXPORTS,
        help="weights exported to OUTPUT_DIR/inference for predict: last (model.pdparams) or best "
        "(model_best.pdparams, the epoch of highest validation accuracy)",
    )
    p.add_argument(
        "--resume",
        nargs="?",
        const="yes",
        default=d.resume,
        choices=("no", "yes", "auto"),
        help="--resume: continue from the last checkpoint in --output-dir (mid-epoch included); "
        "--resume auto: continue if a checkpoint exists, else start afresh. A changed --epochs, --lr, "
        "--warmup-epochs, --lr-schedule or --lr-scaling re-plans the learning-rate schedule from the checkpoint's "
        "step, and one line says so",
    )
    p.add_argument("--overwrite", action="store_true", help="start afresh even if --output-dir holds earlier results")
    _add_count(p, "--save-every-steps", "also checkpoint every N optimizer steps (0: at epoch ends only)")
    _add_count(p, "--keep-checkpoints", "checkpoints kept")
    _add_count(p, "--log-every", "steps between progress lines")
    p.add_argument(
        "--visualdl",
        action="store_true",
        help="rank 0 also writes its scalars (per progress line and per epoch) to OUTPUT_DIR/visualdl for "
        "visualdl --logdir OUTPUT_DIR/visualdl (pip install -r requirements-visualdl.txt)",
    )


def _runtime(p: argparse.ArgumentParser, d: Config) -> None:
    p.add_argument(
        "--collective-timeout",
        type=float,
        default=d.collective_timeout,
        help="seconds without progress before waiting workers exit, naming the one that stalled; 0: no watchdog "
        "(default: 15 on CPU, where gloo aborts a collective that waited 30 s without naming anyone and "
        "Paddle cannot change that, so the watchdog must come first; 300 on GPUs, where NCCL waits without end)",
    )
    _add_count(p, "--cpu-threads", "CPU math threads per worker (0: cores / workers on this node)")
    p.add_argument(
        "--conv-backend",
        default=d.conv_backend,
        choices=("auto", "onednn", "paddle"),
        help="convolutions for float32 training on the CPU: auto uses oneDNN's (a custom operator built once per "
        "machine and Paddle version, then cached) where it builds and checks out, else Paddle's with one log line "
        "saying why (the same build holds the 2x2 max-pool it uses with them); onednn requires it; paddle never "
        "builds it. The weights and the exported model are the same",
    )
    sums = "CPU workers' sums in one machine: shared-memory (gloo, saying why, where it cannot be set up) or gloo"
    p.add_argument("--cpu-sums", default=d.cpu_sums, choices=("shared-memory", "gloo"), help=sums)
    _add_count(
        p,
        "--timing-every",
        "time forward, backward (with its all-reduce) and optimizer every Nth step for the epoch's breakdown (0: off)",
    )
    p.add_argument(
        "--profile-steps",
        default=d.profile_steps,
        metavar="A:B",
        help="record optimizer steps A to B (counted from 1 over the whole run) with paddle.profiler on every worker; "
        "the trace and operator table to OUTPUT_DIR/profile/, the five costliest operators to the log (default: off)",
    )


def _start(p: argparse.ArgumentParser, d: Config) -> None:
    start = p.add_argument_group("starting from trained weights (docs/finetuning.md)")
    start.add_argument(
        "--init-from",
        default=d.init_from,
        metavar="PATH",
        help="start from another run's weights: its output directory (model.pdparams, with its config.json) or a "
        ".pdparams file. Every tensor whose name and shape fit --model is loaded; the rest starts anew (the "
        "classifier, when the classes differ). With --resume and a checkpoint, the checkpoint wins (default: off)",
    )
    start.add_argument(
        "--pretrained",
        nargs="?",
        const=IMAGENET,
        default=d.pretrained,
        metavar="FILE",
        help=f"--model {' or '.join(PRETRAINED_MODELS)} starts from Paddle's ImageNet weights: from Paddle's cache "
        "(~/.cache/paddle/hapi/weights), downloaded there by Paddle when missing; --pretrained FILE: from that "
        ".pdparams file. The classifier starts anew unless the data has 1,000 classes (default: off)",
    )
    start.add_argument(
        "--init-lr-scale",
        type=float,
        help="with --init-from or --pretrained: the loaded layers train at this times the learning rate, the new "
        f"ones at the full rate (default: {FINETUNE_LR_SCALE:g})",
    )
    start.add_argument(
        "--freeze-epochs",
        type=_non_negative("--freeze-epochs"),
        help="with --init-from or --pretrained: the loaded layers stay as loaded for this many epochs, then train "
        f"at --init-lr-scale (default: {FINETUNE_FREEZE_EPOCHS})",
    )


def _folder(p: argparse.ArgumentParser, d: Config) -> None:
    folder = p.add_argument_group("--dataset folder (your own images in DATA_DIR/train/<class>/...)")
    folder.add_argument(
        "--image-size",
        default=d.image_size,
        metavar="W[xH]",
        help="resize every image to W x W or W x H pixels (default: the most common size in train/, scaled down to a "
        "shorter side of 64 and a longer side of 256 where larger, aspect kept)",
    )
    folder.add_argument(
        "--channels",
        type=int,
        default=d.channels,
        choices=(0, 1, 3),
        help="1 (grey) or 3 (RGB); 0: 1 when every training image is grey, else 3",
    )
    folder.add_argument(
        "--val-split",
        type=float,
        default=d.val_split,
        help="without DATA_DIR/val/: the share of each class of train/ held out for validation (0: none; then "
        "test/ is scored after each epoch)",
    )
    folder.add_argument(
        "--flip",
        action="store_true",
        help="the classes are mirror-symmetric: --augment also flips training images, and --tta may be used "
        "(a folder's classes are not flipped unless asked; its start-up line says whether they look the same "
        "mirrored)",
    )
    folder.add_argument(
        "--skip-bad-images",
        action="store_true",
        help="leave unreadable images out and list them in the log, instead of refusing the folder",
    )
    folder.add_argument(
        "--labels",
        default=d.labels,
        metavar="FILE",
        help="in place of --data-dir: the training images listed in FILE, a CSV with a path,label header or "
        "PaddleClas's 'path label' lines; paths relative to FILE's folder, class names the labels (default: none)",
    )
    folder.add_argument(
        "--val-labels",
        default=d.val_labels,
        metavar="FILE",
        help="with --labels: the validation images' label file (default: --val-split of --labels' rows held out)",
    )
    test = "with --labels: the test images' label file (default: none)"
    folder.add_argument("--test-labels", default=d.test_labels, metavar="FILE", help=test)
    p.set_defaults(classes=d.classes)


def image_size(text: str) -> tuple[int, int] | None:
    """--image-size "W" or "WxH" as (width, height); None for "" (the folder's default size)."""
    if not text:
        return None
    try:
        sides = [int(part) for part in text.lower().split("x")]
    except ValueError:
        sides = []
    if len(sides) not in (1, 2) or min(sides) < 1:
        raise ConfigError(f"--image-size takes W or WxH in pixels, e.g. 64 or 64x48; got {text!r}")
    return sides[0], sides[-1]


def _check_folder_flags(cfg: Config) -> None:
    if cfg.dataset != FOLDER:
        given = [flag for flag, field in _FOLDER_FLAGS.items() if getattr(cfg, field) != getattr(Config(), field)]
        if given:
            verb = "apply" if len(given) > 1 else "applies"
            raise ConfigError(f"{', '.join(given)} {verb} to --dataset folder only: drop it or pass --dataset folder")
        return
    if cfg.labels and cfg.data_dir:
        raise ConfigError(
            "--labels and --data-dir both name the training images: keep --labels FILE (its paths are relative to "
            "its folder) or --data-dir DIR (DIR/train/<class>/), not both"
        )
    if not cfg.labels and (cfg.val_labels or cfg.test_labels):
        raise ConfigError("--val-labels and --test-labels go with --labels: add --labels FILE for the training images")
    if not cfg.data_dir and not cfg.labels:
        raise ConfigError(
            "--dataset folder needs --data-dir: the folder holding train/<class>/ (and val/, test/), or --labels FILE"
        )
    image_size(cfg.image_size)
    if not 0 <= cfg.val_split < 1:
        raise ConfigError(
            f"--val-split is a share of train/ from 0 (hold out nothing; test/ is scored each epoch) to below 1, "
            f"e.g. 0.1; got {cfg.val_split}"
        )
    if cfg.labels and cfg.val_split == 0 and not (cfg.val_labels or cfg.test_labels):
        raise ConfigError(
            "--val-split 0 holds none of --labels' rows out, and there is no --test-labels to score each epoch on; "
            "pass --test-labels FILE (or --val-labels FILE), or --val-split 0.1"
        )


_FOLDER_FLAGS = {
    "--image-size": "image_size",
    "--channels": "channels",
    "--val-split": "val_split",
    "--flip": "flip",
    "--skip-bad-images": "skip_bad_images",
    "--labels": "labels",
    "--val-labels": "val_labels",
    "--test-labels": "test_labels",
}


def starts_from_weights(cfg: Config) -> bool:
    """Whether the run starts from trained weights: --init-from or --pretrained."""
    return bool(cfg.init_from or cfg.pretrained)


def _fill_start_flags(ns: argparse.Namespace) -> None:
    """--init-lr-scale and --freeze-epochs not given: the fine-tuning recipe with a start, else no effect. Given
    without a start, they are refused."""
    starts = bool(ns.init_from or ns.pretrained)
    flags = (("--init-lr-scale", ns.init_lr_scale), ("--freeze-epochs", ns.freeze_epochs))
    given = [flag for flag, value in flags if value is not None]
    if given and not starts:
        verb = "apply" if len(given) > 1 else "applies"
        raise ConfigError(
            f"{', '.join(given)} {verb} to the layers loaded by --init-from or --pretrained: add one, or drop it"
        )
    if ns.init_lr_scale is None:
        ns.init_lr_scale = FINETUNE_LR_SCALE if starts else Config.init_lr_scale
    if ns.freeze_epochs is None:
        ns.freeze_epochs = FINETUNE_FREEZE_EPOCHS if starts else Config.freeze_epochs


def _check_start_flags(cfg: Config) -> None:
    if cfg.init_from and cfg.pretrained:
        raise ConfigError("--init-from and --pretrained both choose the starting weights: pass one of them")
    if cfg.pretrained and cfg.model not in PRETRAINED_MODELS:
        raise ConfigError(
            f"--pretrained loads Paddle's ImageNet weights, which exist for --model {' and '.join(PRETRAINED_MODELS)}, "
            f"not {cfg.model}: pass one of those, or --init-from a run of {cfg.model}"
        )
    if cfg.init_lr_scale < 0:
        raise ConfigError(f"--init-lr-scale multiplies the learning rate: 0 (frozen) or more, got {cfg.init_lr_scale}")


def tta_each_epoch(cfg: Config) -> bool:
    """Whether the scores after each epoch use --tta's views too: only where --target-acc compares them with the
    target; otherwise only the final test score does, at two to six times a plain score's cost."""
    return cfg.tta and bool(cfg.target_acc)


def profile_window(text: str) -> tuple[int, int] | None:
    """--profile-steps "A:B" as (A, B), both counted from 1 and included; None when off."""
    if not text:
        return None
    try:
        first, last = (int(part) for part in text.split(":"))
    except ValueError:
        first = last = 0
    if not 1 <= first <= last:
        raise ConfigError(
            f"--profile-steps takes two step numbers A:B with 1 <= A <= B, e.g. --profile-steps 20:40; got {text!r}"
        )
    return first, last


def parse_args(argv: list[str] | None = None, file_values: dict | None = None) -> Config:
    """Parse the command line into a Config; argparse exits with status 2 on malformed flags. file_values: the
    options of --config's file as the parser's own values (files/options.py reads and checks them): the defaults
    that the command line's flags override."""
    parser = build_parser()
    parser.set_defaults(**(file_values or {}))
    ns = parser.parse_args(argv)
    if getattr(ns, "config", None) and file_values is None:
        raise ConfigError("--config is read by the command line (training/api.configure), not by parse_args")
    ns.unset = tuple(f.name for f in dataclasses.fields(Config) if getattr(ns, f.name, 0) is None)
    if ns.augment is None:
        ns.augment = ns.dataset in AUGMENTED_BY_DEFAULT
    _fill_augment(ns)
    _fill_start_flags(ns)
    cfg = Config(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(Config) if f.name != "from_recipe"})
    if cfg.resume != "no" and cfg.overwrite:
        raise ConfigError("--resume and --overwrite contradict each other: pass one of them")
    if cfg.lr <= 0:
        raise ConfigError(f"--lr must be positive, got {cfg.lr}")
    if not 0 <= cfg.label_smoothing < 1:
        raise ConfigError(f"--label-smoothing must be at least 0 and below 1, got {cfg.label_smoothing}")
    if not 0 <= cfg.ema < 1:
        raise ConfigError(
            f"--ema is the moving average's decay: at least 0 (off) and below 1, e.g. 0.999; got {cfg.ema}"
        )
    if not 0 <= cfg.target_acc <= 1:
        raise ConfigError(f"--target-acc is an accuracy between 0 and 1, e.g. 0.91; got {cfg.target_acc}")
    if cfg.optimizer == "adamw" and (cfg.nesterov or cfg.momentum != Config.momentum):
        raise ConfigError("--nesterov and --momentum set SGD's momentum: drop them with --opt adamw")
    _check_folder_flags(cfg)
    _check_start_flags(cfg)
    if cfg.tta_shift and not cfg.tta:
        raise ConfigError("--tta-shift adds moved views to --tta's: add --tta, or drop --tta-shift")
    if cfg.shift is not None and not cfg.augment:
        raise ConfigError("--shift sets the augmentation's shifts: add --augment, or drop --shift")
    if cfg.epochs == 0:
        raise ConfigError("--epochs must be at least 1")
    if cfg.warmup_epochs < 0 or cfg.warmup_epochs >= cfg.epochs:
        raise ConfigError(
            f"--warmup-epochs must be at least 0 and below --epochs {cfg.epochs}, got {cfg.warmup_epochs}"
        )
    if cfg.accum_steps == 0 or cfg.reference_batch == 0:
        raise ConfigError("--accum-steps and --reference-batch must be at least 1")
    if cfg.collective_timeout is not None and cfg.collective_timeout < 0:
        raise ConfigError(f"--collective-timeout is in seconds: 0 (no watchdog) or more; got {cfg.collective_timeout}")
    if cfg.clip_grad_norm < 0:
        raise ConfigError(f"--clip-grad-norm is a norm: above 0, or 0 for no clipping; got {cfg.clip_grad_norm}")
    profile_window(cfg.profile_steps)
    if cfg.keep_checkpoints == 0:
        raise ConfigError("--keep-checkpoints must be at least 1: resuming needs the last checkpoint")
    return cfg


@dataclass(frozen=True)
class DataFacts:
    """What the run's configuration takes from its data, read before the configuration is resolved (resolve)."""

    classes: tuple[str, ...]
    train_images: int  # in the dataset's training split, before --train-limit
    image_size: str = ""  # a folder's "WxH" as decoded; "" for a built-in dataset (IMAGE_SHAPES has its size)
    channels: int = 0  # a folder's 1 or 3 as decoded; 0 for a built-in dataset


def global_batch(cfg: Config, world_size: int) -> int:
    """The global batch for this many workers; ConfigError unless it splits evenly into micro-batches."""
    batch = cfg.batch_size or PER_WORKER_BATCH * world_size
    parts = world_size * cfg.accum_steps
    if batch % parts:
        lower = batch - batch % parts
        into = f"the {world_size} workers" + (f" x {cfg.accum_steps} accumulation steps" if cfg.accum_steps > 1 else "")
        raise ConfigError(
            f"--batch-size {batch} does not divide by {into}: "
            f"pass a multiple of {parts}, e.g. --batch-size {lower or parts}"
        )
    if (cfg.mixup or cfg.cutmix) and batch // parts % 2:
        raise ConfigError(
            f"--mixup and --cutmix mix pairs of images in each worker's micro-batch, of {batch // parts} images here: "
            f"pass a --batch-size that is a multiple of {2 * parts}, e.g. --batch-size {batch + parts}"
        )
    return batch


def steps_per_epoch(train_images: int, batch: int, world_size: int) -> int:
    """Optimizer steps in an epoch, as the training sampler (DistributedBatchSampler, drop_last) counts them: each
    worker's ceil(images / workers) indices, in whole shares of the global batch."""
    return math.ceil(train_images / world_size) // (batch // world_size)


def _stretched(cfg: Config, steps: int) -> tuple[int, float]:
    """(epochs, warmup epochs) of the recipe on a small training split: when its epochs give fewer than --min-steps
    optimizer steps, as many epochs as it takes to reach them, and a recipe's warmup stretched alike (the same share
    of the run), so the schedule keeps its shape. Epochs or a warmup given on the command line are kept as given."""
    if "epochs" not in cfg.from_recipe or cfg.epochs * steps >= cfg.min_steps or steps == 0:
        return cfg.epochs, cfg.warmup_epochs
    epochs = math.ceil(cfg.min_steps / steps)
    warmup = cfg.warmup_epochs * epochs / cfg.epochs if "warmup_epochs" in cfg.from_recipe else cfg.warmup_epochs
    return epochs, warmup


def resolve(cfg: Config, world_size: int, facts: DataFacts) -> Config:
    """The run's configuration, in one step, from the command line's (parse_args), the number of workers and the
    data's facts: the global batch for the workers, the class names, a folder's image size and channels as decoded,
    and the recipe stretched over a small training split (_stretched). Nothing replaces it afterwards: it is what
    config.json and every checkpoint hold. A resolved configuration resolves to itself, so a resumed run plans the
    same schedule."""
    batch = global_batch(cfg, world_size)
    train = min(facts.train_images, cfg.train_limit) if cfg.train_limit else facts.train_images
    epochs, warmup = _stretched(cfg, steps_per_epoch(train, batch, world_size))
    given = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(Config)}
    found = {"classes": tuple(facts.classes), "image_size": facts.image_size, "channels": facts.channels}
    return Config(**{**given, **found, "batch_size": batch, "epochs": epochs, "warmup_epochs": warmup})


def effective_lr(cfg: Config) -> float:
    """The base learning rate after --lr-scaling: the peak the warmup climbs to and the decay starts from."""
    return cfg.lr * cfg.batch_size / cfg.reference_batch if cfg.lr_scaling == "linear" else cfg.lr


def image_shape(cfg: Config) -> tuple[int, int, int]:
    """(channels, height, width) of the images the run's network takes: a folder's from the size and channels the
    run resolved (and recorded in config.json), a built-in dataset's from IMAGE_SHAPES."""
    if cfg.dataset != FOLDER:
        return IMAGE_SHAPES[cfg.dataset]
    if not cfg.image_size or not cfg.channels:
        raise ConfigError(
            f"a folder run's {CONFIG_FILE} holds the image size and channels the run used; this one has "
            f"image_size {cfg.image_size!r} and channels {cfg.channels}: it is not a started run's"
        )
    width, height = image_size(cfg.image_size)
    return cfg.channels, height, width


def load_config(path: Path) -> Config:
    fields = {f.name for f in dataclasses.fields(Config)}
    raw = json.loads(Path(path).read_text())
    for key in ("classes", "from_recipe", "unset"):
        if key in raw:
            raw[key] = tuple(raw[key])
    return Config(**{k: v for k, v in raw.items() if k in fields})

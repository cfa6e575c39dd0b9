"""Starting from trained weights (--init-from, --pretrained): what fits is loaded, the rest starts anew, and the
loaded layers train at their own learning rate (--init-lr-scale, --freeze-epochs)."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import paddle

from paddle_mnist.config import (
    CONFIG_FILE,
    FINETUNE_FREEZE_EPOCHS,
    FINETUNE_LR_SCALE,
    IMAGENET,
    Config,
    ConfigError,
    load_config,
)
from paddle_mnist.files import checkpoint
from paddle_mnist.files.checkpoint import WEIGHTS, CheckpointError
from paddle_mnist.network import backbones
from paddle_mnist.runtime import distributed, waiting
from paddle_mnist.runtime.distributed import DistEnv
from paddle_mnist.training import agreement

SHOWN_LAYERS = 6  # the new layers named in the start-up line; the rest counted
NAME_CHARS = 40  # a longer layer name is shortened in the middle


@dataclass(frozen=True)
class Loaded:
    """What a start loaded: the file, the state-dict names loaded and those started anew, and why the classifier
    started anew although it fit (None when it did not, or fit and was loaded)."""

    source: str
    loaded: tuple[str, ...]
    new: tuple[str, ...]
    loaded_values: int
    total_values: int
    unused: int  # the file's tensors that fit nothing in the network
    classifier_note: str | None = None


def classifier(net: paddle.nn.Layer) -> tuple[str, ...]:
    """The state-dict names of the network's classifier: the parameters of its last dense layer."""
    dense = [(name, layer) for name, layer in net.named_sublayers() if isinstance(layer, paddle.nn.Linear)]
    if not dense:
        return ()
    last, layer = dense[-1]
    return tuple(f"{last}.{p}" for p, _ in layer.named_parameters())


def weights_file(cfg: Config, env: DistEnv, log: logging.Logger, stopped: Callable[[], int]) -> tuple[Path, tuple]:
    """The file to start from, and the classes of the run it came from (() when not known).

    --init-from DIR reads DIR/model.pdparams, and DIR/config.json for the classes; --pretrained FILE that file;
    --pretrained alone Paddle's ImageNet weights of --model, from Paddle's cache, downloaded there first by the
    first worker of each machine when missing. Raises CheckpointError, one line, when the file is not there."""
    if cfg.init_from:
        path = Path(cfg.init_from)
        if path.is_dir():
            weights = path / WEIGHTS
            if not weights.is_file():
                raise CheckpointError(
                    f"--init-from {path}: no {WEIGHTS} in this folder; pass a finished run's --output-dir or a "
                    ".pdparams file"
                )
            config = path / CONFIG_FILE
            return weights, load_config(config).classes if config.is_file() else ()
        if not path.is_file():
            raise CheckpointError(
                f"--init-from {path}: no such file or folder; pass a run's --output-dir or a .pdparams file"
            )
        return path, ()
    if cfg.pretrained != IMAGENET:
        if not Path(cfg.pretrained).is_file():
            raise CheckpointError(f"--pretrained {cfg.pretrained}: no such file; pass a .pdparams file of {cfg.model}")
        return Path(cfg.pretrained), ()
    return _imagenet_weights(cfg.model, env, log, stopped), ()


def cached_path(model: str) -> Path:
    """Where Paddle keeps (or would keep) --model's ImageNet weights: its weights folder, the URL's file name."""
    from paddle.utils import download

    url, _ = backbones.IMAGENET_WEIGHTS[model]
    return Path(download.WEIGHTS_HOME) / url.rsplit("/", 1)[-1]


def _imagenet_weights(model: str, env: DistEnv, log: logging.Logger, stopped: Callable[[], int]) -> Path:
    """Paddle's cache holds the file with its MD5, or the first worker of each machine downloads it there as Paddle
    does (paddle.utils.download, which checks the MD5) while the others wait; then every rank looks for it."""
    from paddle.utils import download

    url, md5 = backbones.IMAGENET_WEIGHTS[model]
    path, reason = cached_path(model), None
    with waiting.Meeting("pretrained", f"{model}'s ImageNet weights", env, log, stopped) as meeting:
        if env.local_rank == 0 and not _intact(path, md5):
            log.info(f"--pretrained: {path} is not in Paddle's cache, or not whole; downloading {url}")
            try:
                download.get_weights_path_from_url(url, md5)
            except Exception as e:  # no network: a connection error, or Paddle's "retry limit reached"
                reason = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
        meeting.finish(env.local_rank != 0 or _intact(path, md5))
    if not _intact(path, md5):
        why = f" ({reason})" if reason else ""
        raise CheckpointError(
            f"--pretrained: {model}'s ImageNet weights are not in Paddle's cache, {path}, and could not be "
            f"downloaded from {url}{why}: put that file there (MD5 {md5}), or pass --pretrained FILE"
        )
    return path


def _intact(path: Path, md5: str) -> bool:
    if not path.is_file():
        return False
    h = hashlib.md5()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest() == md5


def fit(net: paddle.nn.Layer, state: dict, renew_classifier: bool) -> tuple[list[str], list[str]]:
    """(names loaded, names started anew): a tensor loads when the file has its name with the same shape; the
    classifier starts anew when renew_classifier (the source's classes are others) even if it fits."""
    skip = set(classifier(net)) if renew_classifier else set()
    loaded, new = [], []
    for name, tensor in net.state_dict().items():
        value = state.get(name)
        fits = value is not None and list(value.shape) == list(tensor.shape) and name not in skip
        (loaded if fits else new).append(name)
    return loaded, new


def load(net: paddle.nn.Layer, path: Path, classes: tuple, source_classes: tuple) -> Loaded:
    """Load what fits of the file into net (in place, before DataParallel wraps it). Raises CheckpointError when
    the file is damaged or nothing of it fits but the classifier."""
    state = checkpoint.load(path)  # the restricted loader: a hostile file cannot run code
    renew = bool(source_classes) and list(source_classes) != list(classes)
    loaded, new = fit(net, state, renew)
    if not set(loaded) - set(classifier(net)):  # a classifier's bias alone fits many a network by chance
        example = (checkpoint.mismatches(net, state) or ["the file holds no tensors"])[0]
        raise CheckpointError(
            f"{path}: no tensor of it fits this {type(net).__name__} outside its classifier (e.g. {example}); "
            "start from the weights of a run of the same --model"
        )
    own = net.state_dict()
    with paddle.no_grad():
        for name in loaded:
            value = state[name]
            own[name].set_value(value.numpy() if isinstance(value, paddle.Tensor) else np.asarray(value))
    note = None
    if renew and any(n in state and list(state[n].shape) == list(own[n].shape) for n in classifier(net)):
        shown = ", ".join(source_classes[:5]) + (
            f", ... ({len(source_classes)} in all)" if len(source_classes) > 5 else ""
        )
        note = f"the classifier: the run it came from had other classes, {shown}"
    size = lambda names: sum(int(np.prod(own[n].shape)) for n in names)  # noqa: E731
    return Loaded(
        source=str(path),
        loaded=tuple(loaded),
        new=tuple(new),
        loaded_values=size(loaded),
        total_values=size(own),
        unused=len(set(state) - set(loaded)),
        classifier_note=note,
    )


def weights_loader(cfg: Config, env: DistEnv, log: logging.Logger, stopped: Callable[[], int]) -> Callable:
    """A function that loads the start into a network just built and returns the names it loaded, on every rank
    alike: a rank that fails makes every rank refuse, and the ranks agree on the loaded weights' digest (a file that
    differs between machines is named, not trained on)."""

    def load_into(net: paddle.nn.Layer) -> tuple[str, ...]:
        done, problem = None, None
        try:
            path, source_classes = weights_file(cfg, env, log, stopped)
            done = load(net, path, cfg.classes, source_classes)
        except (CheckpointError, ConfigError) as e:
            problem = str(e)
        if distributed.all_reduce_sum([1.0 if problem else 0.0], env)[0]:
            raise CheckpointError(problem or "another rank could not load the starting weights; its log says why")
        agreement.agree({"the starting weights (a digest of those loaded)": _digest(net, done.loaded)}, env)
        log.info(describe(done, cfg))
        return done.loaded

    return load_into


def _digest(net: paddle.nn.Layer, names: tuple[str, ...]) -> str:
    h, own = hashlib.sha256(), net.state_dict()
    for name in names:
        h.update(name.encode() + own[name].numpy().tobytes())
    return h.hexdigest()[:16]


def layers_of(names: tuple[str, ...] | list[str]) -> list[str]:
    """The layers the names belong to, in order (fc.weight, fc.bias -> fc), each shortened in the middle if long."""
    found = []
    for name in names:
        layer = name.rsplit(".", 1)[0] if "." in name else name
        if len(layer) > NAME_CHARS:
            layer = layer[: NAME_CHARS // 2 - 1] + "..." + layer[-(NAME_CHARS // 2 - 2) :]
        if layer not in found:
            found.append(layer)
    return found


def describe(done: Loaded, cfg: Config) -> str:
    """The start-up line: the file, what was loaded, what is new (and why), and how the loaded layers train."""
    new = layers_of(done.new)
    shown = ", ".join(new[:SHOWN_LAYERS]) + (f" and {len(new) - SHOWN_LAYERS} more" if len(new) > SHOWN_LAYERS else "")
    why = f" ({done.classifier_note})" if done.classifier_note else ""
    unused = f"; {done.unused} of the file's tensors unused" if done.unused else ""
    flag = "--init-from" if cfg.init_from else "--pretrained"
    return (
        f"{flag}: loaded {len(done.loaded)} of {len(done.loaded) + len(done.new)} tensors "
        f"({done.loaded_values:,} of {done.total_values:,} values) from {done.source}; "
        f"new: {shown or 'none'}{why}{unused}; {rates_text(cfg)}"
    )


def rates_text(cfg: Config) -> str:
    """How the loaded layers train, and whether that is the fine-tuning default."""
    if cfg.freeze_epochs:
        how = f"the loaded layers stay as loaded for {cfg.freeze_epochs} epochs, then train at {cfg.init_lr_scale:g} x"
    elif cfg.init_lr_scale != 1:
        how = f"the loaded layers train at {cfg.init_lr_scale:g} x"
    else:
        how = "every layer trains at"
    default = (cfg.init_lr_scale, cfg.freeze_epochs) == (FINETUNE_LR_SCALE, FINETUNE_FREEZE_EPOCHS)
    which = "the fine-tuning default, docs/finetuning.md" if default else "as given"
    return (
        f"{how} the learning rate ({which}: --init-lr-scale {cfg.init_lr_scale:g} --freeze-epochs {cfg.freeze_epochs})"
    )


def rate_scale(cfg: Config, epoch: int) -> float:
    """The loaded layers' learning rate, times the schedule's, in epoch `epoch` (counted from 0)."""
    return 0.0 if epoch < cfg.freeze_epochs else cfg.init_lr_scale


def set_rates(net: paddle.nn.Layer, loaded: tuple[str, ...], cfg: Config, epoch: int) -> str | None:
    """Set the loaded parameters' learning rates for epoch `epoch` (Paddle multiplies the schedule's rate by a
    parameter's optimize_attr["learning_rate"]): a function of the flags and the epoch, so every rank, and a
    resumed run, set the same. The line to log when the frozen layers start to train; else None."""
    if not loaded:
        return None
    scale, names = rate_scale(cfg, epoch), set(loaded)
    for name, p in distributed.unwrap(net).named_parameters():
        if name in names:
            p.optimize_attr["learning_rate"] = scale
    if cfg.freeze_epochs and epoch == cfg.freeze_epochs:
        return f"epoch {epoch + 1}: the loaded layers start to train, at {scale:g} x the learning rate"
    return None

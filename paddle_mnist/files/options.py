"""The trainer's options as a file: --config FILE read and checked against the flags, and a run's args.yaml.

A file's options are the command line's, keys spelt as the flags (batch_size or batch-size): each value is checked
as the parser checks a flag (its type, its choices, its bounds), and an unknown key is refused naming the nearest
option, before any worker starts. train() in Python takes its keyword options through the same check.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import time
from collections.abc import Mapping
from pathlib import Path

import yaml

from paddle_mnist.config import ADAMW_DEFAULTS, Config, ConfigError, build_parser

ARGS_FILE = "args.yaml"  # in the output directory: the run's options, read back by --config
NOT_OPTIONS = ("help", "config")  # parser entries that are no option of a run
_FIELD_TYPES = {f.name: str(f.type) for f in dataclasses.fields(Config)}  # "int", "float", "str | None", ...
_KINDS = {"int": "a whole number", "float": "a number", "str": "a text"}


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Each option's parser entry, by the Config field it fills."""
    return {a.dest: a for a in parser._actions if a.option_strings and a.dest not in NOT_OPTIONS}


def _flag(action: argparse.Action) -> str:
    return max(action.option_strings, key=len)


def _is_switch(action: argparse.Action) -> bool:
    """An option that takes no value on the command line: --sync-bn, or --tta."""
    return action.nargs == 0


def _value(key: str, value: object, action: argparse.Action, where: str) -> object:
    """value as the parser would hold it for this option; ConfigError naming the key when it cannot be."""
    if value is None:
        if action.default is None:  # a default the run works out: the model's recipe, the dataset's policy, ...
            return None
        raise ConfigError(f"{where}: {key} has no value; give one (its default is {action.default!r}) or drop the key")
    presets = getattr(action, "presets", ())  # --augment's: --augment photo
    if _is_switch(action) or presets:
        if not isinstance(value, bool) and value not in presets:
            named = "".join(f" or {name}" for name in presets)
            raise ConfigError(f"{where}: {key} is true or false{named}, got {value!r}")
        return value
    kind = _KINDS.get(_FIELD_TYPES[key].split(" ")[0], "a single value")
    if isinstance(value, (bool, list, dict)):
        raise ConfigError(f"{where}: {key} takes {kind} as {_flag(action)} does, got {value!r}")
    text = str(value)
    try:
        converted = action.type(text) if action.type else text
    except argparse.ArgumentTypeError as e:
        raise ConfigError(f"{where}: {key}: {e}") from None
    except ValueError:
        raise ConfigError(f"{where}: {key} takes {kind}, got {value!r}") from None
    if action.choices is not None and converted not in action.choices:
        raise ConfigError(f"{where}: {key} is one of {', '.join(map(str, action.choices))}; got {value!r}")
    return converted


def check(values: Mapping[str, object], where: str) -> dict[str, object]:
    """The options in values (keys as the flags, with - or _), each checked and converted as the parser would: the
    parser's own values. ConfigError, naming the key, for an unknown one or a value the flag would refuse."""
    options = _options(build_parser())
    checked = {}
    for raw_key, value in values.items():
        key = str(raw_key).replace("-", "_")
        if key not in options:
            if key == "config":
                raise ConfigError(f"{where}: config names another file; a file of options cannot: merge the two")
            near = difflib.get_close_matches(key, options, n=1, cutoff=0.6)
            hint = f"did you mean {near[0]}?" if near else "python train.py --help lists the options"
            raise ConfigError(f"{where}: {raw_key} is no option of the trainer; {hint}")
        checked[key] = _value(key, value, options[key], where)
    return checked


def read(path: str) -> dict[str, object]:
    """--config FILE's options, checked (check): YAML, or JSON for a .json file. ConfigError when the file is
    missing, does not parse, or is not a mapping of options."""
    where = f"--config {path}"
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise ConfigError(
            f"{where}: no such file; pass a YAML or JSON file of options, e.g. a run's {ARGS_FILE}"
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{where}: cannot read it ({e}); pass a readable text file") from None
    try:
        values = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as e:
        detail = " ".join(str(e).split())
        raise ConfigError(f"{where}: not valid {'JSON' if path.endswith('.json') else 'YAML'} ({detail})") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ConfigError(f"{where}: holds {type(values).__name__}, not options; write one key: value a line")
    return check(values, where)


def _scalar(value: object) -> str:
    """A value as YAML, read back as the same value (a float to the bit, a string never as a number)."""
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()


def args_yaml(flags: Config, command: str) -> str:
    """The run's options as the user gave them, with the defaults they stood on: every option of the parser, from
    the configuration the command line made (before the run resolved it for its workers and data). An option left
    to a default the run works out (the model's recipe, the dataset's augmentation) is null, with what it was
    here as a comment, so that --config of this file works it out again (and a changed --model takes its own
    recipe)."""
    lines = [
        "# paddle_mnist run options: python train.py --config THIS_FILE [--flag value ...] (a flag wins over the file)",
        f"# written {time.strftime('%Y-%m-%d %H:%M:%S %Z')} by: {command}",
    ]
    for key in _options(build_parser()):
        value = getattr(flags, key)
        if key in flags.unset:
            source = f"{flags.model}'s recipe" if key in flags.from_recipe else "the default here"
            if flags.optimizer == "adamw" and key in ADAMW_DEFAULTS:
                source = "--opt adamw's default"
            lines.append(f"{key}: null" + ("" if value is None else f"  # {source}: {_scalar(value)}"))
        else:
            lines.append(f"{key}: {_scalar(value)}")
    return "\n".join(lines) + "\n"

"""The command line of a training run: the parser derived from the config's sections, `--config` presets
(YAML or TOML), and `TrainConfig` from parsed values. Flags are named as in Megatron-LM (`seq_length` ->
`--seq-length`), with each field's `help` as their help text; flags on the command line win over the preset."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import get_type_hints

from megatron_lc.command_line import ArgumentParser
from megatron_lc.config import SECTIONS, TrainConfig
from megatron_lc.errors import ConfigError
from megatron_lc.flags import hyphenated
from megatron_lc.memory.stack import OFFLOAD_ALIASES, fold_offload_aliases


def _argument(f: dataclasses.Field, hint, default) -> tuple[list[str], dict]:
    """The flag names and argparse settings of section field `f`, the parser's default being `default`."""
    meta = dict(f.metadata)
    help_text = meta.pop("help", "")
    names = [hyphenated(f.name)]
    if "flag_name" in meta:  # Megatron's spelling first, the plain hyphenated one as an alias
        names.insert(0, meta.pop("flag_name"))
    if hint is bool:
        return names, dict(dest=f.name, action="store_true", default=default, help=help_text)
    if f.default is not dataclasses.MISSING:
        help_text = f"{help_text} (default: {f.default})"  # a list's default (none given) is said by its help
    return names, dict(dest=f.name, type=_scalar_type(hint), default=default, help=help_text, **meta)


def _add_field(group, f: dataclasses.Field, hint) -> None:
    names, settings = _argument(f, hint, None)  # None: not given (a preset's value or the field's default)
    group.add_argument(*names, **settings)


def add_section_flag(parser: argparse.ArgumentParser, name: str, **settings) -> None:
    """Training's flag of field `name` on another entry point's parser (evaluation): its type, choices, default
    and help from the section that declares it; `settings` are argparse's where that entry point differs
    (`required`, a help of its own)."""
    section = next(cls for cls in SECTIONS.values() if name in {f.name for f in dataclasses.fields(cls)})
    f = next(f for f in dataclasses.fields(section) if f.name == name)
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    names, arguments = _argument(f, get_type_hints(section)[name], default)
    parser.add_argument(*names, **{**arguments, **settings})


def _scalar_type(hint):
    """int | None -> int, list[str] -> str, ..."""
    args = [a for a in getattr(hint, "__args__", ()) if a is not type(None)]
    return args[0] if args else hint


def build_parser(exit_on_error: bool = True) -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m megatron_lc.train", exit_on_error=exit_on_error,
                                     description="Train a LLaMA model on long contexts.")
    parser.add_argument("--config", default=None, help="YAML or TOML preset; command-line flags win")
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(section)
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.metadata.get("cli", True):  # a field set by the program (from a checkpoint), not a flag
                _add_field(group, f, hints[f.name])
    for alias in OFFLOAD_ALIASES:  # old spellings of --offload-mode, folded by config_from_values
        parser.add_argument(hyphenated(alias), dest=alias, action="store_true", default=None, help=argparse.SUPPRESS)
    return parser


def _read_preset(path: str) -> dict:
    """The preset's settings by field name (flat, or grouped by section)."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot be read ({e.strerror or e})") from e
    if not path.endswith((".yaml", ".yml", ".toml")):
        raise ConfigError(f"--config {path}: expected a .yaml, .yml or .toml file")
    try:
        data = _parse_preset_text(path, text)
    except ValueError as e:  # yaml.YAMLError and tomllib.TOMLDecodeError are ValueErrors or wrapped as one
        raise ConfigError(f"--config {path}: not valid {'TOML' if path.endswith('.toml') else 'YAML'} ({e})") from e
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected settings by name at the top level, got a {type(data).__name__}")
    flat = {}
    for key, value in data.items():  # grouped by section or flat
        flat.update(value if key in SECTIONS and isinstance(value, dict) else {key: value})
    return flat


def _parse_preset_text(path: str, text: str):
    if path.endswith(".toml"):
        import tomllib

        return tomllib.loads(text)
    import yaml

    try:
        return yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ValueError(str(e).replace("\n", " ")) from e


def _preset_argv(path: str, values: dict, parser: argparse.ArgumentParser) -> list[str]:
    """The preset as command-line words, so it is typed and checked exactly like flags."""
    flags = {a.dest: a for a in parser._actions}  # argparse keeps its actions only here
    argv = []
    for key, value in values.items():
        name = key.replace("-", "_")
        if name not in flags or name == "config":
            raise ConfigError(f"--config {path}: unknown setting {key!r}")
        action = flags[name]
        if isinstance(action, argparse._StoreTrueAction):
            if not isinstance(value, bool):
                raise ConfigError(f"--config {path}: {key} must be true or false, got {value!r}")
            argv += [action.option_strings[0]] if value else []
        elif value is not None:
            words = value if isinstance(value, list) else [value]
            argv += [action.option_strings[0], *(str(w) for w in words)]
    return argv


def _parse_preset(path: str) -> dict:
    """The preset's values, parsed by the flags' own parser; errors name the file."""
    parser = build_parser(exit_on_error=False)
    argv = _preset_argv(path, _read_preset(path), parser)
    try:
        parsed, extra = parser.parse_known_args(argv)
    except argparse.ArgumentError as e:
        raise ConfigError(f"--config {path}: {e}") from e
    if extra:
        raise ConfigError(f"--config {path}: {' '.join(extra)} left over: a list given to a setting that takes "
                          "one value")
    parsed = vars(parsed)
    return {k: v for k, v in parsed.items() if v is not None and k != "config"}


def config_from_values(values: dict) -> TrainConfig:
    """A TrainConfig from field-name -> value (unknown names are refused, naming them)."""
    cfg = TrainConfig()
    values = fold_offload_aliases({k.replace("-", "_"): v for k, v in values.items()})
    known = {f.name: section for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
    for name, value in values.items():
        name = name.replace("-", "_")
        if name not in known:
            raise ValueError(f"unknown setting {name!r}")
        if value is not None:
            setattr(getattr(cfg, known[name]), name, value)
    return cfg


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    """TrainConfig from the command line (and the --config preset)."""
    args = vars(build_parser().parse_args(argv))
    path = args.pop("config")
    preset = _parse_preset(path) if path else {}
    values = {**preset, **{k: v for k, v in args.items() if v is not None}}
    return config_from_values(values)

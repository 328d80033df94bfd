"""How a room declares its command-line flags: dataclass fields with help text (a leaf module).

A room's flag section (`memory.stack.MemoryArgs`, ...) is a dataclass of such fields; `config`
composes the sections and `arguments` derives the parser from them, named as in Megatron-LM
(`seq_length` -> `--seq-length`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any


def hyphenated(name: str) -> str:
    """A field name as a flag: `seq_length` -> `--seq-length`."""
    return "--" + name.replace("_", "-")


def flag_name(f: dataclasses.Field) -> str:
    """The flag a section field is given as: Megatron-LM's spelling where the field names one, else its name
    hyphenated."""
    return f.metadata.get("flag_name") or hyphenated(f.name)


def flag(default: Any, help: str, **kwargs) -> Any:
    """A config field with its help text (and optional argparse extras such as choices; `flag_name`
    when Megatron-LM spells the flag otherwise than the field name with hyphens)."""
    return field(default=default, metadata={"help": help, **kwargs})


def flag_list(help: str, **kwargs) -> Any:
    return field(default_factory=list, metadata={"help": help, "nargs": "*", **kwargs})

"""Command-line flags built from config dataclasses, and the configs read back from parsed flags.

Each field declared with ``setting(...)`` (``shared_memory/setting.py``) becomes one flag: its
type picks the parser (``int``: 4096, 32k or 1M as vLLM reads lengths; ``bool``: ``--x`` and
``--no-x``; ``dict``: JSON; a tuple of strings: one or more values), its default and help are the
field's. A section's ``prefix`` keeps names unique (``--grammar-max-lexer-states``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from fusedserve.shared_memory.setting import Setting, parse_int, setting_of


@dataclass(frozen=True)
class Section:
    """One config class's flags: ``prefix`` before each field's name, as its flag and its dest."""

    cls: type
    prefix: str = ""
    title: str = ""

    def dest(self, f: dataclasses.Field) -> str:
        """The parsed value's name: the primary flag's (``--zmq-port``: ``zmq_port``)."""
        return self.flag(f).lstrip("-").replace("-", "_")

    def flag(self, f: dataclasses.Field) -> str:
        return setting_of(f).flag or "--" + f"{self.prefix}{f.name}".replace("_", "-")


def parse_json(value: str) -> dict:
    """A dict flag: JSON, as vLLM takes them."""
    try:
        out = json.loads(value)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(out, dict):
        raise argparse.ArgumentTypeError("a JSON object")
    return out


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _base(tp: Any) -> Any:
    """``int | None`` -> ``int``."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0]
    return tp


def cli_fields(section: Section) -> Iterator[dataclasses.Field]:
    return (f for f in dataclasses.fields(section.cls) if setting_of(f).cli)


def _help(s: Setting, default: Any) -> str:
    text = s.help.replace("%", "%%")
    if default not in (None, (), "", False) and not isinstance(default, bool):
        shown = ",".join(default) if isinstance(default, tuple) else default
        text += f" (default {shown})"
    return text


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, section: Section,
              defaults: dict[str, Any] | None = None) -> None:
    """One flag per setting of ``section``; ``defaults`` (by field name) replace the class's."""
    for f in cli_fields(section):
        s = setting_of(f)
        default = (defaults or {}).get(f.name, f.default if f.default is not dataclasses.MISSING
                                       else f.default_factory())
        names = [section.flag(f), *s.aliases]
        tp = _base(_hints(section.cls)[f.name])
        kw: dict[str, Any] = {"dest": section.dest(f), "default": default, "help": _help(s, default)}
        if s.metavar:
            kw["metavar"] = s.metavar
        if tp is bool:
            parser.add_argument(*names, action=argparse.BooleanOptionalAction, **kw)
            for neg in s.negations:
                parser.add_argument(neg, dest=section.dest(f), action="store_false",
                                    help=f"the same as --no-{section.flag(f)[2:]}")
            continue
        if s.choices:
            kw["choices"] = s.choices
        if s.parse is not None:
            kw["type"] = s.parse
        elif tp is int:
            kw["type"] = parse_int
        elif tp is float:
            kw["type"] = float
        elif tp is dict or typing.get_origin(tp) is dict:
            kw["type"] = parse_json
        elif typing.get_origin(tp) in (tuple, list):
            kw["nargs"] = "+"
        parser.add_argument(*names, **kw)


def values(args: argparse.Namespace, section: Section) -> dict[str, Any]:
    """The section's settings as parsed (field name -> value), tuples for its multi-value flags."""
    out = {}
    for f in cli_fields(section):
        v = getattr(args, section.dest(f))
        out[f.name] = tuple(v) if isinstance(v, list) else v
    return out


def build(args: argparse.Namespace, section: Section, **more: Any) -> Any:
    """The section's class from parsed flags (``more``: its fields that are not flags)."""
    return section.cls(**values(args, section), **more)


def flag_names(sections: list[Section]) -> set[str]:
    """Every flag spelling the sections declare, aliases and negations included."""
    out = set()
    for section in sections:
        for f in cli_fields(section):
            s = setting_of(f)
            out.update([section.flag(f), *s.aliases, *s.negations])
            if _base(_hints(section.cls)[f.name]) is bool:
                out.add("--no-" + section.flag(f)[2:])
    return out

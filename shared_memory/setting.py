"""One declaration per setting: a config field's default, its help and its command-line spelling.

A config dataclass declares its fields with ``setting(...)``; ``coordinator/config_flags.py``
builds the ``serve`` flags from them (type, default, help), so a setting is written once, where
the code reads it. vLLM's spelling is the flag where both projects have the setting; older names
stay as aliases.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Setting:
    """How a field is set from the command line (``cli=False``: it is not: a secret read from a file,
    or a part of a JSON flag)."""

    help: str = ""
    flag: str | None = None  # default: --the-field-name
    aliases: tuple[str, ...] = ()
    negations: tuple[str, ...] = ()  # older flags that turn a boolean off (--no-prefix-caching)
    choices: tuple[str, ...] | None = None
    parse: Callable[[str], Any] | None = None  # default: from the field's type
    cli: bool = True
    metavar: str | None = None


def setting(default: Any = dataclasses.MISSING, help: str = "", *, factory: Callable[[], Any] | None = None,
            **how: Any) -> Any:
    """A dataclass field with its ``Setting`` (``how``: ``Setting``'s other fields)."""
    meta = {"setting": Setting(help, **how)}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def setting_of(f: dataclasses.Field) -> Setting:
    return f.metadata.get("setting") or Setting()


def parse_int(value: str) -> int:
    """An integer as vLLM reads lengths: 4096, 32k (x1000), 32K (x1024), 1m / 1M, 1g / 1G."""
    text = value.strip().replace("_", "")
    scale = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    factor = scale.get(text[-1:], 1)
    number = text[:-1] if factor != 1 else text
    try:
        n = float(number) * factor if factor != 1 else int(number)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {value!r} (as 4096, 32k or 1M)") from None
    if n != int(n):
        raise argparse.ArgumentTypeError(f"not a whole number: {value!r}")
    return int(n)


def parse_size(value: str) -> int:
    """A size: bytes, or a number with KiB/MiB/GiB/TiB (or K/M/G/T, KB/MB/GB: powers of 1024)."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    text = value.strip().upper().removesuffix("IB").removesuffix("B")
    unit = text[-1] if text and text[-1] in "KMGT" else ""
    try:
        n = float(text[: len(text) - len(unit)]) * units[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {value!r} (bytes, or e.g. 8GiB)") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"a size must be positive, got {value!r}")
    return int(n)


def parse_workers(value: str) -> int:
    """A worker count, or ``auto`` (0: one per device in the cluster)."""
    if value == "auto":
        return 0
    n = parse_int(value)
    if n < 1:
        raise argparse.ArgumentTypeError("--workers must be >= 1 or 'auto'")
    return n

"""What a request constrains its output to: a JSON schema, any JSON object, a regex, one of
several strings, or a grammar. Checked for shape here (every front end builds one); the
grammar library checks the content when it compiles it (``GrammarCompiler``)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# Qwen3 thinking before the constrained output: "none": the grammar applies from the first
# token; "open": the prompt opened a think block, so tokens are free until its end;
# "may": the model may open one (``<think>``) before the constrained output.
THINKING = ("none", "open", "may")


class StructuredError(ValueError):
    """A structured-output request that cannot be compiled or is malformed."""


@dataclass(frozen=True)
class StructuredSpec:
    kind: str
    value: Any = None  # json: a schema (dict or JSON text); regex/grammar: text; choice: strings
    thinking: str = "none"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise StructuredError(f"structured output kind must be one of {KINDS}, got {self.kind!r}")
        if self.thinking not in THINKING:
            raise StructuredError(f"thinking must be one of {THINKING}, got {self.thinking!r}")
        v = self.value
        if self.kind == "json" and not isinstance(v, (dict, str, bool)):
            raise StructuredError("a json constraint needs a JSON schema (an object or its text)")
        if self.kind in ("regex", "grammar") and (not isinstance(v, str) or not v):
            raise StructuredError(f"a {self.kind} constraint needs a non-empty string")
        if self.kind == "choice" and (not isinstance(v, list) or not v
                                      or not all(isinstance(c, str) and c for c in v)):
            raise StructuredError("a choice constraint needs a non-empty list of non-empty strings")
        try:  # a schema from a msgpack frame may hold what JSON cannot (non-string keys, bytes)
            text = json.dumps([self.kind, v], sort_keys=True)
        except (TypeError, ValueError, RecursionError) as exc:
            raise StructuredError(f"the {self.kind} constraint is not JSON: {exc}") from None
        object.__setattr__(self, "_key", hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest())

    def key(self) -> str:
        """What identifies the compiled grammar (the cache key): a hash of its kind and value."""
        return self._key

    def to_wire(self) -> dict:
        return {"kind": self.kind, "value": self.value, "thinking": self.thinking}

    @classmethod
    def from_wire(cls, d: Any) -> StructuredSpec:
        if not isinstance(d, dict) or not isinstance(d.get("kind"), str):
            raise StructuredError("'structured' must be a map with a string 'kind'")
        return cls(d["kind"], d.get("value"), d.get("thinking", "none"))

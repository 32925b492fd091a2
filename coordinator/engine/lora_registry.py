"""The adapters a server offers, by name: read and checked once, when they are registered.

A request names an adapter; the registry answers the ``ServedAdapter`` every worker loads (its
``key`` names this registration: an adapter unloaded and loaded again from another path is another
key, so no worker or prefix cache mistakes one for the other). Registering reads the PEFT
directory and refuses, with the reason, what the fused step cannot apply or what does not fit the
base model, before any worker sees it.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass

from fusedserve.coordinator.errors import RequestError
from fusedserve.kernels.model_description.config import Qwen3Config
from fusedserve.kernels.model_description.lora import LoraAdapter, LoraError, check_fits
from fusedserve.shared_memory.engine_config import LoraConfig

MAX_NAME_CHARS = 256


@dataclass(frozen=True)
class ServedAdapter:
    adapter: LoraAdapter
    key: str  # this registration: name and a number never reused
    parent: str | None  # the base model's name it was given with (None: the served base model's)

    @property
    def name(self) -> str:
        return self.adapter.name

    @property
    def cache_root(self) -> bytes:
        """The parent hash of its requests' first KV block: blocks cached under one adapter (or the
        base model, root b"") are never a hit for another."""
        return hashlib.sha256(b"lora\0" + self.key.encode()).digest()


def parse_module(spec: str) -> tuple[str, str, str | None]:
    """``NAME=PATH`` or JSON ``{"name", "path", "base_model_name"}`` (vLLM's --lora-modules forms)."""
    if spec.lstrip().startswith("{"):
        try:
            d = json.loads(spec)
        except ValueError as exc:
            raise LoraError(f"--lora-modules {spec!r}: not JSON ({exc})") from None
        name, path = d.get("name"), d.get("path")
        if not isinstance(name, str) or not isinstance(path, str):
            raise LoraError(f"--lora-modules {spec!r}: JSON needs string 'name' and 'path'")
        return name, path, d.get("base_model_name")
    name, eq, path = spec.partition("=")
    if not eq or not name or not path:
        raise LoraError(f"--lora-modules {spec!r}: give NAME=PATH")
    return name, path, None


class LoraRegistry:
    def __init__(self, config: Qwen3Config, lora: LoraConfig, base_names: tuple[str, ...]):
        """``base_names``: what requests call the base model (an adapter may not take one)."""
        self.config = config
        self.lora = lora
        self.base_names = base_names
        self.adapters: dict[str, ServedAdapter] = {}
        self._keys = itertools.count(1)

    def add(self, name: str, path: str, parent: str | None = None) -> ServedAdapter:
        """Register ``name``; ``LoraError`` (its reason named) if it cannot be served here."""
        if not self.lora.enable_lora:
            raise LoraError("this server serves no LoRA adapters (start it with --enable-lora)")
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS or name.strip() != name:
            raise LoraError(f"an adapter name has 1-{MAX_NAME_CHARS} characters without surrounding "
                            f"spaces, got {name!r}")
        if name in self.base_names:
            raise LoraError(f"{name!r} is the base model's name")
        if name in self.adapters:
            raise LoraError(f"an adapter named {name!r} is already loaded (unload it first)")
        adapter = LoraAdapter.from_dir(name, path, self.lora.max_lora_rank, self.config.num_hidden_layers)
        check_fits(adapter, self.config)
        served = ServedAdapter(adapter, f"{name}#{next(self._keys)}", parent)
        self.adapters[name] = served
        return served

    def remove(self, name: str) -> None:
        if self.adapters.pop(name, None) is None:
            raise RequestError("model_not_found", f"no adapter {name!r} is loaded")

    def get(self, name: str) -> ServedAdapter:
        """The adapter a request names, or ``model_not_found``."""
        served = self.adapters.get(name)
        if served is None:
            have = ", ".join(map(repr, (*self.base_names[:1], *self.adapters))) or "none"
            raise RequestError("model_not_found", f"model {name!r} does not exist; this server has {have}")
        return served

    def listing(self) -> list[dict]:
        """Every adapter with its parent, as ``/v1/models`` shows them."""
        return [{"id": s.name, "parent": s.parent, "path": s.adapter.path, "rank": s.adapter.rank}
                for s in self.adapters.values()]

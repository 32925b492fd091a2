"""A model directory's chat template (``tokenizer_config.json``), rendered as transformers does.

The template is Jinja2 in a sandbox (a model directory is data, not code), with the
variables Hugging Face templates expect: ``messages``, ``add_generation_prompt``, the
special tokens, ``raise_exception``, and any ``chat_template_kwargs`` (Qwen3's
``enable_thinking``).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (the template refused them, or there is no template)."""


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


def _token_text(value: Any) -> str | None:
    """A tokenizer_config token entry: a string, or an AddedToken-like dict with ``content``."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """``tojson`` as transformers defines it for templates (Jinja's own escapes < > & ')."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


class ChatTemplate:
    def __init__(self, source: str, special: dict[str, str | None]):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = _tojson
        self._template = env.from_string(source)
        self.source = source
        self.special = special

    @classmethod
    def from_dir(cls, model_dir: str | Path, override: str | None = None) -> ChatTemplate | None:
        """The model's template, from the first of: ``override`` (``--chat-template``: a file, or
        the template's text), the directory's ``chat_template.jinja`` (how transformers saves it
        now), its ``tokenizer_config.json``'s ``chat_template``. None if there is none."""
        path = Path(model_dir) / "tokenizer_config.json"
        cfg = json.loads(path.read_text()) if path.is_file() else {}
        special = {k: _token_text(cfg.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        jinja = Path(model_dir) / "chat_template.jinja"
        if override is not None:
            source = Path(override).read_text() if Path(override).is_file() else override
        elif jinja.is_file():
            source = jinja.read_text()
        else:
            source = cfg.get("chat_template")
            if isinstance(source, list):  # several named templates: the default one
                source = next((t.get("template") for t in source if t.get("name") == "default"), None)
        if not isinstance(source, str):
            return None
        return cls(source, special)

    def replaced(self, source: str) -> ChatTemplate:
        """Another template with this model's special tokens (a trusted request's own)."""
        return ChatTemplate(source, self.special)

    @property
    def eos_token(self) -> str | None:
        """The token a chat turn ends with (``<|im_end|>`` for ChatML): a stop for chat requests."""
        return self.special.get("eos_token")

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        try:
            return self._template.render({**self.special, **kwargs, "messages": messages,
                                          "add_generation_prompt": add_generation_prompt})
        except ChatTemplateError:
            raise
        except (TemplateError, TypeError, KeyError, AttributeError) as exc:
            raise ChatTemplateError(f"the chat template could not render these messages: {exc}") from None

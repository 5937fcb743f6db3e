"""Render a chat template the way transformers' `apply_chat_template` does.

Same jinja2 setup: a sandboxed environment with trim_blocks and lstrip_blocks, the
loopcontrols extension, `raise_exception`, `strftime_now` and a `tojson` that keeps non-ASCII
text. Templates come from model files and are untrusted, hence the sandbox.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any


@functools.lru_cache(maxsize=8)
def _compile(template: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def render_chat_template(template: str, messages: list[dict[str, Any]], add_generation_prompt: bool,
                         special_tokens: dict[str, str]) -> str:
    """The prompt text for `messages`; special_tokens supplies bos_token/eos_token to the template."""
    return _compile(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     **special_tokens)

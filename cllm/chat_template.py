"""Chat templates: a GGUF's Jinja source compiled in a sandbox and rendered into a prompt."""
from __future__ import annotations

import json
from datetime import datetime

import jinja2
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from cllm.api import APIError

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class _Sandbox(ImmutableSandboxedEnvironment):
    """Jinja's sandbox turns an unsafe attribute (``''.__class__``) into an undefined value that
    prints as nothing; fail at once instead, so probing a template is an error, not silence."""

    def unsafe_undefined(self, obj, attribute):
        raise SecurityError(f"access to attribute {attribute!r} of a "
                            f"{type(obj).__name__!r} object is unsafe")


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)  # Hugging Face's convention for template-side checks


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML; prompts need the plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


# Everything a template can fail with at render time; none of it is a server bug.
_RENDER_ERRORS = (jinja2.TemplateError, TypeError, ValueError, LookupError, ArithmeticError,
                  AttributeError, RecursionError)


class ChatTemplate:
    """A GGUF chat template (Jinja source) compiled once in a sandboxed environment.
    With no source, ChatML. A template that does not compile raises ValueError."""

    def __init__(self, source: str | None, *, bos_token: str, eos_token: str) -> None:
        env = _Sandbox(trim_blocks=True, lstrip_blocks=True,
                       extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
        try:
            self._template = env.from_string(CHATML_TEMPLATE if source is None else source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"invalid chat template (line {e.lineno}): {e.message}") from None
        self._bos_token = bos_token
        self._eos_token = eos_token

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True) -> str:
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self._bos_token, eos_token=self._eos_token)
        except _RENDER_ERRORS as e:
            raise APIError(400, f"chat template error: {e}") from None

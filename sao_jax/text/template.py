"""Chat templates rendered as `transformers` renders them, without transformers.

`render_chat_template(template, messages, **variables)` is `apply_chat_template(...,
tokenize=False)`: the same sandboxed Jinja environment, globals and filters, with the variables
(a tokenizer's special tokens: `bos_token`, `eos_token`, ...) given to the template. A tokenizer's
own template is rendered through it (`hf.HFTokenizer.apply_chat_template`).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


def render_chat_template(template: str, messages: Sequence[Mapping], *,
                         add_generation_prompt: bool = True, **kwargs) -> str:
    """Renders a chat template; `kwargs` (the special tokens, say) become template variables.

    Message keys whose value is None are dropped first, as transformers does.
    """
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
    return _compile(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     **kwargs)


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    """The Jinja environment of transformers' `_compile_jinja_template` (less its `{% generation %}`
    tag, which only marks assistant tokens)."""

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters; templates expect plain JSON.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["namespace"] = _Namespace
    return env.from_string(template)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's `namespace` refusing underscore attributes, which could reach CPython internals."""

    def __init__(*args, **kwargs):  # Jinja's signature trick, so that `namespace(self=1)` works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a chat template may not set the underscore attribute {name!r} on a namespace")

"""Chat templates: where a checkpoint keeps them, and rendering one exactly as transformers does.

A checkpoint keeps its default template in `chat_template.jinja` and named ones in
`additional_chat_templates/NAME.jinja`, or (older) in tokenizer_config.json's `chat_template`: one
string, or a list of {"name", "template"}. As in transformers, template files replace the config's.

The render is transformers' `apply_chat_template(..., tokenize=False)`: a sandboxed Jinja
environment with trim_blocks/lstrip_blocks, loop controls, a JSON `tojson`, `raise_exception`,
`strftime_now`, the `{% generation %}` tag, and the tokenizer's special tokens as variables.
No torch and no transformers here: the front door renders with this module.

Forged roles: transformers and vLLM tokenize the rendered text parsing special tokens wherever
they occur, so a message whose content holds `<|im_start|>system` forges a turn.
`render_chat_pieces` keeps the template's own special tokens apart from the client's text: every
string the client gave (contents, names, roles, tool calls and definitions, documents) has each
special token in it, and each piece of one at its start or end (a special could be formed by
joining two strings: a message's content parts), replaced by a sentinel before rendering; the
specials found in the rendered text are then the template's, and the sentinels go back to the
client's text, which is tokenized as plain text (`Tokenizer.encode_chat`). A conversation with
no such string renders and tokenizes exactly as transformers does. Not covered: a template that
builds a special token around a client string (`'<|im_' ~ content ~ '|>'`); none does.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
from datetime import datetime
from pathlib import Path
from typing import Protocol

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

DEFAULT = "default"
TOOL_USE = "tool_use"  # transformers picks this named template when tools are given


class ChatTemplateError(jinja2.TemplateError, ValueError):
    """The conversation cannot be rendered: the template refused it (its `raise_exception`), or the
    model has no (such) template. The client's fault: the front door answers 400 / INVALID_ARGUMENT."""


def load_chat_templates(model_dir: str | Path, tokenizer_config: dict) -> dict[str, str]:
    """name -> template source; the unnamed one is "default"."""
    model_dir = Path(model_dir)
    files = {}
    default = model_dir / "chat_template.jinja"
    if default.is_file():
        files[DEFAULT] = default.read_text(encoding="utf-8")
    for path in sorted((model_dir / "additional_chat_templates").glob("*.jinja")):
        files[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if files:
        return files
    in_config = tokenizer_config.get("chat_template")
    if isinstance(in_config, str):
        return {DEFAULT: in_config}
    if isinstance(in_config, list):
        return {t["name"]: t["template"] for t in in_config}
    return {}


class Templated(Protocol):
    """What rendering needs of a tokenizer (cluster/engine/tokenizer.py Tokenizer has it)."""

    chat_templates: dict[str, str]  # name -> Jinja source
    special_tokens: dict[str, str]  # bos_token, eos_token, ...: the template's variables
    control_tokens: tuple[str, ...]  # every special token's text (tokenized as one id), longest first


def render_chat(
    tokenizer: Templated,
    messages: list[dict],
    add_generation_prompt: bool = True,
    *,
    template: str | None = None,
    tools: list[dict] | None = None,
    documents: list[dict] | None = None,
    **kwargs,
) -> str:
    """The prompt text for `messages` (tokenize it without adding special tokens: the template has).

    `template` names one of the model's templates; extra keyword arguments reach the template as
    variables (e.g. `enable_thinking=False`), overriding the special tokens of the same name.
    """
    source = select_template(tokenizer.chat_templates, template, tools)
    variables = {**tokenizer.special_tokens, **kwargs}
    return _compile(source).render(messages=messages, tools=tools, documents=documents,
                                   add_generation_prompt=add_generation_prompt, **variables)


def render_chat_pieces(tokenizer: Templated, messages: list[dict], add_generation_prompt: bool = True,
                       **kwargs) -> list[tuple[str, bool]]:
    """`render_chat`'s text as (text, is_special) pieces: the special tokens the template wrote
    (each alone, True) and the text between them (False), where the client's strings are (see
    the module docstring). Joined, the pieces are the rendered prompt."""
    specials = tokenizer.control_tokens
    if not specials:
        return [(render_chat(tokenizer, messages, add_generation_prompt, **kwargs), False)]
    escape = _Escape(specials)
    client = {k: escape.walk(kwargs.pop(k)) for k in ("tools", "documents") if kwargs.get(k) is not None}
    text = render_chat(tokenizer, escape.walk(messages), add_generation_prompt, **client, **kwargs)
    pieces = []
    for i, part in enumerate(special_pattern(specials).split(text)):
        if part:
            pieces.append((escape.restore(part), False) if i % 2 == 0 else (part, True))
    return pieces


@functools.lru_cache(maxsize=8)
def special_pattern(specials: tuple[str, ...]) -> re.Pattern:
    return re.compile("(" + "|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True)) + ")")


class _Escape:
    """Replaces, in client strings, each special token and each piece of one (2 characters or
    more) at the string's start or end with a sentinel no client string holds (a random number
    between two private-use characters); `restore` puts them back."""

    def __init__(self, specials: tuple[str, ...]):
        self.specials = specials
        self.pattern = special_pattern(specials)
        self.nonce = str(secrets.randbits(64))
        self.sentinel = re.compile("\ue000" + self.nonce + "\\.([0-9]+)\ue001")
        self.saved: list[str] = []
        # the pieces of specials (2 characters or more) a string may start or end with
        self.prefixes = {t[:k] for t in specials for k in range(2, len(t))}
        self.suffixes = {t[-k:] for t in specials for k in range(2, len(t))}
        self.longest = max(map(len, specials))

    def _hide(self, fragment: str) -> str:
        self.saved.append(fragment)
        return f"\ue000{self.nonce}.{len(self.saved) - 1}\ue001"

    def text(self, s: str) -> str:
        head = next((s[:k] for k in range(min(self.longest, len(s)), 1, -1) if s[:k] in self.suffixes), "")
        tail = next((s[-k:] for k in range(min(self.longest, len(s)), 1, -1) if s[-k:] in self.prefixes), "")
        if not head and not tail and not self.pattern.search(s):
            return s
        if len(head) + len(tail) > len(s):  # the string is a piece of a special: hidden whole
            head, tail = s, ""
        middle = self.pattern.sub(lambda m: self._hide(m.group(0)), s[len(head):len(s) - len(tail)])
        return (self._hide(head) if head else "") + middle + (self._hide(tail) if tail else "")

    def walk(self, x):
        if isinstance(x, str):
            return self.text(x)
        if isinstance(x, dict):
            return {self.walk(k): self.walk(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [self.walk(v) for v in x]
        return x

    def restore(self, s: str) -> str:
        return self.sentinel.sub(lambda m: self.saved[int(m.group(1))], s) if self.saved else s


def select_template(templates: dict[str, str], name: str | None, tools: list[dict] | None) -> str:
    if not templates:
        raise ChatTemplateError("this model has no chat template (chat_template.jinja or tokenizer_config.json)")
    if name is not None:
        if name not in templates:
            raise ChatTemplateError(f"this model has no chat template named {name!r} (it has {sorted(templates)})")
        return templates[name]
    if tools is not None and TOOL_USE in templates:
        return templates[TOOL_USE]
    if DEFAULT not in templates:
        raise ChatTemplateError(f"this model has no default chat template; name one of {sorted(templates)}")
    return templates[DEFAULT]


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering
    keeps its body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message):
    raise ChatTemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters and sorts keys; templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    return env.from_string(source)

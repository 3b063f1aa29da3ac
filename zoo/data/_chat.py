"""A tokenizer's chat template (jinja2), rendered as transformers renders it, with the
character spans of the assistant's turns."""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..hf._files import read_json
from ._records import DataFormatError

_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class TemplateParseError(DataFormatError):
    """A chat template that does not parse (naming its file and line)."""


class _Refused(jinja2.exceptions.TemplateError):
    """A template's own `raise_exception(message)` (a `TemplateError`, as transformers')."""


class _GenerationTracker(jinja2.ext.Extension):
    """`{% generation %}…{% endgeneration %}` (transformers' `AssistantTracker`): renders its
    body and records the body's character span in the output."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_track"), [], [], body).set_lineno(lineno)

    @jinja2.pass_context
    def _track(self, context, caller):
        text = caller()
        tracking = context.environment.globals.get("_zoo_tracking")
        if tracking is not None:
            blocks, spans = tracking
            start = len("".join(blocks))
            spans.append((start, start + len(text)))
        return text


def _environment() -> ImmutableSandboxedEnvironment:
    def raise_exception(message):
        raise _Refused(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # transformers' filter: jinja's own escapes HTML characters.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTracker, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class ChatTemplate:
    """A chat template: `messages` → the text a model was trained on, and where the
    assistant's turns lie in it.

    Rendered as `transformers`' `apply_chat_template` renders it (jinja2 sandbox,
    `trim_blocks`, `lstrip_blocks`, its `tojson`, `raise_exception`, the special tokens
    as variables). Assistant spans come from `{% generation %}` blocks when the template
    has them (as transformers' `return_assistant_tokens_mask`), else from rendering
    prefixes: assistant turn `i` is the text between the rendering of `messages[:i]`
    with the generation prompt and the rendering of `messages[:i + 1]`.
    """

    def __init__(self, template: str, special_tokens: dict[str, str] | None = None, *, name: str | None = None):
        """**Arguments:** the jinja2 `template` text, the `special_tokens` it may read
        (`{"bos_token": "<s>", ...}`) and `name`, where the text is from (its file), for
        errors. Raises `TemplateParseError` (a `DataFormatError` naming `name` and the
        template's line) for a template that does not parse."""
        self.template = template
        self.special_tokens = dict(special_tokens or {})
        self.environment = _environment()
        try:
            self.compiled = self.environment.from_string(template)
        except jinja2.TemplateSyntaxError as e:
            where = f"{name} line {e.lineno}: " if name else f"line {e.lineno} of "
            raise TemplateParseError(
                f"{where}the chat template does not parse ({e.message.rstrip('.')}); fix the template"
            ) from None
        self.has_generation_blocks = bool(_GENERATION.search(template))

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike | None, *, template: str | None = None, name: str | None = None
    ) -> ChatTemplate | None:
        """The chat template of a model folder (`chat_template.jinja`, else the
        `chat_template` of `tokenizer_config.json`; a list of named templates: the one
        named `"default"`), or `None` when it has none. Its special tokens are the
        folder's (`tokenizer_config.json`).

        **Arguments:** the folder (None: none, so no special tokens), and `template`: a
        jinja2 template text to use instead of the folder's (a `--chat-template` file's), and
        `name`, where that text is from, for errors (as `ChatTemplate`).
        """
        folder = None if path is None else Path(path)
        config = {} if folder is None else read_json(folder / "tokenizer_config.json") or {}
        special = {}
        for token in SPECIAL_TOKEN_NAMES:
            value = config.get(token)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                special[token] = value
        if template is None and folder is not None:
            file = folder / "chat_template.jinja"
            if file.is_file():
                template, name = file.read_text(encoding="utf-8-sig"), str(file)
            else:
                template, name = config.get("chat_template"), f"{folder / 'tokenizer_config.json'}'s chat_template"
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default")
        return None if not isinstance(template, str) else cls(template, special, name=name)

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = False) -> str:
        """The text of a conversation."""
        return self.compiled.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens
        )

    def assistant_spans(self, messages: list[dict[str, Any]]) -> tuple[str, list[tuple[int, int]]]:
        """The text of a conversation and the `(start, end)` character spans of its
        assistant turns. Raises `ValueError` when the template renders a conversation's
        beginning differently from the whole (then prefixes cannot find the turns; add
        `{% generation %}` blocks to the template)."""
        if self.has_generation_blocks:
            blocks, spans = [], []
            self.environment.globals["_zoo_tracking"] = (blocks, spans)
            try:
                context = self.compiled.new_context(
                    dict(messages=messages, add_generation_prompt=False, **self.special_tokens)
                )
                for block in self.compiled.root_render_func(context):
                    blocks.append(block)
            finally:
                self.environment.globals["_zoo_tracking"] = None
            return "".join(blocks), spans
        text = self.render(messages)
        spans = []
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True)
            through = self.render(messages[: i + 1])
            if not (through.startswith(before) and text.startswith(through)):
                raise ValueError(
                    "the chat template renders the start of a conversation differently from the whole, so the "
                    "assistant turns cannot be found by prefixes; add {% generation %} blocks around them"
                )
            spans.append((len(before), len(through)))
        return text, spans


@contextlib.contextmanager
def rendering(where: str) -> Iterator[None]:
    """A chat template's error rendering the record at `where` (its `raise_exception`, an
    undefined field) as a one-line `DataFormatError` naming the record."""
    try:
        yield
    except _Refused as e:
        raise DataFormatError(
            f"{where}: the chat template refused this conversation: {e.message}; fix the row or the template"
        ) from None
    except jinja2.TemplateError as e:
        raise DataFormatError(
            f"{where}: the chat template cannot render this conversation ({type(e).__name__}: {e.message}); fix the "
            "row or the template"
        ) from None

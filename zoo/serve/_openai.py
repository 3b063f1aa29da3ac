"""What the OpenAI API's requests say, read and checked: the fields zoo serves, the ones it
refuses, the messages of a chat, the text ↔ ids of the served model.

Every check raises `BadRequest` naming the field at fault (the server answers it with
OpenAI's error body); nothing here knows about HTTP.
"""

from __future__ import annotations

import codecs
import dataclasses

from ._requests import Request

MAX_N = 64
MAX_STOPS = 4
MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries


class BadRequest(ValueError):
    """A request the server refuses (HTTP 400): `param` names the field at fault."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.code, self.status = param, code, status


class Text:
    """Text ↔ ids: a `zoo.hf.Tokenizer`, or UTF-8 bytes (ids 0-255) without one."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer
        if tokenizer is not None:
            tokenizer.tokenizer.no_truncation()

    def encode(self, text: str, *, special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            return list(text.encode("utf-8"))
        return list(self.tokenizer.tokenizer.encode(text, add_special_tokens=special_tokens).ids)

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return self.tokenizer.decode(ids)

    def token_bytes(self, token: int) -> list[int]:
        """One token's own bytes (chat logprobs' `bytes`)."""
        if self.tokenizer is None:
            return [token] if token < 256 else []
        return list(self.decode([token]).encode("utf-8"))

    def piece(self, token: int) -> str:
        """One token's own text (logprobs' `tokens`)."""
        if self.tokenizer is None:
            return bytes([token]).decode("utf-8", errors="replace") if token < 256 else ""
        return self.tokenizer.tokenizer.id_to_token(token) or ""


class Detokenizer:
    """A request's new text as its tokens come, cut at the first stop string.

    `add(token)` returns the text that is final: the decoded text minus what was already
    handed out, holding back an end that may begin a stop string; `stopped` turns True
    when a stop string appears (its text and what follows are never handed out)."""

    def __init__(self, text: Text, stops: list[str]):
        self.text, self.stops = text, stops
        self.ids: list[int] = []
        self.decoded = ""  # all the tokens' text so far
        self.given = 0  # how much of it was handed out
        self.stopped = False
        self._bytes = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token: int) -> str:
        if self.stopped:
            return ""
        if self.text.tokenizer is None:
            self.decoded += self._bytes.decode(bytes([token])) if token < 256 else ""
        else:
            self.ids.append(token)
            self.decoded = self.text.decode(self.ids)
        found = [i for i in (self.decoded.find(s, max(self.given - len(s), 0)) for s in self.stops) if i >= 0]
        if found:
            self.stopped = True
            end = min(found)
        else:  # keep back the longest end that begins a stop string
            keep = max((n for s in self.stops for n in range(1, len(s)) if self.decoded.endswith(s[:n])), default=0)
            end = len(self.decoded) - keep
        out = self.decoded[self.given : max(end, self.given)]
        self.given = max(end, self.given)
        return out

    def finish(self) -> str:
        """What was held back, at the end of the request."""
        if self.stopped:
            return ""
        out, self.given = self.decoded[self.given :], len(self.decoded)
        return out


# -- reading a request -------------------------------------------------------------------


def number_field(body: dict, name: str, default, kind, low=None, high=None, *, low_open=False):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise BadRequest(f"{name} must be {'a number' if kind is float else 'an integer'}, got {value!r}", name)
    if (low is not None and (value <= low if low_open else value < low)) or (high is not None and value > high):
        where = f"{'(' if low_open else '['}{low}, {high}]" if high is not None else f">{'' if low_open else '='} {low}"
        raise BadRequest(f"{name} must be in {where}, got {value}", name)
    return kind(value)


def logit_bias_field(body: dict, vocab: int) -> dict[int, float] | None:
    """OpenAI's `logit_bias`: token ids (as strings, JSON's keys) → a bias in [-100, 100]."""
    value = body.get("logit_bias")
    if value is None or value == {}:
        return None
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
        raise BadRequest(f"logit_bias must be an object of at most {MAX_LOGIT_BIAS} token ids to biases", "logit_bias")
    bias = {}
    for key, number in value.items():
        token = int(key) if isinstance(key, str) and key.strip().isdigit() else None
        if token is None or not 0 <= token < vocab:
            raise BadRequest(f"logit_bias: {key!r} is no token id of the model's vocabulary [0, {vocab})", "logit_bias")
        if isinstance(number, bool) or not isinstance(number, int | float) or not -100 <= number <= 100:
            raise BadRequest(
                f"logit_bias: the bias of token {key} must be a number in [-100, 100], got {number!r}", "logit_bias"
            )
        bias[token] = float(number)
    return bias


def stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOPS:
        raise BadRequest(f"stop must be a non-empty string or a list of at most {MAX_STOPS} of them", "stop")
    return stops


def prompt_ids(body: dict, text: Text) -> list[list[int]]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [text.encode(prompt)]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return [text.encode(p) for p in prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [list(prompt)]
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        if all(p and all(isinstance(t, int) and not isinstance(t, bool) for t in p) for p in prompt):
            return [list(p) for p in prompt]
    raise BadRequest(
        "prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids", "prompt"
    )


# -- what the API has that the engine does not do ------------------------------------------

# OpenAI request fields this server does not implement, refused (400 naming the field) unless
# given as their "off" value, so a client never believes it got what it asked for.
_NOT_DONE = {
    "tools": "tool calls",
    "tool_choice": "tool calls",
    "functions": "function calls",
    "function_call": "function calls",
    "parallel_tool_calls": "tool calls",
    "response_format": "structured output (only {'type': 'text'})",
    "suffix": "insertion (suffix)",
    "best_of": "best_of above 1",
    "audio": "audio output",
    "modalities": "modalities other than text",
    "prediction": "predicted outputs",
    "web_search_options": "web search",
    "reasoning_effort": "reasoning_effort",
}


def _off(name: str, value) -> bool:
    """Whether `value` of the refused field `name` asks for nothing (its default)."""
    if value is None or value in ([], {}, ""):
        return True
    if name == "response_format":
        return value == {"type": "text"}
    if name == "modalities":
        return value == ["text"]
    if name == "best_of":
        return not isinstance(value, bool) and value == 1
    if name in ("tool_choice", "function_call"):
        return value == "none"
    return name == "parallel_tool_calls" and isinstance(value, bool)


def refuse_unsupported(body: dict) -> None:
    """Raise `BadRequest` naming the first field of `body` this server does not implement
    (`_NOT_DONE`), unless it is given as its off value."""
    for name, what in _NOT_DONE.items():
        if name in body and not _off(name, body[name]):
            raise BadRequest(
                f"{name}: this server does not implement {what}; leave {name} out", name, "unsupported_parameter"
            )


_ROLES = ("system", "developer", "user", "assistant")


@dataclasses.dataclass(frozen=True)
class Message:
    """One chat message, checked: `role` (`developer` is rendered as `system`) and its text
    (a string, or OpenAI content parts of type `text`, joined)."""

    role: str
    content: str

    @classmethod
    def read(cls, value, index: int) -> Message:
        where = f"messages[{index}]"
        if not isinstance(value, dict):
            raise BadRequest(f"{where} must be an object with role and content", "messages")
        role = value.get("role")
        if role not in _ROLES:
            raise BadRequest(f"{where}.role must be one of {list(_ROLES)}, got {role!r}", f"{where}.role")
        for name in ("tool_calls", "function_call", "audio"):
            if value.get(name) is not None:
                raise BadRequest(
                    f"{where}.{name}: this server does not implement tool calls",
                    f"{where}.{name}",
                    "unsupported_parameter",
                )
        content = value.get("content")
        if isinstance(content, list):
            texts = []
            for k, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text" or not isinstance(part.get("text"), str):
                    raise BadRequest(
                        f"{where}.content[{k}]: only parts of type 'text' with a string 'text' are served, got "
                        f"{kind if kind is not None else type(part).__name__!r}",
                        f"{where}.content",
                    )
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            got = "no content" if content is None else f"content of type {type(content).__name__}"
            raise BadRequest(f"{where} has {got}: give a string or a list of text parts", f"{where}.content")
        return cls("system" if role == "developer" else role, content)


class Sampling:
    """The sampling fields common to both endpoints, checked."""

    def __init__(self, body: dict, vocab: int):
        self.max_tokens = number_field(body, "max_tokens", None, int, 0)
        self.temperature = number_field(body, "temperature", 1.0, float, 0, 2)
        self.top_p = number_field(body, "top_p", 1.0, float, 0, 1, low_open=True)
        top_k = number_field(body, "top_k", -1, int, -1)
        self.top_k = None if top_k in (-1, 0) else top_k
        self.seed = number_field(body, "seed", None, int, 0, 2**63 - 1)
        self.n = number_field(body, "n", 1, int, 1, MAX_N)
        self.presence_penalty = number_field(body, "presence_penalty", 0.0, float, -2, 2)
        self.frequency_penalty = number_field(body, "frequency_penalty", 0.0, float, -2, 2)
        self.logit_bias = logit_bias_field(body, vocab)
        self.stops = stop_strings(body)
        ignore_eos = body.get("ignore_eos", False)  # vLLM's: only max_tokens and stop end it
        if not isinstance(ignore_eos, bool):
            raise BadRequest(f"ignore_eos must be true or false, got {ignore_eos!r}", "ignore_eos")
        self.ignore_eos = ignore_eos
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequest(f"stream must be true or false, got {stream!r}", "stream")
        self.stream = stream
        options = body.get("stream_options") or {}
        self.include_usage = bool(isinstance(options, dict) and options.get("include_usage"))

    def request(
        self, prompt: list[int], choice: int, max_tokens: int, stop_ids, prompt_logprobs=False, top=False, adapter=None
    ):
        seed = None if self.seed is None else self.seed + choice
        return Request(
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=None if self.top_p == 1 else self.top_p,
            seed=seed,
            stop_ids=stop_ids,
            prompt_logprobs=prompt_logprobs,
            top_logprobs=top,
            adapter=adapter,
            logit_bias=self.logit_bias,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
        )

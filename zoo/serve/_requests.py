"""What a caller hands the engine and gets back: a `Request` (prompt, limits, sampling,
steering, adapter), each generated `Token`, and the `Handle` its tokens arrive on."""

from __future__ import annotations

import queue
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Request:
    """One completion request, in token ids.

    - `prompt`: the prompt's ids (at least one).
    - `max_tokens`: the most new tokens (the slot's room in the cache may end it first).
    - `temperature`: 0 greedy; above 0 a draw after `top_k` / `top_p` filtering
      (`zoo.generate`'s rules).
    - `seed`: the draws' key is `jax.random.key(seed)` folded with the token's index, as
      `zoo.generate(key=jax.random.key(seed))` draws them (None: a fresh seed).
    - `stop_ids`: ids that end the request (kept as its last token, reason `"stop"`).
    - `prompt_logprobs`: also compute the prompt's token log-probabilities (`echo`).
    - `top_logprobs`: report each new token's `TOP_LOGPROBS` most likely alternatives
      (`Token.top`; a step computes them only when a slot asks).
    - `adapter`: the name of an adapter the engine serves (None: the bare base).
    - `logit_bias`: token id → a bias in [-100, 100] added to its logit before every choice
      (OpenAI's `logit_bias`: -100 bans a token, 100 all but forces it).
    - `presence_penalty`, `frequency_penalty`: in [-2, 2], OpenAI's and vLLM's: before each
      choice a token's logit loses `presence_penalty` once it has been generated, and
      `frequency_penalty` times the number of times it has (the prompt's tokens do not count).
    """

    prompt: Sequence[int]
    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop_ids: Sequence[int] = ()
    prompt_logprobs: bool = False
    top_logprobs: bool = False
    adapter: str | None = None
    logit_bias: Mapping[int, float] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0


@dataclass
class Token:
    """One generated token: its id, its log-probability under the model (before any
    temperature or filtering), the `TOP_LOGPROBS` most likely ids with theirs, and
    `sampled_logprob`: its log-probability under the logits divided by the request's
    temperature (the model's own for a greedy request), before top-k/top-p filtering, the
    distribution it was drawn from as an RL objective weighs it (TRL's GRPO: the rollout's
    old log-probabilities). (A prompt's tokens echoed back are Tokens too: the first has
    no log-probability, None; echoed ones have no `sampled_logprob`.)"""

    id: int
    logprob: float | None
    top: list[tuple[int, float]]
    sampled_logprob: float | None = None


@dataclass
class Handle:
    """A submitted request: its tokens as they come, and how it ended.

    `tokens` grows as the engine steps; `finish_reason` is None while it runs, then
    `"stop"` (a stop id), `"length"` (`max_tokens` or the cache's end) or `"cancelled"`.
    `prompt_logprobs` (with `Request.prompt_logprobs`): one per prompt token, None for the
    first. `on_update` (optional) is called from the engine's thread with each new `Token`,
    then with None when the request finishes.
    """

    id: int
    request: Request
    tokens: list[Token] = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None
    prompt_top: list[list[tuple[int, float]]] | None = None
    finish_reason: str | None = None
    on_update: Callable[[Token | None], Any] | None = None
    _events: queue.Queue = field(default_factory=queue.Queue, repr=False)
    _cancelled: bool = False
    _slot: int = -1  # the adapter slot it uses (-1: none)
    _index: int = -1  # the batch slot it was admitted to
    _limit: int = 0  # how many tokens it may have (max_tokens, or the cache's room)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def ids(self) -> list[int]:
        return [t.id for t in self.tokens]

    def cancel(self) -> None:
        """Stop the request (a client went away): its slot is freed before the next step."""
        self._cancelled = True

    def _emit(self, token: Token | None) -> None:
        self._events.put(token)
        if self.on_update is not None:
            self.on_update(token)


def shares_prefill(leader: Handle, other: Handle) -> bool:
    """Whether `other` can start from `leader`'s prefill (`Engine(share_prompts=True)`): the
    same prompt ids and adapter, not cancelled, no prompt log-probabilities asked."""
    mine, theirs = leader.request.prompt, other.request.prompt
    return (
        not other._cancelled
        and not other.request.prompt_logprobs
        and other._slot == leader._slot
        and len(theirs) == len(mine)
        and all(int(a) == int(b) for a, b in zip(theirs, mine))
    )

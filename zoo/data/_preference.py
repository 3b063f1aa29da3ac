"""Preference pairs (TRL's format: `prompt`, `chosen`, `rejected`, as texts or as
conversations) as rows of a `zoo.models.PreferenceLoss` batch: each pair in one row, its
chosen and rejected sequences side by side, so no microbatch split parts a pair."""

from __future__ import annotations

from typing import Any

import numpy as np

from ._chat import ChatTemplate, rendering
from ._records import DataFormatError

TRUNCATIONS = ("keep_end", "keep_start", "error")


def _texts(
    record: dict[str, Any], template: ChatTemplate | None, system: str | None, where: str
) -> tuple[str, str, str]:
    """(prompt, chosen, rejected) as texts: conversations rendered by the chat template
    (the prompt with the generation prompt; each completion the rest of prompt +
    completion), `system` put first as a system turn when the prompt has none."""
    prompt, chosen, rejected = record["prompt"], record["chosen"], record["rejected"]
    if isinstance(prompt, str):
        return ((system + "\n\n" if system else "") + prompt), chosen, rejected
    if template is None:
        raise DataFormatError(
            f"{where}: the pair is a conversation but the tokenizer has no chat template; pass a model folder whose "
            "tokenizer_config.json has chat_template (or chat_template.jinja), or a jinja2 template file: "
            "--chat-template FILE (in Python: chat_template=zoo.data.ChatTemplate(text))"
        )
    if system and not (prompt and prompt[0].get("role") == "system"):
        prompt = [{"role": "system", "content": system}, *prompt]
    with rendering(where):
        head = template.render(prompt, add_generation_prompt=True)
    out = []
    for completion in (chosen, rejected):
        with rendering(where):
            whole = template.render([*prompt, *completion])
        if not whole.startswith(head):
            raise DataFormatError(
                f"{where}: the chat template renders the prompt differently alone and followed by the completion, so "
                "the completion cannot be cut from it; use a template that renders conversations by prefixes"
            )
        out.append(whole[len(head) :])
    return head, out[0], out[1]


def preference_rows(
    records: list[dict[str, Any]],
    wheres: list[str],
    rust: Any,
    *,
    seq_len: int,
    pad_id: int = 0,
    eos_id: int | None = None,
    chat_template: ChatTemplate | None = None,
    system: str | None = None,
    max_prompt_len: int | None = None,
    truncation: str = "keep_end",
) -> tuple[dict[str, np.ndarray], int]:
    """The pairs as arrays `[pairs, seq_len]` (`chosen_tokens`, `chosen_mask`,
    `chosen_completion`, and the same for `rejected`), and how many pairs were cut.

    Truncation as TRL's (before it moved to one `max_length`): when prompt + the longer
    completion exceed `seq_len`, the prompt keeps its last `max_prompt_len` tokens
    (`truncation="keep_end"`, default half of `seq_len`; `"keep_start"`: its first ones),
    then both completions are cut to what is left; `"error"` refuses such a pair instead.
    Text prompts are tokenized with the tokenizer's special tokens, completions without
    (and end with `eos_id` when known); conversations are rendered by `chat_template`.
    """
    if truncation not in TRUNCATIONS:
        raise ValueError(f"truncation must be one of {TRUNCATIONS}, got {truncation!r}")
    max_prompt = seq_len // 2 if max_prompt_len is None else max_prompt_len
    if not 1 <= max_prompt < seq_len:
        raise ValueError(
            f"max_prompt_len must leave room for a completion: 1 <= it < seq_len {seq_len}, got {max_prompt}"
        )
    n = len(records)
    arrays = {
        f"{side}_{k}": np.full((n, seq_len), pad_id if k == "tokens" else 0, np.int32)
        for side in ("chosen", "rejected")
        for k in ("tokens", "mask", "completion")
    }
    cut = 0
    same: list[tuple[str, bool]] = []  # pairs whose two completions train as one: (where, made so by the cut)
    for i, (record, where) in enumerate(zip(records, wheres)):
        prompt_text, chosen_text, rejected_text = _texts(record, chat_template, system, where)
        conversation = not isinstance(record["prompt"], str)
        prompt = rust.encode(prompt_text, add_special_tokens=not conversation).ids
        eos = [] if eos_id is None or conversation else [eos_id]
        completions = [rust.encode(t, add_special_tokens=False).ids + eos for t in (chosen_text, rejected_text)]
        for name, ids in zip(("chosen", "rejected"), completions):
            if not ids:
                raise DataFormatError(f"{where} field {name!r} holds no token; give it a completion or remove the line")
        longer = max(map(len, completions))
        if len(prompt) + longer > seq_len:
            if truncation == "error":
                room = "no room for the completion" if len(prompt) >= seq_len else "too little room"
                raise DataFormatError(
                    f"{where}: the prompt ({len(prompt)} tokens) leaves {room} at seq_len {seq_len} (the longer "
                    f"completion has {longer}); raise seq_len, shorten the pair, or let zoo cut it "
                    "(prompt truncation keep_end or keep_start)"
                )
            cut += 1
            if len(prompt) > max_prompt:
                prompt = prompt[-max_prompt:] if truncation == "keep_end" else prompt[:max_prompt]
            completions = [ids[: seq_len - len(prompt)] for ids in completions]
        if completions[0] == completions[1]:
            same.append((where, chosen_text != rejected_text))
            continue
        for name, ids in zip(("chosen", "rejected"), completions):
            row = prompt + ids
            arrays[f"{name}_tokens"][i, : len(row)] = row
            arrays[f"{name}_mask"][i, : len(row)] = 1
            arrays[f"{name}_completion"][i, len(prompt) : len(row)] = 1
    if same:
        # Identical completions have equal log-probabilities under any model: the pair's loss
        # has no gradient, so it teaches nothing (and a file of only such pairs, nothing at all).
        where, by_cut = same[0]
        why = f" once cut to seq_len {seq_len} (raise seq_len)" if by_cut else ""
        raise DataFormatError(
            f"{where}: chosen and rejected are the same{why}, so the pair teaches nothing; {len(same)} of the "
            f"{n} pairs are so: remove them or make their completions differ"
        )
    return arrays, cut

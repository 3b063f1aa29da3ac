"""What the engine checks before it allocates or queues: a prompt given as text, a request's logit bias and
penalties, and whether `slots` x `max_len` of cache and `max_queue` waiting prompts fit in
the free memory."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..models._transformer import layer_settings

# Host bytes a waiting request may hold per token of its prompt (a Python list of ints).
_QUEUED_TOKEN_BYTES = 40


def check_steering(logit_bias, presence_penalty, frequency_penalty, vocab: int) -> None:
    """Raise `ValueError` (one line, OpenAI's ranges in it) for a bias or penalty the engine
    does not take: bias ids outside the vocabulary or values outside [-100, 100], penalties
    outside [-2, 2] or not finite."""
    for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not -2.0 <= value <= 2.0:
            raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
    for token, bias in (logit_bias or {}).items():
        if isinstance(token, bool) or not isinstance(token, int | np.integer) or not 0 <= token < vocab:
            raise ValueError(f"logit_bias: token id {token!r} is outside the model's vocabulary [0, {vocab})")
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -100.0 <= bias <= 100.0:
            raise ValueError(f"logit_bias: the bias of token {token} must be a number in [-100, 100], got {bias!r}")


def free_bytes(device) -> int | None:
    """Bytes free for new buffers on `device`: its allocator's limit less what is in use
    (an accelerator), else the host's available memory (`MemAvailable`); None if unknown."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def cache_bytes(config, slots: int, max_len: int) -> int:
    """Bytes of an engine's key/value cache: keys and values of every layer, `slots` rows of
    `max_len` columns (a sliding layer's window of them, when fewer: its ring), in the
    model's compute dtype (and the decode step's copy of a row's logits, float32; each
    slot's logit bias and token counts, `Steering`, float32)."""
    head_dim = config.head_dim or config.d_model // config.num_heads
    kv_heads = config.kv_heads
    itemsize = jnp.dtype(config.compute_dtype).itemsize
    columns = sum(max_len if w is None else min(w, max_len) for w in layer_settings(config)["window"])
    return 2 * columns * slots * kv_heads * head_dim * itemsize + 3 * 4 * slots * config.vocab_size


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def check_room(model, slots: int, max_len: int, max_queue: int | None) -> None:
    """Raise `MemoryError` (one line: the limit at fault and a value that fits) unless the
    cache of `slots` x `max_len` and a full queue fit in the memory free on the model's device."""
    # Never `.devices().pop()`: a NamedSharding caches that set, and popping empties it.
    device = next(iter(jax.tree.leaves(eqx.filter(model, eqx.is_array))[0].devices()))
    free = free_bytes(device)
    if free is None:
        return
    need = cache_bytes(model.config, slots, max_len)
    if need > free:
        fits = max(free // max(cache_bytes(model.config, 1, max_len), 1), 0)
        hint = f"at most {fits:,} slots of {max_len} tokens fit" if fits else "lower max_len"
        raise MemoryError(
            f"slots={slots:,} x max_len={max_len:,}: the key/value cache needs {_size(need)} and {_size(free)} is free "
            f"on {device.platform}: {hint} (zoo serve --slots / --max-len)"
        )
    queued = 0 if max_queue is None else max_queue * max_len * _QUEUED_TOKEN_BYTES
    if queued > free - need:
        fits = max((free - need) // (max_len * _QUEUED_TOKEN_BYTES), 0)
        raise MemoryError(
            f"max_queue={max_queue:,}: a full queue of prompts of up to {max_len} tokens needs {_size(queued)} and "
            f"{_size(free - need)} is left beside the cache: at most {fits:,} fit (zoo serve --max-queue)"
        )


def check_prompt_ids(prompt) -> None:
    """Refuse a text where a request's token ids belong (the engine's checks would fail
    in `int('h')`: "invalid literal for int()"), naming the tokenizer call to make."""
    if isinstance(prompt, str | bytes):
        raise ValueError(
            f"Request.prompt is token ids, got the text {prompt[:40]!r}: tokenize it first, e.g. "
            "zoo.hf.Tokenizer.from_pretrained(folder)(text)['tokens'][0].tolist()"
        )

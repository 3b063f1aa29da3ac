"""The engine's logit bias and presence / frequency penalties (OpenAI's `logit_bias`,
`presence_penalty`, `frequency_penalty`; vLLM's arithmetic): each greedy choice equals the
argmax of a full forward pass's logits, biased and penalised by the counts of the tokens
the request generated, whatever other requests share its decode steps."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tiny_decoder

from zoo.serve import Engine, Request

MAX_LEN = 32
VOCAB = 32


@pytest.fixture(scope="module")
def model():
    return tiny_decoder(jax.random.key(5), vocab_size=VOCAB, max_len=MAX_LEN)


@eqx.filter_jit
def _last_logits(model, tokens, length):
    """The logits at position `length - 1` of a full forward pass over `tokens` (one row
    right-padded to MAX_LEN: causal attention, so the padding changes no earlier
    position; one compiled program for every length)."""
    return model(tokens[None])[0, length - 1].astype(jnp.float32)


def _reference(model, request: Request) -> list[int]:
    """Greedy tokens by full forward passes: logits + bias - presence·[count > 0] -
    frequency·count, the counts those of the tokens generated so far."""
    tokens, counts = list(request.prompt), np.zeros(VOCAB, np.float32)
    bias = np.zeros(VOCAB, np.float32)
    for token, value in (request.logit_bias or {}).items():
        bias[token] = value
    out = []
    for _ in range(request.max_tokens):
        padded = np.zeros(MAX_LEN, np.int32)
        padded[: len(tokens)] = tokens
        logits = np.asarray(_last_logits(model, jnp.asarray(padded), jnp.asarray(len(tokens))))
        steered = logits + bias - request.presence_penalty * (counts > 0) - request.frequency_penalty * counts
        token = int(np.argmax(steered))
        out.append(token)
        tokens.append(token)
        counts[token] += 1
    return out


REQUESTS = {
    "plain": Request([3, 4, 5], max_tokens=10),
    "frequency": Request([3, 4, 5], max_tokens=10, frequency_penalty=2.0),
    "presence": Request([3, 4, 5], max_tokens=10, presence_penalty=2.0, frequency_penalty=-0.25),
    "bias": Request([3, 4, 5], max_tokens=10, logit_bias={7: 100.0}),
    "banned": Request([9, 1], max_tokens=10, logit_bias={t: -100.0 for t in range(0, VOCAB, 2)}),
}


@pytest.fixture(scope="module")
def references(model):
    """Each request's greedy tokens by full forward passes, computed once for both tests."""
    return {name: _reference(model, request) for name, request in REQUESTS.items()}


def test_each_request_is_steered_by_its_own_bias_and_penalties_in_one_batch(model, references):
    engine = Engine(model, slots=8, max_len=MAX_LEN)
    handles = {name: engine.submit(request) for name, request in REQUESTS.items()}
    engine.run_until_done()
    got = {name: [t.id for t in h.tokens] for name, h in handles.items()}
    for name in REQUESTS:
        assert got[name] == references[name], name
    assert got["bias"] == [7] * 10 and all(t % 2 for t in got["banned"])
    # The penalties changed what greedy decoding picks (the tiny model repeats itself).
    assert got["frequency"] != got["plain"] and got["presence"] != got["plain"]
    assert len(set(got["frequency"])) > len(set(got["plain"]))


def test_a_slot_reused_after_a_steered_request_starts_clean(model, references):
    """Its bias and counts are the new request's: a plain request after a biased one in the
    same slot decodes as a plain one alone."""
    engine = Engine(model, slots=1, max_len=MAX_LEN)
    for name in ("bias", "plain"):
        handle = engine.submit(REQUESTS[name])
        engine.run_until_done()
        assert [t.id for t in handle.tokens] == references[name]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"presence_penalty": 2.5}, r"presence_penalty must be a number in \[-2, 2\]"),
        ({"frequency_penalty": float("nan")}, r"frequency_penalty must be a number in \[-2, 2\]"),
        ({"logit_bias": {VOCAB: 1.0}}, r"logit_bias: token id 32 is outside the model's vocabulary \[0, 32\)"),
        ({"logit_bias": {1: -101.0}}, r"logit_bias: the bias of token 1 must be a number in \[-100, 100\]"),
    ],
)
def test_out_of_range_settings_are_refused_in_one_line(model, fields, message):
    engine = Engine(model, slots=1, max_len=MAX_LEN)
    with pytest.raises(ValueError, match=message):
        engine.submit(Request([1, 2], **fields))

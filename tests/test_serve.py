"""zoo.serve: continuous batching against zoo.generate alone, and the HTTP server against
the official `openai` client.

The model is a tiny random LlamaForCausalLM made by transformers, saved with a word-level
tokenizer.json and a chat template, loaded by zoo.hf. zoo.generate (itself checked against
transformers' generate in test_generate.py) is the reference for every request's tokens;
transformers' own forward pass and zoo's give the prompt log-probabilities.
"""

import json
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import serving
import torch
from helpers import backend_compiles, drawn_on_host, tiny_decoder
from serving import (
    EOS,
    MAX_LEN,
    VOCAB,
    WORDS,
    InProcessServe,
    ServeProcess,
    http_json,
    token_ids,
)
from serving import alone as alone_unpadded

import zoo
from zoo.serve import Engine, QueueFull, Request
from zoo.serve._programs import span

served = serving.served  # the tiny random Llama, a module fixture


def alone(model, request, width: int = 32, new: int = 32) -> list[int]:
    """zoo.generate's tokens for `request` by itself (one row, as `serving.alone`), its prompt
    padded on the left to `width` columns (masked: each row's positions count from its first
    real token, so the same tokens) and `new` tokens generated, the first `max_tokens` kept
    (a draw's key is folded with the step alone: the same draws). Every reference of one
    model and sampling settings is one compiled program, not one per prompt length and
    `max_tokens` (each 0.5-1 CPU s to trace, lower and compile). A request that does not
    fit is generated unpadded."""
    n = len(request.prompt)
    if n > width or request.max_tokens > new:
        return alone_unpadded(model, request)
    tokens = np.zeros((1, width), np.int32)
    tokens[0, width - n :] = request.prompt
    key = None if request.temperature == 0 else jax.random.key(request.seed)
    mask = np.arange(width)[None] >= width - n
    out = zoo.generate(
        model, tokens, mask=mask, max_new_tokens=new, temperature=request.temperature, top_k=request.top_k,
        top_p=request.top_p, key=key,
    )  # fmt: skip
    return np.asarray(out)[0, width : width + request.max_tokens].tolist()


@eqx.filter_jit
def _full_logprobs_program(model, tokens):
    return jax.nn.log_softmax(model(tokens).astype(jnp.float32), axis=-1)


def full_logprobs(model, ids) -> np.ndarray:
    """The model's full forward pass over `ids` (one row), as float32 log-probabilities
    `[len(ids), vocab]`. The row is padded on the right to the model's `max_len`, which
    the causal pass's first `len(ids)` positions never see: one compiled program per model,
    not one per length (an eager pass compiles each of its operations for each length)."""
    ids = list(ids)
    row = ids + [0] * (model.config.max_len - len(ids))
    return np.asarray(_full_logprobs_program(model, jnp.asarray([row], jnp.int32)))[0, : len(ids)]


def _assert_logprobs_are_the_full_forward(model, prompt, handle):
    """Each new token's log-probability is the full forward pass's at its position (float32
    log-softmax of the same logits, summed in another order: 1e-5 as the echo checks).
    Returns the full pass's log-probabilities `[prompt + new, vocab]`."""
    full = full_logprobs(model, prompt + handle.ids)
    want = [full[len(prompt) - 1 + j, t] for j, t in enumerate(handle.ids)]
    np.testing.assert_allclose([t.logprob for t in handle.tokens], want, atol=1e-5, rtol=0)
    return full


@pytest.fixture(scope="module")
def engine(served):
    return Engine(served[2], slots=4, max_len=MAX_LEN)


# The two tests that count compiles run first in this file (tests/conftest.py), warm_up's
# first: each empties jax's caches as it starts, and the module engine's programs and the
# batching test's references are the ones later tests share.
def test_warm_up_serves_each_row_count_with_the_kernel_timed_faster(served):
    """`warm_up` compiles the decode step with each CPU matmul kernel and times them: the
    one made slower here (a sleep before each call) is never chosen, the other serves every
    row count, and requests get zoo.generate's tokens with either. Choosing again compiles
    nothing."""
    model = served[2]
    engine = Engine(model, slots=2, max_len=MAX_LEN)
    programs = dict(engine._decode)
    assert set(programs) == {"eigen", "xla"}

    def slowed(program):
        def run(*args):
            time.sleep(0.03)
            return program(*args)

        return run

    requests = [Request([5, 6, 7, 8], max_tokens=6), Request(list(range(6, 26)), max_tokens=9)]
    requests.insert(1, Request([5, 6, 7, 8], max_tokens=4, temperature=1.0, seed=2))  # starts from the first's prefill
    for slow, fast in (("eigen", "xla"), ("xla", "eigen")):
        engine._decode = {**programs, slow: slowed(programs[slow])}
        engine.warm_up([4, 20])
        assert engine.kernels == {1: fast, 2: fast}
        with backend_compiles() as seen:
            handles = [engine.submit(r) for r in requests]
            engine.run_until_done()
        assert seen == []  # warm_up built every program these requests use (`share` too)
        assert handles[1]._index == 1 and engine.compiles[("share",)] == 1
        for request, handle in zip(requests, handles):
            assert handle.ids == alone(model, request), (fast, request)
    assert {k[3] for k in engine.compiles if k[0] == "decode"} == {"eigen", "xla"}
    assert set(engine.compiles.values()) == {1}


def test_every_request_gets_its_own_tokens_whatever_shares_the_batch(served, engine):
    """Staggered arrivals, prompt lengths 1..30 (four buckets), more requests than slots,
    greedy and sampled side by side: each request's tokens are zoo.generate's for it alone."""
    model = served[2]
    rng = np.random.default_rng(0)
    shapes = [(5, 9), (12, 6), (1, 14), (30, 7), (9, 11), (17, 3), (3, 12), (8, 1)]
    requests = [Request(prompt=rng.integers(6, VOCAB, size=n).tolist(), max_tokens=m) for n, m in shapes]
    requests[2] = Request(requests[2].prompt, max_tokens=14, temperature=0.9, top_k=20, top_p=0.9, seed=7)
    requests[6] = Request(requests[6].prompt, max_tokens=12, temperature=1.3, seed=3)
    with backend_compiles() as compiles:  # XLA's own count: programs the engine's steps built
        handles = [engine.submit(r) for r in requests[:3]]
        engine.step()
        engine.step()
        handles += [engine.submit(r) for r in requests[3:6]]
        engine.step()
        assert engine.active == 4 and engine.waiting == 2  # 4 slots: two wait
        handles += [engine.submit(r) for r in requests[6:]]
        engine.run_until_done()
    for request, handle in zip(requests, handles):
        assert handle.finish_reason == "length"
        assert handle.ids == alone(model, request), request
    # One prefill per bucket (8, 16, 32) used; one decode program per number of rows used
    # (as requests end, the rest move to the lowest slots and the step runs fewer rows), all
    # reading the 64 columns, with Eigen's matmuls (no warm_up timed the kernels); each built
    # once, and XLA built nothing else.
    decode = {k[:3]: v for k, v in engine.compiles.items() if k[0] == "decode"}
    assert {("decode", 4, 64), ("decode", 2, 64), ("decode", 1, 64)} >= set(decode) >= {("decode", 4, 64)}
    assert {k[3] for k in engine.compiles if k[0] == "decode"} == {"eigen"}
    assert len(decode) >= 2, "the step should shrink as requests end"
    prefill = {k: v for k, v in engine.compiles.items() if k[0] == "prefill"}
    assert prefill == {("prefill", 8, False): 1, ("prefill", 16, False): 1, ("prefill", 32, False): 1}
    assert set(engine.compiles.values()) == {1} and len(compiles) == len(engine.compiles)
    assert engine.active == 0 and engine.waiting == 0


def _peaked_decoder(seed: int, **config):
    """`tiny_decoder(**config)`'s structure with weights drawn on the host (numpy's
    `default_rng(seed)`): norm scales 1 + 0.3 N(0, 1), every other weight 0.3 N(0, 1), as
    large as the noise the random initialisation was given before: peaked logits, no
    near-ties between programs. Drawn on the host and put on the device, the build compiles
    nothing (eagerly, each initialiser compiles for each shape; in one compiled program,
    1-2 CPU s per configuration)."""
    return drawn_on_host(eqx.filter_eval_shape(tiny_decoder, jax.random.key(0), **config), seed, 0.3, norm=1.0)


def test_a_request_crossing_attention_spans_keeps_its_tokens():
    """A decode step's attention reads only the cache columns in use (`span`: at least 128,
    then 192, 256, ...; one program each; the blocks of columns that hold them): a request
    whose prompt fills two blocks and that grows past 128 columns beside a short one gets
    zoo.generate's tokens for it alone. The model normalises its query and key heads
    (`qk_norm`, Qwen3's: test_generate holds zoo.generate to transformers for it)."""
    model = _peaked_decoder(3, max_len=256, vocab_size=64, qk_norm=True)
    engine = Engine(model, slots=2, max_len=250)  # cache blocks of 64, 64, 64 and 58 columns
    rng = np.random.default_rng(1)
    # Side by side to the end: one decode program per span (2 rows), none for a lone row.
    requests = [Request(rng.integers(0, 64, size=120).tolist(), max_tokens=16), Request([5, 6, 7], max_tokens=16)]
    handles = [engine.submit(r) for r in requests]
    engine.run_until_done()  # the long one uses columns 121 to 136
    for request, handle in zip(requests, handles):
        assert handle.ids == alone(model, request, width=120, new=16)  # both references one program
        _assert_logprobs_are_the_full_forward(model, request.prompt, handle)  # which sees every column
    assert {k[2] for k in engine.compiles if k[0] == "decode"} == {128, 192}  # ("decode", rows, span, kernel)
    assert [span(n, 256) for n in (1, 128, 129, 192, 193)] == [128, 128, 192, 192, 256]
    assert span(100, 64) == 64  # a cache shorter than the smallest span is read whole


# The layer variants of the families zoo reads, each as a tiny decoder (test_generate holds
# zoo.generate to transformers for each family).
ARCHITECTURES = {
    # OLMo 2: norms after each sub-layer only, q/k norms over the whole projections.
    "olmo2_norms": dict(qk_norm=True, qk_norm_scope="projection", norm_placement="output"),
    # Phi-4-mini: RoPE on 4 of 8 head dimensions.
    "partial_rotary": dict(head_dim=8, partial_rotary_factor=0.5),
    # Gemma 2: norms before and after each sub-layer, a window of 4 on every other layer,
    # scores and logits soft-capped, scores scaled by query_pre_attn_scalar.
    "gemma2": dict(
        num_layers=2, norm_placement="sandwich", sliding_window=4, sliding_layers=(True, False),
        attn_logit_softcapping=2.0, final_logit_softcapping=10.0, query_pre_attn_scalar=12.0,
    ),
    # Per-layer patterns scanned as data: SmolLM3's NoPE layers, a window of 4 on some
    # layers, a RoPE base per layer.
    "pattern": dict(
        num_layers=4, sliding_window=4, sliding_layers=(True, False, False, True),
        rope_layers=(True, False, True, False), rope_thetas=(1e4, 1e4, 5e2, 1e4),
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_the_engine_serves_each_architecture_as_it_generates(name):
    """Three requests side by side at their own positions, past every window: each gets
    zoo.generate's tokens for it alone, each token's log-probability the full forward
    pass's (caps, norms, partial rotary and per-layer patterns are the same code in both)."""
    model = _peaked_decoder(5, max_len=64, vocab_size=64, **ARCHITECTURES[name])
    attention = model.layers.layers.attention
    assert {"partial_rotary": attention.rope_dim == 4, "gemma2": attention.logit_softcap == 2.0}.get(name, True)
    engine = Engine(model, slots=2, max_len=48)
    rng = np.random.default_rng(3)
    # Prompts of one prefill bucket (8), the third admitted as the first ends, the last two
    # ending together: one prefill and one decode program (2 rows) per architecture.
    requests = [Request(rng.integers(0, 64, size=n).tolist(), max_tokens=m) for n, m in [(6, 8), (3, 12), (8, 5)]]
    handles = [engine.submit(r) for r in requests]
    engine.run_until_done()
    for request, handle in zip(requests, handles):
        assert handle.ids == alone(model, request)
        _assert_logprobs_are_the_full_forward(model, request.prompt, handle)


def test_requests_left_running_move_down_and_the_step_shrinks(served, engine):
    """Four requests; the two in the lowest slots end first. The two left move into the
    lowest slots (their cache rows and next tokens with them) and the step runs two rows,
    then one: every request still gets zoo.generate's tokens for it alone, and each token's
    log-probability is the full forward pass's. (The module's engine: the rows and moves of
    this test's steps are recorded as they are queued; the move program built once.)"""
    model = served[2]
    rng = np.random.default_rng(2)
    # (prompt, new tokens): slots 2 and 3 outlive 0 and 1. The shapes of the batching test's
    # requests (its prefill buckets; the references: `alone`'s one program, compiled).
    lengths = [(17, 3), (12, 6), (3, 12), (1, 14)]
    requests = [Request(rng.integers(6, VOCAB, size=n).tolist(), max_tokens=m) for n, m in lengths]
    rows, moves = [], []
    decode_rows, move = engine._decode_rows, engine._move
    engine._decode_rows = lambda steps, *a: (rows.append(len(steps)), decode_rows(steps, *a))[1]
    engine._move = lambda *a: (moves.append((int(a[2]), int(a[3]))), move(*a))[1]
    try:
        handles = [engine.submit(r) for r in requests]
        engine.run_until_done()
    finally:
        del engine._decode_rows
        engine._move = move
    assert sorted(moves) == [(2, 1), (3, 0)] and engine.compiles[("move",)] == 1  # both moved down, one program
    assert [n for i, n in enumerate(rows) if i == 0 or rows[i - 1] != n] == [4, 2, 1]  # rows per step as requests end
    for request, handle in zip(requests, handles):
        assert handle.ids == alone(model, request)
        _assert_logprobs_are_the_full_forward(model, request.prompt, handle)


def test_stop_ids_and_the_cache_end_finish_a_request(served, engine):
    model = served[2]
    prompt = list(range(7, 39))  # 32 ids: the cache's end 32 tokens on (the references' shape: `alone`)
    free = alone(model, Request(prompt, max_tokens=MAX_LEN - len(prompt)))
    handle = engine.submit(Request(prompt, max_tokens=10**6))  # only the cache's end stops it
    engine.run_until_done()
    assert handle.finish_reason == "length" and handle.ids == free
    stop = free[5]
    handle = engine.submit(Request(prompt, max_tokens=30, stop_ids=[stop]))
    engine.run_until_done()
    assert handle.finish_reason == "stop" and handle.ids == free[: free.index(stop) + 1]


def test_echo_logprobs_are_the_full_forward_passes(served, engine):
    _, hf, model, _ = served
    prompt = [6, 31, 12, 40, 9, 22, 17, 50, 3, 11, 44]
    handle = engine.submit(Request(prompt, max_tokens=3, prompt_logprobs=True, top_logprobs=True))
    engine.run_until_done()
    full = full_logprobs(model, prompt)
    want = [full[i, prompt[i + 1]] for i in range(len(prompt) - 1)]
    assert handle.prompt_logprobs[0] is None
    np.testing.assert_allclose(handle.prompt_logprobs[1:], want, atol=1e-5, rtol=0)
    with torch.no_grad():
        torch_full = torch.log_softmax(hf(torch.tensor([prompt])).logits.float(), -1)[0].numpy()
    np.testing.assert_allclose(handle.prompt_logprobs[1:], [torch_full[i, prompt[i + 1]] for i in range(10)],
                               atol=1e-5, rtol=0)  # fmt: skip
    full = _assert_logprobs_are_the_full_forward(model, prompt, handle)
    top = handle.tokens[0].top
    assert [i for i, _ in top] == np.argsort(-full[len(prompt) - 1])[:5].tolist()


def test_requests_of_one_prompt_share_its_prefill_and_keep_their_own_tokens(served, engine):
    """Requests of one prompt waiting one after another (an RL rollout's group, OpenAI's `n`)
    are prefilled once: the others copy its cache row and choose their first token from its
    logits with their own settings (seeds, top-k, a bias and penalties, a single token). Each
    gets the tokens and log-probabilities of its own prefill (`share_prompts=False`, whose
    tokens the batching test holds to `zoo.generate` alone). A request asking its prompt's
    log-probabilities, or of another prompt, is prefilled itself."""
    model, prompt = served[2], [6, 31, 12, 40, 9]
    group = [Request(prompt, max_tokens=6, temperature=1.0, top_k=None if s % 2 else 20, seed=s) for s in range(3)]
    group.append(Request(prompt, max_tokens=1, temperature=0.7, seed=11))  # frees its slot at once
    group.append(Request(prompt, max_tokens=5, logit_bias={20: 4.0}, presence_penalty=0.5, frequency_penalty=0.3))
    own = [Request(prompt, max_tokens=3, prompt_logprobs=True, top_logprobs=True), Request(prompt[:-1], max_tokens=3)]
    before = engine.shared
    handles = [engine.submit(r) for r in group + own]
    engine.run_until_done()
    assert engine.shared - before == 4  # the 4 slots: 1 prefill, 4 shares (the single token's slot taken again)
    apart = Engine(model, slots=4, max_len=MAX_LEN, share_prompts=False)
    references = [apart.submit(r) for r in group + own]
    apart.run_until_done()
    assert apart.shared == 0
    for handle, reference in zip(handles, references):
        assert handle.ids == reference.ids and handle.finish_reason == reference.finish_reason
        for field in ("logprob", "sampled_logprob"):
            got, want = ([getattr(t, field) for t in h.tokens] for h in (handle, reference))
            np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    assert handles[5].prompt_logprobs == references[5].prompt_logprobs


def test_cancel_frees_the_slot_and_the_queue_is_bounded(served, engine):
    """The module's engine, every slot taken and one place in its queue (the reference of the
    one that waits: `alone`'s program, compiled)."""
    model = served[2]
    running = [engine.submit(Request([6, 7], max_tokens=20)) for _ in range(engine.slots)]
    engine.step()
    engine.max_queue = 1
    try:
        waiting = engine.submit(Request([8, 9, 10], max_tokens=12))
        with pytest.raises(QueueFull, match="already wait for a slot"):
            engine.submit(Request([8], max_tokens=4))
        running[0].cancel()
        engine.step()  # the cancelled request leaves, the waiting one takes its slot
        assert running[0].finish_reason == "cancelled" and len(running[0].ids) == 2
        assert waiting._index == 0 and engine.waiting == 0
        engine.run_until_done()
    finally:
        engine.max_queue = None
    assert waiting.ids == alone(model, waiting.request)


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (Request([], max_tokens=2), "the prompt is empty"),
        (Request([6] * 64, max_tokens=2), "the prompt has 64 tokens but a request holds at most 64"),
        (Request([6, 99], max_tokens=2), "token id 99 is outside the model's vocabulary [0, 64)"),
        (Request([6], max_tokens=0), "max_tokens must be a positive integer"),
        (Request([6], temperature=-1.0), "temperature must be >= 0"),
        (Request([6], temperature=1.0, top_p=1.5), "top_p must be in (0, 1]"),
        (Request([6], temperature=1.0, top_k=0), "top_k must be a positive integer"),
    ],
)
def test_bad_requests_are_refused_with_the_fix(engine, request_, message):
    with pytest.raises(ValueError) as e:
        engine.submit(request_)
    assert message in str(e.value)


def test_a_text_prompt_is_refused_with_the_tokenizer_call(engine):
    """A text where ids belong (no runtime type check outside the tests) failed in `int('h')`:
    "invalid literal for int() with base 10"."""
    request = Request([6], max_tokens=2)
    object.__setattr__(request, "prompt", "hello")  # past the suite's runtime type check, as a user's call goes
    with pytest.raises(ValueError, match="Request.prompt is token ids, got the text 'hello': tokenize it first"):
        engine.submit(request)


def test_stream_and_background_thread(served, engine):
    """The module's engine (the batching test's request shapes: its programs compiled, and
    `alone`'s), stopped at the end and then made to take requests again."""
    model = served[2]
    request = Request([6, 7, 8], max_tokens=12)
    want = alone(model, request)
    assert [t.id for t in engine.stream(request)] == want  # steps itself
    engine.start()
    try:
        before, handles = engine.shared, []
        with engine.holding():  # the thread waits: the three are admitted together, one prefill
            for _ in range(3):
                handles.append(engine.submit(Request([6, 7, 8], max_tokens=12)))
                time.sleep(0.05)
        assert [[t.id for t in engine.tokens(h)] for h in handles] == [want] * 3
        assert engine.shared - before == 2
    finally:
        engine.stop()
    try:
        with pytest.raises(QueueFull, match="stopping"):
            engine.submit(request)
    finally:  # for the module's later tests: a stopped engine takes no request
        engine._stopping, engine._thread = False, None


# --- the HTTP server, through the official openai client ----------------------------------


@pytest.fixture(scope="module")
def server(served):
    # Two slots: warm_up compiles the decode step for 1 and 2 rows with each kernel (4
    # programs; 4 slots: 6). A request more than the slots waits for one (the 4 choices of
    # test_openai_client_completions: two run, two wait, each with its own tokens).
    running = InProcessServe(served[0], "--slots", 2, "--max-len", MAX_LEN)
    yield running
    running.stop()


def _health(base):
    return http_json(base, "GET", "/health")[2]


def _greedy_text(served, prompt_ids, max_tokens):
    """zoo.generate's greedy continuation as text, up to (not including) the eos id."""
    _, _, model, tokenizer = served
    ids = alone(model, Request(prompt_ids, max_tokens=max_tokens))
    ids = ids[: ids.index(EOS)] if EOS in ids else ids
    return tokenizer.decode(ids), ids


def test_openai_client_completions(served, server):
    client = server.client()
    assert [m.id for m in client.models.list()] == ["tiny"]
    prompts = ["w1 w2 w3", "w40 w7"]
    shared = server.server.engine.shared
    out = client.completions.create(model="tiny", prompt=prompts, max_tokens=12, temperature=0, n=2)
    assert server.server.engine.shared - shared == 2  # each prompt's 2 choices, one prefill (queued as one group)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    wants = [_greedy_text(served, token_ids(served, p), 12) for p in prompts]
    assert [c.text for c in out.choices] == [wants[0][0]] * 2 + [wants[1][0]] * 2
    for choice, (_, ids) in zip(out.choices, [wants[0]] * 2 + [wants[1]] * 2):
        assert choice.finish_reason == ("stop" if len(ids) < 12 else "length")
    assert out.usage.prompt_tokens == 5
    assert out.usage.completion_tokens == sum(min(len(ids) + 1, 12) for _, ids in wants) * 2  # eos counts
    # Token ids in, the same text out; streamed, the same text in pieces.
    by_ids = client.completions.create(model="tiny", prompt=token_ids(served, prompts[0]), max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == wants[0][0]
    pieces = client.completions.create(model="tiny", prompt=prompts[0], max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in pieces) == wants[0][0]


def test_openai_client_stop_strings_and_sampling(served, server):
    client = server.client()
    prompt = "w9 w33 w12 w50"
    text, ids = _greedy_text(served, token_ids(served, prompt), 20)
    words = text.split()
    assert len(words) >= 3, "the random model should say a few words before its eos"
    stop = " " + words[2]
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0, stop=[stop])
    assert out.choices[0].text == text[: text.index(stop)] and out.choices[0].finish_reason == "stop"
    pieces = client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0, stop=stop,
                                       stream=True)  # fmt: skip
    assert "".join(c.choices[0].text for c in pieces) == text[: text.index(stop)]
    # A seeded draw is zoo.generate's with jax.random.key(seed); top_k as vLLM takes it (the
    # batching test's sampling settings: its reference program).
    kw = dict(max_tokens=8, temperature=0.9, top_p=0.9)
    out = client.completions.create(model="tiny", prompt=prompt, seed=11, extra_body={"ignore_eos": True, "top_k": 20},
                                    **kw)  # fmt: skip
    want = alone(served[2], Request(token_ids(served, prompt), seed=11, top_k=20, **kw))
    assert out.choices[0].text == served[3].decode(want)


def test_openai_client_echo_logprobs_are_the_full_forward(served, server):
    client = server.client()
    prompt = "w3 w14 w7 w22 w41 w2"
    ids = token_ids(served, prompt)
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    lp = out.choices[0].logprobs
    full = full_logprobs(served[2], ids)
    assert out.choices[0].text == prompt and lp.tokens == prompt.split()
    assert lp.token_logprobs[0] is None
    np.testing.assert_allclose(lp.token_logprobs[1:], [full[i, ids[i + 1]] for i in range(len(ids) - 1)], atol=1e-5)
    assert list(lp.top_logprobs[1]) == [WORDS[int(np.argmax(full[0]))]]


def test_openai_client_chat(served, server):
    client = server.client()
    messages = [{"role": "user", "content": "w5 w6 w7"}]
    rendered = "user w5 w6 w7 . assistant "
    want, _ = _greedy_text(served, token_ids(served, rendered), 10)
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == want
    assert out.usage.prompt_tokens == len(token_ids(served, rendered))
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens


@pytest.mark.parametrize(
    ("body", "message", "param"),
    [
        (b"{not json", "the request body is not valid JSON", None),
        (json.dumps({"model": "tiny", "prompt": "w1 " * 64}).encode(), "the prompt has 64 tokens but", "prompt"),
        (b'{"model": "tiny", "prompt": "w1", "temperature": 5}', "temperature must be in [0, 2], got 5", "temperature"),
        (b'{"model": "tiny", "prompt": "w1", "top_p": 0}', "top_p must be in (0, 1], got 0", "top_p"),
        (b'{"model": "tiny", "prompt": "w1", "n": 0}', "n must be in [1, 64], got 0", "n"),
        (b'{"model": "tiny", "prompt": {"a": 1}}', "prompt must be a string, a list of strings", "prompt"),
    ],
)
def test_bad_requests_get_400_and_the_server_keeps_serving(server, body, message, param):
    status, _, answer = http_json(server.base, "POST", "/v1/completions", body)
    assert status == 400
    error = answer["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error" and error["param"] == param
    assert _health(server.base)["status"] == "ok"


def test_an_unknown_model_gets_404_as_openai_answers(server):
    status, _, answer = http_json(server.base, "POST", "/v1/completions", {"model": "gpt-4", "prompt": "w1"})
    assert status == 404
    error = answer["error"]
    assert "the model 'gpt-4' does not exist; this server serves ['tiny']" in error["message"]
    assert error["code"] == "model_not_found" and error["type"] == "invalid_request_error" and error["param"] == "model"


def test_a_client_leaving_mid_stream_frees_its_slot(server):
    import http.client
    import time
    from urllib.parse import urlparse

    before = _health(server.base)["finished"].get("cancelled", 0)
    body = {"model": "tiny", "prompt": "w1", "max_tokens": 60, "stream": True, "ignore_eos": True}
    url = urlparse(server.base)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    connection.request("POST", "/v1/completions", body=json.dumps(body).encode())
    response = connection.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data: {")  # the first chunk; then the client goes
    connection.sock.close()
    connection.close()
    for _ in range(100):  # bounded: 10 s
        state = _health(server.base)
        if state["active"] == 0 and state["finished"].get("cancelled", 0) > before:
            break
        time.sleep(0.1)
    assert state["active"] == 0 and state["finished"]["cancelled"] == before + 1


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_full_queue_gets_429_and_sigterm_finishes_requests_in_flight(served, tmp_path):
    """One slot, one place in the queue: a third request gets 429 with Retry-After; SIGTERM
    while two stream lets both finish whole, then the process exits 0. The model is saved
    again with room for 1000 new tokens, so the requests are still running."""
    import shutil
    import threading
    import time

    config = json.loads((served[0] / "config.json").read_text())
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(served[0] / name, tmp_path / name)
    (tmp_path / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 1024}))
    process = ServeProcess(tmp_path, "--slots", 1, "--max-queue", 1)
    try:
        body = {"model": "tiny", "prompt": "w1 w2", "max_tokens": 1000, "temperature": 0, "ignore_eos": True}
        texts = {}

        def stream(name):
            chunks = process.client().completions.create(stream=True, extra_body={"ignore_eos": True},
                                                         **{k: body[k] for k in ("model", "prompt", "max_tokens",
                                                                                 "temperature")})  # fmt: skip
            texts[name] = "".join(c.choices[0].text for c in chunks)

        threads = [threading.Thread(target=stream, args=(k,)) for k in ("a", "b")]
        threads[0].start()
        for _ in range(200):  # bounded: 10 s
            if _health(process.base)["active"] == 1:
                break
            time.sleep(0.05)
        threads[1].start()
        for _ in range(200):
            if _health(process.base)["waiting"] == 1:
                break
            time.sleep(0.05)
        status, headers, answer = http_json(process.base, "POST", "/v1/completions", body)
        assert status == 429 and headers["retry-after"] == "1" and answer["error"]["code"] == "queue_full"
        assert process.stop() == 0  # SIGTERM: both finish first
        for t in threads:
            t.join(timeout=60)
        assert texts["a"] == texts["b"] and len(texts["a"].split()) == 1000
    finally:
        process.proc.kill()


def test_without_the_serve_extra_the_error_says_how_to_install_it():
    import subprocess
    import sys

    code = "import sys; sys.modules['uvicorn'] = None\nimport zoo.serve\nzoo.serve.Server"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 1
    assert (
        "zoo serve needs Starlette and uvicorn (uvicorn is missing); install them with pip install 'eqx-zoo[serve]'"
        in proc.stderr
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_lm_eval_local_completions_scores_as_zoo_does(served, server, tmp_path):
    """lm-evaluation-harness (`--model local-completions`) on a multiple-choice task of our
    own (a local jsonl): each choice's loglikelihood, read from the server's echo +
    logprobs, equals the one zoo computes from its full forward pass."""
    import os

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    rng = np.random.default_rng(1)
    words = [w for w in WORDS if w.startswith("w")]
    docs = [
        {"question": " ".join(rng.choice(words, 4)), "choices": list(rng.choice(words, 3, replace=False)), "answer": 0}
        for _ in range(4)
    ]
    (tmp_path / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tmp_path / "zoo_mc.yaml").write_text(
        "task: zoo_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {tmp_path / 'mc.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n"
    )
    args = (f"model=tiny,base_url={server.base}/completions,tokenizer={served[0]},tokenizer_backend=huggingface,"
            "num_concurrent=2,max_retries=1,max_length=64")  # fmt: skip
    results = lm_eval.simple_evaluate(
        model="local-completions", model_args=args, tasks=["zoo_mc"],
        task_manager=TaskManager(include_path=str(tmp_path)), log_samples=True,
    )  # fmt: skip
    samples = results["samples"]["zoo_mc"]
    assert len(samples) == 4
    model, tokenizer = served[2], served[3].tokenizer
    checked = 0
    for sample in samples:
        for (context, continuation), response in zip(sample["arguments"], sample["resps"]):
            whole, ctx = tokenizer.encode(context + continuation).ids, tokenizer.encode(context).ids
            logprobs = full_logprobs(model, whole)
            want = sum(logprobs[j - 1, whole[j]] for j in range(len(ctx), len(whole)))
            np.testing.assert_allclose(float(response[0][0]), want, atol=1e-5, rtol=0)
            checked += 1
    assert checked == 12


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--slots", 0], "--slots must be >= 1, got 0"),
        (["--max-len", 65], "--max-len must be in [2, 64] (the model's max_len), got 65"),
        (["--chat-template", "/nonexistent"], "--chat-template /nonexistent: no such file"),
    ],
)
@pytest.mark.timeout(120)  # a check that let it through would serve on port 8000
def test_cli_errors_are_one_line(served, extra, message):
    from helpers import one_line_error, zoo_main

    rc, _, err = zoo_main("serve", served[0], *extra)
    one_line_error(rc, err, message)


def test_cli_refuses_a_source_that_is_not_a_model(tmp_path):
    from helpers import one_line_error, zoo_main

    rc, _, err = zoo_main("serve", tmp_path)
    one_line_error(rc, err, "neither a Hugging Face model folder")

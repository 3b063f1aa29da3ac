"""zoo.serve with many LoRA adapters on one base: a mixed batch against each adapter alone,
loading and unloading while serving (nothing dropped, nothing compiled), `zoo serve
--adapter NAME=DIR` through the official `openai` client, and the errors.

The adapters are written by peft itself (`get_peft_model(...).save_pretrained`) on the tiny
random Llama of test_serve.py (`serving.tiny_llama`), with different ranks, scalings and
target modules. Each request's reference is `zoo.generate` on a plain single-adapter model
(`zoo.lora.load_adapter(base, folder)`) or on the bare base, alone.
"""

import copy
import functools
import json
import threading
import time

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import serving
from helpers import backend_compiles
from serving import http_json, http_request, token_ids
from test_serve import alone as alone_padded

import zoo
from zoo.serve import Engine, Request
from zoo.serve._engine import AdapterSlotsFull

served = serving.served  # the tiny random Llama, a module fixture


@functools.cache
def _references() -> dict:
    """`(id(model), prompt)` → `(model, the 16 tokens zoo.generate continues prompt with on
    model alone)`, for the file (its caches are let go when it ends; each model is held, so
    its id names no other)."""
    return {}


def alone(model, request: Request) -> list[int]:
    """zoo.generate's tokens for `request` by itself on `model` (test_serve.alone: its prompt
    padded on the left to 16 columns, 16 new tokens, the first `max_tokens` kept; greedy):
    one compiled program per model, and each prompt's tokens computed once for the file, so
    a test that asks for another's (after emptying jax's caches, as the compile-counting
    tests do) compiles nothing. A request longer than that is generated as it is."""
    assert request.temperature == 0, "the file's references are greedy"
    if len(request.prompt) > 16 or request.max_tokens > 16:
        return alone_padded(model, request, width=16, new=16)  # generated unpadded
    memo, key = _references(), (id(model), tuple(request.prompt))
    if key not in memo:
        memo[key] = model, alone_padded(model, Request(request.prompt, max_tokens=16), width=16, new=16)
    return memo[key][1][: request.max_tokens]


# name → (rank, alpha, peft target modules): different ranks, scalings and targets.
ADAPTERS = {
    "sql": (4, 8, ["q_proj", "v_proj"]),
    "poet": (2, 3, ["k_proj", "down_proj"]),
    "chef": (3, 6, ["gate_proj", "o_proj", "up_proj"]),
    "wide": (16, 16, ["q_proj"]),  # above the servers' max rank of 8
}


@pytest.fixture(scope="module")
def adapters(served, tmp_path_factory):
    """name → `(folder peft wrote, zoo single-adapter model read from it)`."""
    folder, hf, base, _ = served
    out = {}
    for k, (name, (r, alpha, targets)) in enumerate(ADAPTERS.items()):
        config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False)
        import torch

        torch.manual_seed(k)
        model = peft.get_peft_model(copy.deepcopy(hf), config)
        where = tmp_path_factory.mktemp(name)
        model.save_pretrained(where)
        out[name] = (where, zoo.lora.load_adapter(base, where)[0])
    return out


# Two prompt lengths and one output length (the references: one compiled program per model).
_PLAN = [(5, "sql"), (11, "poet"), (5, None), (5, "chef"), (11, "sql"), (5, "poet"), (11, None), (5, "chef")]
_rng = np.random.default_rng(0)
MIXED = [Request(_rng.integers(6, 64, size=n).tolist(), max_tokens=8, adapter=a) for n, a in _PLAN]


def test_a_mixed_batch_gives_each_request_its_adapter_alone(served, adapters):
    """Staggered requests over three adapters of different ranks and targets and the bare
    base share one decode program: each gets zoo.generate's tokens with its adapter alone."""
    base = served[2]
    models = {n: adapters[n][1] for n in ("sql", "poet", "chef")}
    engine = Engine(base, slots=3, max_len=64, adapters=models, max_lora_rank=8)
    assert engine.adapters == ["sql", "poet", "chef"] and engine.bank.capacity == 4
    requests = MIXED  # the references of those of 5 ids serve the next test too
    with backend_compiles() as seen:
        handles = [engine.submit(r) for r in requests[:2]]
        engine.step()
        handles += [engine.submit(r) for r in requests[2:5]]
        engine.step()
        engine.step()
        handles += [engine.submit(r) for r in requests[5:]]
        engine.run_until_done()
    # One prefill per bucket; one decode program per number of rows used (1 to 3), each once.
    prefill = {k: v for k, v in engine.compiles.items() if k[0] == "prefill"}
    assert prefill == {("prefill", 8, False): 1, ("prefill", 16, False): 1}
    decode = {k[:3] for k in engine.compiles if k[0] == "decode"}
    assert {("decode", 1, 64), ("decode", 2, 64), ("decode", 3, 64)} >= decode >= {("decode", 3, 64)}
    assert set(engine.compiles.values()) == {1}
    assert len(seen) == len(engine.compiles)  # XLA's own count: nothing else compiled while serving the mix
    differ = 0
    for request, handle in zip(requests, handles):
        model = base if request.adapter is None else models[request.adapter]
        assert handle.ids == alone(model, request), request
        differ += request.adapter is not None and handle.ids != alone(base, request)
    assert differ >= 4, "the adapters should change most requests' tokens"


def test_load_and_unload_while_requests_run(served, adapters):
    """Two adapter slots. Unloading an adapter its requests still use refuses new ones at
    once and lets those finish (with its tokens); loading another into the free slot meanwhile
    serves it at the next step. No program is built after the first ones."""
    base = served[2]
    engine = Engine(base, slots=3, max_len=64, adapters={"sql": adapters["sql"][1]}, max_adapters=2, max_lora_rank=8)
    # The decode step for 1 to 3 rows, and the prefill of these short prompts (the default
    # kernel: timing the kernels is test_serve.py's warm_up test).
    engine.warm_up(tune=False)
    # The mixed batch's prompts of 5 ids, with their adapters (their references computed once).
    sql, bare, chef, poet = (MIXED[i].prompt for i in (0, 2, 3, 5))
    running = [engine.submit(Request(sql, max_tokens=8, adapter="sql")) for _ in range(2)]
    plain = engine.submit(Request(bare, max_tokens=8))
    engine.step()
    engine.step()
    before = dict(engine.compiles)
    with backend_compiles() as seen:
        assert engine.unload_adapter("sql") == 2  # two requests still use it
        assert engine.adapters == []
        with pytest.raises(LookupError, match="no adapter named 'sql' is served"):
            engine.submit(Request([6], adapter="sql"))
        assert engine.load_adapter("poet", adapters["poet"][1]) == 1  # slot 0 still drains
        late = engine.submit(Request(poet, max_tokens=8, adapter="poet"))
        with pytest.raises(AdapterSlotsFull, match="all 2 adapter slots are taken"):
            engine.load_adapter("chef", adapters["chef"][1])
        engine.run_until_done()
        assert engine.bank.names == [None, "poet"]  # sql's slot freed once its requests ended
        assert engine.load_adapter("chef", adapters["chef"][1]) == 0
        again = engine.submit(Request(chef, max_tokens=8, adapter="chef"))
        engine.run_until_done()
    assert engine.compiles == before and seen == []
    for handle in running:
        assert handle.finish_reason == "length" and handle.ids == alone(adapters["sql"][1], handle.request)
    assert plain.ids == alone(base, plain.request)
    assert late.ids == alone(adapters["poet"][1], late.request)
    assert again.ids == alone(adapters["chef"][1], again.request)


def test_engine_refusals(served, adapters):
    base = served[2]
    engine = Engine(base, slots=1, max_len=64, max_adapters=1, max_lora_rank=8)
    with pytest.raises(ValueError, match="rank 16 .* is above the server's max LoRA rank 8"):
        engine.load_adapter("wide", adapters["wide"][1])
    narrow = Engine(base, slots=1, max_len=64, max_adapters=1, max_lora_rank=8, lora_targets=["q_proj", "v_proj"])
    with pytest.raises(ValueError, match="targets 'layers.layers.attention.k_proj', where the server holds no"):
        narrow.load_adapter("poet", adapters["poet"][1])
    with pytest.raises(LookupError, match="no adapter named 'nobody'"):
        engine.unload_adapter("nobody")
    with pytest.raises(ValueError, match="holds no adapter slots; create it with max_adapters=N"):
        Engine(base, slots=1, max_len=64).load_adapter("sql", adapters["sql"][1])
    with pytest.raises(ValueError, match="max_adapters=1 cannot hold the 2 adapters given"):
        Engine(base, max_len=64, adapters={n: adapters[n][1] for n in ("sql", "poet")}, max_adapters=1)
    with pytest.raises(ValueError, match="serve adapters over the bare base"):
        Engine(adapters["sql"][1], max_len=64, max_adapters=1)
    # A branch holding NaN is refused before it takes a slot, given at the start or loaded later.
    sql = adapters["sql"][1]
    bad = eqx.tree_at(
        lambda m: m.layers.layers.attention.v_proj.lora_B, sql, replace_fn=lambda b: b.at[0, 0].set(jnp.nan)
    )
    said = r"adapter 'bad': its LoRA weight lora_B at 'layers.layers.attention.v_proj' holds NaN or inf \(\d+ of its"
    with pytest.raises(zoo.internal.NonFiniteWeightsError, match=said):
        engine.load_adapter("bad", bad)
    assert engine.load_adapter("sql", sql) == 0  # the one slot still free
    with pytest.raises(zoo.internal.NonFiniteWeightsError, match=said):
        Engine(base, slots=1, max_len=64, adapters={"bad": bad}, max_lora_rank=8)


# --- zoo serve --adapter, through the openai client ----------------------------------------


@pytest.fixture(scope="module")
def server(served, adapters):
    flags = ["--slots", 4, "--max-len", 64, "--max-adapters", 3, "--max-lora-rank", 8]
    for name in ("sql", "poet"):
        flags += ["--adapter", f"{name}={adapters[name][0]}"]
    running = serving.InProcessServe(served[0], *flags)
    yield running
    running.stop()


def _text(served, model, prompt, max_tokens):
    ids = alone(model, Request(token_ids(served, prompt), max_tokens=max_tokens))
    return served[3].decode(ids[: ids.index(5)] if 5 in ids else ids)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_openai_client_names_an_adapter_in_model(served, adapters, server):
    import openai

    client = server.client()
    cards = {m.id: m for m in client.models.list()}
    assert list(cards) == ["tiny", "sql", "poet"]
    assert cards["sql"].parent == "tiny" and cards["sql"].root == str(adapters["sql"][0])
    prompts = ["w1 w2 w3", "w40 w7 w9", "w3 w3"]
    jobs = [(m, p) for p in prompts for m in ("tiny", "sql", "poet")]
    texts = {}

    def ask(model, prompt):  # concurrent clients: the batch mixes adapters
        out = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
        texts[model, prompt] = (out.model, out.choices[0].text)

    threads = [threading.Thread(target=ask, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    models = {"tiny": served[2], "sql": adapters["sql"][1], "poet": adapters["poet"][1]}
    for model, prompt in jobs:
        assert texts[model, prompt] == (model, _text(served, models[model], prompt, 12)), (model, prompt)
    assert len({texts[m, prompts[0]][1] for m in models}) == 3  # three models, three answers
    chat = client.chat.completions.create(model="poet", messages=[{"role": "user", "content": "w5"}], max_tokens=8,
                                          temperature=0)  # fmt: skip
    assert chat.choices[0].message.content == _text(served, models["poet"], "user w5 . assistant ", 8)
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nobody", prompt="w1", max_tokens=2)
    assert e.value.status_code == 404 and e.value.body["code"] == "model_not_found"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_load_and_unload_over_http_while_a_stream_runs(served, adapters, server, tmp_path):
    """vLLM's endpoints: an adapter loaded while another's stream is read answers at once;
    the streamed adapter, unloaded before its stream is read to the end, gives it whole (the
    engine-level test above holds a request running across the unload); the errors' codes."""
    client = server.client()
    chunks = client.completions.create(model="sql", prompt="w1 w2", max_tokens=40, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})  # fmt: skip
    stream = iter(chunks)
    first = next(stream).choices[0].text
    status, _, answer = _http_text(server.base, "/v1/load_lora_adapter",
                                   {"lora_name": "chef", "lora_path": str(adapters["chef"][0])})  # fmt: skip
    assert status == 200 and answer == "Success: LoRA adapter 'chef' added successfully."
    out = client.completions.create(model="chef", prompt="w4 w5", max_tokens=10, temperature=0)
    assert out.choices[0].text == _text(served, adapters["chef"][1], "w4 w5", 10)
    status, _, answer = _http_text(server.base, "/v1/unload_lora_adapter", {"lora_name": "sql"})
    assert status == 200 and answer.startswith("Success: LoRA adapter 'sql' removed successfully.")
    text = first + "".join(c.choices[0].text for c in stream)
    want = served[3].decode(alone(adapters["sql"][1], Request(token_ids(served, "w1 w2"), max_tokens=40)))
    assert text == want  # the unloaded adapter's stream ran to its end
    assert [m.id for m in client.models.list()] == ["tiny", "poet", "chef"]
    status, _, answer = http_json(server.base, "POST", "/v1/completions", {"model": "sql", "prompt": "w1"})
    assert status == 404 and answer["error"]["code"] == "model_not_found"
    for _ in range(100):  # bounded: the drained slot frees once the stream's request ends
        if http_json(server.base, "GET", "/health")[2]["active"] == 0:
            break
        time.sleep(0.05)
    # Errors: a full set of slots (409), a rank above the max, a bad folder, a name taken, an unknown name.
    (tmp_path / "adapter_config.json").write_text("{}")
    cases = [
        ({"lora_name": "again", "lora_path": str(adapters["sql"][0])}, 200, None),
        ({"lora_name": "more", "lora_path": str(adapters["sql"][0])}, 409, "all 3 adapter slots are taken"),
        ({"lora_name": "big", "lora_path": str(adapters["wide"][0])}, None, None),
        ({"lora_name": "bad", "lora_path": str(tmp_path)}, 400, f"adapter {tmp_path}:"),
        ({"lora_name": "none", "lora_path": str(tmp_path / "missing")}, 400, "no adapter_config.json there"),
        ({"lora_name": "poet", "lora_path": str(adapters["sql"][0])}, 400, "'poet' is already served"),
    ]
    for body, code, message in cases:
        if code is None:  # unload one first, so the rank is what refuses it
            assert _http_text(server.base, "/v1/unload_lora_adapter", {"lora_name": "again"})[0] == 200
            status, _, answer = http_json(server.base, "POST", "/v1/load_lora_adapter", body)
            assert status == 400 and "rank 16" in answer["error"]["message"]
            assert "--max-lora-rank" in answer["error"]["message"]
            continue
        status, _, answer = _http_text(server.base, "/v1/load_lora_adapter", body)
        assert status == code, (body, answer)
        if message is not None:
            assert message in json.loads(answer)["error"]["message"], answer
    status, _, answer = http_json(server.base, "POST", "/v1/unload_lora_adapter", {"lora_name": "nobody"})
    assert status == 404 and "cannot be found" in answer["error"]["message"]
    assert http_json(server.base, "GET", "/health")[2]["status"] == "ok"


def _http_text(base, path, body):
    """`(status, headers, text)` of a POST whose answer may be plain text (vLLM's success)."""
    status, headers, data = http_request(base, "POST", path, body)
    return status, headers, data.decode()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--adapter", "x=/nonexistent"], "--adapter: /nonexistent: no adapter_config.json there"),
        (["--adapter", "tiny=/nonexistent"], "the base model is served as 'tiny'"),
        (["--max-lora-rank", 0], "--max-lora-rank must be >= 1, got 0"),
        (["--lora-targets", "q_proj++v_proj"], "--lora-targets 'q_proj++v_proj': give Linear names joined by '+'"),
        (
            ["--lora-targets", "q_proj+v_proj", "--adapter", "poet"],
            "targets 'layers.layers.attention.k_proj', where the server holds no adapter room",
        ),  # fmt: skip
    ],
)
@pytest.mark.timeout(120)
def test_cli_adapter_errors_are_one_line(served, adapters, extra, message):
    from helpers import one_line_error, zoo_main

    extra = [str(adapters["poet"][0]) if e == "poet" else e for e in extra]  # the folder peft wrote
    rc, _, err = zoo_main("serve", served[0], "--name", "tiny", *extra)
    one_line_error(rc, err, message)


@pytest.mark.timeout(120)
def test_cli_lora_targets_reach_the_engine(served, adapters, monkeypatch):
    """`--lora-targets q_proj+v_proj`: the engine holds adapter room on those layers only
    (and serves an adapter on them); the server itself is not started, nor the engine
    warmed up (what warm_up compiles: test_serve.py's warm_up test, and every server the
    tests start through the CLI)."""
    from helpers import zoo_main

    import zoo.serve

    engines = []

    def no_server(server, **_):
        engines.append(server.engine)

    monkeypatch.setattr(zoo.serve, "serve", no_server)
    monkeypatch.setattr(zoo.serve.Engine, "warm_up", lambda self, *a, **k: None)
    rc, _, err = zoo_main("serve", served[0], "--lora-targets", "q_proj+v_proj", "--max-lora-rank", "8",
                          "--adapter", f"sql={adapters['sql'][0]}")  # fmt: skip
    assert rc == 0, err
    (engine,) = engines
    assert sorted(engine.bank.layers) == ["layers.layers.attention.q_proj", "layers.layers.attention.v_proj"]
    assert engine.adapters == ["sql"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_finetune_run_as_source_serves_its_adapter_by_the_run_name(served, tmp_path, monkeypatch):
    """`zoo serve RUN` (a `zoo finetune` LoRA run folder): the base under its folder's name,
    the run's adapter beside it under the run's name, answering as zoo.generate does with
    the adapter read by `zoo.lora.load_adapter`."""
    from helpers import zoo_main, zoo_ok

    import zoo.serve

    rows = [{"text": " ".join(f"w{(7 * i + 3 * j) % 50 + 6}" for j in range(10))} for i in range(24)]
    data = tmp_path / "text.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "myrun"
    zoo_ok("finetune", "transformer", "--init", served[0], "--data", data, "--lora", "r=4,alpha=8", "--lr", "1e-1",
           "--devices", "2", "--batch-size", "4", "--microbatches", "1", "--seq-len", "16", "--steps", "3", "--quiet", "--output", run)  # fmt: skip
    servers = []
    monkeypatch.setattr(zoo.serve, "serve", lambda server, **_: servers.append(server))
    monkeypatch.setattr(zoo.serve.Engine, "warm_up", lambda self, *a, **k: None)  # it compiles what it serves
    rc, _, err = zoo_main("serve", run, "--max-len", 64, "--max-lora-rank", 8)
    assert rc == 0, err
    (server,) = servers
    assert server.model_name == served[0].resolve().name and server.engine.adapters == ["myrun"]
    tuned = zoo.lora.load_adapter(served[2], run / "adapter")[0]
    prompt = token_ids(served, "w1 w2 w3")
    got = {}
    for model in ("myrun", None):
        handle = server.engine.submit(Request(prompt, max_tokens=10, adapter=model))
        server.engine.run_until_done()
        got[model] = handle.ids
    assert got["myrun"] == alone(tuned, Request(prompt, max_tokens=10))
    assert got[None] == alone(served[2], Request(prompt, max_tokens=10))
    assert got["myrun"] != got[None]  # the adapter changed the answer

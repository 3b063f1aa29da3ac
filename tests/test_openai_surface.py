"""The OpenAI surface does what it says and refuses the rest.

An in-process server (a tiny random decoder on UTF-8 bytes, uvicorn in a thread on a free
port of 127.0.0.1) answers: chat `logprobs` / `top_logprobs` (checked against the model's
own full forward pass, through the official `openai` client), content parts of type text;
400 with OpenAI's error body naming the field for what it does not implement (`tools`,
`response_format` other than text, `suffix`, ...), for bad roles and missing content, and
for a request larger than its queue can ever hold (not 429); `--host` / `--port` checked
before anything loads; after SIGTERM, 503 with Retry-After while the requests in flight
finish.
"""

import signal
import socket
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import one_line_error, tiny_decoder, zoo_main
from serving import ServerThread, http_json

import zoo
import zoo.serve

MAX_LEN = 64
MAX_QUEUE = 4
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


class _Running(ServerThread):
    """A `zoo.serve.Server` over `engine` with the test's chat template, in a thread."""

    def __init__(self, engine):
        super().__init__(
            zoo.serve.Server(engine, model_name="tiny", chat_template=zoo.data.ChatTemplate(CHAT_TEMPLATE))
        )

    def post(self, path: str, body: dict) -> tuple[int, dict, dict]:
        return http_json(self.base, "POST", path, body)


@pytest.fixture(scope="module")
def model():
    return tiny_decoder(jax.random.key(0), vocab_size=256, max_len=MAX_LEN)


@pytest.fixture(scope="module")
def running(model):
    running = _Running(zoo.serve.Engine(model, slots=2, max_len=MAX_LEN, max_queue=MAX_QUEUE))
    yield running
    running.stop()


def _error(running, path, body, status=400):
    got, headers, answer = running.post(path, body)
    assert got == status, answer
    assert set(answer["error"]) == {"message", "type", "param", "code"}, answer
    return answer["error"], headers


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 2}


@pytest.mark.parametrize(
    ("base", "field", "value"),
    [
        (CHAT, "tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
        (CHAT, "tool_choice", "auto"),
        (CHAT, "functions", [{"name": "f"}]),
        (CHAT, "response_format", {"type": "json_object"}),
        (CHAT, "modalities", ["text", "audio"]),
        (COMPLETION, "suffix", " end"),
        (COMPLETION, "best_of", 3),
    ],
)
def test_what_it_does_not_implement_is_refused_naming_the_field(running, base, field, value):
    path = "/v1/chat/completions" if "messages" in base else "/v1/completions"
    error, _ = _error(running, path, base | {field: value})
    assert error["param"] == field and error["code"] == "unsupported_parameter", error
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"{field}: this server does not implement"), error


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("response_format", {"type": "text"}),
        ("presence_penalty", 0),
        ("logit_bias", {}),
        ("tools", []),
        ("tool_choice", "none"),
        ("frequency_penalty", None),
    ],  # fmt: skip
)
def test_their_off_values_are_served(running, field, value):
    status, _, answer = running.post("/v1/chat/completions", CHAT | {field: value})
    assert status == 200, answer


def test_logit_bias_and_penalties_are_served_through_the_openai_client(running):
    """logit_bias +100 on a byte makes every greedy token that byte, -100 bans it; the
    penalties are taken (tests/test_steering.py holds their arithmetic)."""
    client = running.client()
    forced = client.completions.create(model="tiny", prompt="hi", max_tokens=3, temperature=0, logit_bias={"65": 100})
    assert forced.choices[0].text == "AAA"
    plain = client.completions.create(model="tiny", prompt="hi", max_tokens=3, temperature=0)
    first = plain.choices[0].text.encode()[0]
    banned = client.completions.create(model="tiny", prompt="hi", max_tokens=3, temperature=0,
                                       logit_bias={str(first): -100})  # fmt: skip
    assert banned.choices[0].text.encode()[0] != first
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          temperature=0, presence_penalty=1.5, frequency_penalty=-0.5)  # fmt: skip
    assert chat.choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("presence_penalty", 2.5, "presence_penalty must be in [-2, 2]"),
        ("frequency_penalty", -3, "frequency_penalty must be in [-2, 2]"),
        ("logit_bias", {"65": 101}, "logit_bias: the bias of token 65 must be a number in [-100, 100]"),
        ("logit_bias", {"256": 1}, "logit_bias: '256' is no token id of the model's vocabulary [0, 256)"),
        ("logit_bias", {"x": 1}, "logit_bias: 'x' is no token id"),
        ("logit_bias", [65], "logit_bias must be an object"),
    ],
)
def test_bias_and_penalties_out_of_range_are_400_naming_the_field(running, field, value, message):
    error, _ = _error(running, "/v1/completions", COMPLETION | {field: value})
    assert error["param"] == field and error["message"].startswith(message), error


@pytest.mark.parametrize(
    ("messages", "param", "message"),
    [
        ([{"role": "robot", "content": "hi"}], "messages[0].role", "messages[0].role must be one of"),
        ([{"role": "user", "content": None}], "messages[0].content", "messages[0] has no content"),
        ([{"role": "user"}], "messages[0].content", "messages[0] has no content"),
        ([{"role": "user", "content": 3}], "messages[0].content", "content of type int"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "messages[0].content",
            "only parts of type 'text'",
        ),  # fmt: skip
        (["hi"], "messages", "messages[0] must be an object"),
        (
            [{"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}],
            "messages[0].tool_calls",
            "does not implement tool calls",
        ),  # fmt: skip
    ],
)
def test_messages_are_checked(running, messages, param, message):
    error, _ = _error(running, "/v1/chat/completions", CHAT | {"messages": messages})
    assert error["param"] == param and message in error["message"], error


def test_text_content_parts_are_the_text_they_hold(running):
    client = running.client()
    whole = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "ab cd"}],
                                           max_tokens=6, temperature=0)  # fmt: skip
    parts = [{"type": "text", "text": "ab"}, {"type": "text", "text": " cd"}]
    split = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": parts}], max_tokens=6,
                                           temperature=0)  # fmt: skip
    assert split.choices[0].message.content == whole.choices[0].message.content
    assert split.usage.prompt_tokens == whole.usage.prompt_tokens == len("user: ab cd\nassistant:")


def test_chat_logprobs_are_the_models_own(running, model):
    client = running.client()
    rendered = "user: w\nassistant:"
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w"}], max_tokens=5,
                                         temperature=0, logprobs=True, top_logprobs=3)  # fmt: skip
    content = out.choices[0].logprobs.content
    ids = [int(e.bytes[0]) for e in content]
    assert len(ids) == 5 and all(len(e.bytes) == 1 for e in content)
    prompt = list(rendered.encode())
    full = np.asarray(jax.nn.log_softmax(model(jnp.asarray([prompt + ids])).astype(jnp.float32), axis=-1))[0]
    for j, entry in enumerate(content):
        row = full[len(prompt) - 1 + j]
        # float32 log-softmax of the same logits, summed in another order (test_serve's bound).
        np.testing.assert_allclose(entry.logprob, row[ids[j]], atol=1e-5, rtol=0)
        assert len(entry.top_logprobs) == 3
        top = np.argsort(-row)[:3]
        assert [t.bytes[0] for t in entry.top_logprobs] == top.tolist()  # greedy: the first is the token itself
        np.testing.assert_allclose([t.logprob for t in entry.top_logprobs], row[top], atol=1e-5, rtol=0)
    # Streamed: the same entries, one chunk each.
    chunks = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w"}], max_tokens=5,
                                            temperature=0, logprobs=True, top_logprobs=3, stream=True)  # fmt: skip
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == [(e.token, round(e.logprob, 5)) for e in content]
    # Without logprobs none are sent; top_logprobs alone is refused.
    plain = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w"}], max_tokens=2)
    assert plain.choices[0].logprobs is None
    error, _ = _error(running, "/v1/chat/completions", CHAT | {"top_logprobs": 2})
    assert error["param"] == "top_logprobs"


@pytest.mark.parametrize(("extra", "param"), [({"prompt": ["a"] * (MAX_QUEUE + 1)}, "prompt"), ({"n": 5}, "n")])
def test_a_request_larger_than_the_queue_gets_400_not_429(running, extra, param):
    error, headers = _error(running, "/v1/completions", COMPLETION | extra)
    assert error["param"] == param and "retry-after" not in headers, error
    assert f"more than this server's queue ever holds ({MAX_QUEUE}" in error["message"]
    status, _, _ = running.post("/v1/completions", COMPLETION | {"prompt": ["a"] * MAX_QUEUE})
    assert status == 200


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--port", "70000"], "--port 70000: a port is in [0, 65535]"),
        (["--port", "-1"], "--port -1: a port is in [0, 65535]"),
        (["--host", "no-such-host.invalid"], "--host 'no-such-host.invalid': not an address or name of this machine"),
    ],
)
def test_host_and_port_are_checked_before_anything_loads(flags, message):
    # SOURCE does not exist: the address is refused before it is looked for, let alone compiled.
    rc, out, err = zoo_main("serve", "no/such/model", *flags)
    one_line_error(rc, err, message)


def test_a_port_in_use_is_refused_before_anything_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        rc, _, err = zoo_main("serve", "no/such/model", "--port", port)
        one_line_error(rc, err, f"--host 127.0.0.1 --port {port}: cannot listen there")


def test_after_sigterm_new_requests_get_503_while_those_in_flight_finish(model):
    engine = zoo.serve.Engine(model, slots=1, max_len=MAX_LEN)
    # The engine pauses after its third step until the test lets it go: the request stays in flight.
    gate, steps, dispatch = threading.Event(), [], engine._dispatch
    engine._dispatch = lambda: (steps.append(1), len(steps) <= 3 or gate.wait(60), dispatch())[-1]
    running = _Running(engine)
    client = running.client()
    stream = client.completions.create(model="tiny", prompt="a", max_tokens=40, temperature=0, stream=True)
    for _ in range(600):  # until the engine waits at the gate, the request mid-way
        if len(steps) > 3:
            break
        time.sleep(0.1)
    running.uvicorn.handle_exit(signal.SIGTERM, None)  # as uvicorn's signal handler calls it
    error, headers = _error(running, "/v1/completions", COMPLETION, status=503)
    assert error["code"] == "server_shutting_down" and headers.get("retry-after") == "1", (error, headers)
    assert engine.active == 1 and running.thread.is_alive(), (engine.finished, len(steps))
    gate.set()
    rest = list(stream)
    assert rest[-1].choices[0].finish_reason == "length"
    running.thread.join(60)
    assert not running.thread.is_alive(), "the server did not stop once the request in flight finished"
    assert running.server.engine.finished.get("length") == 1

"""The tiny served model and the servers of the serving tests (test_serve.py,
test_serve_adapters.py, test_expert_lora.py): a random Llama saved by transformers with a
word-level tokenizer, `zoo.generate` alone as each request's reference, plain HTTP, and
`zoo serve` in a process of its own or in this one."""

import json

import jax
import numpy as np
import pytest
from helpers import noisy, save_word_tokenizer

import zoo
from zoo.serve import Request

WORDS = ["[PAD]", "[UNK]", "user", "assistant", "system", "."] + [f"w{i}" for i in range(58)]
VOCAB = len(WORDS)  # 64
EOS = 5  # "."
MAX_LEN = 64
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} . {% endfor %}"
    "{% if add_generation_prompt %}assistant {% endif %}"
)


def tiny_llama(folder):
    """`(folder, transformers model, zoo model, zoo.hf.Tokenizer)` of a tiny random Llama saved
    in `folder` by transformers, with a word-level tokenizer.json and a chat template."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=MAX_LEN, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=EOS, eos_token_id=EOS, pad_token_id=0,
    )  # fmt: skip
    hf = noisy(transformers.LlamaForCausalLM(config), 0.2)
    hf.save_pretrained(folder)
    save_word_tokenizer(WORDS, folder)
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": CHAT_TEMPLATE, "eos_token": ".", "pad_token": "[PAD]"})
    )
    return folder, hf, zoo.hf.from_pretrained(folder), zoo.hf.Tokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`tiny_llama` in a folder of its own, once per test module that takes it
    (`served = serving.served` there)."""
    return tiny_llama(tmp_path_factory.mktemp("llama"))


def alone(model, request: Request) -> list[int]:
    """zoo.generate's tokens for `request` by itself (greedy, or sampled with its seed)."""
    key = None if request.temperature == 0 else jax.random.key(request.seed)
    out = zoo.generate(
        model, np.asarray([request.prompt], np.int32), max_new_tokens=request.max_tokens,
        temperature=request.temperature, top_k=request.top_k, top_p=request.top_p, key=key,
    )  # fmt: skip
    return np.asarray(out)[0, len(request.prompt) :].tolist()


def token_ids(served, text):
    """The ids the served tokenizer (`tiny_llama`'s fourth item) gives `text`."""
    return served[3].tokenizer.encode(text).ids


def http_request(base, method, path, body=None) -> tuple[int, dict, bytes]:
    """`(status, headers, body bytes)` of one plain HTTP request to the server at `base` (its
    `.../v1` URL; `path` from the root, e.g. `/health`); `body` bytes or JSON-able. Header
    names in lower case (HTTP's are case-insensitive)."""
    import http.client
    from urllib.parse import urlparse

    url = urlparse(base)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    connection.request(method, url.path.removesuffix("/v1") + path, body=data)
    response = connection.getresponse()
    result = response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    connection.close()
    return result


def http_json(base, method, path, body=None):
    """`http_request` of an answer in JSON: `(status, headers, the parsed body)`."""
    status, headers, data = http_request(base, method, path, body)
    return status, headers, json.loads(data)


class ServeProcess:
    """`zoo serve` in a process of its own, on a free port of 127.0.0.1."""

    def __init__(self, folder, *flags):
        import subprocess
        import sys
        from pathlib import Path

        from helpers import short_run_env

        root = Path(__file__).resolve().parents[1]
        # The tests' fast-compile flags: what is served is the same, its programs compile in
        # half the time (the process is the server, not its code's speed).
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "zoo", "serve", str(folder), "--port", "0", "--name", "tiny", *map(str, flags)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=root, env=short_run_env(),
        )  # fmt: skip
        self.line = self.proc.stdout.readline()  # "zoo serve: http://127.0.0.1:PORT/v1  model tiny  ready"
        if "ready" not in self.line:
            self.proc.kill()
            raise AssertionError(f"zoo serve did not start: {self.line}{self.proc.stderr.read()}")
        self.base = self.line.split()[2]  # http://127.0.0.1:PORT/v1

    def client(self):
        import openai

        return openai.OpenAI(base_url=self.base, api_key="none", max_retries=0, timeout=60)

    def stop(self) -> int:
        import signal

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)


class ServerThread:
    """A `zoo.serve.Server` served by uvicorn in a thread of this process, as
    `zoo.serve.serve` serves it in its own (a free port of 127.0.0.1 unless `host` and
    `port` say otherwise), until `stop`; `base` is its `.../v1` URL."""

    def __init__(self, server, *, host="127.0.0.1", port=0):
        import threading

        import uvicorn

        from zoo.serve._http import _Uvicorn

        self.server = server
        ready = threading.Event()

        def announce(host, port):
            self.base = f"http://{host}:{port}/v1"
            ready.set()

        config = uvicorn.Config(server.app, host=host, port=port, log_level="warning", lifespan="on")
        self.uvicorn = _Uvicorn(config, announce, server)
        self.thread = threading.Thread(target=self.uvicorn.run, daemon=True)
        self.thread.start()
        assert ready.wait(120), "the server did not start"

    client = ServeProcess.client

    def stop(self) -> None:
        """SIGTERM, as uvicorn's signal handler hands it on; the thread ends once the
        requests in flight have finished."""
        import signal

        self.uvicorn.handle_exit(signal.SIGTERM, None)
        self.thread.join(60)
        assert not self.thread.is_alive(), "the server did not stop"


class InProcessServe(ServerThread):
    """`zoo serve FOLDER --port 0 --name tiny FLAGS` in this process: the CLI's own entry
    (`helpers.zoo_main`) builds the server from the flags (the model, tokenizer and chat
    template read, the engine made and warmed up), then a `ServerThread` serves it where
    the flags say. What only a process shows (its "ready" line, SIGTERM draining, exit
    code 0) is test_full_queue_gets_429_and_sigterm_finishes_requests_in_flight's, with
    `ServeProcess`."""

    def __init__(self, folder, *flags):
        from helpers import zoo_main

        import zoo.serve

        built = []
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(zoo.serve, "serve", lambda server, **address: built.append((server, address)))
            rc, _, err = zoo_main("serve", folder, "--port", 0, "--name", "tiny", *flags)
        assert rc == 0, err
        ((server, address),) = built
        super().__init__(server, **address)

    def stop(self) -> None:
        super().stop()
        assert self.server.engine.error is None

"""The OpenAI HTTP API (the subset clients use) over an `Engine`, on Starlette + uvicorn.

`GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions`, `GET /health`, and
vLLM's `POST /v1/load_lora_adapter` / `POST /v1/unload_lora_adapter`. A request's `model`
names the base or an adapter the engine serves (unknown: 404 `model_not_found`, as OpenAI).
Streaming is server-sent events as OpenAI sends them, ending with `data: [DONE]`. Bad
input gets HTTP 400 with OpenAI's error body (`{"error": {"message", "type", "param",
"code"}}`); a full queue 429 and a stopping server 503, both with `Retry-After`. The
engine steps in its own thread; each request waits on its handles through the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import signal
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

from ._engine import AdapterSlotsFull, Engine, QueueFull
from ._openai import (
    BadRequest,
    Detokenizer,
    Message,
    Sampling,
    Text,
    number_field,
    prompt_ids,
    refuse_unsupported,
)
from ._programs import TOP_LOGPROBS
from ._requests import Handle, Token

try:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request as HTTPRequest
    from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.routing import Route
except ImportError as e:  # pragma: no cover - the message is the test
    raise ImportError(
        f"zoo serve needs Starlette and uvicorn ({e.name} is missing); install them with pip install 'eqx-zoo[serve]'"
    ) from e


def _error(message: str, status: int, *, kind: str = "invalid_request_error", param=None, code=None, headers=None):
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


class Server:
    """The OpenAI API over `engine`.

    **Arguments:**

    - `engine`: the `Engine` (the server starts its thread on startup, stops it on
      shutdown once the requests in flight are done).
    - `model_name`: the name `/v1/models` lists and requests' `model` must give.
    - `tokenizer`: a `zoo.hf.Tokenizer` (None: UTF-8 bytes).
    - `chat_template`: a `zoo.data.ChatTemplate` for `/v1/chat/completions` (None: the
      endpoint answers 400).
    - `eos_id`: the id that ends a completion (finish reason `"stop"`).
    - `adapter_paths`: name → folder of the engine's adapters (`/v1/models`' `root`).

    With adapter slots (`Engine(max_adapters=...)`), `POST /v1/load_lora_adapter`
    `{"lora_name", "lora_path"}` reads a peft folder (or a zoo run folder) onto the base and
    serves it in a free slot; `POST /v1/unload_lora_adapter` `{"lora_name"}` stops serving
    it (requests already using it finish first). Neither compiles anything.

    `app` is the Starlette application (any ASGI server runs it); `serve` runs it with
    uvicorn.
    """

    def __init__(
        self, engine: Engine, *, model_name: str, tokenizer=None, chat_template=None, eos_id=None, adapter_paths=None
    ):
        self.engine, self.model_name, self.text = engine, model_name, Text(tokenizer)
        self.adapter_paths = dict(adapter_paths or {})
        self.chat_template, self.eos_id = chat_template, eos_id
        self.created = int(time.time())
        # Set by the first SIGTERM / SIGINT (`serve`): new requests get 503 while those in
        # flight finish; the server then stops.
        self.draining = False
        self.app = Starlette(
            routes=[
                Route("/health", self.health, methods=["GET"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/load_lora_adapter", self.load_lora_adapter, methods=["POST"]),
                Route("/v1/unload_lora_adapter", self.unload_lora_adapter, methods=["POST"]),
            ],
            lifespan=self._lifespan,
        )

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        self.engine.start()
        try:
            yield
        finally:  # after uvicorn let the requests in flight finish
            await asyncio.to_thread(self.engine.stop)

    # -- endpoints ------------------------------------------------------------------------

    async def health(self, request: HTTPRequest):
        if self.engine.error is not None:
            return _error(f"the engine stopped: {self.engine.error!r}", 503, kind="server_error")
        engine = self.engine
        return JSONResponse(
            {"status": "ok", "active": engine.active, "waiting": engine.waiting, "finished": dict(engine.finished)}
        )

    async def models(self, request: HTTPRequest):
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "zoo"}
        cards = [card] + [
            card | {"id": name, "root": self.adapter_paths.get(name, name), "parent": self.model_name}
            for name in self.engine.adapters
        ]
        return JSONResponse({"object": "list", "data": cards})

    async def load_lora_adapter(self, request: HTTPRequest):
        """vLLM's: `{"lora_name", "lora_path"}` → served as `lora_name` (200, plain text)."""
        try:
            body = await self._json(request)
            name, path = body.get("lora_name"), body.get("lora_path")
            if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
                raise BadRequest("give lora_name and lora_path, both non-empty strings", "lora_name")
            if name == self.model_name or name in self.engine.adapters:
                raise BadRequest(
                    f"the model {name!r} is already served; unload it first, or pick another name", "lora_name"
                )
            if self.engine.bank is None:
                raise BadRequest("this server holds no adapter slots; restart it with --max-adapters N", "lora_name")
            try:  # reading the folder takes a while: the event loop and the engine go on meanwhile
                await asyncio.to_thread(self.engine.load_adapter, name, Path(path))
            except AdapterSlotsFull as e:
                raise BadRequest(str(e), "lora_name", "adapter_slots_full", 409) from None
            except ValueError as e:
                raise BadRequest(str(e), "lora_path") from None
        except BadRequest as e:
            return _error(str(e), e.status, param=e.param, code=e.code)
        self.adapter_paths[name] = path
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(self, request: HTTPRequest):
        """vLLM's: `{"lora_name"}` → no longer served (its requests in flight finish first)."""
        try:
            body = await self._json(request)
            name = body.get("lora_name")
            try:
                left = self.engine.unload_adapter(name)
            except LookupError:
                raise BadRequest(
                    f"the LoRA adapter {name!r} cannot be found; the adapters are {self.engine.adapters}",
                    "lora_name",
                    "model_not_found",
                    404,
                ) from None
        except BadRequest as e:
            return _error(str(e), e.status, param=e.param, code=e.code)
        self.adapter_paths.pop(name, None)
        after = f" (its slot is freed once the {left} requests using it finish)" if left else ""
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.{after}")

    async def completions(self, request: HTTPRequest):
        return await self._answer(request, chat=False)

    async def chat(self, request: HTTPRequest):
        return await self._answer(request, chat=True)

    # -- the work -------------------------------------------------------------------------

    async def _answer(self, request: HTTPRequest, *, chat: bool):
        try:
            if self.draining:
                raise BadRequest(
                    "the server is shutting down and takes no new requests; retry on another server",
                    None,
                    "server_shutting_down",
                    503,
                )
            body = await self._body(request)
            plan = self._chat_plan(body) if chat else self._completion_plan(body)
            handles = self._submit(plan)
        except BadRequest as e:
            headers = {"Retry-After": "1"} if e.status in (429, 503) else None
            kind = "invalid_request_error" if e.status in (400, 404) else "server_error"
            return _error(str(e), e.status, kind=kind, param=e.param, code=e.code, headers=headers)
        if plan["sampling"].stream:
            stream = self._stream(plan, handles, chat)
            return StreamingResponse(stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            return JSONResponse(await self._whole(plan, handles, chat))
        finally:
            for _, handle, _ in handles:
                handle.cancel()  # a no-op once it finished; frees the slot when the client left

    async def _json(self, request: HTTPRequest) -> dict:
        try:
            body = json.loads(await request.body())
        except ValueError as e:
            raise BadRequest(f"the request body is not valid JSON ({e})") from None
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        return body

    async def _body(self, request: HTTPRequest) -> dict:
        body = await self._json(request)
        model = body.get("model")
        if model != self.model_name and model not in self.engine.adapters:
            served = [self.model_name, *self.engine.adapters]
            raise BadRequest(
                f"the model {model!r} does not exist; this server serves {served} (GET /v1/models)",
                "model",
                "model_not_found",
                404,
            )
        return body

    def _completion_plan(self, body: dict) -> dict:
        refuse_unsupported(body)
        sampling = Sampling(body, self.engine.vocab)
        prompts = prompt_ids(body, self.text)
        echo = body.get("echo", False)
        if not isinstance(echo, bool):
            raise BadRequest(f"echo must be true or false, got {echo!r}", "echo")
        logprobs = number_field(body, "logprobs", None, int, 0, 5)
        max_tokens = 16 if sampling.max_tokens is None else sampling.max_tokens
        if max_tokens == 0 and not echo:
            raise BadRequest("max_tokens must be >= 1 (0 only with echo: the prompt's log-probabilities)", "max_tokens")
        return {
            "sampling": sampling,
            "prompts": prompts,
            "echo": echo,
            "logprobs": logprobs,
            "max_tokens": max_tokens,
            "adapter": self._adapter(body),
            "model": body["model"],
        }

    def _chat_plan(self, body: dict) -> dict:
        if self.chat_template is None:
            raise BadRequest("this model has no chat template; use /v1/completions", "messages")
        refuse_unsupported(body)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list of {role, content} objects", "messages")
        messages = [Message.read(m, i) for i, m in enumerate(messages)]
        sampling = Sampling(body, self.engine.vocab)
        if body.get("max_completion_tokens") is not None:
            sampling.max_tokens = number_field(body, "max_completion_tokens", None, int, 1)
        logprobs = body.get("logprobs", False)
        if not isinstance(logprobs, bool | None):
            raise BadRequest(f"logprobs must be true or false, got {logprobs!r}", "logprobs")
        top = number_field(body, "top_logprobs", None, int, 0, TOP_LOGPROBS)
        if top is not None and not logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
        try:
            rendered = self.chat_template.render([dataclasses.asdict(m) for m in messages], add_generation_prompt=True)
        except Exception as e:  # a template's raise_exception, a missing field
            raise BadRequest(f"the chat template cannot render these messages: {e}", "messages") from None
        prompt = self.text.encode(rendered, special_tokens=False)
        max_tokens = self.engine.max_len - len(prompt) if sampling.max_tokens is None else sampling.max_tokens
        if max_tokens < 1:
            raise BadRequest("max_tokens must be >= 1", "max_tokens")
        return {
            "sampling": sampling,
            "prompts": [prompt],
            "echo": False,
            "max_tokens": max_tokens,
            "logprobs": (top or 0) if logprobs else None,
            "adapter": self._adapter(body),
            "model": body["model"],
        }

    def _adapter(self, body: dict) -> str | None:
        return None if body["model"] == self.model_name else body["model"]

    def _submit(self, plan: dict) -> list[tuple[int, Handle, asyncio.Queue]]:
        """Each (prompt, choice) submitted: `[(prompt index, handle, its token queue)]`."""
        loop = asyncio.get_running_loop()
        sampling = plan["sampling"]
        stop_ids = () if self.eos_id is None or sampling.ignore_eos else (self.eos_id,)
        want_prompt = plan["echo"] and plan["logprobs"] is not None
        requests = [
            (
                i,
                sampling.request(
                    p, j, max(plan["max_tokens"], 1), stop_ids, want_prompt, bool(plan["logprobs"]), plan["adapter"]
                ),
            )
            for i, p in enumerate(plan["prompts"])
            for j in range(sampling.n)
        ]
        room = self.engine.max_queue
        if room is not None and len(requests) > room:  # never fits, however long the client waits: no 429
            param = "n" if sampling.n > 1 else "prompt"
            raise BadRequest(
                f"this request asks for {len(requests)} completions ({len(plan['prompts'])} prompts x n={sampling.n}), "
                f"more than this server's queue ever holds ({room}, zoo serve --max-queue); send at most {room} "
                "per request",
                param,
            )
        for _, r in requests:
            try:
                self.engine.check(r)
            except LookupError as e:  # unloaded since the model was read
                raise BadRequest(str(e), "model", "model_not_found", 404) from None
            except ValueError as e:
                raise BadRequest(str(e), "prompt") from None
        handles = []
        try:
            # Queued as one group (the engine's lock held): a prompt's `n` choices wait side by
            # side and are prefilled once (`Engine(share_prompts=True)`).
            with self.engine.holding():
                for i, r in requests:
                    queue: asyncio.Queue = asyncio.Queue()
                    handle = self.engine.submit(
                        r, on_update=lambda t, q=queue: loop.call_soon_threadsafe(q.put_nowait, t)
                    )
                    handles.append((i, handle, queue))
        except (QueueFull, LookupError) as e:
            for _, handle, _ in handles:
                handle.cancel()
            if isinstance(e, LookupError):
                raise BadRequest(str(e), "model", "model_not_found", 404) from None
            stopping = "stopping" in str(e)
            code, status = ("server_shutting_down", 503) if stopping else ("queue_full", 429)
            raise BadRequest(str(e), None, code, status) from None
        return handles

    def _logprobs(self, tokens: list[Token], top: int, offset: int) -> dict:
        pieces = [self.text.piece(t.id) for t in tokens]
        offsets, at = [], offset
        for p in pieces:
            offsets.append(at)
            at += len(p)
        return {
            "tokens": pieces,
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [{self.text.piece(i): v for i, v in t.top[:top]} for t in tokens],
            "text_offset": offsets,
        }

    def _chat_logprob(self, token: Token, top: int) -> dict:
        """One token's entry of a chat choice's `logprobs.content`, as OpenAI writes it."""

        def entry(ident: int, value: float) -> dict:
            return {"token": self.text.decode([ident]), "logprob": value, "bytes": self.text.token_bytes(ident)}

        return entry(token.id, token.logprob) | {"top_logprobs": [entry(i, v) for i, v in token.top[:top]]}

    def _prompt_part(self, prompt: list[int], handle: Handle, top: int) -> tuple[str, dict | None]:
        text = self.text.decode(prompt)
        if top is None or handle.prompt_logprobs is None:
            return text, None
        tokens = [Token(t, lp, tp) for t, lp, tp in zip(prompt, handle.prompt_logprobs, handle.prompt_top)]
        part = self._logprobs(tokens, top, 0)
        part["token_logprobs"][0], part["top_logprobs"][0] = None, None
        return text, part

    async def _collect(self, handle: Handle, queue: asyncio.Queue, detok: Detokenizer, keep: bool):
        """The handle's tokens until it finishes or a stop string: `(text, tokens, count,
        reason)`; the eos token is counted and has its log-probability (as vLLM's; a
        harness reading `echo` + `max_tokens=1` drops the last entry), not its text."""
        text, tokens, count = "", [], 0
        while True:
            token = await queue.get()
            if token is None:
                break
            count += 1
            if not keep:
                continue
            tokens.append(token)
            if token.id in handle.request.stop_ids:
                continue
            text += detok.add(token.id)
            if detok.stopped:
                handle.cancel()
                break
        text += detok.finish()
        reason = "stop" if detok.stopped or handle.finish_reason == "stop" else "length"
        if handle.finish_reason == "error":
            raise RuntimeError(f"the engine failed: {self.engine.error!r}")
        return text, tokens, count if keep else 0, reason

    async def _whole(self, plan: dict, handles, chat: bool) -> dict:
        sampling, echo, top = plan["sampling"], plan["echo"], plan["logprobs"]
        keep = plan["max_tokens"] > 0
        results = await asyncio.gather(
            *(self._collect(h, q, Detokenizer(self.text, sampling.stops), keep) for _, h, q in handles)
        )
        choices = []
        completion_tokens = 0
        for index, ((i, handle, _), (text, tokens, count, reason)) in enumerate(zip(handles, results)):
            completion_tokens += count
            if chat:
                message = {"role": "assistant", "content": text}
                shown = [t for t in tokens if t.id not in handle.request.stop_ids]
                logprobs = None if top is None else {"content": [self._chat_logprob(t, top) for t in shown]}
                choices.append({"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason})
                continue
            logprobs = None
            prefix = ""
            if echo:
                prefix, prompt_part = self._prompt_part(plan["prompts"][i], handle, top)
                if top is not None:
                    logprobs = prompt_part
            if top is not None:
                own = self._logprobs(tokens, top, len(prefix))
                logprobs = own if logprobs is None else {k: logprobs[k] + own[k] for k in own}
            choices.append({"index": index, "text": prefix + text, "logprobs": logprobs, "finish_reason": reason})
        prompt_tokens = sum(len(p) for p in plan["prompts"])
        return {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": plan["model"],
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }

    async def _stream(self, plan: dict, handles, chat: bool) -> AsyncIterator[str]:
        """Server-sent events: a chunk per piece of text of any choice, a last chunk per
        choice with its finish reason, usage when asked, then `[DONE]`."""
        sampling, top = plan["sampling"], plan["logprobs"]
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices, usage=None):
            body = {"id": ident, "object": kind, "created": created, "model": plan["model"], "choices": choices}
            if usage is not None:
                body["usage"] = usage
            return f"data: {json.dumps(body)}\n\n"

        def choice(index, text, reason=None, logprobs=None):
            if chat:
                out = {"index": index, "delta": {"content": text} if text else {}, "finish_reason": reason}
                return out | ({"logprobs": logprobs} if logprobs is not None else {})
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}

        merged: asyncio.Queue = asyncio.Queue()

        async def pump(index, handle, queue):
            while True:
                token = await queue.get()
                await merged.put((index, token))
                if token is None:
                    return

        tasks = [asyncio.create_task(pump(k, h, q)) for k, (_, h, q) in enumerate(handles)]
        detoks = [Detokenizer(self.text, sampling.stops) for _ in handles]
        counts = [0] * len(handles)
        try:
            if chat:
                yield chunk(
                    [
                        {"index": k, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                        for k in range(len(handles))
                    ]
                )
            elif plan["echo"]:
                for k, (i, _, _) in enumerate(handles):
                    yield chunk([choice(k, self.text.decode(plan["prompts"][i]))])
            open_ = len(handles)
            while open_:
                k, token = await merged.get()
                handle, detok = handles[k][1], detoks[k]
                if token is None or detok.stopped:
                    if token is None:
                        open_ -= 1
                        if handle.finish_reason == "error":
                            raise RuntimeError(f"the engine failed: {self.engine.error!r}")
                        reason = "stop" if detok.stopped or handle.finish_reason == "stop" else "length"
                        rest = detok.finish()
                        yield chunk([choice(k, rest, reason)])
                    continue
                counts[k] += 1
                if token.id in handle.request.stop_ids:
                    continue  # the eos: counted, not shown
                piece = detok.add(token.id)
                if detok.stopped:
                    handle.cancel()
                if piece or top is not None:
                    if top is None:
                        logprobs = None
                    elif chat:
                        logprobs = {"content": [self._chat_logprob(token, top)]}
                    else:
                        logprobs = self._logprobs([token], top, 0)
                    yield chunk([choice(k, piece, None, logprobs)])
            if sampling.include_usage:
                prompt_tokens = sum(len(p) for p in plan["prompts"])
                usage = {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": sum(counts),
                    "total_tokens": prompt_tokens + sum(counts),
                }
                yield chunk([], usage)
            yield "data: [DONE]\n\n"
        finally:  # the client left, or the stream ended: free the slots
            for _, handle, _ in handles:
                handle.cancel()
            for task in tasks:
                task.cancel()


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, saying where it listens and "ready" once it does. The first
    SIGTERM / SIGINT drains: the app answers new requests 503 (`Server.draining`) while the
    engine finishes those in flight, then uvicorn shuts down; a second Ctrl-C forces it."""

    def __init__(self, config, announce, app: Server | None = None):
        super().__init__(config)
        self.announce, self.app = announce, app

    def handle_exit(self, sig, frame) -> None:
        if self.app is None or self.app.draining:
            return super().handle_exit(sig, frame)
        self.app.draining = True
        engine = self.app.engine

        def drain():
            while engine.error is None and (engine.active or engine.waiting):
                time.sleep(0.02)
            super(_Uvicorn, self).handle_exit(sig, frame)

        threading.Thread(target=drain, name="zoo-serve-drain", daemon=True).start()

    async def startup(self, sockets=None):
        await super().startup(sockets)
        if self.started:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            self.announce(host, port)


def check_address(host: str, port: int) -> None:
    """Raise `ValueError` (one line, the fix in it) unless `host:port` can be listened on:
    `port` in [0, 65535] (0: any free one), `host` an address of this machine, the port free."""
    import socket

    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"--port {port}: a port is in [0, 65535] (0: any free port)")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        raise ValueError(f"--host {host!r}: not an address or name of this machine ({e}); e.g. 127.0.0.1") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as e:
            raise ValueError(
                f"--host {host} --port {port}: cannot listen there ({e.strerror}); "
                "pick another --port (0: any free one)"
            ) from None


def serve(
    server: Server,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "warning",
    announce=None,
) -> None:
    """Run `server` with uvicorn until SIGINT / SIGTERM; then take no new connections,
    finish the requests in flight and return.

    **Arguments:** the `Server`, the address (`port` 0: any free port), uvicorn's
    `log_level`, and `announce(host, port)`: called once it listens (default: print the
    address, the model and "ready").
    """

    def default(h, p):
        adapters = server.engine.adapters
        more = f"  adapters {', '.join(adapters)}" if adapters else ""
        print(f"zoo serve: http://{h}:{p}/v1  model {server.model_name}{more}  ready", flush=True)

    config = uvicorn.Config(server.app, host=host, port=port, log_level=log_level, lifespan="on")
    # uvicorn raises the caught signal again once it has shut down; a handler of our own
    # turns that into a clean return (exit 0 after a graceful SIGTERM).
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        _Uvicorn(config, announce or default, server).run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    if server.engine.error is not None:
        print(f"zoo serve: the engine stopped: {server.engine.error!r}", file=sys.stderr)

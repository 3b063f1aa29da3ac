"""Continuous batching: a fixed set of slots over one key/value cache, one compiled decode
step for all of them, requests joining and leaving between steps.

Each slot holds one request. A new request is prefilled alone (its prompt padded on the
right to a bucket width, so few programs compile: `bucket`) and its cache row written into a
free slot; from the next step on, the shared decode step advances it with every other
active slot. A slot's columns start at 0 and its writes go to its own column (the cache's
per-row `index`); the attention mask of a row holds only its own columns, so no request
ever sees another's tokens. Sampling settings are per-slot arrays, so greedy and sampled
requests share the program. The model side (`prefill`, `decode_step`, the cache and the
sampling) is `zoo.generate`'s own.

A step costs what is in use: requests are kept in the lowest slots (one moves down when
another ends) and the decode step runs the next power of two of busy rows; its attention
reads only the columns the longest request has reached (`span`), from a cache kept in
blocks of 64 columns (`KVCache.blocks`) so those are read in place; a sliding layer whose
window is below `max_len` holds only a ring of `window` columns (`KVCache.rings`), read
whole. The background thread
queues step t+1 before it reads step t's tokens (each slot's next input token stays on the
device), so the host's bookkeeping overlaps the device's work.

Adapters: with `adapters` (or `max_adapters`), the engine holds a fixed number of adapter
slots beside the base (`_bank.AdapterBank`); each slot of the batch carries its request's
adapter, and the programs take a `[rows, adapters]` row scale as data, so one decode step
serves any mix of adapters and the bare base, and loading or unloading an adapter between
steps compiles nothing.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._finite import check_finite_once
from .._generate import split_layers
from .._jit import Flattened, Jit
from .._kernels import EIGEN, EIGEN_PREFILL_ROWS, eigen_matmuls, fastest_kernel, matmul_kernels
from .._sampling import check_sampling
from ..models._config import rope_scaling_of
from ..models._transformer import layer_settings
from ..nn._cache import KVCache, empty_cache
from ._bank import build_bank, read_adapter
from ._limits import check_prompt_ids, check_room, check_steering
from ._programs import (
    Steering,
    _decode_program,
    _move_program,
    _prefill_program,
    _share_program,
    bucket,
    row_bucket,
    span,
)
from ._requests import Handle, Request, Token, shares_prefill
from ._slots import SlotSettings, bias_row


class _Slot:
    """A slot's request while its tokens are being dispatched: `dispatched` counts the
    tokens whose computation has been queued (the prefill's first one included)."""

    def __init__(self, handle: Handle):
        self.handle, self.dispatched = handle, 1


class Engine:
    """Serves many requests at once with one decoder: continuous batching over `slots`.

    **Arguments:**

    - `model`: a `zoo.models.Transformer` (as `zoo.generate` takes it, on one device).
    - `slots`: how many requests decode together (the cache's batch).
    - `max_len`: the cache's columns: prompt + new tokens of one request (default the
      model's `max_len`; at most it).
    - `max_queue`: how many requests may wait for a slot; `submit` raises `QueueFull`
      beyond (None: no bound).
    - `adapters`: name → a model carrying one plain LoRA adapter over `model` (from
      `zoo.lora.add_lora` or `load_adapter`), or the folder of one (peft's, or a `zoo
      finetune` run); ranks and targets (expert weights too) may differ. Served beside the bare base; a request
      picks one by `Request.adapter`.
    - `max_adapters`: adapter slots held (default 4, or the number of
      `adapters`, when any; 0 without). `load_adapter` fills a free one while serving.
    - `max_lora_rank`: the largest rank a slot holds (default 16, or
      the largest of `adapters`).
    - `lora_targets`: the layers given adapter room (`LoraConfig.target_modules`; default
      `"all-linear"`: every `Linear` but the output head; `()`: none).
    - `lora_parameters`: a mixture of experts' expert weights given adapter room (peft's
      `target_parameters`, e.g. `["gate", "up", "down"]`; default: those the `adapters`
      given adapt, none without).
    - `share_prompts`: requests of the same prompt ids and adapter waiting one after
      another (an RL rollout's group, OpenAI's `n`) are prefilled once: the others copy
      that cache row and choose their first token from its logits with their own settings
      (not for a request that asks its prompt's log-probabilities). Their tokens are those
      each would get prefilled alone. `shared` counts the requests so started. False:
      every request is prefilled on its own.

    `submit(request)` returns a `Handle`; `step()` admits waiting requests (one prefill
    each, bucketed, or a copy of the one before: `share_prompts`), then advances every active slot by one token; `run_until_done()`
    steps until nothing is left; `stream(request)` yields its `Token`s, stepping as needed.
    `start()` steps in a background thread (what the HTTP server does); `stop()` ends it
    once the requests in flight have finished. `compiles` counts the programs built:
    `("decode", rows, span, kernel)` per number of rows (`row_bucket`), attention span
    (`span`) and CPU matmul kernel (`kernels`) used, `("prefill", width, echo)` per bucket
    used, `("move",)` once a request first moves down a slot, `("share",)` once a
    request first starts from another's prefill; `warm_up` builds them ahead
    (and, on a CPU, picks each row count's faster kernel: `kernels`, rows → name). Loading
    and unloading adapters adds none.
    """

    def __init__(
        self,
        model,
        *,
        slots: int = 8,
        max_len: int | None = None,
        max_queue: int | None = None,
        adapters=None,
        max_adapters: int | None = None,
        max_lora_rank: int | None = None,
        lora_targets="all-linear",
        lora_parameters=None,
        share_prompts: bool = True,
    ):
        limit = model.config.max_len
        max_len = limit if max_len is None else int(max_len)
        if not 1 < max_len <= limit:
            raise ValueError(f"max_len must be in [2, {limit}] (the model's max_len), got {max_len}")
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        if max_queue is not None and (isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0):
            raise ValueError(f"max_queue must be an int >= 0 or None, got {max_queue!r}")
        self.slots, self.max_len, self.max_queue = int(slots), max_len, max_queue
        check_room(model, self.slots, max_len, max_queue)  # before anything is allocated
        # Weights holding NaN give NaN logits, whose argmax (token 0) looks like an answer.
        check_finite_once(model, where="the Engine's model")
        self.bank = build_bank(model, dict(adapters or {}), max_adapters, max_lora_rank, lora_targets, lora_parameters)
        self._use(model if self.bank is None else self.bank.model)
        self._draining: set[int] = set()  # unloaded adapters' slots, freed when their requests end
        self._uses = np.zeros((0 if self.bank is None else self.bank.capacity,), np.int64)
        self.vocab = model.config.vocab_size
        self.compiles: dict[tuple, int] = {}
        # Short prompts: Eigen's CPU matmuls; long ones: XLA's default. The decode step: one
        # program per kernel (zoo/_kernels.py), the one a row count uses chosen by `warm_up`.
        # Never `.devices().pop()`: a NamedSharding caches that set, and popping empties it.
        device = next(iter(jax.tree.leaves(eqx.filter(model, eqx.is_array))[0].devices()))
        eigen = eigen_matmuls()
        self._prefill = Jit(_prefill_program, donate=(1, 2), on_compile=self._count("prefill"), compiler_options=eigen)
        self._prefill_long = Jit(_prefill_program, donate=(1, 2), on_compile=self._count("prefill"))
        self._decode = {
            kernel: Jit(
                _decode_program, donate=(1, 2), on_compile=self._count("decode", kernel), compiler_options=options
            )
            for kernel, options in matmul_kernels(device.platform).items()
        }
        self.kernels: dict[int, str] = {}  # rows → the decode step's kernel, where `warm_up` timed them
        self._default_kernel = EIGEN if EIGEN in self._decode else next(iter(self._decode))
        self._move = Jit(_move_program, donate=(0, 1), on_compile=self._count("move"))
        self._share = Jit(_share_program, donate=(0, 1), on_compile=self._count("share"))
        self.share_prompts = bool(share_prompts)
        self.shared = 0  # requests started from another's prefill (`share_prompts`)
        attention = model.layers.layers.attention
        dummy = jnp.zeros((slots, 1), jnp.int32)
        cache = empty_cache(attention, model.config.num_layers, slots, max_len, model.config.compute_dtype, dummy)
        # Keys and values in buffers of their own: the steps donate both. Placed (committed)
        # on the model's device as the steps' outputs are, so the first call's programs serve all.
        # Each layer's keys and values in blocks of columns, arrays of their own; a sliding
        # layer whose window is below max_len, one ring of window columns (`KVCache.rings`).
        self._cache = jax.device_put(
            KVCache(
                cache.keys, jnp.zeros_like(cache.values), cache.mask, cache.positions, jnp.zeros((slots,), jnp.int32)
            )
            .split()
            .rings(layer_settings(model.config)["window"], 0)
            .blocks(),
            device,
        )
        vocab = model.config.vocab_size
        self._next = jax.device_put(  # each slot's next input token, bias, counts and penalties
            Steering(
                np.zeros((slots,), np.int32),
                np.zeros((slots, vocab), np.float32),
                np.zeros((slots, vocab), np.float32),
                np.zeros((slots,), np.float32),
                np.zeros((slots,), np.float32),
            ),
            device,
        )
        # Dispatched programs whose results the host has not read yet, oldest first, as
        # (kind, [(slot, handle), ...], (tokens and log-probabilities, prompt's or None)).
        self._unread: deque[tuple] = deque()
        self._rows = SlotSettings(slots, vocab)  # each slot's sampling settings (free slots: greedy)
        self._active: list[_Slot | None] = [None] * slots
        self._waiting: deque[Handle] = deque()
        self._ids = itertools.count()
        self._seeds = np.random.default_rng()
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.error: BaseException | None = None
        self.finished: dict[str, int] = {}  # requests ended, by finish reason

    # -- bookkeeping ------------------------------------------------------------------

    def _use(self, model) -> None:
        """Serve `model` from the next step: the prefills take it whole, the decode step its
        layers as arrays of their own (`split_layers`: a second copy of the layer weights,
        which spares the decode step a copy of every layer's weights per token)."""
        self.model, self._blocks = model, split_layers(model)
        self._weights = Flattened((model, tuple(self._blocks)))  # flattened once, not at every step

    def _count(self, kind: str, kernel: str | None = None):
        def on_compile(_compiled, args):
            if kind == "decode":  # rows, span, matmul kernel
                key = ("decode", args[3].shape[0], args[-1], kernel)
            else:
                key = (kind,) if kind in ("move", "share") else ("prefill", args[4].shape[1], args[-1])
            self.compiles[key] = self.compiles.get(key, 0) + 1

        return on_compile

    @property
    def active(self) -> int:
        """How many slots hold a request."""
        return sum(s is not None for s in self._active)

    @property
    def waiting(self) -> int:
        """How many submitted requests wait for a slot."""
        return len(self._waiting)

    def check(self, request: Request) -> None:
        """Raise `ValueError` (one line, the fix in it) for a request the engine cannot run."""
        check_prompt_ids(request.prompt)
        n = len(request.prompt)
        if n < 1:
            raise ValueError("the prompt is empty; give it at least one token")
        if n >= self.max_len:
            raise ValueError(
                f"the prompt has {n} tokens but a request holds at most {self.max_len} (prompt + new tokens, "
                f"the server's max_len); shorten the prompt to at most {self.max_len - 1} tokens"
            )
        bad = [int(t) for t in request.prompt if not 0 <= int(t) < self.vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the model's vocabulary [0, {self.vocab})")
        if isinstance(request.max_tokens, bool) or not isinstance(request.max_tokens, int) or request.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {request.max_tokens!r}")
        check_sampling(float(request.temperature), request.top_k, request.top_p)
        scaling = rope_scaling_of(self.model.config)
        limit = None if scaling is None else scaling.decode_limit(n)
        if limit is not None and min(request.max_tokens, self.max_len - n) > limit:
            raise ValueError(
                f"the prompt has {n} tokens and max_tokens {request.max_tokens} passes this model's original context "
                f"({scaling.original_max_len} tokens, where its longrope RoPE switches to its long factors and "
                f"transformers recomputes every earlier key, which a key/value cache cannot); set max_tokens to at most "
                f"{limit}, or send a prompt longer than {scaling.original_max_len} tokens"
            )
        if request.seed is not None and not 0 <= int(request.seed) < 2**63:
            raise ValueError(f"seed must be a non-negative integer below 2**63, got {request.seed}")
        if request.adapter is not None:
            self._served_slot(request.adapter)
        check_steering(request.logit_bias, request.presence_penalty, request.frequency_penalty, self.vocab)

    # -- adapters -----------------------------------------------------------------------

    @property
    def adapters(self) -> list[str]:
        """The names of the adapters served, in slot order (an unloaded one leaves at once)."""
        if self.bank is None:
            return []
        return [n for k, n in enumerate(self.bank.names) if n is not None and k not in self._draining]

    def _served_slot(self, name: str) -> int:
        for k, n in enumerate([] if self.bank is None else self.bank.names):
            if n == name and k not in self._draining:
                return k
        raise LookupError(f"no adapter named {name!r} is served; the adapters are {self.adapters}")

    def load_adapter(self, name: str, lora_model) -> int:
        """Serve `lora_model` (a plain single-adapter LoRA model over the base, or the folder
        of one) as `name`, in a free adapter slot, between steps; returns the slot. Nothing compiles: the slot's
        arrays keep their shapes. Raises `ValueError` (the fix in it) for a name already
        served, a full set of slots (`AdapterSlotsFull`), a rank above `max_lora_rank`, a
        layer without adapter room, a branch holding NaN or inf (`NonFiniteWeightsError`;
        `AdapterBank.write` checks it all, on the host, before the slot changes), or an
        engine without adapter slots."""
        if self.bank is None:
            raise ValueError(
                "this engine holds no adapter slots; create it with max_adapters=N (zoo serve --max-adapters N)"
            )
        if not isinstance(name, str) or not name:
            raise ValueError(f"an adapter's name must be a non-empty string, got {name!r}")
        if isinstance(lora_model, str | os.PathLike):
            lora_model = read_adapter(self.bank.base, lora_model)
        with self._lock:
            if name in self.adapters:
                raise ValueError(f"an adapter named {name!r} is already served; unload it first, or pick another name")
            slot = self.bank.free()
            if slot is None:
                raise AdapterSlotsFull(
                    f"all {self.bank.capacity} adapter slots are taken ({self.adapters}); unload one first, or "
                    "restart with a larger max_adapters (zoo serve --max-adapters)"
                )
            self.bank.write(slot, name, lora_model)
            self._use(self.bank.model)
        return slot

    def update_adapter(self, name: str, lora_model) -> None:
        """New weights for adapter `name` in its slot (an RL policy after an update): nothing
        compiles. `ValueError` while its requests are in flight or for weights the slot
        cannot take (`AdapterBank.check`: shapes, NaN or inf); `LookupError`: no such name."""
        with self._lock:
            slot = self._served_slot(name)
            if self._uses[slot]:
                raise ValueError(
                    f"adapter {name!r} has {int(self._uses[slot])} requests in flight; update it once they finish"
                )
            self.bank.write(slot, name, lora_model)
            self._use(self.bank.model)

    def unload_adapter(self, name: str) -> int:
        """Stop serving adapter `name`: new requests for it are refused at once; its slot is
        zeroed and freed when the requests already using it have finished (none is dropped).
        Returns how many such requests are still in flight. `LookupError` for an unknown name."""
        with self._lock:
            slot = self._served_slot(name)
            left = int(self._uses[slot])
            if left:
                self._draining.add(slot)
            else:
                self.bank.clear(slot)
                self._use(self.bank.model)
        return left

    def _release(self, handle: Handle) -> None:
        """`handle` ended: its adapter slot has one user less (and is freed if unloaded)."""
        slot, handle._slot = handle._slot, -1
        if slot < 0:
            return
        self._uses[slot] -= 1
        if not self._uses[slot] and slot in self._draining:
            self._draining.discard(slot)
            self.bank.clear(slot)
            self._use(self.bank.model)

    # -- the public surface -------------------------------------------------------------

    def submit(self, request: Request, on_update: Callable[[Token | None], Any] | None = None) -> Handle:
        """Queue `request`; it joins at the next step with a free slot. Raises `ValueError`
        for a request that cannot run (see `check`), `QueueFull` when `max_queue` wait."""
        self.check(request)
        with self._lock:
            if self._stopping:
                raise QueueFull("the engine is stopping and takes no new requests")
            if self.max_queue is not None and len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests already wait for a slot; retry shortly")
            handle = Handle(next(self._ids), request, on_update=on_update)
            if request.adapter is not None:
                handle._slot = self._served_slot(request.adapter)
                self._uses[handle._slot] += 1
            self._waiting.append(handle)
            self._lock.notify_all()
        return handle

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """Hold the engine between steps: requests submitted inside wait side by side until
        it ends, so a group of one prompt (OpenAI's `n`) is admitted together and prefilled
        once (`share_prompts`) even while `start()`'s thread runs."""
        with self._lock:
            yield

    def step(self) -> int:
        """Admit waiting requests into free slots, advance every active slot by one token,
        and hand each request the tokens computed. Returns how many slots are active after
        it. (The background thread of `start()` overlaps the two: it reads a step's tokens
        while the next step runs.)"""
        self._dispatch()
        self._collect(keep=0)
        return self.active

    def _busy(self) -> bool:
        """Whether a request waits, holds a slot, or has tokens not yet handed over."""
        return bool(self._waiting) or bool(self._unread) or any(s is not None for s in self._active)

    def run_until_done(self) -> None:
        """Step until no request waits or runs."""
        while self._busy():
            self.step()

    def stream(self, request: Request) -> Iterator[Token]:
        """Submit `request` and yield its tokens as they come (stepping the engine here
        unless `start()` runs it in a thread)."""
        handle = self.submit(request)
        yield from self.tokens(handle)

    def tokens(self, handle: Handle) -> Iterator[Token]:
        """`handle`'s tokens as they come, until it finishes."""
        while True:
            if self._thread is None:
                while handle._events.empty():
                    self.step()
            token = handle._events.get()
            if token is None:
                return
            yield token

    def warm_up(self, prompt_lengths: Sequence[int] = (1,), columns: int = 1, *, tune: bool = True) -> None:
        """Compile ahead, so no client waits for it: the prefill of every bucket that
        `prompt_lengths` fall in (a short greedy request each, served here; the first twice,
        so the program starting a request from another's prefill is built too) and the decode
        step for every number of rows (`row_bucket`) and every attention span a request of
        up to `columns` cache columns (prompt + new tokens) passes through (default: the
        smallest span only). With `tune` (on a CPU), the decode step of each number of rows
        is first compiled with each matmul kernel (`zoo._kernels.matmul_kernels`) and timed
        (`zoo._kernels.fastest_kernel`: 5 calls each, interleaved; the median): the faster one serves that
        many rows from then on (`kernels`; untimed row counts: Eigen's, on a CPU). Call it before
        serving, while no request runs."""
        for i, width in enumerate(sorted({bucket(n, self.max_len) for n in prompt_lengths})):
            # Twice the first prompt: the second starts from the first's prefill (`share_prompts`).
            copies = 2 if i == 0 and self.share_prompts and self.slots > 1 else 1
            handles = [self.submit(Request([0] * min(width, self.max_len - 1), max_tokens=2)) for _ in range(copies)]
            while not all(handle.done for handle in handles):
                self.step()
        with self._lock:
            if self._busy():
                raise RuntimeError("warm_up runs before serving: requests are in flight")
            spans = sorted({span(c, self.max_len) for c in range(1, min(columns, self.max_len) + 1)})
            # Every slot free: the steps' writes land in free rows, which an admission resets.
            for n in sorted({row_bucket(a, self.slots) for a in range(1, self.slots + 1)}):
                if tune and len(self._decode) > 1:
                    decode = functools.partial(self._decode_rows, np.zeros((n,), np.int32), spans[0])
                    self.kernels[n] = fastest_kernel(decode, self._decode)
                for width in spans:
                    jax.block_until_ready(self._decode_rows(np.zeros((n,), np.int32), width))
            self._cache, self._next = self._move(self._cache, self._next, np.int32(0), np.int32(0))

    def start(self) -> None:
        """Step in a background thread whenever there is work (until `stop()`)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="zoo-serve-engine", daemon=True)
            self._thread.start()

    def stop(self, *, wait: bool = True) -> None:
        """Take no new requests; the thread ends once those waiting and running are done."""
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        if wait and self._thread is not None:
            self._thread.join()

    # -- the work -----------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while True:
                with self._lock:
                    while not self._busy() and not self._stopping:
                        self._lock.wait()
                    if self._stopping and not self._busy():
                        return
                # The step just dispatched stays in flight while the host reads the one before.
                self._collect(keep=1 if self._dispatch() else 0)
        except BaseException as e:  # every handle learns it; the server reports it
            self.error = e
            with self._lock:
                for i, slot in enumerate(self._active):
                    if slot is not None:
                        self._free(i)
                        self._end(slot.handle, "error")
                for item in self._unread:
                    for _, handle in item[1]:
                        if not handle.done:
                            self._end(handle, "error")
                self._unread.clear()
                while self._waiting:
                    self._end(self._waiting.popleft(), "error")
            raise

    def _dispatch(self) -> bool:
        """Queue this step's programs without waiting for them: the prefill of each request
        admitted, then one decode step of every active slot. Returns whether it queued a
        decode step."""
        with self._lock:
            for i, slot in enumerate(self._active):
                if slot is not None and slot.handle._cancelled:
                    self._free(i)
                    self._end(slot.handle, "cancelled")
            while self._waiting and None in self._active:
                handle = self._waiting.popleft()
                if handle._cancelled:
                    self._end(handle, "cancelled")
                    continue
                source = self._active.index(None)
                logits = self._admit(source, handle)
                while self.share_prompts and self._waiting and None in self._active:
                    if not shares_prefill(handle, self._waiting[0]):
                        break
                    self._share_prefill(source, logits, self._waiting.popleft())
            if all(s is None for s in self._active):
                return False
            self._compact()
            self._advance()
            return True

    def _collect(self, keep: int) -> None:
        """Read back the programs dispatched, oldest first, until at most `keep` remain in
        flight, and hand their tokens to the requests still running."""
        while len(self._unread) > keep:
            kind, rows, out = self._unread.popleft()
            token, chosen, ids, values, sampled = (np.asarray(x) for x in out[0])
            prompt = None if out[1] is None else [np.asarray(x) for x in out[1]]
            tokens, chosen, sampled = token.tolist(), chosen.tolist(), sampled.tolist()
            with self._lock:
                for row, (i, handle) in enumerate(rows):
                    at = row if kind == "prefill" else i
                    if prompt is not None:
                        n = len(handle.request.prompt)
                        seen, top_ids, top_values = prompt
                        handle.prompt_logprobs = [None] + seen[: n - 1].tolist()
                        handle.prompt_top = [[]] + [
                            list(zip(top_ids[j].tolist(), top_values[j].tolist())) for j in range(n - 1)
                        ]
                    self._deliver(handle, tokens[at], chosen[at], ids[at], values[at], sampled[at])

    def _admit(self, index: int, handle: Handle):
        """Queue `handle`'s prefill into slot `index`; the slot joins the next decode step
        unless the first token is all the request may have. Returns the prefill's last
        logits (on the device, not read), which requests of the same prompt start from
        (`_share_prefill`)."""
        request = handle.request
        self._settle(index, handle)
        n = len(request.prompt)
        width = bucket(n, self.max_len)
        tokens = np.zeros((1, width), np.int32)
        tokens[0, :n] = request.prompt
        echo = bool(request.prompt_logprobs)
        rows = slice(index, index + 1)
        program = self._prefill if width <= EIGEN_PREFILL_ROWS else self._prefill_long
        # Copies of the settings: a queued program may read its host arrays after this returns.
        self._cache, self._next, first, prompt, logits = program(
            self._weights,
            self._cache,
            self._next,
            np.int32(index),
            tokens,
            np.asarray([n], np.int32),
            *self._rows.sampling(rows),
            self._row_scale(self._rows.adapter[rows]),
            bias_row(request, self.vocab),
            np.float32(request.presence_penalty),
            np.float32(request.frequency_penalty),
            echo,
        )
        self._started(index, handle, first, prompt)
        return logits

    def _share_prefill(self, source: int, logits, handle: Handle) -> None:
        """Start `handle` in a free slot from the prefill just queued into slot `source`
        (`shares_prefill`): that cache row copied, its first token chosen from that
        prefill's last `logits` with its own settings. Its prompt is not run again."""
        index = self._active.index(None)
        self._settle(index, handle)
        rows = slice(index, index + 1)
        request = handle.request
        self._cache, self._next, first = self._share(
            self._cache,
            self._next,
            np.int32(source),
            np.int32(index),
            logits,
            *self._rows.sampling(rows),
            bias_row(request, self.vocab),
            np.float32(request.presence_penalty),
            np.float32(request.frequency_penalty),
        )
        self.shared += 1
        self._started(index, handle, first, None)

    def _settle(self, index: int, handle: Handle) -> None:
        """Slot `index`'s sampling settings and adapter become `handle`'s (a sampled request
        without a seed gets a fresh one)."""
        request = handle.request
        if request.seed is None and request.temperature > 0:
            request.seed = int(self._seeds.integers(2**62))
        self._rows.set(index, request, handle._slot)

    def _started(self, index: int, handle: Handle, first, prompt) -> None:
        """`handle`'s first token is queued in slot `index`: its tokens are read with the
        others (`_collect`), and the slot joins the next decode step unless that token is
        all the request may have."""
        handle._index, handle._limit = index, min(handle.request.max_tokens, self.max_len - len(handle.request.prompt))
        self._unread.append(("prefill", [(index, handle)], (first, prompt)))
        if handle._limit > 1:
            self._active[index] = _Slot(handle)
        else:
            self._free(index)

    def _advance(self) -> None:
        """Queue one decode step of every active slot; a slot whose last token it computes
        is free for the next admission at once (its tokens are read later)."""
        rows = [(i, s.handle) for i, s in enumerate(self._active) if s is not None]
        steps = np.zeros((self.slots,), np.int32)
        columns = 0  # the columns in use after this step: attention reads no others
        for i, handle in rows:
            steps[i] = self._active[i].dispatched
            columns = max(columns, len(handle.request.prompt) + steps[i])
        n = row_bucket(len(rows), self.slots)  # rows[-1][0] < n: `_compact` kept them low
        out = self._decode_rows(steps[:n], span(int(columns), self.max_len))
        self._unread.append(("decode", rows, (out, None)))
        for i, _ in rows:
            slot = self._active[i]
            slot.dispatched += 1
            if slot.dispatched >= slot.handle._limit:
                self._free(i)

    def _decode_rows(self, steps: np.ndarray, width: int, kernel: str | None = None):
        """Queue the decode step of the first `len(steps)` slots, attention over `width`
        columns, compiled with `kernel` (default: the one `kernels` holds for that many
        rows); returns its (not yet read) tokens and log-probabilities. The settings go as
        copies: a queued program may read its host arrays after this returns."""
        n = len(steps)
        program = self._decode[kernel or self.kernels.get(n, self._default_kernel)]
        self._cache, self._next, out = program(
            self._weights,
            self._cache,
            self._next,
            steps,
            *self._rows.sampling(slice(0, n)),
            self._row_scale(self._rows.adapter[:n]),
            width,
        )
        return out

    def _compact(self) -> None:
        """Move requests from the highest slots into free lower ones until the busy slots fit
        in the rows the next decode step runs (`row_bucket`): fewer requests, a smaller step."""
        busy = [i for i, s in enumerate(self._active) if s is not None]
        rows = row_bucket(len(busy), self.slots)
        while busy and busy[-1] >= rows:
            source, target = busy.pop(), self._active.index(None)
            self._cache, self._next = self._move(self._cache, self._next, np.int32(source), np.int32(target))
            slot = self._active[target] = self._active[source]
            slot.handle._index = target
            self._rows.move(source, target)
            self._free(source)
            busy = sorted([*busy, target])

    def _row_scale(self, slots: np.ndarray) -> np.ndarray | None:
        return None if self.bank is None else self.bank.row_scale(slots)

    def _deliver(self, handle: Handle, token: int, logprob: float, ids, values, sampled: float) -> None:
        if handle.done:  # it ended (a stop id, cancelled) while this token was computed
            return
        if handle._cancelled:
            self._end(handle, "cancelled")
            return
        request = handle.request
        top = list(zip(ids.tolist(), values.tolist())) if request.top_logprobs else []
        handle.tokens.append(Token(token, logprob, top, sampled))
        handle._emit(handle.tokens[-1])
        if token in request.stop_ids:
            self._end(handle, "stop")
        elif len(handle.tokens) >= handle._limit:
            self._end(handle, "length")

    def _free(self, index: int) -> None:
        """Slot `index` takes the next admission; until then it decodes greedily, alone, so
        the step's sampling and top-k branches follow the busy slots only."""
        self._active[index] = None
        self._rows.clear(index)

    def _end(self, handle: Handle, reason: str) -> None:
        """`handle` is finished (`reason`): its slot is freed if it still holds one."""
        index = handle._index
        if 0 <= index and self._active[index] is not None and self._active[index].handle is handle:
            self._free(index)
        handle.finish_reason = reason
        self._release(handle)
        self.finished[reason] = self.finished.get(reason, 0) + 1
        handle._emit(None)


class QueueFull(RuntimeError):
    """More requests than the engine's `max_queue` wait for a slot (or it is stopping)."""


class AdapterSlotsFull(ValueError):
    """`Engine.load_adapter` found every adapter slot taken."""

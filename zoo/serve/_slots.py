"""Each batch slot's sampling settings, kept on the host as arrays over the slots."""

from __future__ import annotations

import jax
import numpy as np

from ._requests import Request


class SlotSettings:
    """What each slot of the engine's batch samples with, as arrays over the slots (the
    engine's programs take them per row): the key data of its request's seed, its
    temperature, top-k (0: none), top-p (1: none), whether it wants the top
    log-probabilities (`wanted`), and its adapter slot (`adapter`, -1: the bare base). A
    free slot decodes greedily with the base (`clear`), so a step's sampling and top-k
    branches follow the busy slots only.

    **Arguments:** the engine's number of `slots` and the model's `vocab` size (top-k is
    capped at it).
    """

    def __init__(self, slots: int, vocab: int):
        self.vocab = vocab
        self.key_data = np.zeros((slots,) + jax.random.key_data(jax.random.key(0)).shape, np.uint32)
        self.temperature = np.zeros((slots,), np.float32)
        self.top_k = np.zeros((slots,), np.int32)
        self.top_p = np.ones((slots,), np.float32)
        self.wanted = np.zeros((slots,), bool)
        self.adapter = np.full((slots,), -1, np.int32)

    def set(self, index: int, request: Request, adapter: int) -> None:
        """Slot `index` samples as `request` asks (its `seed`: None is 0), with adapter slot
        `adapter`."""
        self.key_data[index] = np.asarray(jax.random.key_data(jax.random.key(request.seed or 0)))
        self.temperature[index] = float(request.temperature)
        self.top_k[index] = 0 if request.top_k is None else min(request.top_k, self.vocab)
        self.top_p[index] = 1.0 if request.top_p is None else float(request.top_p)
        self.wanted[index] = bool(request.top_logprobs)
        self.adapter[index] = adapter

    def sampling(self, rows: slice) -> tuple:
        """Copies of `rows`' key data, temperature, top-k, top-p and `wanted`, in the order
        the programs take them (copies: a queued program may read its host arrays after the
        call returns)."""
        return tuple(x[rows].copy() for x in (self.key_data, self.temperature, self.top_k, self.top_p, self.wanted))

    def clear(self, index: int) -> None:
        """Slot `index` is free: greedy, no filters, no top log-probabilities, the base."""
        self.temperature[index], self.top_k[index], self.top_p[index], self.wanted[index] = 0, 0, 1, False
        self.adapter[index] = -1

    def move(self, source: int, target: int) -> None:
        """Slot `source`'s settings are slot `target`'s too (its request moved there)."""
        for settings in (self.key_data, self.temperature, self.top_k, self.top_p, self.wanted, self.adapter):
            settings[target] = settings[source]


def bias_row(request: Request, vocab: int) -> np.ndarray:
    """`request.logit_bias` as a `[vocab]` row (zeros without)."""
    row = np.zeros((vocab,), np.float32)
    for token, bias in (request.logit_bias or {}).items():
        row[int(token)] = float(bias)
    return row

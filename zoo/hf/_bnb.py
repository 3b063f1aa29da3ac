"""Checkpoints saved by transformers with a bitsandbytes 4-bit `quantization_config`
(`load_in_4bit`, NF4, double quantisation or not): their projections read back as the
float weights the 4-bit codes stand for, so every family's loader reads them, and
quantised again as they load (`from_pretrained`'s `quantize`, the checkpoint's NF4 and block
by default: the same codes and scales, since a dequantised block re-quantises to itself)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from ..nn._four_bit import NESTED_BLOCK_SIZE, NF4_CODE, dynamic_code
from ._files import Checkpoint

# The tensors bitsandbytes saves beside a 4-bit `weight` (`Params4bit`'s quant state).
_STATE = (".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map")
_STATE_JSON = ".quant_state.bitsandbytes__"


def bnb_quantize(values: dict[str, Any], where: str) -> str | None:
    """The `quantize` a checkpoint's `quantization_config` (config.json) stands for: "nf4:64"
    for bitsandbytes' 4-bit NF4 (blocks of 64), None without one.

    **Raises:** `ValueError` naming what is not read (8-bit LLM.int8 checkpoints, FP4,
    other quantisation methods) and how to load the model instead."""
    config = values.get("quantization_config")
    if not config:
        return None
    method = config.get("quant_method")
    if method != "bitsandbytes":
        raise ValueError(
            f"{where}: its config.json's quantization_config is {method!r}, which zoo does not read (it reads "
            "bitsandbytes' 4-bit NF4 checkpoints); load the float model and pass quantize='nf4', 'int4' or 'int8'"
        )
    if not config.get("load_in_4bit"):
        raise ValueError(
            f"{where}: a bitsandbytes 8-bit (LLM.int8) checkpoint, which zoo does not read; load the float model "
            "with quantize='int8' (a scale per output channel) instead"
        )
    kind = config.get("bnb_4bit_quant_type", "fp4")
    if kind != "nf4":
        raise ValueError(
            f"{where}: a bitsandbytes 4-bit checkpoint of quant type {kind!r}; zoo reads NF4 (its 4-bit kinds are "
            "nf4 and int4): save it with bnb_4bit_quant_type='nf4', or load the float model with quantize="
        )
    return "nf4"


class FourBitCheckpoint:
    """A `Checkpoint` whose bitsandbytes 4-bit weights read as float32 `[out, in]` tensors.

    The quant-state tensors beside each 4-bit weight are not listed; a weight is
    dequantised whole when a slice of it is read (one projection of one layer at a time:
    the loader reads a stacked leaf layer by layer), as bitsandbytes' `dequantize_4bit`
    computes it (the code book times its block's absmax, float32; with double
    quantisation the absmax first from its 8-bit codes, their blocks' scales and offset).
    """

    def __init__(self, checkpoint: Checkpoint, where: str):
        self.checkpoint, self.where = checkpoint, where
        names = checkpoint.keys()
        self._states = {n.split(_STATE_JSON)[0]: n for n in names if _STATE_JSON in n}
        self._last: tuple[str, np.ndarray] | None = None

    def __enter__(self) -> FourBitCheckpoint:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.checkpoint.close()

    def block_size(self) -> int:
        """The 4-bit block of the checkpoint's weights (one for all; a mix is refused)."""
        sizes = {self._state(n)["blocksize"] for n in self._states}
        if len(sizes) > 1:
            raise ValueError(f"{self.where}: its 4-bit weights use several block sizes {sorted(sizes)}")
        return sizes.pop() if sizes else 64

    def double_quant(self) -> bool:
        """Whether the checkpoint's 4-bit weights keep their scales double-quantised."""
        return any("nested_blocksize" in self._state(n) for n in self._states)

    def nested_state(self, name: str, blocks: int) -> tuple[np.ndarray, np.ndarray, np.float32, float] | None:
        """The double-quantised scales of 4-bit weight `name` (file name) as zoo stores them:
        uint8 codes `[blocks, out]` (the file's `[out, blocks]` transposed), the nested absmax,
        the offset and the value of code 0 in its `nested_quant_map`; `None` when its scales
        are float or its nested code book is not bitsandbytes' dynamic map."""
        state = self._state(name)
        if "nested_blocksize" not in state or state["nested_blocksize"] != NESTED_BLOCK_SIZE:
            return None
        table = self._whole(name + ".nested_quant_map").astype(np.float32)
        if table.shape != (256,) or not np.array_equal(table[1:], dynamic_code()[1:]):
            return None
        codes = self._whole(name + ".absmax").reshape(-1, blocks).T
        absmax = self._whole(name + ".nested_absmax").astype(np.float32)
        return codes.astype(np.uint8), absmax, np.float32(state["nested_offset"]), float(table[0])

    def keys(self) -> list[str]:
        return [
            n
            for n in self.checkpoint.keys()
            if _STATE_JSON not in n and not any(n.endswith(s) and n[: -len(s)] in self._states for s in _STATE)
        ]

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._states:
            return tuple(self._state(name)["shape"])
        return self.checkpoint.shape(name)

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        if name not in self._states:
            return self.checkpoint.read(name, index)
        if self._last is None or self._last[0] != name:
            self._last = (name, self._dequantized(name))
        weight = self._last[1]
        return np.array(weight[index] if index else weight)

    def _state(self, name: str) -> dict[str, Any]:
        key = self._states[name]
        return json.loads(bytes(self.checkpoint.read(key, ())).decode("utf-8"))

    def _whole(self, name: str) -> np.ndarray:
        return self.checkpoint.read(name, ())

    def _dequantized(self, name: str) -> np.ndarray:
        state = self._state(name)
        if state.get("quant_type") != "nf4":
            raise ValueError(f"{self.where}: {name} is 4-bit {state.get('quant_type')!r}; zoo reads NF4")
        code = self._whole(name + ".quant_map").astype(np.float32)
        if not np.array_equal(code, NF4_CODE):
            raise ValueError(f"{self.where}: {name}'s quant_map is not bitsandbytes' NF4 code book")
        absmax = self._whole(name + ".absmax")
        if "nested_blocksize" in state:  # double quantisation: the absmax in 8 bits per block of nested_blocksize
            nested = self._whole(name + ".nested_quant_map").astype(np.float32)
            scales = self._whole(name + ".nested_absmax").astype(np.float32)
            blocks = np.arange(absmax.size) // state["nested_blocksize"]
            absmax = nested[absmax.astype(np.int64)] * scales[blocks] + np.float32(state["nested_offset"])
        absmax = absmax.astype(np.float32)
        packed = self._whole(name).reshape(-1)
        codes = np.stack([packed >> 4, packed & 0xF], axis=-1).reshape(-1)
        shape = tuple(state["shape"])
        values = NF4_CODE[codes] * np.repeat(absmax, state["blocksize"])[: codes.size]
        return values.reshape(shape)

    def close(self) -> None:
        self.checkpoint.close()

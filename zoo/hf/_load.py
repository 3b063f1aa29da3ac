"""Loading Hugging Face checkpoints of every registered family into zoo models, placed as
annotated."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._finite import check_finite
from .._presets import rules as preset_rules
from .._rules import Rules, _concrete_mesh, axis_size, check_head_counts, partition_specs, shard
from .._tree import dotted_name, node_at
from ..models import Encoder, Transformer
from ..nn._four_bit_linear import FourBitLinear
from ..nn._quantized import quantize_kind, quantizer, stack_projections
from . import _families  # noqa: F401  (registers the families)
from ._bnb import FourBitCheckpoint, bnb_quantize
from ._family import Family, get_family
from ._files import Checkpoint, read_config
from ._hub import resolve_model_dir
from ._layout import leaf_sources
from ._place import place


def _placeholders(skeleton: Any) -> Any:
    """The skeleton with zero-stride numpy arrays (no memory) for its shape structs, so
    annotation lookups that expect arrays can read it."""
    return jax.tree.map(
        lambda s: np.broadcast_to(np.zeros((), s.dtype), s.shape) if isinstance(s, jax.ShapeDtypeStruct) else s,
        skeleton,
    )


def fit_to_mesh(config: Any, rules: Rules, mesh: Any, where: str) -> Any:
    """`config` with its vocabulary padded (`vocab_multiple`) to split over the mesh axes
    `rules["vocab"]` maps to; a `ValueError` naming the fix when those of `"heads"` /
    `"kv_heads"` cannot split the (key/value) head count."""
    check_head_counts(config.num_heads, config.kv_heads, rules, mesh, where)
    size, _ = axis_size(rules, "vocab", mesh)
    if size > 1 and config.vocab_size % size:
        multiple = int(np.lcm(size, config.vocab_multiple))
        config = dataclasses.replace(config, vocab_multiple=multiple)
    return config


def _load(
    layout: Family,
    path: str | os.PathLike,
    values: dict[str, Any],
    *,
    rules: Rules | None,
    mesh: Any,
    dtype: Any,
    config_overrides: Mapping[str, Any] | None,
    quantize: str | None = None,
) -> Any:
    try:
        floating = jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
    except TypeError:  # a name numpy does not know ('bf16'): numpy's own message names no fix
        floating = False
    if not floating:
        raise ValueError(
            f"dtype must be a floating dtype (the parameters' dtype), got {dtype!r}: "
            "give jnp.float32, jnp.bfloat16 or jnp.float16 (or their names, 'bfloat16')"
        )
    four_bit = bnb_quantize(values, str(path))  # a bitsandbytes 4-bit checkpoint: read as float, quantised again
    values = {k: v for k, v in values.items() if k != "quantization_config"}
    if quantize is not None:
        quantize_kind(quantize)  # its mistakes before anything is read
    overrides = {"family": layout.name, "source_dir": str(Path(path).resolve())} | dict(config_overrides or {})
    config = layout.config_from_hf(values, **overrides)
    specs, concrete = None, None
    if rules is not None or mesh is not None:
        concrete = _concrete_mesh(mesh)
        rules = preset_rules("dp") if rules is None else rules
        config = fit_to_mesh(config, rules, concrete, str(path))
    skeleton = eqx.filter_eval_shape(layout.model_class, config, key=jax.random.key(0))
    if concrete is not None:
        specs = partition_specs(_placeholders(skeleton), rules, concrete)
    with Checkpoint(path) as checkpoint:
        if four_bit is not None:
            checkpoint = FourBitCheckpoint(checkpoint, str(path))
            stored = f"{four_bit}:{checkpoint.block_size()}" + (":dq" if checkpoint.double_quant() else "")
            quantize = quantize or stored
        kind, block_size, double_quant = quantize_kind(quantize) if quantize is not None else (None, None, False)
        convert = _quantizers(skeleton, kind, block_size, str(path), double_quant)
        if four_bit is not None and quantize == stored and double_quant:
            convert = _stored_scales(convert, layout, skeleton, config, checkpoint, block_size)
        model, nonfinite = place(
            layout,
            skeleton,
            config,
            layout.file_view(checkpoint),
            specs=specs,
            mesh=concrete,
            dtype=dtype,
            where=str(path),
            convert=convert,
        )
    if convert and concrete is not None:  # the quantised layers' codes and scales, placed as annotated
        model = shard(model, rules, concrete)
    # NaN weights would give NaN logits, argmax token 0: the error names the leaf. Each
    # process read only its own shards, and check_finite is one program over the global
    # arrays: with several processes every one runs it (one alone would wait for the rest).
    if nonfinite or convert or jax.process_count() > 1:
        check_finite(model, where=str(path))
    return model


def _quantizers(
    skeleton: Any, quantize: str | None, block_size: int | None, where: str, double_quant: bool = False
) -> dict[str, Any]:
    """Dotted name → the function that quantises it, for every `Linear` of the layer stack
    (`stack_projections`: attention and MLP projections; embeddings, norms and an untied
    head stay float, as bitsandbytes leaves `lm_head`). A block that does not divide a layer's inputs is
    refused here, before anything is read."""
    if quantize is None:
        return {}
    convert = quantizer(quantize, block_size, double_quant)
    found = {dotted_name(path): node_at(skeleton, path) for path in stack_projections(skeleton)}
    for name, linear in found.items():
        try:
            eqx.filter_eval_shape(convert, linear)
        except ValueError as e:
            # FourBitLinear.quantize names its own argument; here the block is in the text form.
            hint = str(e).replace("pass block_size= one of", f"pass quantize='{quantize}:BLOCK', BLOCK one of")
            raise ValueError(f"{where}: cannot quantize {name} as {quantize}: {hint}") from None
    return dict.fromkeys(found, convert)


def _stored_scales(
    convert: dict[str, Any], layout: Family, skeleton: Any, config: Any, checkpoint: FourBitCheckpoint, block: int
) -> dict[str, Any]:
    """`convert` for a checkpoint transformers saved with double-quantised NF4 scales: each
    projection's NF4 codes made again from the float weights read (a dequantised block
    re-quantises to itself), its scales kept as the file stores them (the 8-bit codes,
    nested absmax, offset), so the layer is bitsandbytes' state, bit for bit. A projection
    cut from a fused tensor (its runs of 256 scales are the whole tensor's), or whose nested
    code book is not bitsandbytes' dynamic map (one first entry for all its layers), is
    double-quantised again by zoo."""
    sources = {dotted_name(p): s for p, _, s in leaf_sources(layout, skeleton, config)}
    files, _ = layout.canonical_names(checkpoint.keys())
    out = dict(convert)
    for name, quantize in convert.items():
        source = sources.get(f"{name}.weight")
        if source is None or source.block is not None:
            continue

        def stored(linear, quantize=quantize, names=tuple(files[n] for n in source.names)):
            plain = FourBitLinear.quantize(linear, "nf4", block_size=block)
            states = [checkpoint.nested_state(n, plain.scale.shape[-2]) for n in names]
            if any(s is None for s in states) or len({s[3] for s in states}) > 1:
                return quantize(linear)
            layers = plain.scale.shape[:-2]
            codes, absmax, offset = (np.stack([s[i] for s in states]) for i in range(3))
            codes, absmax, offset = (
                codes.reshape(plain.scale.shape),
                absmax.reshape(*layers, -1),
                offset.reshape(layers),
            )
            return plain.with_scales(codes, absmax, offset, states[0][3])

        out[name] = stored
    return out


_COMMON_DOC = """
    **Arguments:**

    - `path`: a Hugging Face model directory: `config.json` and `model.safetensors` (or a
      sharded `model.safetensors.index.json` set), as `save_pretrained` writes them; or
      a model id (`"org/name"`) already in the local Hugging Face hub cache (never
      downloaded).
    - `rules`: logical axis → mesh axes (`zoo.rules("fsdp")`, …). With `rules` (or
      `mesh`), every leaf is created directly with the sharding its annotations ask for
      (`zoo.partition_specs`), each device's shard read alone from the file; `mesh`
      defaults to the one set by `jax.set_mesh`, `rules` to `zoo.rules("dp")`
      (replicated). With neither: ordinary single-device arrays. A vocabulary the mesh
      axes of `rules["vocab"]` cannot split is padded (`config.vocab_multiple`; padded
      logits are masked, export writes the real rows); a head count they cannot split
      is refused.
    - `mesh`: a concrete `jax.sharding.Mesh`.
    - `dtype`: the floating parameters' dtype (default float32; the compute dtype is the
      config's `dtype` field, settable through `config_overrides`).
    - `config_overrides`: zoo config fields to set on top of the converted config.json
      (e.g. `{"dropout": 0.0, "remat": "dots_saveable"}`).
    - `quantize`: `"nf4"` or `"int4"` (`zoo.nn.FourBitLinear`; `"nf4:32"` for a block of
      32 inputs per scale, default 64 / 128: it must divide every projection's inputs;
      `"nf4:dq"` / `"nf4:32:dq"`: NF4's scales in 8 bits, bitsandbytes' double
      quantisation) or
      `"int8"` (`zoo.nn.QuantizedLinear`), as `RunConfig.quantize` and `--quantize` take
      it: every projection of the layer stack is quantised as it is
      read, one stacked projection at a time, so the float model never exists in memory
      (peak host memory: the quantised model plus one float projection of all layers;
      benchmarks/quantized_load.py). Embeddings, norms and an untied head stay float
      (`dtype`), as bitsandbytes leaves `lm_head`. The same codes and scales as
      `FourBitLinear.quantize` / `QuantizedLinear.quantize` of the float model; add LoRA
      on top (`zoo.lora.add_lora`) to train it (QLoRA). Default None: float weights, or
      for a checkpoint transformers saved with a bitsandbytes 4-bit NF4
      `quantization_config` (QLoRA bases such as `*-bnb-4bit`), that NF4 and block: the
      same codes and scales; double-quantised scales (`bnb_4bit_use_double_quant`) stay
      so, their 8-bit codes, nested absmax and offset as the file holds them (`"nf4:64:dq"`;
      `quantize="nf4:64"` expands them to float32). `zoo.nn.dequantize(model)` gives float
      weights.

    A `ValueError` lists every missing, unexpected and mis-shaped tensor, names the
    unsupported config option, or names a weight holding NaN or inf. Files of task models (`bert.` / `roberta.` / `transformer.` prefixes)
    load their base model; their head tensors are skipped with a warning.
"""


def load_family(
    name: str,
    path: str | os.PathLike,
    *,
    rules: Rules | None = None,
    mesh: Any = None,
    dtype: Any = jnp.float32,
    config_overrides: Mapping[str, Any] | None = None,
) -> Encoder | Transformer:
    """`from_pretrained` for a folder that must hold the family `name` (`"bert"` for the
    classifier and MiniLM loaders); another `model_type` is a `ValueError`."""
    path = resolve_model_dir(path)
    values = read_config(path)
    if values.get("model_type", name) != name:
        raise ValueError(
            f"{str(path)!r} holds a {values.get('model_type')!r} model, not {name!r}; try zoo.hf.from_pretrained"
        )
    return _load(get_family(name), path, values, rules=rules, mesh=mesh, dtype=dtype, config_overrides=config_overrides)


def from_pretrained(
    path: str | os.PathLike,
    *,
    rules: Rules | None = None,
    mesh: Any = None,
    dtype: Any = jnp.float32,
    config_overrides: Mapping[str, Any] | None = None,
    quantize: str | None = None,
    revision: str | None = None,
) -> Encoder | Transformer:
    """A zoo model holding a Hugging Face checkpoint, its family chosen by `config.json`'s
    `model_type` from the registry (`zoo.hf.families()`: `"bert"` → `zoo.models.Encoder`,
    the decoders, `zoo.hf.families(zoo.models.Transformer)`, → `zoo.models.Transformer`). The
    model's config records the family and the folder (`config.family`, `config.source_dir`), which
    `save_pretrained` and `zoo.lora.save_adapter` use.

    `revision`: for a Hub id, the branch, tag or commit to load (default `main`), as
    transformers' `from_pretrained(id, revision=...)`; refused for a local folder
    (`zoo.hf.resolve_model_dir`).
    """
    path = resolve_model_dir(path, revision=revision)
    values = read_config(path)
    model_type = values.get("model_type")
    family = get_family(model_type, str(Path(path) / "config.json"))
    return _load(
        family,
        path,
        values,
        rules=rules,
        mesh=mesh,
        dtype=dtype,
        config_overrides=config_overrides,
        quantize=quantize,
    )


from_pretrained.__doc__ = (from_pretrained.__doc__ or "").rstrip() + "\n" + _COMMON_DOC

"""The architecture registry: one `Family` per Hugging Face architecture, each in its own
file under `zoo/hf/_families/`, used by loading, export and adapter I/O alike.

The interface (stable; additions only):

- class attributes
  - `name`: the `config.json` `model_type` (`"llama"`), the registry key.
  - `model_class`, `config_class`: the zoo model and config classes
    (`Transformer`/`TransformerConfig`, `Encoder`/`EncoderConfig`), or their import paths
    (`"zoo.models.Transformer"`), imported when first read: the built-in families give
    paths, so the registry loads, and lists them (the `zoo` command's help), without jax.
  - `architecture`: `config.json`'s `architectures[0]` on export (`"LlamaForCausalLM"`).
  - `auto_class`: the transformers Auto class that opens an export
    (`"AutoModelForCausalLM"`, `"AutoModel"`).
  - `prefix`: the base-model prefix of task-model files (`"model."`, `"transformer."`,
    `"bert."`); `canonical_prefixed`: whether the table's names carry it; `head_names`:
    file names outside the prefix that are the model's own (`"lm_head.weight"`);
    `written_as`: another family a model of this one is exported as (a multimodal Gemma
    3 checkpoint's text decoder: `"gemma3_text"`), or None.
  - `module_names`: zoo module path → HF module name, `{0}` = the layer number
    (`"layers.layers.attention.q_proj"` → `"model.layers.{0}.self_attn.q_proj"`). Covers
    every module that holds tensors, plus the containers LoRA/peft may name. Fused
    modules (GPT-2's q/k/v in `c_attn`) map several zoo modules onto one HF module.
  - `fused`: zoo module → the zoo modules (in block order) whose tensors Hugging Face
    fuses into one (`_layout.fused_group`): GPT-2's q/k/v in `c_attn`, Phi-3's q/k/v in
    `qkv_proj` and gate/up in `gate_up_proj`; empty for most families.
  - `lora_names`: zoo projection (last path component: `q_proj`, `k_proj`, `v_proj`,
    `o_proj`, `up`, `gate`, `down`) → HF module's last name (`q_proj`, `query`, `c_attn`,
    `gate_proj`, …): what peft `target_modules` spell.
  - `vocab_axes`: zoo leaf path → its vocabulary axis (padded under tensor parallelism).
- methods
  - `config_from_hf(values, **overrides)` → zoo config; refuses what the zoo cannot
    reproduce with a `ValueError` naming the option and why.
  - `config_to_hf(config, base=None)` → `config.json` dict; `base` is the source folder's
    `config.json` (keeps spellings such as `gelu_pytorch_tanh`). Refuses what the
    architecture cannot express.
  - `claims(config)` → whether a config without `family` is this architecture's shape
    (export of models built from scratch: GPT-2-shaped → gpt2, Llama-shaped → llama).
  - `source(module, param, parent, shape, config)` → `Source` (tensor names, stacking,
    transpose, fused block, file shape) or `None`: the tensor-name table.
  - `block(module, config)` → the `Block` of its fused HF tensor that zoo module
    `module` is (widths from the config: unequal for grouped-query q/k/v), or `None`.
  - `ignored(name, config)` → whether a file tensor is a known non-parameter (buffers,
    a tied head, a pooler).
  - `hf_module_name(module, index)` → the HF/peft module name of zoo module `module` at
    layer numbers `index`, or `None` when the table has none.
  - `generation_config(values)` → `generation_config.json` from the HF config dict
    (None for a family that generates nothing: BERT).
  - `file_view(checkpoint)` → the open checkpoint as this family's tensor names read it
    (default: itself; Mixtral and Qwen3-MoE read transformers 5's fused expert tensors as
    one per expert).
  - `builds(model_class)` → whether its checkpoints build a `model_class` (a class or an
    import path; two paths into the zoo compare without importing either).

Registry functions: `register(family)` (a decorator on the class; the instance is
stored), `get_family(name)`, `families()`, `family_of(model_or_config)` (the config's
`family` field, set by `zoo.hf.from_pretrained`, else the first registered family that
`claims` it), `refuse(name, reason)` for architectures the zoo cannot hold (Gemma).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, ClassVar

from .._lazy import is_subclass, resolve_class
from ._layout import Block, Source, is_linear_weight, output_width


class _Imported:
    """A class attribute given as an import path: read, the class, imported then."""

    def __init__(self, path: str):
        self.path = path

    def __get__(self, instance: Any, owner: type | None = None) -> type:
        return resolve_class(self.path)


class Family:
    """One Hugging Face architecture ↔ one zoo model class. Subclass, fill in the class
    attributes and the two config conversions, decorate with `@register`.

    The default `source` reads `module_names`: tensor `<hf module>.<param>`, one per
    layer for modules under the stacked layers, a `Linear` weight transposed (torch
    `[out, in]`), fused modules as blocks of the last axis, vocabulary leaves valid up to
    the real vocabulary (padding rows are zero and never written).
    """

    name: ClassVar[str] = ""
    model_class: ClassVar[type] = object
    config_class: ClassVar[type] = object
    architecture: ClassVar[str] = ""
    auto_class: ClassVar[str] = "AutoModelForCausalLM"
    prefix: ClassVar[str] = ""
    written_as: ClassVar[str | None] = None  # another family a model of this one is exported as
    canonical_prefixed: ClassVar[bool] = False
    head_names: ClassVar[tuple[str, ...]] = ()
    module_names: ClassVar[Mapping[str, str]] = {}
    fused: ClassVar[Mapping[str, tuple[str, ...]]] = {}
    lora_names: ClassVar[Mapping[str, str]] = {}
    # Module-name prefixes of older transformers versions → today's (as a model's
    # `_checkpoint_conversion_mapping`): peft adapters made then still load.
    older_module_prefixes: ClassVar[Mapping[str, str]] = {}
    vocab_axes: ClassVar[Mapping[str, int]] = {}

    def __init_subclass__(cls, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        for name in ("model_class", "config_class"):  # an import path: imported when read
            if isinstance(vars(cls).get(name), str):
                setattr(cls, name, _Imported(vars(cls)[name]))

    def builds(self, model_class: type | str) -> bool:
        """Whether this family's checkpoints build a `model_class` (that class or a
        subclass; a class or its import path). Two import paths into the zoo compare as
        paths: listing the families of a model imports neither."""
        declared = inspect.getattr_static(self, "model_class")
        return is_subclass(declared.path if isinstance(declared, _Imported) else declared, model_class)

    # -- config --

    def config_from_hf(self, values: dict[str, Any], **overrides: Any) -> Any:
        """The zoo config of a `config.json` dict (`overrides`: zoo fields on top);
        refuses, naming each, the options the zoo cannot reproduce."""
        raise NotImplementedError

    def config_to_hf(self, config: Any, base: dict[str, Any] | None = None) -> dict[str, Any]:
        """The `config.json` dict of a zoo config (`base`: the source folder's, for
        spellings to keep); refuses, naming each, the fields it cannot express."""
        raise NotImplementedError

    def claims(self, config: Any) -> bool:
        """Whether a config without `family` has this architecture's shape."""
        return False

    def generation_config(self, values: dict[str, Any]) -> dict[str, Any] | None:
        """`generation_config.json` for a model without one: its token ids (None: the
        family generates nothing and its folders hold none)."""
        out: dict[str, Any] = {"_from_model_config": True}
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if values.get(key) is not None:
                out[key] = values[key]
        return out

    # -- tensors --

    def source(self, module: str, param: str, parent: Any, shape: tuple[int, ...], config: Any) -> Source | None:
        """The file tensors of leaf `param` of zoo module `module` (`parent`, leaf `shape`),
        or `None` when the family has none."""
        if param not in ("weight", "bias"):
            return None
        hf_module = self.module_names.get(module)
        if hf_module is None:
            return None
        stacked = "{0}" in hf_module
        core = tuple(shape[1:] if stacked else shape)
        valid = None
        axis = self.vocab_axes.get(f"{module}.{param}")
        if axis is not None:
            valid = core[:axis] + (config.vocab_size,) + core[axis + 1 :]
        names = (
            tuple(f"{hf_module.format(i)}.{param}" for i in range(shape[0])) if stacked else (f"{hf_module}.{param}",)
        )
        return Source.of(
            names,
            core,
            stacked=int(stacked),
            transpose=self.transposed(module, param, parent),
            block=self.block(module, config),
            valid=valid,
        )

    def file_view(self, checkpoint: Any) -> Any:
        """The open checkpoint as this family's tensor names read it (`keys`, `shape`,
        `read`): the checkpoint itself, unless a family reads another layout of its files."""
        return checkpoint

    def block(self, module: str, config: Any) -> Block | None:
        """The block of its fused Hugging Face tensor that zoo module `module` is, or `None`."""
        group = self.fused.get(module)
        if group is None:
            return None
        return Block(group.index(module), tuple(output_width(config, m) for m in group))

    def transposed(self, module: str, param: str, parent: Any) -> bool:
        """Whether the file holds the transpose (torch `nn.Linear` weights)."""
        return is_linear_weight(parent, param)

    def ignored(self, name: str, config: Any) -> bool:
        """Whether file tensor `name` is a known non-parameter, skipped on load."""
        return False

    def hf_module_name(self, module: str, index: tuple[int, ...] = ()) -> str | None:
        """The HF (peft) name of zoo module `module` at layer numbers `index`, or `None`."""
        hf = self.module_names.get(module)
        return None if hf is None else hf.format(*index)

    # -- file names --

    def canonical_names(self, file_keys: list[str]) -> tuple[dict[str, str], list[str]]:
        """Map checkpoint names onto this family's names.

        **Returns:** `(canonical name → file name, task-head names)`: files of task models
        carry the base model under `prefix`; their other tensors belong to a task head (a
        classifier, an MLM head), returned separately. Names without the prefix are
        accepted as the base model's.
        """
        prefixed = any(k.startswith(self.prefix) for k in file_keys)
        mapping: dict[str, str] = {}
        heads: list[str] = []
        for key in file_keys:
            if prefixed and not key.startswith(self.prefix) and key not in self.head_names:
                heads.append(key)
                continue
            if key in self.head_names:
                name = key
            elif self.canonical_prefixed:
                name = key if key.startswith(self.prefix) else self.prefix + key
            else:
                name = key.removeprefix(self.prefix)
            mapping[name] = key
        return mapping, heads

    def __repr__(self) -> str:
        return f"<zoo.hf family {self.name!r}>"


_REGISTRY: dict[str, Family] = {}
_REFUSED: dict[str, str] = {}


def register(cls: type[Family]) -> type[Family]:
    """Class decorator: add an instance of `cls` to the registry under `cls.name`."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name (the config.json model_type)")
    _REGISTRY[cls.name] = cls()
    return cls


def refuse(name: str, reason: str) -> None:
    """Record an architecture the zoo cannot hold, with the reason loading gives."""
    _REFUSED[name] = reason


def families(model_class: type | None = None) -> dict[str, Family]:
    """The registered families by name, in registration order; with `model_class`, those
    whose zoo model is that class (`zoo.models.Transformer`: the decoders)."""
    return {n: f for n, f in _REGISTRY.items() if model_class is None or f.model_class is model_class}


def get_family(name: str | None, where: str = "") -> Family:
    """The family registered as `name` (a `config.json` `model_type`). Raises a
    `ValueError` naming the registered ones, or the reason the zoo refuses it."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    where = f"{where}: " if where else ""
    if name in _REFUSED:
        raise ValueError(f"{where}model_type {name!r} is not supported: {_REFUSED[name]}")
    raise ValueError(f"{where}model_type {name!r} is not a registered family; zoo.hf loads {sorted(_REGISTRY)}")


def family_of(model_or_config: Any) -> Family:
    """The family of a zoo model (or config): its config's `family` (set when loaded by
    `zoo.hf.from_pretrained`), else the first registered family that claims its shape.
    An `EncoderClassifier` is its encoder's family."""
    target = model_or_config
    if hasattr(target, "encoder") and not hasattr(target, "config"):
        target = target.encoder
    config = getattr(target, "config", target)
    name = getattr(config, "family", None)
    if name is not None:
        return get_family(name)
    for family in _REGISTRY.values():
        if isinstance(config, family.config_class) and family.claims(config):
            return family
    raise TypeError(
        f"no Hugging Face family writes a {type(target).__name__} with this config; registered: "
        f"{sorted(_REGISTRY)} (a zoo.models.Encoder is written as BERT, a Transformer with learned "
        "positions as GPT-2, one with RoPE, RMSNorm and SwiGLU as Llama)"
    )

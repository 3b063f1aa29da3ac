"""Hugging Face Gemma 3 (text) ↔ `zoo.models.Transformer`: Gemma 2 with q/k norms and a
RoPE base for each kind of layer.

Gemma 3's text decoder (`model_type` `"gemma3_text"`, `Gemma3ForCausalLM`) is `gemma2.py`
with three changes. Each query and key head is RMS-normalised over `head_dim` before RoPE
(`self_attn.q_norm`, `self_attn.k_norm`, scaling by `1 + weight` as Gemma's other norms:
`TransformerConfig.qk_norm`). The sliding layers rotate with one base
(`rope_parameters["sliding_attention"]`, formerly `rope_local_base_freq`, 10,000 by
default), the global layers with another (`rope_parameters["full_attention"]`, formerly
`rope_theta`, 1,000,000 by default): `TransformerConfig.rope_thetas`. By default every 6th
layer is global. Soft-capping is off by default, and transformers' Gemma 3 attention never
applies `attn_logit_softcapping` (it keeps the value, its kernels are not given it): zoo
reads it as transformers runs it, not at all, and writes the logits' cap only. The larger
checkpoints' `linear` RoPE scaling of the global layers (a factor per layer kind) is read
and written (`TransformerConfig.rope_factors`); other scalings are refused by name.

The multimodal checkpoints (`model_type` `"gemma3"`, `Gemma3ForConditionalGeneration`:
Gemma 3 4B, 12B, 27B) hold this decoder beside a vision tower; `Gemma3` loads their text
decoder (its config is `text_config`, its tensors those under `language_model.model.`, as
transformers writes them, or `model.language_model.`), skips the vision tower and the
projector, names LoRA modules as transformers' `Gemma3ForConditionalGeneration` holds them
(`model.language_model.layers.{i}...`: peft opens zoo's adapters on the multimodal model),
reads `final_logit_softcapping` as that model runs it (not applied), and writes the model
as its text decoder (`gemma3_text`, `Gemma3ForCausalLM`).

| zoo `Transformer`, layer `i` | Gemma 3 (`Gemma3ForCausalLM`) |
|---|---|
| `layers.layers.attention.{q,k}_norm.weight` | `model.layers.{i}.self_attn.{q,k}_norm.weight` |

The rest as Gemma 2's table.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from .._family import register
from .gemma2 import SANDWICH_NAMES, SANDWICH_NORMS, Gemma2

_QK = {"attention.q_norm": "self_attn.q_norm", "attention.k_norm": "self_attn.k_norm"}
_KINDS = ("sliding_attention", "full_attention")
_DEFAULT_THETA = {"sliding_attention": 10_000.0, "full_attention": 1_000_000.0}  # Gemma3TextConfig.default_theta


def _ropes(values: dict[str, Any]) -> tuple[dict[str, float], dict[str, float], list[str]]:
    """Each attention kind's RoPE base and linear factor (1: none), as transformers'
    `Gemma3TextConfig` reads them (`rope_parameters` per kind, else `rope_theta` with
    `rope_scaling` for the global layers and `rope_local_base_freq` for the sliding ones),
    and what zoo cannot build."""
    params = values.get("rope_parameters") or {}
    if not any(kind in params for kind in _KINDS):
        params = {
            "full_attention": (values.get("rope_scaling") or {}) | {"rope_theta": values.get("rope_theta")},
            "sliding_attention": {"rope_theta": values.get("rope_local_base_freq")},
        }
    thetas, factors, problems = {}, {}, []
    for kind in _KINDS:
        kind_params = params.get(kind) or {}
        theta = kind_params.get("rope_theta")
        thetas[kind] = float(_DEFAULT_THETA[kind] if theta is None else theta)
        factors[kind] = 1.0
        rope_type = kind_params.get("rope_type", kind_params.get("type")) or "default"
        if rope_type == "linear":  # Gemma 3 4B and larger: the global layers' positions stretched 8 times
            factors[kind] = float(kind_params.get("factor", 1.0))
        elif rope_type != "default":
            problems.append(
                f"rope_parameters[{kind!r}] of type {rope_type!r} (zoo's RoPE on Gemma 3 implements 'default' and "
                "'linear')"
            )
    return thetas, factors, problems


@register
class Gemma3Text(Gemma2):
    """Gemma 3's text decoder (`Gemma3ForCausalLM`) ↔ a `zoo.models.Transformer` with
    Gemma 2's layers, `qk_norm` and `rope_thetas`."""

    name = "gemma3_text"
    architecture = "Gemma3ForCausalLM"
    qk_norm_scope = "head"
    module_names = SANDWICH_NAMES | {f"layers.layers.{zoo}": f"model.layers.{{0}}.{hf}" for zoo, hf in _QK.items()}
    offset_norms = SANDWICH_NORMS + tuple(f"layers.layers.{zoo}" for zoo in _QK)
    global_every = 6
    global_every_key = "sliding_window_pattern"  # older files' Gemma3TextConfig kwarg
    cap_defaults: ClassVar[dict[str, float | None]] = {"attn_logit_softcapping": None, "final_logit_softcapping": None}

    def unsupported(self, values: dict[str, Any]) -> list[str]:
        return super().unsupported(values) + _ropes(values)[2]

    def config_from_hf(self, values: dict[str, Any], **overrides: Any):
        thetas, factors, problems = _ropes(values)
        if problems:  # raised with the others, by name
            return super().config_from_hf(values, **overrides)
        # The bases and linear factors per layer go in `fields`; Llama's RoPE reading sees
        # the first layer's base.
        types = self._types(values) or ["full_attention"]
        first = thetas.get(types[0], thetas["full_attention"])  # (other kinds are refused by name)
        params = {
            kind: {"rope_type": "default", "rope_theta": theta}
            | ({"rope_type": "linear", "factor": factors[kind]} if factors[kind] != 1.0 else {})
            for kind, theta in thetas.items()
        }
        plain = values | {"rope_parameters": params, "rope_scaling": None, "rope_theta": first}
        return super().config_from_hf(plain, **overrides)

    def fields(self, values: dict[str, Any]) -> dict[str, Any]:
        thetas, factors, _ = _ropes(values)
        per_layer = tuple(thetas[kind] for kind in self._types(values))
        uniform = len(set(per_layer)) <= 1
        scaled = tuple(factors[kind] for kind in self._types(values))
        fields = super().fields(values) | {"qk_norm": True, "rope_thetas": None if uniform else per_layer}
        fields |= {"rope_factors": None if set(scaled) == {1.0} else scaled}
        return fields | {"attn_logit_softcapping": None}  # transformers' Gemma 3 does not apply it

    def export_problems(self, config: Any) -> list[str]:
        problems = self._rope_problems(config)
        if config.attn_logit_softcapping is not None:
            problems.append(
                f"attn_logit_softcapping={config.attn_logit_softcapping} (transformers' Gemma 3 does not apply it; "
                "Gemma 2 does)"
            )
        return problems

    def _rope_problems(self, config: Any) -> list[str]:
        problems = [p for p in super().export_problems(config) if not p.startswith("rope_thetas")]
        if config.rope_scaling is not None:
            problems.append(f"rope_scaling={config.rope_scaling!r} (zoo writes Gemma 3 with the 'default' RoPE)")
        factors = config.rope_factors or (1.0,) * config.num_layers
        for kind, kind_factors in self._per_kind(config, factors).items():
            if len(kind_factors) > 1:
                problems.append(
                    f"rope_factors with {sorted(kind_factors)} on the {kind} layers (Gemma 3 has one linear factor for "
                    "its sliding layers and one for its global ones)"
                )
        if config.rope_thetas is not None:
            for kind, bases in self._bases(config).items():
                if len(bases) > 1:
                    problems.append(
                        f"rope_thetas with {sorted(bases)} on the {kind} layers (Gemma 3 has one base for its "
                        "sliding layers and one for its global ones)"
                    )
        return problems

    def config_to_hf(self, config: Any, base: dict[str, Any] | None = None) -> dict[str, Any]:
        out = super().config_to_hf(config, base)
        del out["rope_theta"], out["rope_scaling"]
        bases = self._bases(config)
        factors = self._per_kind(config, config.rope_factors or (1.0,) * config.num_layers)
        params = {}
        for kind in _KINDS:
            params[kind] = {"rope_type": "default", "rope_theta": next(iter(bases[kind]), config.rope_theta)}
            factor = next(iter(factors[kind]), 1.0)
            if factor != 1.0:
                params[kind] |= {"rope_type": "linear", "factor": factor}
        return out | {"rope_parameters": params}

    def claims(self, config: Any) -> bool:
        # Gemma's shape with this class's norms, a RoPE base per layer allowed.
        return (
            isinstance(config, self.config_class)
            and config.attn_logit_softcapping is None
            and super().claims(dataclasses.replace(config, rope_thetas=None))
        )

    @staticmethod
    def _bases(config: Any) -> dict[str, set[float]]:
        """The RoPE bases `config` gives its sliding and its global layers."""
        return Gemma3Text._per_kind(config, config.rope_thetas or (config.rope_theta,) * config.num_layers)

    @staticmethod
    def _per_kind(config: Any, values: tuple) -> dict[str, set]:
        """The per-layer `values` of `config`'s sliding and of its global layers."""
        sliding = config.sliding_layers or (config.sliding_window is not None,) * config.num_layers
        return {kind: {v for v, s in zip(values, sliding) if s == (kind == _KINDS[0])} for kind in _KINDS}


_MM_MODULES = "model.language_model."  # where Gemma3ForConditionalGeneration holds the text decoder
_MM_FILES = ("language_model.model.", "model.language_model.")  # its tensors, as written, older layout first
_MM_OTHER = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


@register
class Gemma3(Gemma3Text):
    """The text decoder of a Gemma 3 multimodal checkpoint (`Gemma3ForConditionalGeneration`)
    ↔ a `zoo.models.Transformer` as `Gemma3Text`'s; written back as `gemma3_text`."""

    name = "gemma3"
    architecture = "Gemma3ForConditionalGeneration"
    prefix = _MM_MODULES
    # transformers 4.x held the decoder at `language_model.model.` and the head at
    # `language_model.lm_head` (peft adapters made then; transformers' own renaming).
    older_module_prefixes = {"language_model.model.": _MM_MODULES, "language_model.lm_head.": "lm_head."}
    module_names = {zoo: hf.replace("model.", _MM_MODULES, 1) for zoo, hf in Gemma3Text.module_names.items()}
    written_as = "gemma3_text"

    def config_from_hf(self, values: dict[str, Any], **overrides: Any):
        text = values.get("text_config")
        if not isinstance(text, dict):
            raise ValueError(
                "this gemma3 config has no text_config: a Gemma 3 multimodal config.json holds its text decoder's "
                "settings there"
            )
        tie = values.get("tie_word_embeddings", text.get("tie_word_embeddings", True))
        # transformers' Gemma3ForConditionalGeneration never caps its logits (its text
        # config may hold final_logit_softcapping): read as it runs, not at all.
        text = text | {"model_type": self.name, "tie_word_embeddings": tie, "final_logit_softcapping": None}
        return super().config_from_hf(text, **overrides)

    def canonical_names(self, file_keys: list[str]) -> tuple[dict[str, str], list[str]]:
        """The text decoder's tensors by this family's names; the vision tower's and the
        projector's are left out (zoo loads the text decoder)."""
        mapping: dict[str, str] = {}
        for key in file_keys:
            if key.startswith(_MM_OTHER):
                continue
            for written in _MM_FILES:
                if key.startswith(written):
                    mapping[_MM_MODULES + key.removeprefix(written)] = key
                    break
            else:
                mapping[key] = key  # lm_head.weight, or a name the check reports as unexpected
        return mapping, []

    def claims(self, config: Any) -> bool:
        return False  # a model is written as its text decoder (gemma3_text)

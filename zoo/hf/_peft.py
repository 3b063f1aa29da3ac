"""The Hugging Face / peft names of a zoo model's modules, for LoRA adapters.

A peft adapter names each adapted module as the Hugging Face model it was made on names
it. Which model that is follows from the zoo model: a family's own model class is the
family's task model for its `auto_class` (a `Transformer` is `GPT2LMHeadModel`,
`LlamaForCausalLM`, …: the family tables already carry those names; an `Encoder` is
`BertModel`), and a zoo task model wrapping one is described here
(`EncoderClassifier` is `BertForSequenceClassification`: the encoder under the family's
`prefix`, its own modules named by the family's `lora_task_modules`: `pooler` →
`bert.pooler.dense`, `head` → `classifier`). The name tables live in the family files
(`zoo/hf/_families/*.py`: `module_names`, `fused`, `lora_task_modules`, `lora_absent`);
`zoo.lora` asks only `adapter_names(model)`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ..models import EncoderClassifier
from ._family import Family, family_of
from ._layout import Block, Source

# transformers Auto class of a family's own model → peft `task_type`.
_TASK_TYPES = {"AutoModelForCausalLM": "CAUSAL_LM", "AutoModel": "FEATURE_EXTRACTION"}


@dataclasses.dataclass(frozen=True)
class _Wrapper:
    """A zoo task model around a family model: where the family model sits, its peft task
    type and its HF class. Its own modules' HF names are the family's `lora_task_modules`."""

    inner: str  # the attribute holding the family model
    task_type: str
    architecture: str


# `EncoderClassifier` ↔ `BertForSequenceClassification` (the family's `sequence_classifier`:
# RoBERTa's). Only a CLS-pooling classifier
# computes what BertForSequenceClassification computes: a mean-pooling one is its encoder's
# model (`BertModel`, a FEATURE_EXTRACTION adapter) and a head apart (`adapter_names`).
_WRAPPERS: dict[type, _Wrapper] = {
    EncoderClassifier: _Wrapper(inner="encoder", task_type="SEQ_CLS", architecture="BertForSequenceClassification"),
}


@dataclasses.dataclass(frozen=True)
class AdapterNames:
    """The peft names of one zoo model's modules.

    - `family`: the `zoo.hf` family of the (inner) model.
    - `task_type`: peft's `task_type` for the HF model these names belong to
      (`"CAUSAL_LM"`, `"FEATURE_EXTRACTION"`, `"SEQ_CLS"`).
    - `architecture`: that HF model's class (`"GPT2LMHeadModel"`).
    - `inner`: the zoo attribute holding the family model (`"encoder"`), or `""`.
    - `prefix`: the HF prefix of the family model's names inside the task model (`"bert."`).
    - `own`: the task model's own modules → HF names (`"head"` → `"classifier"`).
    - `not_in_zoo`: HF module names (inside the family model) the zoo model lacks → why
      their branches can be skipped.
    - `cls_pooling`: for a classifier, whether it pools as the HF model does.
    - `apart`: the task model's own modules the HF model lacks (a mean-pooling
      classifier's `head`): an adapter keeps them in a file of their own, not in peft's.
    """

    family: Family
    task_type: str | None
    architecture: str
    inner: str = ""
    prefix: str = ""
    own: Mapping[str, str] = dataclasses.field(default_factory=dict)
    not_in_zoo: Mapping[str, str] = dataclasses.field(default_factory=dict)
    cls_pooling: bool = True
    apart: tuple[str, ...] = ()
    config: Any = None  # the family model's config

    def _split(self, name: str) -> tuple[str, str | None]:
        """`(HF prefix, name inside the family model)`, or `(HF name, None)` for the
        wrapper's own modules."""
        if not self.inner:
            return "", name
        for zoo_name, hf in self.own.items():
            if name == zoo_name or name.startswith(zoo_name + "."):
                return hf + name[len(zoo_name) :], None
        if name == self.inner:
            return self.prefix.rstrip("."), None
        if name.startswith(self.inner + "."):
            return self.prefix, name[len(self.inner) + 1 :]
        return name, None

    def module(self, name: str, index: tuple[int, ...] = ()) -> str | None:
        """The HF module name of zoo module `name` at layer numbers `index`, or `None`."""
        prefix, inner = self._split(name)
        if inner is None:
            return prefix
        hf = self.family.hf_module_name(inner, index)
        return None if hf is None else prefix + hf

    def block(self, name: str) -> Block | None:
        """The `Block` of its fused HF module's outputs that zoo module `name` is, or `None`."""
        _, inner = self._split(name)
        return None if inner is None or self.config is None else self.family.block(inner, self.config)

    def conv1d(self, name: str, node: Any) -> bool:
        """Whether zoo `Linear` `name` is a `Conv1D` in HF (weights `[in, out]`, as zoo's)."""
        _, inner = self._split(name)
        if inner is None:
            return False
        return not self.family.transposed(inner, "weight", node)

    def source(self, name: str, param: str, parent: Any, shape: tuple[int, ...]) -> Source | None:
        """The family's `Source` of leaf `param` of zoo module `name` (orientation, padded
        vocabulary, offset; its names are the base model's), or `None` when it has none."""
        _, inner = self._split(name)
        if inner is None or self.config is None:
            return None
        return self.family.source(inner, param, parent, shape, self.config)

    def current(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """A peft adapter's tensors (`base_model.model.<module>...`) with the module names of
        older transformers versions (`family.older_module_prefixes`: Gemma 3's
        `language_model.model.` of transformers 4.x) renamed as today's, as peft renames
        them by the model's `_checkpoint_conversion_mapping` (its config's explicit
        `target_modules` names it does not rename, nor does zoo)."""
        older = getattr(self.family, "older_module_prefixes", {})
        if not older or self.inner:
            return tensors
        at = "base_model.model."
        renamed = {}
        for key, value in tensors.items():
            for old, new in older.items():
                if key.startswith(at + old):
                    key = at + new + key[len(at + old) :]
                    break
            renamed[key] = value
        return renamed

    def skipped(self, hf_name: str) -> str | None:
        """Why an HF module name the zoo model lacks may be skipped, or `None`."""
        if not hf_name.startswith(self.prefix):
            return None
        return self.not_in_zoo.get(hf_name[len(self.prefix) :])


def adapter_names(model: Any) -> AdapterNames | None:
    """The peft names of `model`'s modules, or `None` when no Hugging Face family writes
    it (its adapters then keep zoo names, which peft cannot open)."""
    wrapper = _WRAPPERS.get(type(model))
    inner = getattr(model, wrapper.inner) if wrapper else model
    try:
        family = family_of(inner)
    except (TypeError, ValueError):
        return None
    if not isinstance(inner, family.model_class):
        return None
    if wrapper is None:
        return AdapterNames(
            family=family,
            task_type=_TASK_TYPES.get(family.auto_class),
            architecture=family.architecture,
            not_in_zoo=getattr(family, "lora_absent", {}),
            config=getattr(inner, "config", None),
        )
    own = getattr(family, "lora_task_modules", {})
    if getattr(model, "pooling", "cls") != "cls":
        # Mean pooling: the encoder is the family's own model under its own names (what
        # peft and sentence-transformers read as features); the head, which that model
        # lacks, keeps its HF name (`classifier`) but lies apart.
        return AdapterNames(
            family=family,
            task_type=_TASK_TYPES.get(family.auto_class),
            architecture=family.architecture,
            inner=wrapper.inner,
            own={k: v for k, v in own.items() if k == "head"},
            not_in_zoo=getattr(family, "lora_absent", {}),
            cls_pooling=False,
            apart=("head",),
            config=getattr(inner, "config", None),
        )
    if not own:  # no peft names for this family's task model (RoBERTa's classifier head)
        return None
    return AdapterNames(
        family=family,
        task_type=wrapper.task_type,
        architecture=getattr(family, "sequence_classifier", None) or wrapper.architecture,
        inner=wrapper.inner,
        prefix=family.prefix,
        own=own,
        config=getattr(inner, "config", None),
    )


def source_of(model: Any) -> str | None:
    """The folder `zoo.hf` loaded `model` (or the family model inside it) from: its
    config's `source_dir`, or `None`."""
    wrapper = _WRAPPERS.get(type(model))
    inner = getattr(model, wrapper.inner) if wrapper else model
    return getattr(getattr(inner, "config", None), "source_dir", None)


__all__ = ["AdapterNames", "adapter_names", "source_of"]

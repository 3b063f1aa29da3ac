"""The `--lora KEY=VALUE,...` flag's help and each command's defaults. The text form itself
(`parse_lora`, `lora_text`) and adding the adapters (`add_lora`) are `zoo.train._lora`'s."""

from __future__ import annotations

from typing import Any

# Modules trained in full besides the adapters when `save=` is not given: a classifier's
# head is new for the task (peft's modules_to_save=["classifier"] for sequence
# classification); `save=none` freezes it too.
CLASSIFIER_SAVE = ("head",)

LORA_HELP = (
    "Keys: r (rank), alpha (lora_alpha; scaling alpha/r), dropout (the branches' input dropout), "
    "targets (Linear names joined by '+', e.g. q_proj+v_proj, or all-linear), exclude (names joined "
    "by '+'), rslora (true/false: scaling alpha/sqrt(r)), save (modules_to_save, names joined by '+', "
    "trained in full; a classifier's default is head, its new classification head; save=none "
    "freezes it)"
)


def inspect_defaults(model: str) -> dict[str, Any]:
    """`inspect`/`info --lora` defaults: the attention's query and value projections
    (peft's default for LLaMA/BERT-style models; every hidden Linear for the MLP, which has
    no attention), the classifier's head trained in full."""
    fields: dict[str, Any] = {"target_modules": "all-linear" if model == "mlp" else ("q_proj", "v_proj")}
    if model in ("encoder", "minilm"):
        fields["modules_to_save"] = CLASSIFIER_SAVE
    return fields


def finetune_defaults(classifier: bool) -> dict[str, Any]:
    """`finetune --lora` defaults: r=8, alpha=16 (scaling 2) on every Linear layer but the
    output head (`all-linear`, as peft), a classifier's new head trained in full."""
    fields: dict[str, Any] = {"r": 8, "lora_alpha": 16, "target_modules": "all-linear"}
    if classifier:
        fields["modules_to_save"] = CLASSIFIER_SAVE
    return fields

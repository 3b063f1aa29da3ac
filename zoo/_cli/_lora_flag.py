"""The `--lora KEY=VALUE,...` flag's help and the pinned collectives' LoRA. The text form
itself (`parse_lora`, `lora_text`) and adding the adapters (`add_lora`) are the
library's (`zoo.internal`); `finetune`'s defaults are the model's (`ModelSpec.lora_defaults`)."""

from __future__ import annotations

from typing import Any

from ..internal import CLASSIFIER_SAVE

LORA_HELP = (
    "Keys: r (rank), alpha (lora_alpha; scaling alpha/r), dropout (the branches' input dropout), "
    "targets (Linear names joined by '+', e.g. q_proj+v_proj, or all-linear), exclude (names joined "
    "by '+'), rslora (true/false: scaling alpha/sqrt(r)), save (modules_to_save, names joined by '+', "
    "trained in full; a classifier's default is head, its new classification head; save=none "
    "freezes it), use_dora (true/false: DoRA, a trained magnitude per output), "
    "init_lora_weights (true, gaussian, pissa or olora: peft's initialisations), ensure_weight_tying "
    "(true/false: a tied head adapted with its embedding, targets embedding+lm_head), trainable_token_indices "
    "(token ids joined by '+': only those embedding rows train)"
)


def inspect_defaults(model: str) -> dict[str, Any]:
    """The LoRA of the pinned collectives (tests/data/step_collectives.json) and the
    benchmarks: the attention's query and value projections
    (peft's default for LLaMA/BERT-style models; every hidden Linear for the MLP, which has
    no attention), the classifier's head trained in full."""
    fields: dict[str, Any] = {"target_modules": "all-linear" if model == "mlp" else ("q_proj", "v_proj")}
    if model in ("encoder", "minilm"):
        fields["modules_to_save"] = CLASSIFIER_SAVE
    return fields

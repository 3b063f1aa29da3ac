"""The `--lora KEY=VALUE,...` flag's help. The text form
itself (`parse_lora`, `lora_text`) and adding the adapters (`add_lora`) are the
library's (`zoo.internal`); `finetune`'s defaults are the model's (`ModelSpec.lora_defaults`)."""

from __future__ import annotations

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

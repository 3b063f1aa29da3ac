"""The LoRA configuration, with peft's field names and meanings."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

# The initialisations zoo computes; the last two change the base (it keeps a residual).
INITS = (True, False, "gaussian", "pissa", "olora")
MUTATING = ("pissa", "olora")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """What to adapt and how, as `peft.LoraConfig` says it.

    **Fields:**

    - `r`: rank of the update `B·A` (> 0, at most min(in, out) of every target).
    - `lora_alpha`: scale numerator: the branch adds `lora_alpha / r · x A B`
      (`lora_alpha / √r` with `use_rslora`).
    - `lora_dropout`: dropout on the branch's input (needs per-example keys, see
      `zoo.nn.example_keys`).
    - `target_modules`: which `Linear` layers get a branch: a list of names (a module
      matches when its dotted path equals the name or ends with `.name`, e.g. `"q_proj"`),
      a string regex matched against the whole path, or `"all-linear"` (every `Linear`
      except output layers: `lm_head`, `head`, `output_layer`). For models of a `zoo.hf`
      family the Hugging Face / peft names match too (`"query"`, `"gate_proj"`,
      `"c_attn"`: GPT-2's fused q/k/v picks `q_proj`, `k_proj` and `v_proj`).
    - `exclude_modules`: names or a regex, as `target_modules`, removed from the targets.
    - `target_parameters`: a mixture of experts' stacked expert weights to adapt (peft's
      field of that name, its `lora.ParamWrapper`): a list of names, each matching an
      expert projection by zoo name (`"gate"`, `"up"`, `"down"`,
      `"layers.layers.mlp.down"`) or, for a `zoo.hf` family, by its transformers-5
      parameter at every layer as peft matches it (`"mlp.experts.gate_up_proj"` picks
      gate and up, fused there; `"down_proj"`). Each expert gets its own rank-`r` branch
      (`zoo.lora.LoraExpertLinear`). With it, `target_modules` may be empty (`[]`).
      No dropout, DoRA, PiSSA or OLoRA there (peft refuses them too).
    - `use_rslora`: rank-stabilised scaling `lora_alpha / √r`.
    - `init_lora_weights`: `True` (A uniform ±1/√in as torch's kaiming-uniform(a=√5), B = 0:
      the model's output is unchanged at init), `"gaussian"` (A normal(0, 1/r), B = 0),
      `"pissa"` (A, B the top-`r` singular directions of the base weight, √(σ/scaling) on
      each side; the base keeps the residual `W − scaling·A B`), `"olora"` (B, A the first
      `r` columns of Q and rows of R of the base weight's QR; the base keeps the
      residual), or `False` (both random: for tests only; the output changes). PiSSA and
      OLoRA change the base: save with `path_initial_model_for_weight_conversion`
      (`zoo.lora.save_adapter`) for an adapter of the original base.
    - `modules_to_save`: a list of names of modules trained (and saved) in full besides
      the adapters, e.g. a new classification `"head"` (`"classifier"` in BERT's names).
      As peft (0.22 on) matches them, an entry picks every module whose name, zoo or
      Hugging Face, is the entry or ends with `.entry`: `"norm"` picks a Llama's
      `final_norm` (`model.norm`), `"input_layernorm"` each layer's `attention_norm`;
      per-layer ones at every layer of their stack. An entry that picks nothing is an
      error.
    - `use_dora`: DoRA (weight-decomposed LoRA): each adapted `Linear` also trains a
      magnitude vector `m` `[out]` and computes `m / ‖W + scaling·A B‖ · x (W + scaling·A B)`,
      the norm over each output's column held constant in the backward pass, as peft.
    - `ensure_weight_tying`: with `target_modules` naming the token embedding and
      `"lm_head"` on a model whose head is that embedding (tied), the head's branch is the
      embedding's: the two stay one weight (peft's option; without it peft would give the
      tied head an adapter of its own, which zoo refuses). Naming only the embedding adapts
      the input rows and leaves the tied head's scores on the base table, as peft does.
    - `trainable_token_indices`: peft's TrainableTokens: the token ids whose rows of the
      token embedding train (and are saved), the rest of the table frozen; a tied head
      scores against the same rows. A list, or peft's `{"embed_tokens": [...]}` naming
      the token embedding.
    - `bias`: only `"none"` (biases stay frozen), as peft's default.
    """

    r: int = 8
    lora_alpha: float | int = 8.0
    lora_dropout: float | int = 0.0
    target_modules: tuple[str, ...] | list[str] | str = ("q_proj", "v_proj")
    exclude_modules: tuple[str, ...] | list[str] | str | None = None
    target_parameters: tuple[str, ...] | list[str] | None = None
    use_rslora: bool = False
    init_lora_weights: bool | str = True  # True, False, "gaussian", "pissa", "olora" (checked below)
    modules_to_save: tuple[str, ...] | list[str] | None = None
    bias: Literal["none"] = "none"
    use_dora: bool = False
    ensure_weight_tying: bool = False
    trainable_token_indices: tuple[int, ...] | list[int] | dict[str, Any] | None = None

    def __post_init__(self):
        # Lists (as peft takes them, or from JSON) become tuples: the config stays hashable.
        tokens = self.trainable_token_indices
        if isinstance(tokens, dict):
            if len(tokens) != 1:
                raise ValueError(
                    f"LoraConfig.trainable_token_indices: zoo trains rows of the token embedding only; got {tokens!r}: "
                    "give a list of token ids, or {'embed_tokens': [...]}"
                )
            tokens = next(iter(tokens.values()))
        if tokens is not None:
            if not isinstance(tokens, list | tuple) or not all(isinstance(i, int) and i >= 0 for i in tokens):
                raise ValueError(
                    f"LoraConfig.trainable_token_indices must be token ids (non-negative ints), got {tokens!r}"
                )
            if len(set(tokens)) != len(tokens) or not tokens:
                raise ValueError(f"LoraConfig.trainable_token_indices must be distinct and non-empty, got {tokens!r}")
            object.__setattr__(self, "trainable_token_indices", tuple(tokens))
        for name in ("target_modules", "exclude_modules", "modules_to_save", "target_parameters"):
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
        if isinstance(self.modules_to_save, str):
            # peft would match each character of a string as a name: refuse it.
            raise TypeError(
                f"LoraConfig.modules_to_save takes a list of module names, got the string "
                f"{self.modules_to_save!r}: write [{self.modules_to_save!r}]"
            )
        if not isinstance(self.r, int) or self.r <= 0:
            raise ValueError(f"LoraConfig.r must be a positive int, got {self.r!r}")
        alpha = self.lora_alpha
        if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
            raise ValueError(f"LoraConfig.lora_alpha must be a finite number, got {alpha!r}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"LoraConfig.lora_dropout must be in [0, 1), got {self.lora_dropout}")
        if self.init_lora_weights not in INITS:
            hint = ""
            if isinstance(self.init_lora_weights, str) and self.init_lora_weights.startswith("pissa_niter_"):
                hint = (
                    " (peft's pissa_niter_K is a randomized SVD drawn from torch's generator, which zoo cannot "
                    "reproduce: 'pissa' computes the exact SVD)"
                )
            raise ValueError(
                f"LoraConfig.init_lora_weights must be one of True, False, 'gaussian', 'pissa', 'olora', got "
                f"{self.init_lora_weights!r}{hint}"
            )
        if self.use_dora and self.init_lora_weights in MUTATING:
            raise ValueError(
                f"LoraConfig: use_dora with init_lora_weights={self.init_lora_weights!r} is not supported (the "
                "conversion to an adapter of the original base is defined for plain LoRA only): choose one"
            )
        if self.bias != "none":
            raise ValueError(f"LoraConfig.bias: only 'none' is supported (biases stay frozen), got {self.bias!r}")
        if isinstance(self.target_parameters, str):
            raise TypeError(
                f"LoraConfig.target_parameters takes a list of parameter names, got the string "
                f"{self.target_parameters!r}: write [{self.target_parameters!r}]"
            )
        if self.target_parameters:
            refused = {
                "lora_dropout": self.lora_dropout > 0,
                "use_dora": self.use_dora,
                f"init_lora_weights={self.init_lora_weights!r}": self.init_lora_weights in MUTATING,
            }
            wrong = [k for k, v in refused.items() if v]
            if wrong:
                raise ValueError(
                    f"LoraConfig: target_parameters (LoRA on the experts) does not work with {', '.join(wrong)}, as "
                    "peft's ParamWrapper refuses them: drop them, or adapt the experts in a second run"
                )
        if not self.target_modules and not self.target_parameters:
            raise ValueError(
                "LoraConfig.target_modules is empty; name the Linear layers to adapt, or 'all-linear' (or name "
                "the experts' weights in target_parameters)"
            )

    @property
    def scaling(self) -> float:
        """The branch's scale: `lora_alpha / r`, or `lora_alpha / √r` with `use_rslora`."""
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    def to_peft_dict(self, target_names: list[str] | None = None) -> dict[str, Any]:
        """The `adapter_config.json` contents peft writes for this config."""
        targets = (
            self.target_modules if isinstance(self.target_modules, str) else list(target_names or self.target_modules)
        )
        return {
            "peft_type": "LORA",
            "task_type": None,
            "r": self.r,
            "lora_alpha": self.lora_alpha,
            "lora_dropout": self.lora_dropout,
            "target_modules": targets,
            "exclude_modules": self.exclude_modules
            if isinstance(self.exclude_modules, str | None)
            else list(self.exclude_modules),
            "target_parameters": None if self.target_parameters is None else list(self.target_parameters),
            "use_rslora": self.use_rslora,
            "init_lora_weights": self.init_lora_weights,
            "modules_to_save": None if self.modules_to_save is None else list(self.modules_to_save),
            "bias": self.bias,
            "use_dora": self.use_dora,
            "ensure_weight_tying": self.ensure_weight_tying,
            "trainable_token_indices": None
            if self.trainable_token_indices is None
            else list(self.trainable_token_indices),
            "fan_in_fan_out": False,
            "inference_mode": True,
        }

    @classmethod
    def from_peft_dict(cls, values: dict[str, Any]) -> LoraConfig:
        """A config from `adapter_config.json` contents (keys zoo does not use are ignored)."""
        if values.get("peft_type", "LORA") != "LORA":
            raise ValueError(f"not a LoRA adapter: peft_type is {values.get('peft_type')!r}")
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in fields and v is not None})

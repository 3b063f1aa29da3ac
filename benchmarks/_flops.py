"""Model FLOPs of a decoder's training step, and its model FLOPs utilisation (MFU).

`step_flops` counts a training step's matmul FLOPs from the model's Hugging Face
`config.json` (the standard accounting: PaLM, appendix B; MaxText; Levanter), `peak_tflops`
reads an accelerator's dense peak from `PEAKS` by `jax.devices()[0].device_kind`, and
`utilisation` divides. This module imports neither jax nor torch (`real_size.py`'s torch
worker imports it, and its resident memory must be torch's alone): the callers hand in
the device kind and the matmul arithmetic (`matmul_arithmetic`) their side runs.

The scripts run as `python benchmarks/<script>.py`, which puts this folder on `sys.path`:
they import this module as `_flops`.
"""

from __future__ import annotations

import re


def _dims(config: dict) -> tuple[int, int, int, int, int]:
    """`(hidden, intermediate, heads, kv_heads, head_dim)` of a Llama-shaped `config.json`."""
    d, heads = config["hidden_size"], config["num_attention_heads"]
    return (
        d,
        config["intermediate_size"],
        heads,
        config.get("num_key_value_heads") or heads,
        config.get("head_dim") or d // heads,
    )


def layer_weights(config: dict) -> tuple[tuple[int, int, int], ...]:
    """`(in, out, count)` of one decoder layer's matmul weights: the query projection, the
    key and value ones, the output one, a gated MLP's gate and up, its down. The one list
    `matmul_params`, `lora_params` and `weight_matmuls` count from."""
    d, f, heads, kv, head_dim = _dims(config)
    return ((d, heads * head_dim, 1), (d, kv * head_dim, 2), (heads * head_dim, d, 1), (d, f, 2), (f, d, 1))


def matmul_params(config: dict) -> tuple[int, int]:
    """`(per_layer, head)`: the weights one decoder layer's matmuls multiply by (the
    query, key, value and output projections and a gated MLP's gate, up and down:
    `layer_weights`) and the LM head's (`hidden_size × vocab_size`, tied or not: its matmul
    runs either way). Biases and norms are left out (a few thousand elementwise FLOPs per
    token), and so is the embedding lookup (a gather, no matmul).

    **Arguments:** `config`, a Llama-shaped `config.json` as a dict (HF names:
    `hidden_size`, `intermediate_size`, `num_hidden_layers`, `num_attention_heads`,
    `num_key_value_heads`, `head_dim` (default `hidden_size / num_attention_heads`),
    `vocab_size`).
    """
    per_layer = sum(fan_in * fan_out * count for fan_in, fan_out, count in layer_weights(config))
    return per_layer, config["hidden_size"] * config["vocab_size"]


def lora_params(config: dict, rank: int) -> int:
    """The parameters of rank-`rank` LoRA branches on every linear layer of every decoder
    layer (peft's `target_modules="all-linear"`: not the LM head): `rank × (in + out)` each."""
    sides = sum((fan_in + fan_out) * count for fan_in, fan_out, count in layer_weights(config))
    return config["num_hidden_layers"] * rank * sides


def forward_flops(config: dict, batch: int, seq: int) -> float:
    """The matmul FLOPs of one forward pass over `batch × seq` tokens: `2·N·T` for the `N`
    weights `matmul_params` counts (`T = batch·seq` tokens), plus attention's score and
    value matmuls, `2 × 2·layers·T·seq·(heads·head_dim)`: every query against all `seq`
    keys, the causal mask's skipped half not subtracted (PaLM's convention, and what a
    dense attention computes)."""
    per_layer, head = matmul_params(config)
    layers, tokens = config["num_hidden_layers"], batch * seq
    _, _, heads, _, head_dim = _dims(config)
    width = heads * head_dim
    return 2 * (layers * per_layer + head) * tokens + 2 * 2 * layers * tokens * seq * width


def step_flops(config: dict, batch: int, seq: int, *, lora_rank: int | None = None) -> float:
    """The model FLOPs of one training step on `batch × seq` tokens (remat's recompute not
    counted: the hardware does more, the model needs this much).

    - Full fine-tuning: `3 ×` the forward (`forward_flops`): the backward pass computes
      each matmul's activation gradient and its weight gradient, `2·N·T` each: `6·N·T`
      for the weights, PaLM's `6N` per token.
    - LoRA (`lora_rank`, on every linear layer): the frozen weights get no weight-gradient
      matmul, so they cost `4·N·T` (forward, activation gradients); the branches' own
      `n` parameters (`lora_params`) are trained, `6·n·T`. Attention's score and value
      matmuls are `3 ×` their forward either way: both operands are activations, and the
      backward needs both gradients to reach the projections below. (Counting `6·N·T` for
      a LoRA step, as some do, gives 1.5x the weights' share.)
    """
    per_layer, head = matmul_params(config)
    weights = 2 * (config["num_hidden_layers"] * per_layer + head) * batch * seq
    attention = forward_flops(config, batch, seq) - weights
    if lora_rank is None:
        return 3 * (weights + attention)
    return 2 * weights + 6 * lora_params(config, lora_rank) * batch * seq + 3 * attention


def weight_matmuls(config: dict, batch: int, seq: int, *, lora: bool = True) -> list[tuple[int, int, int, str, int]]:
    """The weight matmuls of one training step on `batch × seq` tokens, as
    `(m, k, n, form, count)`: `form` `"nn"` is `a[m, k] @ b[k, n]`, `"nt"` `a[m, k] @ b[n, k]ᵀ`,
    `"tn"` `a[k, m]ᵀ @ b[k, n]`; `count` how many a step runs. Each weight `W[in, out]`
    (stored as a Linear holds it, `[in, out]`) runs its forward `x @ W` (`nn`) and its
    activation gradient `dy @ Wᵀ` (`nt`); without `lora` (a full fine-tune) also its weight
    gradient `xᵀ @ dy` (`tn`). Their FLOPs, `2·m·k·n·count`, are `step_flops`'s weight
    term (`4·N·T`, or `6·N·T`). Left out, as `real_size.py --mfu` says: attention's score
    and value matmuls (batched, a few percent at these sizes) and LoRA's rank-r products.

    **Arguments:** `config`, a Llama-shaped `config.json` as a dict (see `matmul_params`);
    `batch`, `seq`; `lora`: the frozen weights get no weight gradient."""
    layers, tokens = config["num_hidden_layers"], batch * seq
    shapes = {}  # (in, out) -> weights of that shape in a step
    for fan_in, fan_out, per_layer in layer_weights(config):
        shapes[fan_in, fan_out] = shapes.get((fan_in, fan_out), 0) + per_layer * layers
    head = (config["hidden_size"], config["vocab_size"])
    shapes[head] = shapes.get(head, 0) + 1
    out = []
    for (fan_in, fan_out), count in shapes.items():
        out += [(tokens, fan_in, fan_out, "nn", count), (tokens, fan_out, fan_in, "nt", count)]
        if not lora:
            out.append((fan_in, tokens, fan_out, "tn", count))
    return out


def matmul_operands(m: int, k: int, n: int, form: str) -> tuple[tuple[int, int], tuple[int, int]]:
    """The shapes of `a` and `b` for a `weight_matmuls` entry (`form` as there)."""
    return {"nn": ((m, k), (k, n)), "nt": ((m, k), (n, k)), "tn": ((k, m), (k, n))}[form]


def multiply(a, b, form: str):
    """`a @ b` in a `weight_matmuls` `form` (jax arrays or torch tensors alike)."""
    if form == "nt":
        return a @ b.T
    return a.T @ b if form == "tn" else a @ b


# Dense (no sparsity) peak TFLOP/s per chip, by the matmul arithmetic: `bf16` (bfloat16 or
# float16 inputs, float32 accumulation), `tf32` (float32 on NVIDIA tensor cores), `fp32`
# (float32 on CUDA cores). Vendor figures; NVIDIA's datasheets list the tensor-core ones
# "with sparsity", halved here:
# - H100 SXM / PCIe: NVIDIA H100 datasheet (BF16 1,979 / 1,513 sparse, TF32 989 / 756
#   sparse, FP32 67 / 51).
# - H200 SXM / NVL: NVIDIA H200 datasheet (BF16 1,979 / 1,671 sparse, TF32 989 / 835
#   sparse, FP32 67 / 60).
# - A100 (SXM and PCIe, 40 and 80 GB): NVIDIA A100 datasheet (BF16 312, TF32 156 dense;
#   FP32 19.5).
# - L4: NVIDIA L4 datasheet (BF16 242, TF32 120 sparse; FP32 30.3).
# - TPU v4 275, v5e 197, v5p 459, v6e (Trillium) 918 bf16 TFLOPS per chip: Google Cloud's
#   TPU system-architecture pages. Google publishes no float32 peak (float32 matmuls run
#   as bfloat16 passes).
# Keys: regular expressions matched against the lowercased `device_kind` in full.
PEAKS: dict[str, dict[str, float]] = {
    r"nvidia h100 (80gb hbm3|sxm.*)": {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9},
    r"nvidia h100 pcie": {"bf16": 756.5, "tf32": 378.0, "fp32": 51.2},
    r"nvidia h200( 141gb hbm3e)?": {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9},
    r"nvidia h200 nvl": {"bf16": 835.5, "tf32": 417.5, "fp32": 60.0},
    r"nvidia a100.*": {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5},
    r"nvidia l4": {"bf16": 121.0, "tf32": 60.0, "fp32": 30.3},
    r"tpu v4": {"bf16": 275.0},
    r"tpu v5 lite|tpu v5e": {"bf16": 197.0},
    r"tpu v5|tpu v5p": {"bf16": 459.0},
    r"tpu v6 lite|tpu v6e": {"bf16": 918.0},
}


def matmul_arithmetic(dtype: str, platform: str, float32_precision: str | None) -> str:
    """The arithmetic a run's matmuls use (a `PEAKS` column): `bf16` for bfloat16 or float16;
    for float32, by the framework's setting `float32_precision`: jax's
    `jax_default_matmul_precision` (None: its default, TF32 on NVIDIA GPUs since Ampere,
    one bfloat16 pass on TPU) or torch's `get_float32_matmul_precision()` (`"highest"`,
    its default: true float32; `"high"`: TF32; `"medium"`: bfloat16).

    **Arguments:** `dtype`, the compute dtype (`"float32"`, `"bfloat16"`, `"float16"`);
    `platform`, `"gpu"`, `"tpu"` or `"cpu"`; `float32_precision`, as above."""
    if dtype in ("bfloat16", "float16"):
        return "bf16"
    setting = (float32_precision or "default").lower()
    if setting in ("highest", "float32", "f32_f32_f32"):
        return "fp32"
    if setting in ("medium", "bfloat16", "fastest", "bf16_bf16_f32"):
        return "bf16"
    if setting in ("high", "tensorfloat32", "tf32_tf32_f32"):
        return "tf32" if platform == "gpu" else "bf16"  # TPU: three bfloat16 passes, not counted apart
    return {"gpu": "tf32", "tpu": "bf16"}.get(platform, "fp32")  # jax's default


def peak_tflops(device_kind: str, arithmetic: str, override: float | None = None) -> float | None:
    """The dense peak TFLOP/s of one `device_kind` chip (`jax.devices()[0].device_kind`) in
    `arithmetic` (`matmul_arithmetic`), from `PEAKS`; `override` (`--peak-tflops`) wins;
    None where neither knows it (a CPU, an unlisted accelerator, float32 on a TPU)."""
    if override is not None:
        return override
    kind = device_kind.strip().lower()
    for pattern, peaks in PEAKS.items():
        if re.fullmatch(pattern, kind):
            return peaks.get(arithmetic)
    return None


def utilisation(flops: float, seconds: float, peak: float | None) -> tuple[float, float | None]:
    """`(achieved TFLOP/s, MFU)`: `flops` done in `seconds`, and that over `peak` TFLOP/s
    (None when the peak is unknown)."""
    achieved = flops / seconds / 1e12
    return achieved, (None if peak is None else achieved / peak)

"""Memory and accuracy of a bfloat16, int8 or NF4 frozen base (`zoo.lora.cast_frozen`) against float32.

For `vs_torch.py`'s two LoRA workloads (all-MiniLM-L6-v2 with r=8 on every linear layer and
a trained 8-way head; the ~30M Llama-shaped decoder with r=8 on q/k/v/o and the MLP), the
zoo LoRA step is compiled on one CPU device with the frozen base in float32, in bfloat16
in int8 (the adapted projections int8 with a float32 scale per output channel, the
other frozen leaves bfloat16; LoRA A/B and the head stay float32; compute is float32, the
weights are upcast where used) and in NF4 (QLoRA: the adapted projections 4-bit, a float32
scale per 64 inputs, the rest as for int8). Printed per variant: resident parameter bytes, the compiled step's
`memory_analysis()` (arguments = parameters + optimizer state + batch, outputs, peak
temporaries), the step time (interleaved rounds), and the output difference against
float32 (MiniLM: the mean-pooled sentence embeddings, max |diff| and the lowest cosine
similarity; decoder: max |logit diff| and the loss).

Then, at real size (issue 46: at least 0.3B parameters), a Llama-shaped decoder of ~0.35B
parameters with LoRA r=8 on every projection: its parameter bytes with the frozen base in
float32, bfloat16, int8 and NF4, and each one's ratio to float32 (measured on the arrays,
not computed from shapes; no step: one takes tens of seconds on two cores).

    python benchmarks/bf16_memory.py [--rounds 3] [--no-large]
"""

from __future__ import annotations

import argparse

import _harness
import vs_torch


def mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-large", action="store_true", help="skip the ~0.35B model's parameter bytes")
    args = p.parse_args()

    import equinox as eqx
    import jax
    import jax.numpy as jnp

    import zoo
    from zoo.models import mean_pool

    rows = []
    for name in ("minilm-lora", "llama-lora"):
        model, step, batch = vs_torch.zoo_workload(name)
        jbatch = jax.tree.map(jnp.asarray, batch)
        config = None if name == "llama-lora" else zoo.lora.LoraConfig(modules_to_save=("head",))
        variants = {
            "float32": model,
            "bfloat16": zoo.lora.cast_frozen(model, jnp.bfloat16, config=config),
            "int8": zoo.lora.cast_frozen(model, jnp.int8, config=config),
            "nf4": zoo.lora.cast_frozen(model, "nf4", config=config),
        }
        compiled, outputs, steps = {}, {}, {}
        for dtype, m in variants.items():
            # The int8 model's tree differs (scales, QuantizedLinear bases): its own filter.
            steps[dtype] = zoo.TrainStep(step.loss_fn, step.optimizer, trainable=zoo.lora.trainable(m, config))
            opt_state = steps[dtype].init(m)
            compiled[dtype] = (steps[dtype].compile(m, opt_state, jbatch), m, opt_state)
            if name == "minilm-lora":
                mask = jbatch["mask"]
                hidden = eqx.filter_jit(lambda m, t, k: m.encoder(t, mask=k))(m, jbatch["tokens"], mask)
                outputs[dtype] = mean_pool(hidden, mask)
            else:
                outputs[dtype] = eqx.filter_jit(lambda m, t: m(t))(m, jbatch["tokens"])

        def call(v, compiled=compiled, jbatch=jbatch):
            jax.block_until_ready(compiled[v][0](*compiled[v][1:], jbatch))

        timing = _harness.time_rounds(call, tuple(variants), args.rounds)
        ref = outputs["float32"]
        for dtype, (c, m, _) in compiled.items():
            mem = c.memory_analysis()
            out = outputs[dtype]
            if name == "minilm-lora":
                cos = jnp.sum(out * ref, -1) / (jnp.linalg.norm(out, axis=-1) * jnp.linalg.norm(ref, axis=-1))
                diff = f"max |emb diff| {float(jnp.max(jnp.abs(out - ref))):.2e}, min cosine {float(jnp.min(cos)):.6f}"
            else:
                diff = f"max |logit diff| {float(jnp.max(jnp.abs(out - ref))):.2e} (logits up to {float(jnp.max(jnp.abs(ref))):.1f})"
            loss = float(steps[dtype].loss_and_grads(m, jbatch)[0])
            rows.append(
                [
                    name,
                    dtype,
                    mib(sum(x.nbytes for x in jax.tree.leaves(eqx.filter(m, eqx.is_array)))),
                    mib(mem.argument_size_in_bytes),
                    mib(mem.output_size_in_bytes),
                    mib(mem.temp_size_in_bytes),
                    f"{timing.medians()[dtype]:.0f}",
                    f"{loss:.6f}",
                    "-" if dtype == "float32" else diff,
                ]
            )
            print(" | ".join(rows[-1]), flush=True)
    header = [
        "workload",
        "frozen base",
        "params MiB",
        "step args MiB",
        "step outputs MiB",
        "step temp MiB",
        "step ms",
        "loss",
        "output vs float32",
    ]
    print()
    print("\n".join(_harness.table(header, rows, left=2)))
    print(f"loadavg {vs_torch.loadavg()}")
    if not args.no_large:
        large_parameter_bytes()


def large_parameter_bytes() -> None:
    """Parameter bytes of a ~0.35B Llama-shaped LoRA model per frozen-base storage: the
    whole model, and the adapted projections' bases alone (NF4's codes and scales, or its
    double-quantised scales: `nf4:dq`)."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    import zoo
    from zoo._tree import node_at
    from zoo.models import Transformer, TransformerConfig

    config = TransformerConfig(
        vocab_size=32000, d_model=1024, num_heads=16, num_kv_heads=8, num_layers=24, mlp_dim=2816, max_len=2048,
        activation="swiglu", norm="rmsnorm", positions="rope", tie_embeddings=False, use_bias=False,
    )  # fmt: skip
    lora = zoo.lora.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")
    model = zoo.lora.add_lora(Transformer(config, key=jax.random.key(0)), lora, key=jax.random.key(1))

    def size(m) -> int:
        return sum(x.nbytes for x in jax.tree.leaves(eqx.filter(m, eqx.is_array)))

    def bases(m) -> int:
        return sum(size(node_at(m, p).base) for p, _ in zoo.lora.modules(m, zoo.lora.LoraLinear).values())

    count = sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
    full, full_bases = size(model), bases(model)
    rows = [["float32", mib(full), "1.00", mib(full_bases), "1.000"]]
    kinds = (("bfloat16", jnp.bfloat16), ("int8", jnp.int8), ("nf4", "nf4"), ("nf4:dq", "nf4:dq"))
    for name, dtype in kinds:
        cast = zoo.lora.cast_frozen(model, dtype, config=lora)
        b = bases(cast)
        rows.append([name, mib(size(cast)), f"{size(cast) / full:.2f}", mib(b), f"{b / full_bases:.3f}"])
        del cast
    print(f"\nLlama-shaped decoder, {count / 1e9:.2f}B parameters (LoRA r=8 on every projection):")
    header = ["frozen base", "params MiB", "vs float32", "projections MiB", "vs float32"]
    print("\n".join(_harness.table(header, rows, left=1)))


if __name__ == "__main__":
    main()

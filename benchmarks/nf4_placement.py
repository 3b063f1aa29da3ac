"""Where double-quantised NF4 scales live under FSDP: sharded on the weight's axes (as zoo
places them) or always replicated.

A small Llama-shaped decoder (d_model 256, MLP 512, 2 layers, tied embeddings, LoRA r=4 on
every projection) is stored as NF4 (`cast_frozen(model, "nf4:BLOCK")`) and with its
scales double-quantised (`"nf4:BLOCK:dq"`), placed by the fsdp preset on 4 simulated CPU
devices; the double-quantised one a second time with its 8-bit scale codes re-placed
replicated. Printed per way and block: the bytes of the 4-bit bases one device holds (bits
per weight), the bytes the compiled LoRA step gathers inside its loops, and its
all-reduces (in loop?, bytes), which must not change.

    python benchmarks/nf4_placement.py
"""

from __future__ import annotations

import jax

jax.config.update("jax_num_cpu_devices", 4)

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import zoo  # noqa: E402
from zoo.lora import LoraConfig, add_lora, cast_frozen, trainable  # noqa: E402
from zoo.nn import FourBitLinear  # noqa: E402

LORA = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)


def _is_four_bit(x) -> bool:
    return isinstance(x, FourBitLinear)


def _replicated_scale_codes(model, mesh):
    """`model` with every 4-bit layer's scale (codes) placed whole on every device."""

    def one(x):
        if not _is_four_bit(x):
            return x
        return eqx.tree_at(lambda layer: layer.scale, x, jax.device_put(x.scale, NamedSharding(mesh, P())))

    return jax.tree.map(one, model, is_leaf=_is_four_bit)


def measure(model, text: str, replicated: bool, mesh, batch) -> tuple[int, int, int, list]:
    """(weights, one device's base bytes, in-loop gathered bytes, all-reduces) of `model`
    stored as `text`, its fsdp LoRA step compiled."""
    cast = cast_frozen(model, text, config=LORA)
    step = zoo.TrainStep(
        zoo.models.next_token_loss, optax.adamw(1e-2), trainable=trainable(cast, LORA), microbatches=2, preset="fsdp"
    )
    with jax.set_mesh(mesh):
        placed = zoo.shard(cast, zoo.rules("fsdp"), mesh)
        if replicated:
            placed = _replicated_scale_codes(placed, mesh)
        colls = zoo.collectives(step.compile(placed, step.init(placed), batch), mesh=mesh)
    layers = [x for x in jax.tree.leaves(placed, is_leaf=_is_four_bit) if _is_four_bit(x)]
    device = jax.devices()[0]
    arrays = [a for layer in layers for a in jax.tree.leaves(eqx.filter(layer, eqx.is_array)) if a is not layer.bias]
    held = sum(s.data.nbytes for a in arrays for s in a.addressable_shards if s.device == device)
    gathered = sum(c.bytes for c in colls if c.kind == "all-gather" and c.in_loop)
    reduced = sorted((c.in_loop, c.bytes) for c in colls if c.kind == "all-reduce")
    return sum(layer.codes.size * 2 for layer in layers), held, gathered, reduced


def main() -> None:
    config = zoo.models.TransformerConfig(
        vocab_size=32, d_model=256, num_heads=4, num_kv_heads=2, num_layers=2, mlp_dim=512, max_len=8,
        positions="rope", activation="swiglu", norm="rmsnorm", tie_embeddings=True,
    )  # fmt: skip
    model = add_lora(zoo.models.Transformer(config, key=jax.random.key(0)), LORA, key=jax.random.key(1))
    tokens = jax.random.randint(jax.random.key(3), (8, 8), 1, 32)
    batch = {"tokens": tokens, "mask": jnp.ones_like(tokens, bool)}
    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    print(
        "| block | storage | base bytes per device | bits per weight per device | in-loop gathered bytes | all-reduces |"
    )
    print("|---:|---|---:|---:|---:|---|")
    for block in (16, 64):
        ways = (("nf4", f"nf4:{block}", False), ("nf4:dq, scale codes sharded (zoo)", f"nf4:{block}:dq", False),
                ("nf4:dq, scale codes replicated", f"nf4:{block}:dq", True))  # fmt: skip
        for name, text, replicated in ways:
            weights, held, gathered, reduced = measure(model, text, replicated, mesh, batch)
            print(f"| {block} | {name} | {held:,} | {8 * held / weights:.3f} | {gathered:,} | {reduced} |")


if __name__ == "__main__":
    main()

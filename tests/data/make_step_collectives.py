"""Compile the training steps of the `zoo inspect` models and record their collectives.

The fixture `step_collectives.json` beside this file pins what every compiled step
communicates (kind, inside or outside loops, bytes, mesh axes, group size of each
collective); `tests/test_compiled_steps.py` recompiles the same steps and compares. Regenerate it
(only when a change to the compiled steps is intended) with one command:

    python tests/data/make_step_collectives.py [CASE_NAME ...]   # names: only those cases
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

FIXTURE = Path(__file__).with_name("step_collectives.json")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the fixed models (fixed_tasks.py)
MICROBATCHES = 2

# (model, preset, mesh, mode): each zoo inspect model under every preset that fits it, on 8
# devices (the mlp's 1-wide output cannot split its embed axis: no fsdp layouts).
_TP_MESH = {"data": 4, "model": 2}
_DP_MESH = {"data": 8}
CASES = [
    (model, preset, _TP_MESH if "tp" in preset else _DP_MESH, "explicit")
    for model in ("mlp", "transformer", "encoder", "transformer+lora")
    for preset in ("dp", "fsdp", "fsdp-once", "tp", "fsdp+tp", "zero1")
    if not (model == "mlp" and "fsdp" in preset)
] + [(model, preset, _DP_MESH, "shard_map") for model in ("mlp", "transformer") for preset in ("dp", "zero1")]
# Adapter kinds beyond plain LoRA (docs/lora.md): DoRA's magnitude vectors ride in the one
# gradient all-reduce with the branches; so do an embedding's branch and a tied head's.
CASES += [
    (model, preset, _TP_MESH if "tp" in preset else _DP_MESH, "explicit")
    for model in ("transformer+dora", "transformer+embedlora")
    for preset in ("dp", "fsdp", "fsdp+tp")
]
# `--lora` fields of each adapter kind, over the inspect defaults.
_KINDS = {
    "+lora": {},
    "+dora": {"use_dora": True},
    # The inspect transformer's head is its token embedding: adapted with it, one weight.
    "+embedlora": {"target_modules": ("token_embedding", "lm_head", "q_proj", "v_proj"), "ensure_weight_tying": True},
}
# Preference steps of a LoRA decoder (zoo.models.PreferenceLoss): DPO's reference is the
# same model with its adapters disabled, in the same program, adding no gradient.
CASES += [(f"transformer+lora+{objective}", preset, _DP_MESH, "explicit")
          for objective in ("dpo", "orpo") for preset in ("dp", "fsdp-once")]  # fmt: skip

# Three adapters trained in one step (zoo.lora.routed over zoo.lora.stack_adapters), each
# row its own adapter, each clipped at its own norm: one gradient all-reduce carrying the
# three adapters' bytes (the inspect LoRA's, three times: same targets and rank), none of
# the base.
CASES += [("transformer+3adapters", preset, _DP_MESH, "explicit") for preset in ("dp", "fsdp-once")]
K_ADAPTERS = 3

# Meshes with axes of size 1, which every preset accepts: a data axis of size 1 holds no
# gradient reduction (nothing to add up over it; the preset's budget on that mesh,
# `Preset.budget_on`, expects none), a model axis of size 1 no tensor parallelism.
CASES += [("transformer", preset, {"data": 1}, "explicit") for preset in ("dp", "fsdp", "fsdp-once", "zero1")]
CASES += [
    ("transformer", preset, mesh, "explicit")
    for preset in ("tp", "fsdp+tp")
    for mesh in ({"data": 1, "model": 2}, {"data": 4, "model": 1})
]
CASES += [("mlp", "dp", {"data": 1}, "shard_map"), ("transformer+lora", "tp", {"data": 1, "model": 2}, "explicit")]


def case_name(model: str, preset: str, mesh: dict, mode: str) -> str:
    return f"{model}/{preset}/{','.join(f'{k}={v}' for k, v in mesh.items())}/{mode}"


def step_collectives(model: str, preset: str, mesh_shape: dict, mode: str) -> list[dict]:
    """The sorted collectives of one compiled step (as JSON-ready dicts, no op names)."""
    return rows(compile_case(model, preset, mesh_shape, mode)[0])


def compile_case(model: str, preset: str, mesh_shape: dict, mode: str):
    """(collectives, the budget sizes of its model) of one compiled step."""
    import jax
    import optax
    from fixed_tasks import build_inspect_task, inspect_defaults

    import zoo
    from zoo._jit import ONCE_COMPILER_OPTIONS
    from zoo.train._adapters import add_lora
    from zoo.train._text import parse_lora

    model, _, objective = model.partition("+lora+")  # a preference step: transformer+lora+dpo
    if objective:
        model += "+lora"
    base, plus, kind = model.partition("+")
    task = build_inspect_task(base, 0)
    lora = None
    several = kind == f"{K_ADAPTERS}adapters"
    if several:  # the inspect LoRA's targets and rank, each adapter its own alpha and initial weights
        configs = [parse_lora(f"alpha={2 * (k + 1)},init_lora_weights=false", inspect_defaults(base))
                   for k in range(K_ADAPTERS)]  # fmt: skip
        task.model = zoo.lora.stack_adapters({f"a{k}": add_lora(task.model, c, k) for k, c in enumerate(configs)})
    elif plus:
        lora = parse_lora("", inspect_defaults(base) | _KINDS[plus + kind])
        task.model = add_lora(task.model, lora, 0)
    axis_types = (jax.sharding.AxisType.Explicit,) * len(mesh_shape)
    mesh = jax.make_mesh(tuple(mesh_shape.values()), tuple(mesh_shape), axis_types=axis_types)
    with jax.set_mesh(mesh):
        placed = zoo.shard(task.model, zoo.rules(preset), mesh)
        options = {}
        if lora is not None or several:
            options["trainable"] = zoo.lora.trainable(placed, lora)
        loss_fn = (
            zoo.models.PreferenceLoss(objective, reference=zoo.lora.disabled_adapters) if objective else task.loss_fn
        )
        optimizer = optax.adamw(1e-3)
        if several:
            loss_fn, optimizer = zoo.lora.routed(loss_fn), optax.chain(zoo.lora.clip_per_adapter(1.0), optimizer)
        step = zoo.TrainStep(loss_fn, optimizer, microbatches=MICROBATCHES, mode=mode, preset=preset, **options)
        batch = task.make_batch(mesh_shape["data"] * MICROBATCHES * 2, jax.random.key(0))
        if several:
            batch = routed_batch(batch)
        if objective:
            batch = preference_batch(batch, task.make_batch(len(batch["tokens"]), jax.random.key(1)))
        lowered = step.lower(placed, step.init(placed), batch)
        colls = zoo.collectives(lowered.compile(compiler_options=ONCE_COMPILER_OPTIONS), mesh=mesh)
        sizes = step.budget_sizes(placed)
    return colls, sizes


def routed_batch(batch: dict) -> dict:
    """`batch` with each row's adapter (`adapter`, rows dealt in turn) and `adapter_norm`."""
    import numpy as np

    import zoo

    index = np.arange(len(batch["tokens"])) % K_ADAPTERS
    counts = np.asarray(batch["mask"])[:, 1:].sum(axis=1) if "mask" in batch else None
    return batch | {
        "adapter": index.astype(np.int32),
        "adapter_norm": zoo.lora.adapter_norms(index, counts, K_ADAPTERS),
    }


def preference_batch(chosen: dict, rejected: dict) -> dict:
    """A preference batch (`zoo.models.PreferenceLoss`) from two token batches: each row's
    first two tokens are its prompt, the rest of its real tokens its completion."""
    import jax.numpy as jnp

    out = {}
    for side, b in (("chosen", chosen), ("rejected", rejected)):
        mask = b["mask"].astype(jnp.int32)
        out |= {f"{side}_tokens": b["tokens"], f"{side}_mask": mask, f"{side}_completion": mask.at[:, :2].set(0)}
    return out


def rows(colls) -> list[dict]:
    """The collectives as sorted JSON-ready dicts (no op names or source lines)."""
    out = [
        {
            "kind": c.kind,
            "in_loop": c.in_loop,
            "bytes": c.bytes,
            "mesh_axes": list(c.mesh_axes),
            "group_size": c.group_size,
        }
        for c in colls
    ]
    return sorted(out, key=lambda r: (r["kind"], r["in_loop"], r["bytes"], r["mesh_axes"], r["group_size"]))


def main() -> int:
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    only = set(sys.argv[1:])  # case names: recompute those alone, keep the others as recorded
    out = json.loads(FIXTURE.read_text()) if only else {}
    for case in CASES:
        if only and case_name(*case) not in only:
            continue
        out[case_name(*case)] = step_collectives(*case)
        print(case_name(*case), len(out[case_name(*case)]), "collectives", file=sys.stderr)
    FIXTURE.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {FIXTURE} ({len(out)} steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

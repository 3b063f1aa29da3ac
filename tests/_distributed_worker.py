"""One process of tests/test_distributed.py: train a tiny decoder on a 4-device global mesh.

    python tests/_distributed_worker.py OUT.npz --devices 4
    python tests/_distributed_worker.py OUT.npz --devices 2 --coordinator 127.0.0.1:PORT \\
        --num-processes 2 --process-id I

The first is the reference (1 process × 4 CPU devices); the second is one of 2 processes ×
2 devices joined by `zoo.distributed_init` (gloo CPU collectives). Both train the same
global batches (each process builds them whole and keeps its rows) and write the per-step
losses, the final parameters and the collective counts of the compiled step to OUT.npz.
conftest is not imported: it would start jax's backend with 8 devices. The reference
also runs in the test process (`train(out, mesh)` on 4 of its 8 devices): the test holds
the two within a rounding bound, not bit for bit.
"""

import argparse
import json
import os
import sys

# The XLA flags of the test process (conftest), so every worker compiles the same programs
# (only as a script: imported by the test, its environment is the test process's).
if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = (
        f"{os.environ.get('XLA_FLAGS', '')} --xla_cpu_collective_call_terminate_timeout_seconds=300 "
        "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
        "--xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1"
    )

import jax
import jax.numpy as jnp
import numpy as np

STEPS, BATCH, MICROBATCHES, SEQ, VOCAB = 4, 16, 2, 8, 32
LR, MOMENTUM = 1e-2, 0.9


def lm_batch(step: int) -> dict:
    """The global batch of a step, from the step number alone (numpy: no device needed)."""
    rng = np.random.default_rng([7, step])
    tokens = rng.integers(1, VOCAB, (BATCH, SEQ))
    lengths = SEQ - (np.arange(BATCH) % 3)
    mask = np.arange(SEQ)[None, :] < lengths[:, None]
    return {"tokens": np.where(mask, tokens, 0).astype(np.int32), "mask": mask}


def grpo_batch(step: int) -> dict:
    """A GRPO batch of the step (`zoo.models.GRPOLoss`'s layout): the LM batch's rows as
    prompt (3 tokens) then completion of unequal lengths, advantages of groups of 4, old
    log-probabilities off the policy's so some ratios are clipped."""
    batch = lm_batch(step)
    rng = np.random.default_rng([8, step])
    completion = batch["mask"] & (np.arange(SEQ)[None, :] >= 3)
    advantages = rng.normal(size=(BATCH // 4, 4)).astype(np.float32)
    return {
        "tokens": batch["tokens"],
        "completion": completion.astype(np.int32),
        "advantages": (advantages - advantages.mean(axis=1, keepdims=True)).reshape(-1),
        "old_logps": rng.uniform(-3.8, -3.1, (BATCH, SEQ - 1)).astype(np.float32),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--devices", type=int, required=True)
    p.add_argument("--coordinator")
    p.add_argument("--num-processes", type=int, default=1)
    p.add_argument("--process-id", type=int, default=0)
    p.add_argument("--objective", choices=("sft", "grpo"), default="sft")
    args = p.parse_args()

    import zoo

    if args.num_processes > 1:
        zoo.distributed_init(args.coordinator, args.num_processes, args.process_id, local_device_count=args.devices)
    else:
        jax.config.update("jax_num_cpu_devices", args.devices)
    train(args.out, jax.make_mesh((len(jax.devices()),), ("data",)), objective=args.objective)


def train(out: str, mesh, objective: str = "sft") -> None:
    """Train on `mesh` (its devices: every process's, or some of this one's) and write
    OUT.npz; `objective` sft (next-token loss) or grpo (`GRPOLoss("dapo")`: a token mean
    over the global batch, clipped ratios)."""
    import equinox as eqx
    import optax

    import zoo

    n = mesh.size
    config = zoo.models.TransformerConfig(
        vocab_size=VOCAB, d_model=16, num_heads=4, num_kv_heads=2, num_layers=2, mlp_dim=32, max_len=SEQ,
        positions="rope", activation="swiglu", norm="rmsnorm", tie_embeddings=False,
    )  # fmt: skip
    # Linear in the gradients (not adamw, whose m/(sqrt(v)+eps) amplifies a rounding
    # difference in a near-zero gradient to order lr): the parameters can be held to a
    # derived bound (tests/test_distributed.py).
    loss = zoo.models.next_token_loss if objective == "sft" else zoo.models.GRPOLoss("dapo", max_completion_length=SEQ)
    batches = lm_batch if objective == "sft" else grpo_batch
    step = zoo.TrainStep(loss, optax.sgd(LR, momentum=MOMENTUM), microbatches=MICROBATCHES)
    with jax.set_mesh(mesh):
        # Every process initialises the same model from the same key (one program, so the
        # same bits), then places it: replicated under the dp rules.
        model = eqx.filter_jit(lambda k: zoo.models.Transformer(config, key=k))(jax.random.key(0))
        model = zoo.shard(model, zoo.rules("dp"), mesh)
        opt_state = step.init(model)
        rows = zoo.local_rows(BATCH)

        def batch_of(i):
            return zoo.global_batch({k: v[rows] for k, v in batches(i).items()})

        compiled = step.compile(model, opt_state, batch_of(1))
        colls = zoo.collectives(compiled, mesh=mesh)
        grads_of = eqx.filter_jit(step.loss_and_grads)
        first_grads = grads_of(model, batch_of(1))[1]
        losses, largest_grad = [], []
        for i in range(1, STEPS + 1):
            grads = first_grads if i == 1 else grads_of(model, batch_of(i))[1]
            largest_grad.append(max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(grads)))
            model, opt_state, loss = compiled(model, opt_state, batch_of(i))
            losses.append(float(loss))
    counts = {}
    for c in colls:
        key = f"{c.kind}/{'loop' if c.in_loop else 'outside'}"
        counts[key] = counts.get(key, 0) + 1
    params = eqx.filter(model, eqx.is_inexact_array)
    arrays = {
        jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(params)
    }
    first = {
        jax.tree_util.keystr(path): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_leaves_with_path(eqx.filter(first_grads, eqx.is_inexact_array))
    }
    np.savez(
        out,
        losses=np.array(losses, np.float64),
        largest_grad=np.array(largest_grad, np.float64),
        **{f"grad{k}": v for k, v in first.items()},
        counts=json.dumps(counts, sort_keys=True),
        rows=np.array([rows.start, rows.stop]),
        processes=jax.process_count(),
        devices=n,
        **{f"param{k}": v for k, v in arrays.items()},
    )
    print(f"DONE process {jax.process_index()}/{jax.process_count()} rows {rows} counts {counts}", flush=True)


if __name__ == "__main__":
    sys.exit(main())

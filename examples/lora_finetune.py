"""Pretrain a byte-level LM on Python code, then LoRA-fine-tune it on English prose.

Two real text domains, both shipped with Python (no download):

- pretraining: the standard library's top-level `.py` sources (as `train_lm.py`);
- fine-tuning: `pydoc_data.topics.topics`, the prose of the language reference that
  `help()` prints (every 10th topic held out for validation).

The base model is trained in full, then frozen: `zoo.lora.add_lora` wraps its linear
layers in rank-r branches and `zoo.TrainStep(..., trainable=zoo.lora.trainable(...))`
trains the branches alone, on simulated CPU devices with microbatches. The frozen base is
partitioned out before differentiation, so it gets no gradient, and the step's one
all-reduce (outside the microbatch loop) carries the adapter's bytes only.

It prints the adapter's size against the model's, the prose validation loss before and
after fine-tuning, a bit-for-bit check that the base weights did not move, the
fine-tuning step's collectives (the all-reduce's bytes against the adapter's), the loss of
the merged model (`zoo.lora.merge`), and the adapter files it saved in peft's layout
(`zoo.lora.save_adapter`), reloaded onto the base (`zoo.lora.load_adapter`) and checked.
It exits 0 only if fine-tuning lowered the prose validation loss.

Run it (about two to three minutes on two idle CPU cores):

    python examples/lora_finetune.py
    python examples/lora_finetune.py --pretrain-steps 150 --finetune-steps 100   # quicker
    python examples/lora_finetune.py --help
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pydoc_data.topics import topics

import _lm_common as common
from _lm_common import LN2


def parse_args(argv=None) -> argparse.Namespace:
    p = common.new_parser(__doc__)
    shared = ("devices", "microbatches", "batch-size", "seq-len", "d-model", "layers", "heads", "data-mb")
    common.add_flags(p, *shared, batch_size=64, data_mb=2.0)
    p.add_argument("--pretrain-steps", type=int, default=500, help="full training steps on Python code")
    p.add_argument("--pretrain-lr", type=float, default=1e-2, help="peak learning rate of pretraining")
    p.add_argument("--finetune-steps", type=int, default=300, help="LoRA steps on English prose")
    p.add_argument("--lr", type=float, default=1e-2, help="peak learning rate of fine-tuning")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank r")
    p.add_argument("--alpha", type=float, default=16.0, help="LoRA lora_alpha (scaling alpha / r)")
    p.add_argument("--lora-dropout", type=float, default=0.05, help="dropout on the branches' input")
    p.add_argument(
        "--targets",
        default="all-linear",
        help="target_modules: 'all-linear', a regex, or comma-separated names (q_proj,v_proj,...)",
    )
    p.add_argument("--eval-windows", type=int, default=256, help="validation windows per domain")
    p.add_argument("--log-every", type=int, default=0, help="print train loss every k steps (0: steps/10)")
    p.add_argument("--seed", type=int, default=0, help="seed for the model, adapters and batches")
    p.add_argument("--out", default=None, help="directory for the adapter files (None: a new temp dir)")
    common.add_cache_flag(p)
    return p.parse_args(argv)


# Parsed first: the device count must be set before jax starts its backend.
args = parse_args()
common.use_cpu_devices(args.devices)
common.use_compile_cache(args)

import equinox as eqx
import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zoo

# --- data ----------------------------------------------------------------------------------


def prose_domain() -> tuple[np.ndarray, np.ndarray]:
    """The language reference's topics (`help('if')` etc.), in topic-name order."""
    return common.split_files([topics[name].encode("utf-8") + b"\n\n" for name in sorted(topics)])


# --- helpers ---------------------------------------------------------------------------------


def arrays(tree) -> list:
    return jax.tree.leaves(eqx.filter(tree, eqx.is_array))


def size(tree) -> tuple[int, int]:
    """(parameters, bytes) of the array leaves of `tree`."""
    leaves = arrays(tree)
    return sum(x.size for x in leaves), sum(x.size * x.dtype.itemsize for x in leaves)


def safetensors_shapes(path: str) -> dict[str, list[int]]:
    """Tensor name → shape, read from a safetensors file's JSON header."""
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return {k: v["shape"] for k, v in header.items() if k != "__metadata__"}


def train(run, model, opt_state, make_batch, steps: int, label: str, first: str):
    """`steps` calls of `run(model, opt_state, batch)` with progress lines; returns
    (model, opt_state, seconds)."""
    log_every = args.log_every or max(steps // 10, 1)
    tokens = args.batch_size * args.seq_len
    start = timer = time.perf_counter()
    timed, previous = 0, None
    for i in range(1, steps + 1):
        model, opt_state, loss = run(model, opt_state, make_batch(i))
        # At most two steps in flight: the next batch is prepared while a step runs, but
        # the queue stays short. With dozens of steps queued, XLA's CPU runtime (8
        # simulated devices on 2 busy cores) was seen to hang for good in the all-reduce.
        if previous is not None:
            previous.block_until_ready()
        previous = loss
        if i > 1:
            timed += tokens
        if i % log_every == 0 or i in (1, steps):
            value = float(loss)  # waits for the step
            elapsed = time.perf_counter() - timer
            speed = f"{timed / elapsed:8,.0f} tokens/s" if timed else first
            print(f"{label} step {i:4d}  train loss {value:.4f} nats  {value / LN2:.3f} bits/byte  {speed}", flush=True)
            timer, timed = time.perf_counter(), 0
    return model, opt_state, time.perf_counter() - start


def lora_config() -> zoo.lora.LoraConfig:
    targets = args.targets
    names = [t.strip() for t in targets.split(",")]
    if targets != "all-linear" and all(name.isidentifier() for name in names):
        targets = tuple(names)  # names matched by suffix; anything else is a regex
    return zoo.lora.LoraConfig(
        r=args.rank, lora_alpha=args.alpha, lora_dropout=args.lora_dropout, target_modules=targets
    )


# --- main ------------------------------------------------------------------------------------


def main() -> int:
    n, m, bsz, seq = common.batch_layout(args)
    t_start = time.perf_counter()

    code_train, code_val = common.split_files(common.stdlib_sources(int(args.data_mb * 1e6), min_files=10))
    prose_train, prose_val = prose_domain()
    print(f"pretraining domain: Python stdlib sources, {len(code_train):,} train / {len(code_val):,} validation bytes")
    print(
        f"fine-tuning domain: pydoc_data.topics prose, {len(prose_train):,} train / {len(prose_val):,} validation bytes"
    )

    config = zoo.models.TransformerConfig(
        vocab_size=256, d_model=args.d_model, num_heads=args.heads, num_layers=args.layers, max_len=seq
    )
    base = zoo.models.Transformer(config, key=jax.random.key(args.seed))
    rng = np.random.default_rng(args.seed)
    mesh = jax.make_mesh((n,), ("data",))
    with jax.set_mesh(mesh):
        placed = NamedSharding(mesh, P("data"))
        code_val_tokens = jax.device_put(common.fixed_windows(code_val, args.eval_windows, seq), placed)
        prose_val_tokens = jax.device_put(common.fixed_windows(prose_val, args.eval_windows, seq), placed)

        # --- 1. pretrain the whole model on code -------------------------------------------
        base_params, base_bytes = size(base)
        print(
            f"\nmodel: d_model {args.d_model}, {args.layers} layers, {args.heads} heads, "
            f"{base_params:,} parameters ({base_bytes:,} bytes)"
        )
        print(f"pretraining: {n} devices x {m} microbatches, batch {bsz} x {seq} bytes, {args.pretrain_steps} steps")
        base = zoo.shard(base, zoo.rules("dp"), mesh)
        step = zoo.TrainStep(
            zoo.models.next_token_loss, common.make_optimizer(args.pretrain_lr, args.pretrain_steps), microbatches=m
        )
        base, _, secs = train(
            step,
            base,
            step.init(base),
            lambda i: {"tokens": common.random_windows(rng, code_train, bsz, seq)},
            args.pretrain_steps,
            "pretrain",
            "(compiled)",
        )
        code_loss = common.evaluate(base, code_val_tokens)
        prose_before = common.evaluate(base, prose_val_tokens)
        print(f"pretraining took {secs:.1f} s")
        print(f"base val loss, code:  {code_loss:.4f} nats = {code_loss / LN2:.3f} bits/byte")
        print(f"val loss before fine-tuning: {prose_before:.4f} nats = {prose_before / LN2:.3f} bits/byte (prose)")

        # --- 2. add adapters; only they train ------------------------------------------------
        lcfg = lora_config()
        model = zoo.lora.add_lora(base, lcfg, key=jax.random.key(args.seed + 1))
        model = zoo.shard(model, zoo.rules("dp"), mesh)
        flags = zoo.lora.trainable(model, lcfg)
        step = zoo.TrainStep(
            zoo.models.next_token_loss,
            common.make_optimizer(args.lr, args.finetune_steps),
            microbatches=m,
            trainable=flags,
        )
        adapter = step.partition(model)[0]
        adapter_params, adapter_bytes = size(adapter)
        names = zoo.lora.target_names(base, lcfg)
        print(
            f"\nLoRA: r={lcfg.r}, lora_alpha={lcfg.lora_alpha:g} (scaling {lcfg.scaling:g}), "
            f"lora_dropout={lcfg.lora_dropout:g}, target_modules={lcfg.target_modules!r}"
        )
        print(f"adapted modules ({len(names)}, each stacked over {args.layers} layers): {', '.join(names)}")
        print(
            f"adapter size: {adapter_params:,} parameters, {adapter_bytes:,} bytes; "
            f"model size: {base_params:,} parameters, {base_bytes:,} bytes; "
            f"ratio {adapter_params / base_params:.2%}"
        )
        key = jax.random.key(args.seed + 2)

        def prose_batch(i):
            # One dropout key per example: the masks do not depend on the device split.
            return {
                "tokens": common.random_windows(rng, prose_train, bsz, seq),
                "dropout_key": zoo.nn.example_keys(jax.random.fold_in(key, i), bsz),
            }

        opt_state = step.init(model)
        t0 = time.perf_counter()
        compiled = step.compile(model, opt_state, prose_batch(0))  # the program both inspected and run
        colls = zoo.collectives(compiled, mesh=mesh)
        print(
            f"fine-tuning: {n} devices x {m} microbatches, batch {bsz} x {seq} bytes, {args.finetune_steps} steps "
            f"(step compiled in {time.perf_counter() - t0:.1f} s)"
        )
        model, opt_state, secs = train(
            compiled, model, opt_state, prose_batch, args.finetune_steps, "finetune", "(first step)"
        )
        prose_after = common.evaluate(model, prose_val_tokens)
        print(f"fine-tuning took {secs:.1f} s")
        print(f"val loss after fine-tuning:  {prose_after:.4f} nats = {prose_after / LN2:.3f} bits/byte (prose)")

        # --- 3. the base did not move --------------------------------------------------------
        unloaded = zoo.lora.unload(model)
        same = all(
            np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(arrays(unloaded), arrays(base), strict=True)
        )
        print(f"base weights bit-for-bit unchanged: {same}")

        # --- 4. merge ---------------------------------------------------------------------------
        merged = zoo.lora.merge(model)
        merged_loss = common.evaluate(merged, prose_val_tokens)
        print(
            f"merged model val loss: {merged_loss:.4f} nats (|merged - adapter| = {abs(merged_loss - prose_after):.2e}); "
            f"code val loss: base {code_loss:.4f}, merged {common.evaluate(merged, code_val_tokens):.4f} nats"
        )

        # --- 5. save, reload onto the base ------------------------------------------------------
        out = args.out or tempfile.mkdtemp(prefix="zoo-lora-")
        zoo.lora.save_adapter(model, lcfg, out)
        print(f"\nadapter saved to {out}:")
        for name in sorted(os.listdir(out)):
            print(f"  {name:28s} {os.path.getsize(os.path.join(out, name)):>10,} bytes")
        keys = safetensors_shapes(os.path.join(out, "adapter_model.safetensors"))
        print(f"  {len(keys)} tensors, peft's names, torch's [out, in] orientation, e.g.")
        for k in sorted(keys)[:2]:
            print(f"    {k} {keys[k]}")
        reloaded, _ = zoo.lora.load_adapter(base, out)
        reloaded_loss = common.evaluate(reloaded, prose_val_tokens)
        print(
            f"reloaded onto the base: val loss {reloaded_loss:.4f} nats (|reloaded - adapter| = {abs(reloaded_loss - prose_after):.2e})"
        )

    print("\ncollectives in the compiled fine-tuning step:")
    print(zoo.report(colls))
    reduced = sum(c.bytes for c in colls if c.kind == "all-reduce" and not c.in_loop)
    print(
        f"all-reduce bytes: {reduced:,} = adapter {adapter_bytes:,} + loss scalars {reduced - adapter_bytes:,} "
        f"(the base's {base_bytes:,} bytes are not communicated)"
    )
    print(f"total time: {time.perf_counter() - t_start:.1f} s")

    if prose_after < prose_before:
        print(f"\nOK: fine-tuning lowered the prose val loss from {prose_before:.4f} to {prose_after:.4f} nats")
        return 0
    print(
        f"\nFAILED: the prose val loss did not fall ({prose_before:.4f} -> {prose_after:.4f} nats); raise --lr or the steps"
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())

"""Step time of zoo against transformers + peft (PyTorch) on the same models, same batch.

Three workloads, each a zoo `TrainStep` (one CPU device, no mesh) against a hand-written
PyTorch step (`torch.set_num_threads(2)` by default), AdamW (lr 1e-4, weight decay 0.01),
no dropout:

- **minilm-lora**: the real all-MiniLM-L6-v2 (`zoo.hf.load_minilm()`; torch:
  `transformers.BertModel` from the same files) with rank-8 LoRA (alpha 16) on every linear
  layer (peft: `query`, `key`, `value`, `dense`) and a new 8-way head on mean pooling,
  trained in full; batch 32 × 48 tokens, half the rows padded to 24.
- **llama-lora**: a Llama-shaped decoder of ~31M parameters (RoPE, RMSNorm, SwiGLU,
  grouped-query attention, untied head): zoo's `zoo.models.Transformer` and a
  `transformers.LlamaForCausalLM` of the same shape holding the same weights (copied from
  zoo); LoRA r=8 on q/k/v/o and the three MLP projections; next-token loss, batch 8 × 128.
- **minilm-full**: all-MiniLM-L6-v2 and the head, every parameter trained.

Both sides first compute the loss of the same batch with the same weights (printed: they
must agree), then run interleaved rounds (`_harness.time_rounds`: the order rotates, so
load from other processes hits both alike). Reported: median step times and the median
of per-round ratios zoo/torch (below 1.00: zoo is faster), with `/proc/loadavg`.

Then a worker process with 2 simulated CPU devices checks each workload's zoo step under
`zoo.rules("dp")`: the compiled step's all-reduces inside/outside loops (`zoo.collectives`,
`zoo.count`: the promise is 0 inside, 1 outside) and the largest difference between the
2-device gradients and the single-device ones.

    python benchmarks/vs_torch.py                      # all three, 5 rounds each
    python benchmarks/vs_torch.py --only minilm-lora --rounds 8
    python benchmarks/vs_torch.py --no-check           # skip the 2-device worker
    python benchmarks/vs_torch.py --default-malloc     # without zoo.keep_freed_memory()

The process first calls the opt-in `zoo.keep_freed_memory()` (`zoo ... --keep-memory`:
glibc's malloc keeps freed memory, so each step's CPU buffers reuse warm pages; it applies
to torch in the same process alike); `--default-malloc` leaves glibc at its defaults, where
each zoo step faults its temporaries in afresh (docs/performance.md, "Page faults"). Both
modes print each side's page faults per step.

On a shared machine the absolute times are noisy; read the ratios and the load line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

import _harness  # benchmarks/_harness.py: this script's folder is on sys.path
import numpy as np

WORKLOADS = ("minilm-lora", "llama-lora", "minilm-full")
LR, WD = 1e-4, 0.01
LLAMA = {"vocab_size": 8192, "d_model": 512, "num_heads": 8, "num_kv_heads": 2, "num_layers": 8, "mlp_dim": 1408}
LLAMA_BATCH, LLAMA_SEQ = 8, 128


# -- the zoo side ---------------------------------------------------------------------------


def minilm_batch():
    rng = np.random.default_rng(0)
    b, s = 32, 48
    tokens = rng.integers(1000, 30000, (b, s)).astype(np.int32)
    mask = np.ones((b, s), bool)
    mask[b // 2 :, s // 2 :] = False
    tokens[~mask] = 0
    return {"tokens": tokens, "mask": mask, "labels": rng.integers(0, 8, b).astype(np.int32)}


def llama_batch():
    rng = np.random.default_rng(1)
    return {"tokens": rng.integers(0, LLAMA["vocab_size"], (LLAMA_BATCH, LLAMA_SEQ)).astype(np.int32)}


def zoo_workload(name: str):
    """(model, TrainStep, numpy batch) of a workload."""
    import equinox as eqx
    import jax.random as jr
    import optax

    import zoo
    from zoo.models import (
        EncoderClassifier,
        Transformer,
        TransformerConfig,
        classification_loss,
        next_token_loss,
    )

    opt = optax.adamw(LR, weight_decay=WD)
    if name.startswith("minilm"):
        encoder, _ = zoo.hf.load_minilm()
        model = EncoderClassifier(encoder, 8, key=jr.key(1))
        if name == "minilm-full":
            return model, zoo.TrainStep(classification_loss, opt, trainable=eqx.is_inexact_array), minilm_batch()
        config = zoo.lora.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", modules_to_save=("head",))
    else:
        model = Transformer(
            TransformerConfig(
                **LLAMA,
                max_len=LLAMA_SEQ,
                activation="swiglu",
                norm="rmsnorm",
                positions="rope",
                rope_theta=10000.0,
                tie_embeddings=False,
                use_bias=False,
                norm_eps=1e-6,
            ),
            key=jr.key(1),
        )
        config = zoo.lora.LoraConfig(
            r=8, lora_alpha=16, target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "up", "gate", "down")
        )
    model = zoo.lora.add_lora(model, config, key=jr.key(2))
    model = _nonzero_lora_b(model)
    loss = classification_loss if name.startswith("minilm") else next_token_loss
    return (
        model,
        zoo.TrainStep(loss, opt, trainable=zoo.lora.trainable(model, config)),
        (minilm_batch() if name.startswith("minilm") else llama_batch()),
    )


def _nonzero_lora_b(model):
    """LoRA B starts at zero; a small random B makes the branch count in the loss check."""
    import jax
    import jax.random as jr

    from zoo.lora import LoraLinear

    def fill(node):
        if isinstance(node, LoraLinear):
            b = 0.01 * jr.normal(jr.key(node.lora_B.size), node.lora_B.shape, node.lora_B.dtype)
            return _replace(node, lora_B=b)
        return node

    return jax.tree.map(fill, model, is_leaf=lambda x: isinstance(x, LoraLinear))


def _replace(module, **fields):
    import equinox as eqx

    return eqx.tree_at(lambda m: [getattr(m, k) for k in fields], module, list(fields.values()))


# -- the torch side -------------------------------------------------------------------------


def _t(x):
    import torch

    return torch.from_numpy(np.array(x, dtype=np.float32))


def _linear_from(zoo_linear, torch_linear):
    torch_linear.weight.data.copy_(_t(zoo_linear.weight).T)
    if zoo_linear.bias is not None:
        torch_linear.bias.data.copy_(_t(zoo_linear.bias))


def _lora_from(zoo_lora, peft_linear):
    """Copy a zoo LoraLinear's A, B into a peft lora.Linear (`default` adapter)."""
    peft_linear.lora_A["default"].weight.data.copy_(_t(zoo_lora.lora_A).T)
    peft_linear.lora_B["default"].weight.data.copy_(_t(zoo_lora.lora_B).T)


def _layer(tree, i):
    import jax

    return jax.tree.map(lambda x: x[i], tree)


def torch_workload(name: str, zoo_model, batch):
    """A torch `step()` (returns the loss) and `loss()` with zoo's weights."""
    import peft
    import torch
    import transformers

    import zoo

    if name.startswith("minilm"):
        bert = transformers.BertModel.from_pretrained(  # no dropout, as zoo's step without dropout keys
            str(zoo.hf.minilm_path()),
            add_pooling_layer=False,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        head = torch.nn.Linear(384, 8)
        base_head = zoo_model.head.base if hasattr(zoo_model.head, "base") else zoo_model.head
        _linear_from(base_head, head)
        if name == "minilm-lora":
            bert = peft.get_peft_model(
                bert,
                peft.LoraConfig(
                    r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["query", "key", "value", "dense"]
                ),
            )
            layers = zoo_model.encoder.layers.layers
            names = {
                ("attention", "q_proj"): "attention.self.query",
                ("attention", "k_proj"): "attention.self.key",
                ("attention", "v_proj"): "attention.self.value",
                ("attention", "o_proj"): "attention.output.dense",
                ("mlp", "up"): "intermediate.dense",
                ("mlp", "down"): "output.dense",
            }
            for i in range(zoo_model.encoder.config.num_layers):
                for (sub, proj), hf in names.items():
                    module = bert.base_model.model.encoder.layer[i].get_submodule(hf)
                    _lora_from(_layer(getattr(getattr(layers, sub), proj), i), module)
        bert.train()
        params = [p for p in list(bert.parameters()) + list(head.parameters()) if p.requires_grad]
        tokens = torch.from_numpy(batch["tokens"].astype(np.int64))
        mask = torch.from_numpy(batch["mask"].astype(np.int64))
        labels = torch.from_numpy(batch["labels"].astype(np.int64))

        def loss():
            hidden = bert(input_ids=tokens, attention_mask=mask).last_hidden_state
            m = mask.unsqueeze(-1).float()
            pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
            return torch.nn.functional.cross_entropy(head(pooled), labels)
    else:
        cfg = transformers.LlamaConfig(
            vocab_size=LLAMA["vocab_size"],
            hidden_size=LLAMA["d_model"],
            intermediate_size=LLAMA["mlp_dim"],
            num_hidden_layers=LLAMA["num_layers"],
            num_attention_heads=LLAMA["num_heads"],
            num_key_value_heads=LLAMA["num_kv_heads"],
            max_position_embeddings=LLAMA_SEQ,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            tie_word_embeddings=False,
            attention_bias=False,
            mlp_bias=False,
        )
        llama = transformers.LlamaForCausalLM(cfg)
        _llama_from(zoo_model, llama)
        llama = peft.get_peft_model(
            llama,
            peft.LoraConfig(
                r=8,
                lora_alpha=16,
                lora_dropout=0.0,
                target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            ),
        )
        zl = zoo_model.layers.layers
        for i in range(LLAMA["num_layers"]):
            hf_layer = llama.base_model.model.model.layers[i]
            for sub, proj, hf in [
                ("attention", "q_proj", "self_attn.q_proj"),
                ("attention", "k_proj", "self_attn.k_proj"),
                ("attention", "v_proj", "self_attn.v_proj"),
                ("attention", "o_proj", "self_attn.o_proj"),
                ("mlp", "gate", "mlp.gate_proj"),
                ("mlp", "up", "mlp.up_proj"),
                ("mlp", "down", "mlp.down_proj"),
            ]:
                _lora_from(_layer(getattr(getattr(zl, sub), proj), i), hf_layer.get_submodule(hf))
        llama.train()
        params = [p for p in llama.parameters() if p.requires_grad]
        tokens = torch.from_numpy(batch["tokens"].astype(np.int64))

        def loss():
            return llama(input_ids=tokens, labels=tokens).loss

    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=WD)

    def step():
        optimizer.zero_grad(set_to_none=True)
        value = loss()
        value.backward()
        optimizer.step()
        return value

    return step, loss


def _llama_from(zoo_model, llama):
    """Copy the zoo decoder's base weights into a LlamaForCausalLM."""
    import torch

    m = llama.model
    m.embed_tokens.weight.data.copy_(_t(zoo_model.token_embedding.weight))
    m.norm.weight.data.copy_(_t(zoo_model.final_norm.weight))
    llama.lm_head.weight.data.copy_(_t(zoo_model.lm_head.weight).T)
    zl = zoo_model.layers.layers
    base = lambda lin: lin.base if hasattr(lin, "base") else lin
    with torch.no_grad():
        for i in range(LLAMA["num_layers"]):
            layer = m.layers[i]
            for zoo_lin, hf in [
                (zl.attention.q_proj, layer.self_attn.q_proj),
                (zl.attention.k_proj, layer.self_attn.k_proj),
                (zl.attention.v_proj, layer.self_attn.v_proj),
                (zl.attention.o_proj, layer.self_attn.o_proj),
                (zl.mlp.gate, layer.mlp.gate_proj),
                (zl.mlp.up, layer.mlp.up_proj),
                (zl.mlp.down, layer.mlp.down_proj),
            ]:
                _linear_from(_layer(base(zoo_lin), i), hf)
            layer.input_layernorm.weight.copy_(_t(zl.attention_norm.weight[i]))
            layer.post_attention_layernorm.weight.copy_(_t(zl.mlp_norm.weight[i]))


# -- driver ---------------------------------------------------------------------------------


def bench(name: str, rounds: int, threads: int) -> dict:
    import jax
    import jax.numpy as jnp
    import torch

    torch.set_num_threads(threads)
    model, step, batch = zoo_workload(name)
    jbatch = jax.tree.map(jnp.asarray, batch)
    opt_state = step.init(model)
    compiled = step.compile(model, opt_state, jbatch)
    torch_step, torch_loss = torch_workload(name, model, batch)
    zoo_loss, _ = step.loss_and_grads(model, jbatch)
    with torch.no_grad():
        ref = float(torch_loss())
    n_params = sum(x.size for x in jax.tree.leaves(eqx_arrays(model)))
    n_train = sum(x.size for x in jax.tree.leaves(step.partition(model)[0]))
    print(
        f"{name}: {n_params / 1e6:.1f}M parameters, {n_train / 1e6:.2f}M trained; first loss zoo {float(zoo_loss):.6f} torch {ref:.6f}",
        flush=True,
    )

    faults = {"zoo": [], "torch": []}

    def call(variant):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        if variant == "zoo":
            jax.block_until_ready(compiled(model, opt_state, jbatch))
        else:
            torch_step()
        faults[variant].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)

    for _ in range(3):  # warm-up: the first steps grow malloc's heap to the peak a step needs
        call("zoo")
        call("torch")
    for v in faults.values():
        v.clear()
    timing = _harness.time_rounds(call, ("zoo", "torch"), rounds)
    # Minor page faults per step: fresh pages the kernel zero-fills (docs/performance.md, "Page faults").
    page_faults = {k: int(np.median(v[1:])) for k, v in faults.items()}  # the first is time_rounds' warm-up
    med = timing.medians()
    ratio = timing.ratio("zoo", "torch")  # median over rounds of zoo time / torch time
    line = (
        f"{name}: zoo {med['zoo']:.0f} ms, torch {med['torch']:.0f} ms, zoo/torch {ratio:.3f} "
        f"(median of {rounds} interleaved rounds; loadavg {_harness.loadavg()}, other processes busy on "
        f"{timing.other_cpus if timing.other_cpus is None else round(timing.other_cpus, 2)} CPUs; "
        f"page faults per step zoo {page_faults['zoo']:,}, torch {page_faults['torch']:,})"
    )
    print(line, flush=True)
    return {
        "workload": name,
        "zoo_ms": med["zoo"],
        "torch_ms": med["torch"],
        "zoo_over_torch": ratio,
        "loss_zoo": float(zoo_loss),
        "loss_torch": ref,
        "loadavg": _harness.loadavg(),
        "other_cpus": timing.other_cpus,
        "page_faults": page_faults,
    }


def eqx_arrays(model):
    import equinox as eqx

    return eqx.filter(model, eqx.is_inexact_array)


def check(names) -> None:
    """Worker: 2 simulated devices, dp step; collectives and gradients vs one device."""
    mesh = _harness.data_mesh(2)
    import jax
    import jax.numpy as jnp

    import zoo

    for name in names:
        model, step, batch = zoo_workload(name)
        jbatch = jax.tree.map(jnp.asarray, batch)
        _, ref = step.loss_and_grads(model, jbatch)
        with jax.set_mesh(mesh):
            placed = zoo.shard(model, zoo.rules("dp"), mesh)
            sbatch = jax.tree.map(lambda x: jax.device_put(x, jax.NamedSharding(mesh, jax.P("data"))), jbatch)
            opt_state = step.init(placed)
            colls = zoo.collectives(step.compile(placed, opt_state, sbatch))
            _, grads = step.loss_and_grads(placed, sbatch)
        diff = max(
            float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
            for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref))
        )
        r = _harness.all_reduces(colls, max_grad_diff=diff)
        print(
            f"{name} dp x2: all-reduces in loops {r['in_loop']}, outside {r['outside']}, other collectives "
            f"{r['other_collectives'] or 'none'}; max |grad(2 devices) - grad(1 device)| {diff:.2e}",
            flush=True,
        )
        print("JSON " + json.dumps({"workload": name, **r}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=WORKLOADS, action="append", help="run only this workload (repeatable)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--no-check", action="store_true", help="skip the 2-device collectives/gradient check")
    p.add_argument("--check-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", help="write the results here")
    p.add_argument(
        "--default-malloc",
        action="store_true",
        help="do not call zoo.keep_freed_memory() (glibc's malloc defaults: every step maps and zero-fills "
        "its temporaries afresh)",
    )
    args = p.parse_args()
    names = args.only or list(WORKLOADS)
    if args.check_worker:
        check(names)
        return
    malloc = "glibc malloc defaults"
    if not args.default_malloc:
        import zoo

        # First thing, before jax starts its backend (so XLA's threads share the one arena).
        malloc = "zoo.keep_freed_memory(): " + ("applied" if zoo.keep_freed_memory() else "NOT applied")
    print(f"machine: {os.cpu_count()} CPUs, loadavg {_harness.loadavg()} at start; {malloc}", flush=True)
    results = [bench(n, args.rounds, args.threads) for n in names]
    checks = []
    if not args.no_check:
        cmd = [sys.executable, __file__, "--check-worker"] + [a for n in names for a in ("--only", n)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("JSON "):
                checks.append(json.loads(line[5:]))
            else:
                print(line, flush=True)
    print(f"loadavg at end {_harness.loadavg()}")
    for r in results:
        print(f"  {r['workload']:12s} zoo/torch {r['zoo_over_torch']:.3f}")
    if args.json:
        _harness.write_summary({"results": results, "checks": checks}, args.json)


if __name__ == "__main__":
    main()

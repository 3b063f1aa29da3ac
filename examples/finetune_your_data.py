"""LoRA fine-tuning of a Hugging Face decoder on your own data file; the adapter is saved in
peft's layout (`peft.PeftModel.from_pretrained(hf_model, OUT)` opens it).

    python examples/finetune_your_data.py MODEL_DIR DATA_FILE --out adapter/ [--steps 50]

MODEL_DIR: a Hugging Face folder (config.json, model.safetensors, tokenizer.json; GPT-2,
Llama, Mistral, Qwen2, Gemma). DATA_FILE: `.txt`, or `.jsonl` with `"text"`,
`"prompt"`/`"completion"` or `"messages"` (docs/data.md).
"""

import argparse

import jax

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("model", help="a Hugging Face model folder")
parser.add_argument("data", help="a .txt or .jsonl file")
parser.add_argument("--out", default="adapter", help="where the adapter goes")
parser.add_argument("--steps", type=int, default=50)
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--microbatches", type=int, default=2)
parser.add_argument("--seq-len", type=int, default=128)
parser.add_argument("--rank", type=int, default=8)
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--devices", type=int, default=2, help="simulated CPU devices (ignored on accelerators)")
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()
jax.config.update("jax_num_cpu_devices", args.devices)  # before jax starts its backend

import optax

import zoo

try:
    train, val = zoo.data.load(args.data, args.model, seq_len=args.seq_len, validation=0.1)
except (ValueError, OSError) as e:  # DataFormatError, no tokenizer: one line naming the fix
    raise SystemExit(f"error: {e}") from None
print(zoo.data.describe(train))
if len(train) < args.batch_size:
    raise SystemExit(f"{args.data} gives {len(train)} rows of {args.seq_len} tokens: lower --batch-size or --seq-len")

mesh = jax.make_mesh((jax.device_count(),), ("data",))
config = zoo.lora.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules="all-linear")
with jax.set_mesh(mesh):
    model = zoo.hf.from_pretrained(args.model, rules=zoo.rules("dp"), mesh=mesh)
    model = zoo.lora.add_lora(model, config, key=jax.random.key(args.seed))
    trainable = zoo.lora.trainable(model, config)  # only the adapters get gradients
    step = zoo.TrainStep(zoo.models.next_token_loss, optax.adamw(args.lr), microbatches=args.microbatches,
                         trainable=trainable)  # fmt: skip
    opt_state = step.init(model)
    done, epoch = 0, 0
    while done < args.steps:
        for batch in train.batches(args.batch_size, seed=args.seed, epoch=epoch):
            model, opt_state, loss = step(model, opt_state, zoo.global_batch(batch))
            done += 1
            if done == 1 or done % 10 == 0 or done == args.steps:
                print(f"step {done}: train loss {float(loss):.4f}", flush=True)
            if done == args.steps:
                break
        epoch += 1

zoo.lora.save_adapter(model, config, args.out)
print(f"adapter saved to {args.out} (peft's layout, base {args.model})")

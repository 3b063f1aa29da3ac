"""LoRA fine-tuning of a Hugging Face decoder on your own data file with `zoo.train.run`;
the adapter is saved in peft's layout (`peft.PeftModel.from_pretrained(hf_model,
OUT/adapter)` opens it).

    python examples/finetune_your_data.py MODEL_DIR DATA_FILE --out runs/mine [--steps 50]

MODEL_DIR: a Hugging Face folder (config.json, model.safetensors, tokenizer.json; GPT-2,
Llama, Mistral, Qwen2, Gemma). DATA_FILE: `.txt`, or `.jsonl` with `"text"`,
`"prompt"`/`"completion"` or `"messages"` (docs/data.md). OUT gets the adapter, config.json,
metrics.jsonl, loss.png and summary.json (what `zoo finetune transformer --init MODEL_DIR
--data DATA_FILE` writes: the command is a thin layer over the same call).
"""

import argparse

import jax

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("model", help="a Hugging Face model folder")
parser.add_argument("data", help="a .txt or .jsonl file")
parser.add_argument("--out", default="runs/finetune-your-data", help="the run's folder (OUT/adapter: the adapter)")
parser.add_argument("--steps", type=int, default=50)
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--seq-len", type=int, default=128)
parser.add_argument("--rank", type=int, default=8)
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--devices", type=int, default=2, help="simulated CPU devices (ignored on accelerators)")
args = parser.parse_args()
jax.config.update("jax_num_cpu_devices", args.devices)  # before jax starts its backend

import zoo
from zoo.train import DataConfig, Hook, OptimizerConfig, RunConfig


class PrintLoss(Hook):
    """Your own hook: each step's training loss as the run records it (after the first,
    every 10th)."""

    def on_record(self, row):
        if row["kind"] == "train" and (row["step"] == 1 or row["step"] % 10 == 0):
            print(f"step {row['step']}: train loss {row['loss']:.4f}", flush=True)


config = RunConfig(
    model="transformer",  # a decoder; `init` says which pretrained one
    init=args.model,
    data=DataConfig(source=args.data, seq_len=args.seq_len, validation=0.1),
    lora=zoo.lora.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules="all-linear"),
    optimizer=OptimizerConfig(name="adamw", lr=args.lr),  # warmup: a twentieth of the steps
    steps=args.steps,
    batch_size=args.batch_size,
    microbatches=2,
    output=args.out,
    overwrite=True,
    quiet=True,  # only the summary; PrintLoss reports progress
)
try:
    result = zoo.train.run(config, hooks=[PrintLoss()])
except zoo.train.ConfigError as e:  # a bad data file, no tokenizer, too few rows: one line
    raise SystemExit(f"error: {e}") from None
print(f"adapter saved to {result.output / 'adapter'} (peft's layout, base {args.model})")

"""Preference tuning (DPO with LoRA) with `zoo.train.run`, on a preference set this script
writes itself: answers that end with a question back to the user are preferred to answers
that end flatly.

    python examples/dpo_your_data.py --out runs/dpo-example [--sft-steps 300] [--dpo-steps 40]

Two runs, as `zoo train` / `zoo finetune` would make them: first a small decoder learns
the answers by supervised fine-tuning on both kinds of ending alike (so it prefers neither:
~50% held-out preference accuracy); then DPO tunes LoRA adapters on the pairs, the
reference being the same model with its adapters off, inside the training step. The script
prints the held-out preference accuracy (the share of held-out pairs whose chosen answer
the model finds likelier than the rejected one) and three greedy answers, before and after.

Your own pairs: a `.jsonl` of `{"prompt", "chosen", "rejected"}` lines (texts, or
conversations as lists of messages) and `zoo finetune transformer --init MODEL --data
PAIRS.jsonl --objective dpo` (docs/training.md, "Preference tuning").
"""

import argparse
import json
import random
from pathlib import Path

import jax

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--out", default="runs/dpo-example", help="the runs' folder (OUT/sft, OUT/dpo)")
parser.add_argument("--sft-steps", type=int, default=300)
parser.add_argument("--dpo-steps", type=int, default=40)
parser.add_argument("--dpo-lr", type=float, default=5e-4)
parser.add_argument("--beta", type=float, default=0.5)
parser.add_argument("--devices", type=int, default=2, help="simulated CPU devices (ignored on accelerators)")
args = parser.parse_args()
jax.config.update("jax_num_cpu_devices", args.devices)  # before jax starts its backend

import equinox as eqx
import numpy as np

import zoo
from zoo.train import DataConfig, OptimizerConfig, RunConfig

THINGS = ["the sea", "a cat", "the moon", "bread", "a river", "the sun", "a tree", "snow", "a bird", "the wind",
          "a dog", "rain", "a book", "the sky", "a fish", "stone", "fire", "a song", "a road", "the night"]  # fmt: skip
FACTS = ["It is old.", "It is big.", "It is calm.", "It is bright.", "It is new.", "It is small."]
ASKS = ["Want more?", "Any question?", "Shall I go on?"]  # preferred: a question back to the user
ENDS = ["That is all.", "The end.", "Nothing more."]  # rejected: a flat ending
SEQ_LEN = 64


def write_data(out: Path) -> tuple[Path, Path, list[dict]]:
    """The pairs to tune on (pairs.jsonl), the supervised set (sft.jsonl: every prompt
    with both answers, so supervised training prefers neither ending) and the held-out
    pairs (about things no training pair is about)."""
    rng = random.Random(0)
    pairs, sft = [], []
    for thing in THINGS:
        for fact in FACTS:
            prompt = f"Tell me about {thing}."
            chosen, rejected = f" {fact} {rng.choice(ASKS)}", f" {fact} {rng.choice(ENDS)}"
            pairs.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
            sft += [{"prompt": prompt, "completion": chosen}, {"prompt": prompt, "completion": rejected}]
    held = len(FACTS) * 4  # the last four things
    out.mkdir(parents=True, exist_ok=True)
    for name, records in (("pairs.jsonl", pairs[:-held]), ("sft.jsonl", sft)):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in records))
    return out / "pairs.jsonl", out / "sft.jsonl", pairs[-held:]


def byte_rows(pairs: list[dict]) -> dict:
    """Pairs as a `zoo.models.PreferenceLoss` batch of byte tokens (one pair per row)."""
    rows = {f"{s}_{k}": np.zeros((len(pairs), SEQ_LEN), np.int32) for s in ("chosen", "rejected")
            for k in ("tokens", "mask", "completion")}  # fmt: skip
    for i, pair in enumerate(pairs):
        prompt = list(pair["prompt"].encode())
        for side in ("chosen", "rejected"):
            ids = prompt + list(pair[side].encode())
            rows[f"{side}_tokens"][i, : len(ids)] = ids
            rows[f"{side}_mask"][i, : len(ids)] = 1
            rows[f"{side}_completion"][i, len(prompt) : len(ids)] = 1
    return rows


def preference_accuracy(model, pairs: dict) -> float:
    """The share of `pairs` whose chosen answer `model` finds likelier (summed log-prob)."""
    metrics = eqx.filter_jit(zoo.models.PreferenceLoss("dpo").metrics)
    # The reference does not matter here: the policy's own log-probabilities are compared.
    refs = {f"ref_{s}_logps": np.zeros(len(pairs["chosen_tokens"]), np.float32) for s in ("chosen", "rejected")}
    out = metrics(model, pairs | refs)
    return float(np.mean(np.asarray(out["logps/chosen"]) > np.asarray(out["logps/rejected"])))


def greedy_answers(model, pairs: list[dict]) -> list[str]:
    """Greedy answers (two sentences) to the prompts of `pairs`, byte tokens."""
    answers = []
    for pair in pairs:
        prompt = np.frombuffer(pair["prompt"].encode(), np.uint8).astype(np.int32)
        tokens = zoo.generate(model, prompt[None], max_new_tokens=30)
        text = bytes(np.asarray(tokens[0, len(prompt) :]).astype(np.uint8)).decode("utf-8", "replace")
        ends = [i for i, ch in enumerate(text) if ch in ".?"]
        answers.append(f"{pair['prompt']!r} -> {text[: ends[1] + 1] if len(ends) > 1 else text!r}")
    return answers


out = Path(args.out)
pairs_file, sft_file, held_pairs = write_data(out / "data")
tiny = {"d_model": 64, "num_layers": 2, "num_heads": 4, "mlp_dim": 128}
sft = RunConfig(model="transformer", model_config=tiny, data=DataConfig(source=str(sft_file), seq_len=SEQ_LEN, packed=False),
                optimizer=OptimizerConfig(lr=3e-3), steps=args.sft_steps, batch_size=32, microbatches=1,
                eval_every=0, output=str(out / "sft"), overwrite=True, quiet=True)  # fmt: skip
print(f"supervised fine-tuning on both endings ({args.sft_steps} steps)...", flush=True)
base = zoo.train.run(sft).model
dpo = RunConfig(model="transformer", init=str(out / "sft"), objective="dpo", beta=args.beta,
                lora=zoo.lora.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"),
                data=DataConfig(source=str(pairs_file), seq_len=SEQ_LEN, validation=0.1),
                optimizer=OptimizerConfig(lr=args.dpo_lr), steps=args.dpo_steps, batch_size=16, microbatches=2,
                eval_every=0, output=str(out / "dpo"), overwrite=True, quiet=True)  # fmt: skip
print(f"DPO of LoRA adapters on the pairs ({args.dpo_steps} steps)...", flush=True)
result = zoo.train.run(dpo)

held = byte_rows(held_pairs)
before, after = preference_accuracy(base, held), preference_accuracy(result.model, held)
print(f"held-out preference accuracy ({len(held['chosen_tokens'])} pairs): before {100 * before:.0f}%, after "
      f"{100 * after:.0f}%")  # fmt: skip
print(f"TRL's rewards/accuracies on the run's held-out pairs after DPO: {100 * result.summary['eval_after']['accuracy']:.0f}%, "
      f"rewards/margins {result.summary['eval_after']['rewards/margins']:.3f}")  # fmt: skip
for when, model in (("before", base), ("after", result.model)):
    print(f"greedy answers {when}:")
    for line in greedy_answers(model, held_pairs[:: len(FACTS) + 1][:3]):
        print(f"  {line}")

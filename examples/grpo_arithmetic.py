"""Online RL (GRPO with LoRA) with `zoo.train.run`, on a task whose reward a program can
check: the sums of two numbers.

    python examples/grpo_arithmetic.py --out runs/grpo-example [--sft-steps 300] [--grpo-steps 100]

Two runs, as `zoo train` / `zoo finetune` would make them: first a small byte-level decoder
learns each sum with two answers, the right one and one more ("3+5=" -> "8." and "9."), then GRPO
tunes LoRA adapters on the prompts alone: each step samples `--num-generations`
completions of each prompt from the policy being trained (the serving engine, in the same
process, the adapter rewritten in its slot after every update), scores them with
`correct` below (1 for the right sum, 0.1 for a number in the right format) and pushes each
completion up or down by its reward against its group's mean. The script prints the mean
reward per evaluation, the share of held-out sums the greedy answer gets right, and a few
answers, before and after.

Your own task: a `.jsonl` of `{"prompt", ...}` lines (extra keys reach the reward
functions by name), a file of reward functions, and `zoo finetune transformer --init MODEL
--objective grpo --data PROMPTS.jsonl --reward rewards.py:NAME` (docs/training.md, "Online
RL: GRPO").
"""

import argparse
import json
import random
import re
from pathlib import Path

TOP = 10  # operands 0..TOP-1: prompts of four bytes


def correct(prompts, completions, answer, **columns):
    """The reward: 1 when the completion starts with the right sum and a full stop, 0.1 for
    another number so written, 0 otherwise (TRL's signature: the prompts file's `answer`
    column arrives by name)."""
    out = []
    for completion, want in zip(completions, answer):
        found = re.match(r"(\d+)\.", completion)
        out.append(0.0 if found is None else 1.0 if found[1] == want else 0.1)
    return out


def write_data(out: Path) -> tuple[Path, Path, list[dict]]:
    """The supervised set (every sum twice: with its answer and with the answer plus one,
    so the supervised model holds both about equally likely), the prompts GRPO tunes on
    (80 of the sums, each with its answer as a column) and the 20 held-out sums."""
    rng = random.Random(0)
    sums = [(a, b) for a in range(TOP) for b in range(TOP)]
    rng.shuffle(sums)
    sft = [{"prompt": f"{a}+{b}=", "completion": f"{a + b + wrong}."} for a, b in sums for wrong in (0, 1)]
    prompts = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in sums]
    out.mkdir(parents=True, exist_ok=True)
    for name, records in (("sft.jsonl", sft), ("prompts.jsonl", prompts[20:])):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in records))
    return out / "sft.jsonl", out / "prompts.jsonl", prompts[:20]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/grpo-example", help="the runs' folder (OUT/sft, OUT/grpo)")
    parser.add_argument("--sft-steps", type=int, default=300)
    parser.add_argument("--grpo-steps", type=int, default=150)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-3, help="GRPO's learning rate")
    args = parser.parse_args()

    import jax

    jax.config.update("jax_num_cpu_devices", 1)  # the rollouts and the step on one device

    import numpy as np

    import zoo
    from zoo.train import DataConfig, GRPOConfig, OptimizerConfig, RunConfig

    def greedy(model, held: list[dict]) -> tuple[float, list[str]]:
        """The share of `held` sums the greedy answer gets right, and the answers."""
        prompts = [np.frombuffer(h["prompt"].encode(), np.uint8).astype(np.int32) for h in held]
        tokens = np.asarray(zoo.generate(model, np.stack(prompts), max_new_tokens=3))  # prompts of equal length
        texts = [
            bytes(np.asarray(t[len(p) :]).astype(np.uint8)).decode("utf-8", "replace") for t, p in zip(tokens, prompts)
        ]
        right = [r == 1.0 for r in correct(None, texts, [h["answer"] for h in held])]
        return float(np.mean(right)), [f"{h['prompt']}{t!r}" for h, t in zip(held, texts)]

    out = Path(args.out)
    sft_file, prompts_file, held = write_data(out / "data")
    tiny = {"d_model": 64, "num_layers": 2, "num_heads": 4, "mlp_dim": 256}
    sft = RunConfig(model="transformer", model_config=tiny, data=DataConfig(source=str(sft_file), seq_len=8, packed=False),
                    optimizer=OptimizerConfig(lr=3e-3), steps=args.sft_steps, batch_size=32, microbatches=1, devices=1,
                    eval_every=0, output=str(out / "sft"), overwrite=True, quiet=True)  # fmt: skip
    print(f"supervised training on every sum, right and one too many ({args.sft_steps} steps)...", flush=True)
    base = zoo.train.run(sft).model
    grpo = RunConfig(model="transformer", init=str(out / "sft"), objective="grpo",
                     grpo=GRPOConfig(reward=f"{Path(__file__).resolve()}:correct", num_generations=args.num_generations,
                                     max_completion_length=3, temperature=1.0),
                     lora=zoo.lora.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"),
                     data=DataConfig(source=str(prompts_file), seq_len=8, validation=0.1),
                     optimizer=OptimizerConfig(lr=args.lr, schedule="constant"), steps=args.grpo_steps,
                     batch_size=8 * args.num_generations, microbatches=2, devices=1,
                     eval_every=max(1, args.grpo_steps // 5), output=str(out / "grpo"), overwrite=True, quiet=True)  # fmt: skip
    print(f"GRPO of LoRA adapters on the prompts alone ({args.grpo_steps} steps)...", flush=True)
    result = zoo.train.run(grpo, command="finetune")

    rows = [json.loads(line) for line in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["eval_reward"]) for r in rows if r["kind"] == "eval"]
    print("held-out mean reward by step: " + ", ".join(f"{step}: {reward:.3f}" for step, reward in evals))
    seconds = result.summary["seconds"]
    print(
        f"time: {args.grpo_steps} steps {seconds['train']:.1f} s, of which sampling the rollouts {seconds['rollouts']:.1f} s"
    )
    for when, model in (("before", base), ("after", result.model)):
        accuracy, answers = greedy(model, held)
        print(f"greedy sums right {when}: {100 * accuracy:.0f}% of {len(held)}; " + ", ".join(answers[:4]))


if __name__ == "__main__":
    main()

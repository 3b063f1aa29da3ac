"""End-to-end runs of the scripts in examples/ (slow: run with `pytest -m slow`)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import short_run_env

ROOT = Path(__file__).resolve().parents[1]

# Tiny but still learning: a one-layer, 32-wide byte LM on 8 devices x 4 microbatches
# drops from ~7.9 bits/byte to 3.79 in 150 steps (3.40 in 300, 3.96 in 100: measured),
# 0.77 bit under the unigram entropy (4.55), past the 0.5 asked below; most of the run's
# ~19 CPU seconds are importing and compiling (1 step: 8 s; 300 steps: 22 s).
TRAIN_LM_FLAGS = [
    "--devices", "8",
    "--microbatches", "4",
    "--steps", "150",
    "--batch-size", "32",
    "--seq-len", "64",
    "--d-model", "32",
    "--layers", "1",
    "--heads", "4",
    "--lr", "1e-2",
    "--eval-windows", "64",
    "--sample-bytes", "100",
]  # fmt: skip


def _run_example(script: str, *flags: str, timeout: int, fast_compile: bool = False) -> str:
    """Run `examples/<script>` with `flags`; assert it exits 0; return its stdout.

    `fast_compile`: compiled as the tests compile (`helpers.short_run_env`: LLVM's
    optimisation off; XLA's passes, which place the collectives the examples print,
    unchanged), for the examples of tiny models, whose time is compiling (the byte LMs,
    the tiny Llama, DPO's and GRPO's small decoders: 206 -> 157 CPU s in all, every
    outcome the same); otherwise XLA's defaults, for those whose time is running
    (MiniLM's forward over every text: 45 -> 48 CPU s unoptimised). Measured side by side
    in docs/testing.md, session 28."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *flags],
        cwd=ROOT,
        env=short_run_env() if fast_compile else None,
        check=False,  # the exit code is asserted here, with the output
        capture_output=True,
        timeout=timeout,  # generous: a loaded machine compiles slowly
    )
    out = proc.stdout.decode("utf-8", errors="replace")
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{out}\n{proc.stderr.decode(errors='replace')}"
    return out


def _number(pattern: str, text: str) -> float:
    match = re.search(pattern, text)
    assert match, f"no line matching {pattern!r} in the output:\n{text}"
    return float(match.group(1))


@pytest.mark.timeout(600)
@pytest.mark.slow
def test_train_lm_learns_below_unigram_entropy():
    out = _run_example("train_lm.py", *TRAIN_LM_FLAGS, timeout=300, fast_compile=True)

    unigram = _number(r"unigram entropy of the training bytes: ([\d.]+) bits/byte", out)
    before = _number(r"val loss before training: [\d.]+ nats = ([\d.]+) bits/byte", out)
    after = _number(r"val loss after training: +[\d.]+ nats = ([\d.]+) bits/byte", out)
    assert 4.0 < unigram < 6.0, unigram  # Python source: about 4.5 bits/byte
    assert before > 7.0, before  # an untrained model is near uniform: log2(256) = 8
    assert after < unigram - 0.5, (after, unigram)  # well below, not just below

    # The sample (prompt + 100 bytes) follows its header, between two rules.
    sample = re.search(r"sample \(temperature [\d.]+\):\n-{72}\n(.*?)\n-{72}\n", out, re.DOTALL)
    assert sample, out
    assert sample.group(1).startswith("def ") and len(sample.group(1)) >= 50, sample.group(1)

    # The compiled step's collectives: the one gradient all-reduce, outside the loop.
    assert "all-reduces: 0 inside loops, 1 outside" in out, out
    assert re.search(r"^all-reduce +outside .*\bdata\b", out, re.MULTILINE), out
    assert "OK: final val loss" in out


# Tiny: a one-layer, 32-wide byte LM pretrained 50 steps on stdlib code, then 30 LoRA
# steps (r=4, all-linear, dropout on) on pydoc prose; the prose loss falls by 0.083 nats
# (measured; 0.12 after 100 + 60 steps), past the 0.05 asked below. Every other claim
# (the files, the one all-reduce of the adapter's bytes, merged and reloaded losses) is
# the same at any length. 31 CPU s (40 at 100 + 60), most of it compiling the two steps.
LORA_FLAGS = [
    "--devices", "8",
    "--microbatches", "4",
    "--batch-size", "32",
    "--seq-len", "64",
    "--d-model", "32",
    "--layers", "1",
    "--heads", "4",
    "--pretrain-steps", "50",
    "--finetune-steps", "30",
    "--rank", "4",
    "--alpha", "8",
    "--eval-windows", "64",
]  # fmt: skip


@pytest.mark.timeout(600)
@pytest.mark.slow
def test_lora_finetune_adapts_to_prose_communicating_only_the_adapter(tmp_path):
    out_dir = tmp_path / "adapter"
    out = _run_example("lora_finetune.py", *LORA_FLAGS, "--out", str(out_dir), timeout=300, fast_compile=True)

    before = _number(r"val loss before fine-tuning: ([\d.]+) nats", out)
    after = _number(r"val loss after fine-tuning: +([\d.]+) nats", out)
    assert after < before - 0.05, (before, after)  # the adapter learned the new domain

    assert "base weights bit-for-bit unchanged: True" in out, out
    # docs/lora.md: the merged model's loss differs from the adapted model's by float32
    # rounding (2.4e-7 measured), the reloaded adapter's not at all.
    merged_gap = _number(r"\|merged - adapter\| = ([\d.e+-]+)\)", out)
    reloaded_gap = _number(r"\|reloaded - adapter\| = ([\d.e+-]+)\)", out)
    assert merged_gap <= 2e-6 and reloaded_gap == 0.0, (merged_gap, reloaded_gap)

    # One all-reduce, outside the loop, carrying the adapter's bytes plus two f32 scalars
    # (the loss sum and the token count), and nothing of the frozen base.
    plain = re.sub(r"(?<=\d),(?=\d{3})", "", out)  # numbers without thousands separators
    adapter_params = _number(r"adapter size: (\d+) parameters", plain)
    adapter_bytes = _number(r"adapter size: \d+ parameters, (\d+) bytes", plain)
    model_params = _number(r"model size: (\d+) parameters", plain)
    assert adapter_bytes == 4 * adapter_params and 0 < adapter_params < model_params / 2
    assert "all-reduces: 0 inside loops, 1 outside" in out, out
    assert re.search(r"^all-reduce +outside .*\bdata\b", out, re.MULTILINE), out
    reduced = _number(r"all-reduce bytes: (\d+) = adapter", plain)
    assert reduced - adapter_bytes == 8, (reduced, adapter_bytes)

    assert sorted(p.name for p in out_dir.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "zoo_adapter.json",
    ]
    # The files, read here (not the example's word): rank 4, every A and B of 1 layer x
    # (q, k, v, o, up, down) trained off peft's init (B starts at zero). The byte LM is
    # GPT-2-shaped, so its q/k/v branches are written as peft's one rank-12 `c_attn` branch
    # (A stacked, B block-diagonal): the file's non-zero entries are exactly the trained ones.
    import json

    import numpy as np
    import safetensors.numpy

    config = json.loads((out_dir / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8
    tensors = safetensors.numpy.load_file(str(out_dir / "adapter_model.safetensors"))
    assert sum(int(np.count_nonzero(t)) for t in tensors.values()) == adapter_params
    a = {k: v for k, v in tensors.items() if "lora_A" in k}
    b = {k: v for k, v in tensors.items() if "lora_B" in k}
    rank = {k: config["rank_pattern"].get(k.split("model.", 2)[-1].rsplit(".lora_", 1)[0], 4) for k in tensors}
    assert len(a) == len(b) >= 4 and set(rank.values()) <= {4, 12}
    assert all(v.shape[0] == rank[k] for k, v in a.items()) and all(v.shape[1] == rank[k] for k, v in b.items())
    assert all(np.abs(v).max() > 0 for v in b.values())  # trained: peft's B starts at 0


@pytest.mark.timeout(900)
@pytest.mark.slow
def test_finetune_minilm_trains_adapters_of_the_real_model(tmp_path):
    """The pretrained all-MiniLM-L6-v2, LoRA on 8 devices x 2 microbatches, a few steps.
    Texts cut at 16 tokens: most of the run is the encoder's forward over every train and
    test text (72 CPU s at 32 tokens, 50 at 16, measured); at 16 the probe reaches 0.763
    and LoRA + head 0.467 over a majority class of 0.175 (0.777 and 0.482 at 32)."""
    flags = ["--steps", "8", "--probe-steps", "60", "--seq-len", "16", "--batch-size", "16", "--out", str(tmp_path)]
    out = _run_example("finetune_minilm.py", *flags, timeout=600)
    majority = _number(r"majority-class test accuracy ([\d.]+)", out)
    probe = _number(r"trained to convergence: test loss [\d.]+, accuracy ([\d.]+)", out)
    lora = _number(r"LoRA r=8 \+ head: +test loss [\d.]+, accuracy ([\d.]+)", out)
    # Real pretrained features: far above always guessing the largest class, even after
    # 8 LoRA steps from a new head.
    assert probe > majority + 0.4 and lora > majority + 0.2, (majority, probe, lora)
    trained = _number(r"trained (\d+) bytes", out.replace(",", ""))
    reduced = _number(r"gradient all-reduces outside loops: 1 (\d+) bytes", out.replace(",", ""))
    assert reduced == trained + 4  # the adapters and head, and the loss sum: nothing else
    assert "frozen base weights bit for bit unchanged: yes" in out
    # A mean-pooling classifier: the encoder's FEATURE_EXTRACTION adapter and the head apart.
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "head.safetensors",
        "zoo_adapter.json",
    ]
    # The files, read here: rank 8; they hold exactly the trained bytes (adapters + head),
    # and every B moved off peft's zero init.
    import json

    import numpy as np
    import safetensors.numpy

    values = json.loads((tmp_path / "adapter_config.json").read_text())
    assert values["r"] == 8 and values["task_type"] == "FEATURE_EXTRACTION"
    tensors = safetensors.numpy.load_file(str(tmp_path / "adapter_model.safetensors"))
    head = safetensors.numpy.load_file(str(tmp_path / "head.safetensors"))
    assert sum(t.nbytes for t in [*tensors.values(), *head.values()]) == trained
    b = [v for k, v in tensors.items() if "lora_B" in k]
    assert len(b) >= 36 and all(np.abs(v).max() > 0 for v in b)  # 6 layers x 6 Linear layers


@pytest.mark.timeout(600)
@pytest.mark.slow
def test_finetune_your_data_writes_an_adapter_peft_opens_with_zoos_logits(tmp_path):
    """A tiny random Llama saved by transformers with a word-level tokenizer beside it, a
    prompt/completion `.jsonl`: the example trains LoRA on it (the loss falls) and its
    adapter, opened by peft on the transformers model, gives zoo's logits."""
    import json

    import numpy as np
    import peft
    import tokenizers
    import torch
    import transformers
    from helpers import assert_as_accurate, torch_reference

    import zoo

    words = "the a cat dog sat ran on under mat log red blue big small".split()
    special = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {t: i for i, t in enumerate(special + words)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(special)
    tok.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    folder = tmp_path / "llama"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(vocab), hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(folder)
    rng = np.random.default_rng(0)
    records = []
    for _ in range(64):  # the completion names the prompt's animal's place: learnable
        animal, place = rng.choice(["cat", "dog"]), rng.choice(["mat", "log"])
        records.append({"prompt": f"the {animal} sat on the {place}", "completion": f"{place} {animal}"})
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))

    out = _run_example(
        "finetune_your_data.py", str(folder), str(data), "--out", str(tmp_path / "run"),
        "--steps", "30", "--seq-len", "32", "--batch-size", "8", "--lr", "1e-2", timeout=500, fast_compile=True,
    )  # fmt: skip
    first = _number(r"step 1: train loss ([\d.]+)", out)
    last = _number(r"step 30: train loss ([\d.]+)", out)
    assert last < first - 0.3, (first, last)

    tokens = np.array([[1, 4, 6, 8, 9, 4, 12]], np.int32)  # <s> the cat sat on the mat
    model = zoo.hf.from_pretrained(folder)
    model, _ = zoo.lora.load_adapter(model, tmp_path / "run" / "adapter")
    ours = np.asarray(model(tokens))[..., : len(vocab)]
    with torch.no_grad():  # before peft wraps `hf` in place
        base = hf(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()
    peft_model = peft.PeftModel.from_pretrained(hf, tmp_path / "run" / "adapter").eval()
    theirs = torch_reference(lambda m: m(torch.from_numpy(tokens.astype(np.int64))).logits, peft_model)
    assert_as_accurate(ours, theirs, what="example's adapter vs peft")
    assert np.abs(theirs.f32 - base).max() > 1e-3  # the adapter changed the model


@pytest.mark.timeout(900)
@pytest.mark.slow
def test_dpo_your_data_prefers_the_chosen_answers_after_tuning(tmp_path):
    """The DPO example: supervised training on both endings leaves the held-out preference
    near chance; DPO of LoRA adapters (reference: the adapters off, in the step) lifts it
    to >= 90%, and the greedy answers end with a question back after tuning. 150 SFT
    steps, not the example's 300 (measured: 46% before, 96% after, all three greedy
    answers end with a question); the DPO run at its default 40."""
    out = _run_example(
        "dpo_your_data.py", "--out", str(tmp_path / "runs"), "--sft-steps", "150", timeout=850, fast_compile=True
    )
    before = _number(r"held-out preference accuracy \(\d+ pairs\): before (\d+)%", out)
    after = _number(r"held-out preference accuracy \(\d+ pairs\): before \d+%, after (\d+)%", out)
    assert before <= 70 and after >= 90, (before, after)
    answers_after = out.split("greedy answers after:")[1].strip().splitlines()
    assert len(answers_after) == 3 and sum(line.rstrip("'").endswith("?") for line in answers_after) >= 2, out


@pytest.mark.timeout(900)
@pytest.mark.slow
def test_grpo_arithmetic_makes_the_held_out_greedy_sums_right(tmp_path):
    """The GRPO example: supervised training on each sum with its right answer and one too
    many leaves the greedy answer right on few held-out sums; GRPO on the prompts alone,
    rewarded for the right sum, makes it right on most, the held-out mean reward rising.
    Its defaults (measured: 15% before, 100% after; 150 GRPO steps in about 20 s)."""
    out = _run_example("grpo_arithmetic.py", "--out", str(tmp_path / "runs"), timeout=850, fast_compile=True)
    before = _number(r"greedy sums right before: (\d+)%", out)
    after = _number(r"greedy sums right after: (\d+)%", out)
    assert before <= 60 and after >= 85, (before, after)
    rewards = [
        float(r) for r in re.findall(r"\d+: ([\d.]+)", out.split("held-out mean reward by step:")[1].splitlines()[0])
    ]
    assert rewards[-1] > rewards[0], rewards

"""The tiny Hugging Face folder, data files and finished runs the CLI tests share.

tests/conftest.py makes each once per test process (session fixtures `llama_dir`,
`data_files`, `chat_run`, `classifier_run`, `lora_classifier_run`): a finished run costs a
training run's compiles, and the tests that only read it (predict, eval, export, generate,
peft opening it) read the same one. A test that changes a folder copies it first
(`shutil.copytree`). One tiny-run flag set (`TINY`): 2 devices, 1 microbatch, batch 4.
"""

import json
from pathlib import Path

import numpy as np
from helpers import zoo_ok

WORDS = "the a cat dog sat ran on under mat log red blue big small".split()
SPECIAL = ["<pad>", "<s>", "</s>", "<unk>", "<user>", "<assistant>"]
VOCAB = {t: i for i, t in enumerate(SPECIAL + WORDS)}
# No generation blocks: the assistant turns are found by rendering prefixes.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<' + m['role'] + '> ' + m['content'] + ' </s> ' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<assistant> ' }}{% endif %}"
)
SEQ = 32
# A decoder's run ends with a greedy sample (zoo.generate: its own compiled programs); the
# tests whose subject is not the sample leave it out (`--sample-tokens 0`). The sample's own
# test: test_cli.py::test_finetune_transformer_from_a_hugging_face_folder.
NO_SAMPLE = ["--sample-tokens", "0"]
# 2 devices, 1 microbatch, batch 4: the smallest runs that still split the batch (no sample).
# The tiny Llama's float32 sums (helpers.rounding_bound): <= 48 wide (its MLP), 2 layers of
# ~6 chained sums and the head, then a loss's log-sum-exp and sum over the tokens.
FORWARD = {"terms": 48, "depth": 2 * 6 + 1}
LOSS_DEPTH = FORWARD["depth"] + 2
TINY = [*NO_SAMPLE, "--devices", "2", "--batch-size", "4", "--microbatches", "1", "--seq-len", str(SEQ), "--quiet"]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def make_llama_dir(folder: Path) -> Path:
    """A tiny random Llama saved by transformers, a word-level tokenizer (BOS added to
    each text, EOS `</s>`) and a chat template beside it."""
    import tokenizers
    import torch
    import transformers

    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(VOCAB, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIAL)
    tok.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "chat_template": CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(
        vocab_size=len(VOCAB), hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    transformers.LlamaForCausalLM(hf_config).save_pretrained(folder)
    return folder


def _sentence(rng, n: int) -> str:
    return " ".join(rng.choice(WORDS, n))


def make_data_files(folder: Path) -> dict[str, Path]:
    """The tiny data files of the CLI tests: plain text, text / prompt-completion / chat
    JSON lines over the tiny Llama's words, labelled texts (JSON lines and CSV)."""
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    files = {}
    files["txt"] = folder / "notes.txt"
    files["txt"].write_text("def f(x):\n    return x + 1  # héllo\n" * 40)
    files["text"] = write_jsonl(folder / "text.jsonl", [{"text": _sentence(rng, 6)} for _ in range(40)])
    pc = []
    for _ in range(40):  # the completion names the prompt's animal's place: learnable
        animal, place = rng.choice(["cat", "dog"]), rng.choice(["mat", "log"])
        pc.append({"prompt": f"the {animal} sat on the {place}", "completion": f"{place} {animal}"})
    files["pc"] = write_jsonl(folder / "pc.jsonl", pc)
    chats = []
    for _ in range(30):
        turns = [{"role": "user", "content": _sentence(rng, 3)}, {"role": "assistant", "content": _sentence(rng, 2)}]
        if rng.random() < 0.5:
            turns += [
                {"role": "user", "content": _sentence(rng, 2)},
                {"role": "assistant", "content": _sentence(rng, 3)},
            ]
        chats.append({"messages": turns})
    files["chat"] = write_jsonl(folder / "chat.jsonl", chats)
    labelled = [("the cat sat on the mat", "cats"), ("a dog ran under a log", "dogs"), ("red blue big", "colours")]
    files["labels"] = write_jsonl(
        folder / "labels.jsonl",
        [{"text": f"{t} {_sentence(rng, 2)}", "label": label} for _ in range(8) for t, label in labelled],
    )
    rows = [f'"{t} {_sentence(rng, 2)}",{i}' for _ in range(12) for i, (t, _) in enumerate(labelled[:2])]
    files["csv"] = folder / "labels.csv"
    files["csv"].write_text("text,label\n" + "\n".join(rows) + "\n")
    return files


# A tiny BERT from scratch on byte tokens (the classifier runs), its flags beside TINY's.
ENCODER = ["--model-config", "d_model=32,num_layers=1", "--seq-len", "32"]


def train_classifier_run(out: Path, data_files: dict[str, Path]) -> Path:
    """`zoo train encoder` on string labels (cats, colours, dogs): model/ + head.safetensors."""
    zoo_ok("train", "encoder", "--data", data_files["labels"], *TINY[:-3], *ENCODER, "--steps", "2", "--quiet",
           "--output", out)  # fmt: skip
    return out


def train_lora_classifier_run(out: Path, classifier_run: Path, data_files: dict[str, Path]) -> Path:
    """`zoo finetune encoder --init` the classifier run's encoder: a LoRA adapter with the head."""
    zoo_ok("finetune", "encoder", "--init", classifier_run, "--data", data_files["labels"], *TINY[:-3], "--seq-len",
           "32", "--steps", "2", "--lr", "1e-2", "--quiet", "--output", out)  # fmt: skip
    return out


def train_chat_run(out: Path, llama_dir: Path, data_files: dict[str, Path]) -> Path:
    """A chat SFT run: LoRA on the tiny Llama, its chat template from tokenizer_config.json."""
    zoo_ok("finetune", "transformer", "--init", llama_dir, "--data", data_files["chat"], "--lora", "r=4,alpha=8",
           *TINY, "--steps", "2", "--lr", "1e-2", "--output", out)  # fmt: skip
    return out


# The tiny mlp run on 2 devices (the mlp's own model and data): every in-process mlp run of
# these shapes reuses one set of compiled programs (jax's caches, kept across files).
TINY_MLP = ["--devices", "2", "--batch-size", "8", "--microbatches", "1", "--eval-size", "16", "--quiet"]


def train_finished_mlp_run(out: Path) -> Path:
    """A finished 4-step mlp run, checkpoints at steps 2 and 4; lr, seed and model config
    not the defaults: what a resume continues, and must refuse to change."""
    zoo_ok("train", "mlp", *TINY_MLP, "--steps", "4", "--checkpoint-every", "2", "--lr", "0.01", "--seed", "3",
           "--model-config", "width=16,depth=2", "--output", out)  # fmt: skip
    return out


def train_rows(folder: Path) -> list[dict]:
    """The training rows of a run's metrics.jsonl."""
    return [r for r in read_jsonl(folder / "metrics.jsonl") if r["kind"] == "train"]

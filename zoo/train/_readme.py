"""How other tools use a classifier run's adapter: the README.md of its `adapter/` folder,
with the exact recipe (transformers + peft, or sentence-transformers) that gives zoo's
logits."""

from __future__ import annotations

import json
from pathlib import Path

# The texts a recipe classifies, as written in it.
_TEXTS = '["Return the number of items in a container.", "items in a container. Return the number of"]'


def _tokenize(tokenizer_dir: Path | None, seq_len: int, pad_id: int) -> str:
    """The recipe's lines that make `batch` (torch tensors) from `texts` as the run did."""
    if tokenizer_dir is None:  # byte tokens: what zoo.data.byte_tokens gives
        return (
            "# zoo read UTF-8 bytes as tokens, each text cut at the run's seq_len and padded with the model's pad id\n"
            "import zoo\n"
            f"tokens, mask = zoo.data.byte_tokens(texts, {seq_len}, pad_id={pad_id})\n"
            'batch = {"input_ids": torch.tensor(tokens, dtype=torch.long), '
            '"attention_mask": torch.tensor(mask, dtype=torch.long)}\n'
        )
    return (
        f'tokenizer = AutoTokenizer.from_pretrained("{tokenizer_dir}")\n'
        "# cut at the run's seq_len, as zoo cut the texts it trained and evaluated on\n"
        f'batch = tokenizer(texts, padding=True, truncation=True, max_length={seq_len}, return_tensors="pt")\n'
    )


def classifier_readme(adapter: Path, *, pooling: str, title: str, seq_len: int, label_names, d_model: int,
                      tokenizer_dir: Path | None, pad_id: int) -> str:  # fmt: skip
    """The README.md of a classifier run's adapter folder `adapter` (written already: its
    adapter_config.json names the base model): what the adapter is and the recipe that
    computes the run's logits in transformers + peft (`pooling="cls"`: a `SEQ_CLS` adapter
    on `BertForSequenceClassification`; `"mean"`: a `FEATURE_EXTRACTION` adapter on
    `BertModel`, mean pooling and `head.safetensors`; with sentence-transformers too)."""
    values = json.loads((adapter / "adapter_config.json").read_text())
    base, labels = values.get("base_model_name_or_path"), list(label_names)
    n = len(labels)
    imports = "import torch\n" + ("from transformers import AutoTokenizer\n" if tokenizer_dir is not None else "")
    common = f'ADAPTER = "{adapter}"\nLABELS = {labels!r}\ntexts = {_TEXTS}\n'
    tokenize = _tokenize(tokenizer_dir, seq_len, pad_id)
    finish = "print([LABELS[i] for i in logits.argmax(-1).tolist()])\n"
    if pooling == "cls":
        saved = "classifier" in (values.get("modules_to_save") or [])
        what = (
            f"a peft LoRA adapter (`task_type` `SEQ_CLS`) of `{base}` as `BertForSequenceClassification`: the "
            f"`[CLS]` state through BERT's pooler (dense + tanh), then the head (`classifier`, {n} labels"
            + (", trained in full). peft opens it as the classifier zoo trained" if saved else
               ", not trained: --lora save=none). Without the head in the adapter peft starts a new random one, "
               "so its logits are not zoo's: train the head (save=head) to use it elsewhere")
            + "; pass `num_labels` (transformers' default is 2)."
        )  # fmt: skip
        recipe = (
            f"{imports}from peft import AutoPeftModelForSequenceClassification\n\n{common}"
            f"model = AutoPeftModelForSequenceClassification.from_pretrained(ADAPTER, num_labels={n}).eval()\n"
            f"{tokenize}with torch.no_grad():\n    logits = model(**batch).logits\n{finish}"
        )
        extra = ""
    else:
        what = (
            f"a peft LoRA adapter (`task_type` `FEATURE_EXTRACTION`) of `{base}`'s encoder (`BertModel`), and the "
            f"classifier's head in `head.safetensors` (torch's `nn.Linear({d_model}, {n})` state dict). zoo's "
            "classifier reads the mean of the last hidden states over the real tokens (not normalised), which no "
            "Hugging Face class computes: open the adapter as features, pool, then apply the head. "
            "`AutoPeftModelForSequenceClassification` refuses this adapter (its task type is another)."
        )
        recipe = (
            f"{imports}from peft import AutoPeftModelForFeatureExtraction\nfrom safetensors.torch import load_file\n\n"
            f"{common}encoder = AutoPeftModelForFeatureExtraction.from_pretrained(ADAPTER).eval()\n"
            f"head = torch.nn.Linear({d_model}, {n})\n"
            f'head.load_state_dict(load_file(f"{{ADAPTER}}/head.safetensors"))\n'
            f"{tokenize}with torch.no_grad():\n"
            "    hidden = encoder(**batch).last_hidden_state\n"
            '    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)\n'
            "    features = (hidden * mask).sum(1) / mask.sum(1)  # the mean over real tokens\n"
            f"    logits = head(features)\n{finish}"
        )
        extra = "" if tokenizer_dir is None else _sentence_transformers(base, seq_len, common, d_model, n)
    return (
        f"# {title}: LoRA adapter\n\nThis folder holds {what}\n\n"
        f"Its logits, as zoo computes them (texts cut at {seq_len} tokens):\n\n```python\n{recipe}```\n{extra}"
        "\nIn zoo: `zoo.lora.load_adapter(classifier, ADAPTER)` on the `zoo.models.EncoderClassifier` the run built "
        f'(`pooling="{pooling}"`, {n} labels).\n'
    )


def _sentence_transformers(base: str, seq_len: int, common: str, d_model: int, n: int) -> str:
    """The sentence-transformers variant of the mean-pooling recipe (its pipeline without
    the Normalize module: the head reads the plain mean)."""
    return (
        "\nWith sentence-transformers (the same features: its Transformer and mean Pooling modules, without "
        "Normalize):\n\n```python\nimport torch\nfrom safetensors.torch import load_file\n"
        f"from sentence_transformers import SentenceTransformer\n\n{common}"
        f'st = SentenceTransformer("{base}", device="cpu")\nst.load_adapter(ADAPTER)\n'
        'features = SentenceTransformer(modules=[st[0], st[1]], device="cpu")  # no Normalize\n'
        f"features.max_seq_length = {seq_len}\n"
        f'head = torch.nn.Linear({d_model}, {n})\nhead.load_state_dict(load_file(f"{{ADAPTER}}/head.safetensors"))\n'
        "with torch.no_grad():\n    logits = head(features.encode(texts, convert_to_tensor=True))\n"
        "print([LABELS[i] for i in logits.argmax(-1).tolist()])\n```\n"
    )

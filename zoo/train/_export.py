"""The export hook: after the last step, a run's result in a form other tools open."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from .._files import atomic_write
from ..hf import save_pretrained
from ..hf._files import read_json
from ..lora import save_adapter, save_adapters
from ..lora._folders import DEFAULT
from ._errors import ConfigError
from ._folder import claim
from ._head import save_head
from ._hooks import Checkpoint
from ._plan import RunPlan
from ._task import Task
from ._trainer import Hook, TrainState

# What the tokenizer of a saved model needs next to its weights.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
    "sentence_bert_config.json",
)


class Export(Hook):
    """After the last step, writes the run's result: the LoRA adapter in peft's layout
    (OUTPUT/adapter; a classifier's with a README.md holding the recipe that computes its
    logits in transformers + peft; several adapters: each in OUTPUT/adapter/NAME, peft's
    layout of named adapters), else the model as a Hugging Face folder with its
    tokenizer's files (OUTPUT/model; a classifier's encoder, with its head in
    model/head.safetensors); a trained model neither holds (the mlp, a transformer GPT-2
    cannot express) and no checkpoint would keep is saved as a final checkpoint.

    `outputs` names what was written (`"adapter"`, `"model"`, `"checkpoints"`), or why no
    Hugging Face folder was (`"model_not_saved"`). Every process calls the savers (sharded
    leaves are gathered); process 0 writes.
    """

    def __init__(self, plan: RunPlan, task: Task, saver: Checkpoint, *, checkpointed: bool, main: bool):
        self.plan, self.task, self.saver, self.checkpointed, self.main = plan, task, saver, checkpointed, main
        self.outputs: dict[str, Any] = {}

    def _claim(self, folder: str, written: list[Path] | None = None) -> None:
        """List OUTPUT/`folder` in the run's marker: as a folder before it is written, then
        as the files `written` (process 0)."""
        if self.main:
            names = [f"{folder}/"] if written is None else [p.relative_to(self.plan.output).as_posix() for p in written]
            claim(self.plan.output, self.plan.checkpoints, names, replace=None if written is None else f"{folder}/")

    def _readme(self, adapter: Path) -> Path:
        """adapter/README.md: what a classifier's adapter is, and the recipe that computes
        its logits in other tools (`_readme.classifier_readme`)."""
        c, task = self.plan.config, self.task
        config = task.config or {}
        text = classifier_readme(
            adapter,
            pooling=c.pooling or "mean",
            title=self.plan.title,
            seq_len=c.data.seq_len,
            label_names=task.label_names or (),
            d_model=config["d_model"],
            tokenizer_dir=task.tokenizer_dir,
            pad_id=config.get("pad_token_id", 0),
        )
        atomic_write(adapter / "README.md", lambda tmp: Path(tmp).write_text(text))
        return adapter / "README.md"

    def on_end(self, state: TrainState) -> None:
        output, lcfg, task = self.plan.output, self.plan.config.lora, self.task
        if lcfg is not None and task.adapter_names is not None:  # several: peft's folder of named adapters
            self._claim("adapter")
            names = task.adapter_names
            self._claim("adapter", save_adapters(state.model, dict.fromkeys(names, lcfg), output / "adapter"))
            self.outputs["adapter"] = str(output / "adapter")
            self.outputs["adapters"] = {
                n: str(output / "adapter" / n) if n != DEFAULT else str(output / "adapter") for n in names
            }
        elif lcfg is not None:
            self._claim("adapter")
            written = save_adapter(state.model, lcfg, output / "adapter")
            if task.classifier and self.main:  # how transformers + peft compute its logits
                written.append(self._readme(output / "adapter"))
            self._claim("adapter", written)
            self.outputs["adapter"] = str(output / "adapter")
        elif task.hf_part is not None:
            try:
                self._claim("model")
                written = save_pretrained(task.hf_part(state.model), output / "model")
                if task.classifier:  # the head, which the encoder's folder lacks (every process: gathered)
                    written += save_head(state.model, output / "model")
                if task.tokenizer_dir is not None and self.main:
                    for name in TOKENIZER_FILES:
                        if (task.tokenizer_dir / name).is_file():
                            shutil.copy(task.tokenizer_dir / name, output / "model" / name)
                            written.append(output / "model" / name)
                self._claim("model", written)
                self.outputs["model"] = str(output / "model")
            except ValueError as e:  # a config Hugging Face's GPT-2 / BERT cannot express
                self.outputs["model_not_saved"] = str(e).splitlines()[0]
        if not self.checkpointed and self.plan.command == "train" and "model" not in self.outputs:
            self.saver.save(state)
            self.saver.close()
        if self.saver.last_saved == state.step:  # the last step, or the one the run stopped early at
            self.outputs["checkpoints"] = str(self.plan.checkpoints)


# --------------------------------------------------------------------------- the README of an exported folder
# How other tools use a classifier run's adapter: the README.md of its `adapter/` folder,
# with the exact recipe (transformers + peft, or sentence-transformers) that gives zoo's
# logits.


# What transformers prints when peft's recipe opens the base as a classifier, and why it is fine.
_MISSING_NOTE = (
    '\ntransformers reports `classifier.weight` and `classifier.bias` as MISSING ("newly initialized") when it '
    "builds `BertForSequenceClassification` from the base `BertModel`: expected. peft then puts the adapter's "
    "trained head (`modules_to_save`) in their place, and the logits are the ones above.\n"
)
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


def classifier_readme(
    adapter: Path,
    *,
    pooling: str,
    title: str,
    seq_len: int,
    label_names,
    d_model: int,
    tokenizer_dir: Path | None,
    pad_id: int,
) -> str:
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
            + (
                ", trained in full). peft opens it as the classifier zoo trained"
                if saved
                else ", not trained: --lora save=none). Without the head in the adapter peft starts a new random one, "
                "so its logits are not zoo's: train the head (save=head) to use it elsewhere"
            )
            + "; pass `num_labels` (transformers' default is 2)."
        )
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
        + (_MISSING_NOTE if pooling == "cls" else "")
        + "\nIn zoo: `model, config = zoo.lora.load_adapter(classifier, ADAPTER)` (the classifier with its "
        f'adapter, and the adapter\'s `LoraConfig`) on the `zoo.models.EncoderClassifier` the run built (`pooling="{pooling}"`, '
        f"{n} labels).\n"
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


def merged_readme(folder: Path, *, title: str, seq_len: int, label_names, tokenized: bool, pad_id: int) -> str:
    """The README.md of a mean-pooled classifier's merged export (`zoo export --merge`):
    no Hugging Face class computes its logits (the mean of the last hidden states over
    the real tokens, then the head), so it says exactly what to run instead: transformers'
    `AutoModel` for the hidden states and the head of `head.safetensors` (zoo's `[in, out]`
    layout)."""
    labels = list(label_names)
    tokenize = _tokenize(folder if tokenized else None, seq_len, pad_id)
    recipe = (
        "import torch\nfrom safetensors.torch import load_file\nfrom transformers import AutoModel"
        + (", AutoTokenizer" if tokenized else "")
        + f'\n\nFOLDER = "{folder}"\nLABELS = {labels!r}\ntexts = {_TEXTS}\n'
        "encoder = AutoModel.from_pretrained(FOLDER).eval()\n"
        'head = load_file(f"{FOLDER}/head.safetensors")  # zoo\'s layout: head.weight is [hidden, labels]\n'
        f"{tokenize}with torch.no_grad():\n"
        "    hidden = encoder(**batch).last_hidden_state\n"
        '    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)\n'
        "    features = (hidden * mask).sum(1) / mask.sum(1)  # the mean over real tokens\n"
        '    logits = features @ head["head.weight"] + head["head.bias"]\n'
        "print([LABELS[i] for i in logits.argmax(-1).tolist()])\n"
    )
    return (
        f"# {title}\n\nThis folder holds a classifier trained with `--pooling mean`: its encoder as `BertModel` "
        f"(`config.json`, `model.safetensors`; `id2label` names its {len(labels)} classes) and its head in "
        "`head.safetensors`. It reads the mean of the last hidden states over the real tokens, which no Hugging Face "
        "class computes: `AutoModelForSequenceClassification` would read the `[CLS]` state through a pooler this "
        "model does not have, with a new random head, and its logits would not be zoo's. Run this instead "
        f"(texts cut at {seq_len} tokens, as zoo cut them):\n\n```python\n{recipe}```\n\n"
        "`--pooling cls` (the default for minilm) trains a classifier that `zoo export --merge` writes as "
        "`BertForSequenceClassification`, which `AutoModelForSequenceClassification` opens as it is.\n"
    )


# The weights' dtypes an export writes (`zoo export --dtype`).
EXPORT_DTYPES = ("float32", "bfloat16", "float16")


def export_dtype(source_dir: str | None, dtype: str | None) -> str:
    """The dtype an exported model's floating weights are written in: `dtype` when given
    (one of `EXPORT_DTYPES`), else the one the config.json of `source_dir` (the Hugging
    Face folder the model was loaded from) names (`dtype`, or the older `torch_dtype`),
    as transformers + peft write a merged model in its base's dtype; float32 for a model
    of no such folder (trained from scratch, or a dtype named there that is none of them).
    Raises `ConfigError` for another `dtype`."""
    if dtype is not None:
        if dtype not in EXPORT_DTYPES:
            raise ConfigError(f"--dtype {dtype!r}: choose one of {', '.join(EXPORT_DTYPES)}")
        return dtype
    values = read_json(Path(source_dir) / "config.json") if source_dir else None
    named = (values or {}).get("dtype") or (values or {}).get("torch_dtype")
    return named if named in EXPORT_DTYPES else "float32"

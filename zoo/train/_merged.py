"""A saved run as one Hugging Face folder, LoRA merged into the base (`SavedRun.export`,
`zoo export --merge`): a decoder transformers opens as its family's causal LM; a
classifier's encoder (`BertModel`) with its head beside it (`head.safetensors`) and its
label names in config.json (`id2label`). The tokenizer's files travel with it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from .._export_dir import check_export_dir
from .._files import atomic_write
from ..hf import save_pretrained
from ..lora import merge
from ._errors import ConfigError
from ._export import TOKENIZER_FILES
from ._head import HEAD_NAME, save_head

if TYPE_CHECKING:
    from ._saved_run import SavedRun


def export_merged(run: SavedRun, directory: str | Path) -> list[Path]:
    """Write `run`'s model, LoRA branches merged (`zoo.lora.merge`), as a Hugging Face
    folder at `directory` (created; a folder holding files of the names written must be a
    Hugging Face model folder already: a user's own files are never replaced).

    A decoder is written by `zoo.hf.save_pretrained` (transformers'
    `AutoModelForCausalLM` opens it and computes the same logits); a classifier's encoder
    likewise (`BertModel`: the same hidden states), its head in `head.safetensors` (zoo's
    `[in, out]` layout: logits = pooled hidden states @ `head.weight` + `head.bias`, the
    pooling named in the file's metadata) and its label names as config.json's
    `id2label` / `label2id`. The tokenizer's files are copied in (none for byte-level
    models: their ids are the text's UTF-8 bytes).

    **Returns:** the paths written. **Raises:** `ConfigError` for a regressor (no Hugging
    Face form) or a decoder no family expresses; `FileExistsError` as `save_pretrained`.
    """
    if run.kind == "regression":
        raise ConfigError(f"{run.folder}: the {run.config.model} has no Hugging Face form; its weights are its "
                          "checkpoints (zoo.Checkpointer)")  # fmt: skip
    directory = Path(directory).expanduser()
    model = merge(run.model)
    part = model if run.kind == "lm" else model.encoder
    source = getattr(part.config, "source_dir", None)
    tok_dir = run.tokenizer_dir
    tokenizer = [n for n in TOKENIZER_FILES if tok_dir is not None and (tok_dir / n).is_file()]
    tokenizer = [n for n in tokenizer if source is None or not (Path(source) / n).is_file()]  # else save_pretrained's
    extra = tokenizer + ([HEAD_NAME] if run.kind == "classification" else [])
    check_export_dir(directory, extra, writer="zoo export", config="config.json", key="model_type",
                     weights="model.safetensors", kind="a Hugging Face model folder")  # fmt: skip
    try:
        written = save_pretrained(part, directory)
    except ValueError as e:  # a config no Hugging Face family expresses
        raise ConfigError(f"{run.folder}: {str(e).splitlines()[0]}") from e
    for name in tokenizer:
        atomic_write(directory / name, lambda tmp, name=name: shutil.copyfile(tok_dir / name, tmp))
        written.append(directory / name)
    if run.kind == "classification":
        written += save_head(model, directory)
        config = json.loads((directory / "config.json").read_text())
        names = list(run.label_names or ())
        config |= {"id2label": dict(enumerate(names)), "label2id": {n: i for i, n in enumerate(names)}}
        text = json.dumps(config, indent=2, sort_keys=True) + "\n"
        atomic_write(directory / "config.json", lambda tmp: Path(tmp).write_text(text))
    return written

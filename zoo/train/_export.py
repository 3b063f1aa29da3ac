"""The export hook: after the last step, a run's result in a form other tools open."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from .._files import atomic_write
from ..hf import save_pretrained
from ..lora import save_adapter, save_adapters
from ..lora._folders import DEFAULT
from ._folder import claim
from ._head import save_head
from ._hooks import Checkpoint
from ._plan import RunPlan
from ._readme import classifier_readme
from ._task import Task
from ._trainer import Hook, TrainState

# What the tokenizer of a saved model needs next to its weights.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt",
                   "sentence_bert_config.json")  # fmt: skip


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
        text = classifier_readme(adapter, pooling=c.pooling or "mean", title=self.plan.title, seq_len=c.data.seq_len,
                                 label_names=task.label_names or (), d_model=config["d_model"],
                                 tokenizer_dir=task.tokenizer_dir, pad_id=config.get("pad_token_id", 0))  # fmt: skip
        atomic_write(adapter / "README.md", lambda tmp: Path(tmp).write_text(text))
        return adapter / "README.md"

    def on_end(self, state: TrainState) -> None:
        output, lcfg, task = self.plan.output, self.plan.config.lora, self.task
        if lcfg is not None and task.adapter_names is not None:  # several: peft's folder of named adapters
            self._claim("adapter")
            names = task.adapter_names
            self._claim("adapter", save_adapters(state.model, dict.fromkeys(names, lcfg), output / "adapter"))
            self.outputs["adapter"] = str(output / "adapter")
            self.outputs["adapters"] = {n: str(output / "adapter" / n) if n != DEFAULT else str(output / "adapter")
                                        for n in names}  # fmt: skip
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

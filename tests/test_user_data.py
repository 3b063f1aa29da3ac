"""A user's own data files (`zoo.data.load`): every format end to end (file → tokenizer →
packed rows → batches → one `zoo.TrainStep` step on 2 devices), packing's segment ids and
positions against each document run alone, splits, shuffles, errors."""

import dataclasses
import hashlib
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tokenizers
from helpers import (
    assert_as_accurate,
    assert_rounding_close,
    data_mesh,
    tiny_decoder,
    tiny_encoder_classifier,
    torch_reference,
)

import zoo

WORDS = "the cat sat on a mat dog ran far big small red blue is what yes no good bad hello hi".split()
SPECIAL = ["<pad>", "<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>"]

# The same conversation text two ways: turns found by {% generation %} blocks, or by prefixes.
GENERATION_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ ' <|assistant|> ' }}"
    "{% generation %}{{ m['content'] + ' ' + eos_token }}{% endgeneration %}"
    "{% else %}{{ ' <|' + m['role'] + '|> ' + m['content'] + ' ' + eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ ' <|assistant|>' }}{% endif %}"
)
PREFIX_TEMPLATE = (
    "{% for m in messages %}{{ ' <|' + m['role'] + '|> ' + m['content'] + ' ' + eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}{{ ' <|assistant|>' }}{% endif %}"
)
CHATS = [
    [
        {"role": "user", "content": "hello what is a cat"},
        {"role": "assistant", "content": "a small dog"},
        {"role": "user", "content": "yes"},
        {"role": "assistant", "content": "no good"},
    ],
    [
        {"role": "system", "content": "be good"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    ],
]


def make_tokenizer(folder, chat_template=PREFIX_TEMPLATE):
    """A word-level fast tokenizer saved as a Hugging Face folder (`<s>` prepended)."""
    vocab = {t: i for i, t in enumerate(SPECIAL + WORDS)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIAL)
    tok.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    folder.mkdir(exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


# float32 rounding bounds (helpers.rounding_bound) for the tiny models (2 layers of ~6
# chained sums, <= 32 wide, plus the head): their outputs in another order (packed rows vs a
# document alone), and a loss (2 more sums: log-sum-exp, the weighted sum over the batch's
# tokens, the longest sum there) on 2 devices vs one.
FORWARD = {"terms": 32, "depth": 2 * 6 + 1}
LOSS_DEPTH = FORWARD["depth"] + 2


def loss_sums(batch):
    """The sums of a loss over `batch`: its tokens (or the 32-wide forward's, if longer)."""
    return {"terms": max(np.size(batch["tokens"]), FORWARD["terms"]), "depth": LOSS_DEPTH}


def ids(text, special=True):
    vocab = {t: i for i, t in enumerate(SPECIAL + WORDS)}
    return ([1] if special else []) + [vocab[w] for w in text.split()]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def one_step(model, loss_fn, batch):
    """The loss of one TrainStep step on 2 devices (finite), whose compiled program holds
    one all-reduce, outside the microbatch loop."""
    rows = len(batch["tokens"])
    with jax.set_mesh(data_mesh(2)):
        sharded = zoo.shard(model, zoo.rules("dp"), data_mesh(2))
        step = zoo.TrainStep(loss_fn, optax.sgd(0.1), microbatches=2 if rows % 4 == 0 else 1)
        opt_state = step.init(sharded)
        compiled = step.compile(sharded, opt_state, batch)
        colls = zoo.collectives(compiled)
        assert zoo.count(colls, "all-reduce", in_loop=True) == 0, zoo.report(colls)
        assert zoo.count(colls, "all-reduce", in_loop=False) == 1, zoo.report(colls)
        _, _, loss = compiled(sharded, opt_state, batch)
    assert np.isfinite(float(loss))
    return float(loss)


def reference_lm_loss(model, batch):
    """sum(nll * weights[:, 1:]) / sum(weights[:, 1:]) on one device, the model called with
    the batch's segment ids and positions."""
    batch = jax.tree.map(jnp.asarray, batch)
    logits = model(batch["tokens"], segment_ids=batch["segment_ids"], positions=batch["positions"])
    nll = zoo.models.cross_entropy(logits[:, :-1], batch["tokens"][:, 1:])
    w = batch["weights"][:, 1:]
    return float(jnp.sum(nll * w) / jnp.sum(w))


def test_txt_is_cut_into_rows_and_trains(tmp_path, key):
    folder = make_tokenizer(tmp_path / "model")
    text = "the cat sat on a mat\nthe dog ran far\n" * 3
    (tmp_path / "corpus.txt").write_text(text)
    train, val = zoo.data.load(tmp_path / "corpus.txt", folder, seq_len=8)
    expected = np.asarray(ids(text))
    assert train.kind == "text" and len(val) == 0
    assert len(train) == -(-len(expected) // 8)
    np.testing.assert_array_equal(train.arrays["tokens"][train.arrays["mask"]], expected)
    # Every real token is a target except the first of each row.
    w = train.arrays["weights"]
    assert np.all(w[:, 0] == 0) and np.array_equal(w[:, 1:] == 1, train.arrays["mask"][:, 1:])
    batch = next(train.batches(4, seed=0))
    model = tiny_decoder(key, vocab_size=32, max_len=8, positions="learned")
    loss = one_step(model, zoo.models.next_token_loss, batch)
    assert_rounding_close(loss, reference_lm_loss(model, batch), **loss_sums(batch))


@pytest.mark.parametrize("positions", ["rope", "learned"])
def test_packed_logits_equal_each_document_alone(tmp_path, key, positions):
    docs = ["the cat sat", "a big red dog ran far", "hi", "yes no good bad"]
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": d} for d in docs])
    train, _ = zoo.data.load(path, make_tokenizer(tmp_path / "model"), seq_len=16)
    rows = train.arrays
    assert len(train) == 2  # 4 + 7 + 2 tokens, then 5
    np.testing.assert_array_equal(rows["segment_ids"][0], [1] * 4 + [2] * 7 + [3] * 2 + [0] * 3)
    np.testing.assert_array_equal(rows["positions"][0, :13], [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 0, 1])
    model = tiny_decoder(key, vocab_size=32, max_len=16, positions=positions)
    packed = np.asarray(
        model(
            *[jnp.asarray(rows[k]) for k in ("tokens",)],
            segment_ids=jnp.asarray(rows["segment_ids"]),
            positions=jnp.asarray(rows["positions"]),
        )
    )
    for r in range(len(train)):
        for s in range(1, rows["segment_ids"][r].max() + 1):
            where = rows["segment_ids"][r] == s
            alone = model(jnp.asarray(rows["tokens"][r][where])[None])[0]
            assert_rounding_close(packed[r][where], alone, **FORWARD)


def test_prompt_completion_weights_exactly_the_completion(tmp_path, key):
    records = [
        {"prompt": "what is a cat", "completion": "a small dog"},
        {"prompt": "hello", "completion": "hi"},
        {"prompt": "is the mat red", "completion": "no the mat is blue"},
        {"prompt": "good bad", "completion": "good"},
    ] * 2
    path = write_jsonl(tmp_path / "sft.jsonl", records)
    train, _ = zoo.data.load(path, make_tokenizer(tmp_path / "model"), seq_len=16)
    rows = train.arrays
    # Rebuild each document's target mask from the records: completion words and </s>.
    expected = []
    for r in records:
        p, c = ids(r["prompt"]), ids(r["completion"], special=False) + [2]
        expected.append((p + c, [0] * len(p) + [1] * len(c)))
    got = []
    for r in range(len(train)):
        for s in range(1, rows["segment_ids"][r].max() + 1):
            where = rows["segment_ids"][r] == s
            got.append((rows["tokens"][r][where].tolist(), rows["weights"][r][where].tolist()))
    assert got == expected, (got, expected)
    assert train.arrays["tokens"].shape[1] == 16 and len(train) == 4  # packed: 8 docs in 4 rows
    batch = next(train.batches(4, shuffle=False))
    model = tiny_decoder(key, vocab_size=32, max_len=16)
    loss = one_step(model, zoo.models.next_token_loss, batch)
    # The loss is the mean over completion tokens of each document run alone.
    nll, count = 0.0, 0
    for tokens, weights in expected:
        logits = model(jnp.asarray(tokens)[None])[0]
        per = zoo.models.cross_entropy(logits[:-1], jnp.asarray(tokens[1:]))
        nll += float(jnp.sum(per * jnp.asarray(weights[1:], jnp.float32)))
        count += sum(weights[1:])
    assert_rounding_close(loss, nll / count, **loss_sums(batch))


def test_chat_template_and_assistant_mask_match_transformers(tmp_path):
    import transformers

    folder = make_tokenizer(tmp_path / "gen", GENERATION_TEMPLATE)
    reference = transformers.PreTrainedTokenizerFast.from_pretrained(str(folder))
    template = zoo.data.ChatTemplate.from_pretrained(folder)
    prefix = zoo.data.ChatTemplate.from_pretrained(make_tokenizer(tmp_path / "prefix", PREFIX_TEMPLATE))
    assert template.has_generation_blocks and not prefix.has_generation_blocks
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CHATS])
    for chosen in (template, prefix):
        train, _ = zoo.data.load(
            path, zoo.hf.Tokenizer.from_pretrained(folder), seq_len=32, packed=False, chat_template=chosen
        )
        assert train.kind == "chat"
        for row, messages in enumerate(CHATS):
            out = reference.apply_chat_template(
                messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
            n = len(out["input_ids"])
            assert chosen.render(messages) == reference.apply_chat_template(messages, tokenize=False)
            np.testing.assert_array_equal(train.arrays["tokens"][row, :n], out["input_ids"])
            mask = np.asarray(out["assistant_masks"], np.float32)
            mask[0] = 0  # a row's first token is never a target
            np.testing.assert_array_equal(train.arrays["weights"][row, :n], mask)
            assert mask.sum() > 0


def test_chat_end_to_end_trains_on_assistant_tokens_only(tmp_path, key):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CHATS * 2])
    train, _ = zoo.data.load(path, make_tokenizer(tmp_path / "model"), seq_len=32)
    rows = train.arrays
    vocab = {t: i for i, t in enumerate(SPECIAL + WORDS)}
    assistant = {vocab[w] for w in "a small dog no good hello </s>".split()}
    # Weighted tokens are assistant words and their </s>, never a role marker or user word.
    weighted = rows["tokens"][rows["weights"] > 0]
    assert set(weighted.tolist()) <= assistant and len(weighted) == 2 * (4 + 3 + 2)
    batch = next(train.batches(len(train) - len(train) % 2, seed=1))
    model = tiny_decoder(key, vocab_size=32, max_len=32)
    loss = one_step(model, zoo.models.next_token_loss, batch)
    assert_rounding_close(loss, reference_lm_loss(model, batch), **loss_sums(batch))


@pytest.mark.parametrize("suffix", ["jsonl", "csv"])
def test_classification_labels_and_step(tmp_path, key, suffix):
    examples = [("the cat sat", "cat"), ("a dog ran", "dog"), ("red mat", "mat"), ("big dog", "dog")] * 2
    if suffix == "jsonl":
        path = write_jsonl(tmp_path / "cls.jsonl", [{"text": t, "label": lab} for t, lab in examples])
        names = ("cat", "dog", "mat")
        labels = [names.index(lab) for _, lab in examples]
    else:
        path = tmp_path / "cls.csv"
        codes = {"cat": 2, "dog": 0, "mat": 1}
        path.write_text("text,label\n" + "".join(f"{t},{codes[lab]}\n" for t, lab in examples))
        names, labels = ("0", "1", "2"), [codes[lab] for _, lab in examples]
    train, _ = zoo.data.load(path, make_tokenizer(tmp_path / "model"), seq_len=8)
    assert train.kind == "classification" and train.label_names == names and train.num_labels == 3
    assert zoo.data.describe(train) == f"classification: 8 rows, 3 labels {list(names)}"
    np.testing.assert_array_equal(train.arrays["labels"], labels)
    np.testing.assert_array_equal(train.arrays["tokens"][0, :4], ids("the cat sat"))
    batch = next(train.batches(4, seed=0))
    assert set(batch) == {"tokens", "mask", "token_types", "labels"}
    model = tiny_encoder_classifier(key, vocab_size=32, dropout=0.0)
    with jax.set_mesh(data_mesh(2)):
        sharded = zoo.shard(model, zoo.rules("dp"), data_mesh(2))
        step = zoo.TrainStep(zoo.models.classification_loss, optax.sgd(0.1))
        _, _, loss = step(sharded, step.init(sharded), batch)
    reference = jnp.mean(zoo.models.classification_loss(model, jax.tree.map(jnp.asarray, batch)))
    assert_rounding_close(float(loss), float(reference), **loss_sums(batch))


def test_split_is_by_content_and_shuffle_by_seed(tmp_path, monkeypatch):
    folder = make_tokenizer(tmp_path / "model")
    records = [{"text": " ".join(WORDS[i : i + 3])} for i in range(20)]
    a, va = zoo.data.load(write_jsonl(tmp_path / "a.jsonl", records), folder, seq_len=4, packed=False, validation=0.2)
    b, vb = zoo.data.load(
        write_jsonl(tmp_path / "b.jsonl", records[::-1]), folder, seq_len=4, packed=False, validation=0.2
    )
    assert len(va) == 4 and len(a) == 16

    def rows(d):
        return {tuple(r) for r in d.arrays["tokens"].tolist()}

    assert rows(va) == rows(vb) and not rows(va) & rows(a)  # the order of the file does not matter
    first = [x["tokens"] for x in a.batches(4, seed=3)]
    assert all(np.array_equal(x, y) for x, y in zip(first, [x["tokens"] for x in a.batches(4, seed=3)]))
    assert not np.array_equal(np.concatenate(first), np.concatenate([x["tokens"] for x in a.batches(4, seed=4)]))
    assert rows(a) == {tuple(r) for r in np.concatenate(first).tolist()}  # an epoch sees every row
    # With several processes each reads its block of every global batch (zoo.local_rows).
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(zoo.data._dataset, "local_rows", lambda n, mesh, axes: slice(n // 2, n))
    halves = [x["tokens"] for x in a.batches(4, seed=3)]
    assert all(np.array_equal(h, f[2:]) for h, f in zip(halves, first))
    # batch_at(step): the epochs' batches one after another (this process's rows of them).
    epochs = [x["tokens"] for e in range(3) for x in a.batches(4, seed=3, epoch=e)]
    for step in (1, 4, 5, 9, 12):
        assert np.array_equal(a.batch_at(step, 4, seed=3)["tokens"], epochs[step - 1])
    monkeypatch.undo()  # one process: the whole global batches
    epochs = [x["tokens"] for e in range(3) for x in a.batches(4, seed=3, epoch=e)]
    assert all(np.array_equal(a.batch_at(k + 1, 4, seed=3)["tokens"], epochs[k]) for k in range(12))
    # The digest of the bytes load read (what a run saves with its checkpoints).
    assert a.sha256 == va.sha256 == hashlib.sha256((tmp_path / "a.jsonl").read_bytes()).hexdigest() != b.sha256


def test_conversational_prompt_completion_weights_the_completion_as_trl(tmp_path):
    # TRL's conversational prompt-completion: the loss on what prompt + completion renders
    # past the prompt rendered with the generation prompt; not on the prompt's own
    # assistant turn (a "messages" record would weight it). Refused as "not a string" before.
    prompt = CHATS[0][:3]
    record = {"prompt": prompt, "completion": CHATS[0][3:]}
    path = write_jsonl(tmp_path / "pc.jsonl", [record])
    train, _ = zoo.data.load(path, make_tokenizer(tmp_path / "model"), seq_len=32, packed=False)
    assert train.kind == "prompt_completion"
    words = " <|user|> hello what is a cat </s> <|assistant|> a small dog </s> <|user|> yes </s> <|assistant|>"
    tokens, weights = ids(words + " no good </s>", special=False), [0] * len(ids(words, False)) + [1] * 3
    n = len(tokens)
    assert train.arrays["tokens"][0, :n].tolist() == tokens
    assert train.arrays["weights"][0, :n].tolist() == weights and train.arrays["weights"][0, n:].sum() == 0


def test_a_json_array_reads_as_the_same_records_in_json_lines(tmp_path):
    # Hugging Face datasets' json loader (what a TRL script reads a file with) takes a .json
    # array or JSON lines: so does zoo (refused as "unknown extension '.json'" before).
    records = [{"prompt": "what is a cat", "completion": "a small dog"}, {"prompt": "hi", "completion": "hello"}]
    folder = make_tokenizer(tmp_path / "model")
    want = zoo.data.load(write_jsonl(tmp_path / "lines.jsonl", records), folder, seq_len=16)[0].arrays
    (tmp_path / "array.json").write_text(json.dumps(records, indent=2))
    for path in (tmp_path / "array.json", write_jsonl(tmp_path / "lines.json", records)):
        got = zoo.data.load(path, folder, seq_len=16)[0].arrays
        assert all(np.array_equal(got[k], want[k]) for k in want), path
    (tmp_path / "bad.json").write_text(json.dumps([records[0], {"text": "a cat"}]))
    with pytest.raises(
        zoo.data.DataFormatError, match="mixes formats: prompt_completion .first at item 1., text .first at item 2."
    ):
        zoo.data.load(tmp_path / "bad.json", folder, seq_len=16)
    (tmp_path / "array.jsonl").write_text(json.dumps(records, indent=2))
    with pytest.raises(zoo.data.DataFormatError, match=r"array.jsonl line 1 .* \(a JSON array\? name the file .json\)"):
        zoo.data.load(tmp_path / "array.jsonl", folder, seq_len=16)


def test_a_tool_calling_turn_with_null_content_trains_as_transformers_renders_it(tmp_path):
    # OpenAI's / transformers' tool calls: an assistant turn of "tool_calls" with
    # "content": null (refused before as "each message must be ... a string content").
    template = (
        "{% for m in messages %}{{ ' <|' + m['role'] + '|> ' }}{% if m['content'] %}{{ m['content'] }}{% endif %}"
        "{% for c in m.get('tool_calls', []) %}{{ c['function']['name'] }}{% endfor %}{{ ' ' + eos_token }}"
        "{% endfor %}{% if add_generation_prompt %}{{ ' <|assistant|>' }}{% endif %}"
    )
    call = {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "cat"}}]}
    messages = [{"role": "user", "content": "what is red"}, call, {"role": "tool", "content": "blue"}]
    messages.append({"role": "assistant", "content": "no"})
    path = write_jsonl(tmp_path / "tools.jsonl", [{"messages": messages}])
    train, _ = zoo.data.load(path, make_tokenizer(tmp_path / "model", template), seq_len=32, packed=False)
    vocab = {t: i for i, t in enumerate(SPECIAL + WORDS)}
    weighted = train.arrays["tokens"][0][train.arrays["weights"][0] > 0]
    assert weighted.tolist() == [vocab[w] for w in "cat </s> no </s>".split()]
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"messages": [messages[0], {"role": "assistant", "content": None}]}])
    with pytest.raises(zoo.data.DataFormatError, match=r"item 1 .* \(null only beside \"tool_calls\"\)"):
        zoo.data.load(bad, make_tokenizer(tmp_path / "model", template), seq_len=32)


def test_bad_files_get_one_line_errors(tmp_path):
    folder = make_tokenizer(tmp_path / "model", chat_template=None)
    cases = {
        "data.parquet": ("x", "unknown extension '.parquet'"),
        "empty.jsonl": ("\n\n", "is empty"),
        "keys.jsonl": ('{"input": "x", "output": "y"}\n', "none of the known keys (found ['input', 'output'])"),
        "sharegpt.jsonl": (
            '{"conversations": [{"from": "human", "value": "x"}]}\n',
            'ShareGPT\'s "conversations" of {"from", "value"} are "messages" of {"role", "content"} (human: "user"',
        ),
        "mixed.jsonl": (
            '{"text": "a"}\n{"prompt": "a", "completion": "b"}\n',
            "mixes formats: text (first at line 1), prompt_completion (first at line 2)",
        ),
        "cols.csv": ("sentence,label\nx,1\n", "needs a header with 'text' and 'label'"),
        "chat.jsonl": ('{"messages": [{"role": "user", "content": "hi"}]}\n', "has no chat template"),
        "convpc.jsonl": (
            '{"prompt": [{"role": "user", "content": "a"}], "completion": [{"role": "assistant", "content": "b"}]}\n',
            "has no chat template",
        ),
        "halfpc.jsonl": (
            '{"prompt": [{"role": "user", "content": "a"}], "completion": "b"}\n',
            "halfpc.jsonl line 1: field 'prompt' is list but 'completion' is str; write both as strings or both",
        ),
        "bad.jsonl": ("{not json\n", "bad.jsonl line 1 is not valid JSON"),
        "labels.jsonl": (
            '{"text": "a", "label": -1}\n',
            "labels.jsonl line 1 field 'label' is -1: labels are integers >= 0 or names, and zoo has no ignore label",
        ),
        # Silently wrong before: a number as a text, an empty or -1 label as a class of its own.
        "num.jsonl": ('{"text": "a"}\n{"text": 12345}\n', "num.jsonl line 2 field 'text' is int 12345, not a string"),
        "prompt.jsonl": ('{"prompt": 1, "completion": "a"}\n', "prompt.jsonl line 1 field 'prompt' is int 1"),
        "empty.csv": ("text,label\na,0\nb,1\nc,\n", "empty.csv line 4 field 'label' is empty"),
        "neg.csv": ("text,label\na,0\nb,1\nc,-1\n", "neg.csv line 4 field 'label' is '-1': labels are integers"),
        "kinds.csv": ("text,label\na,0\nb,pos\n", "kinds.csv line 2 has '0' but kinds.csv line 3 has 'pos'"),
        "float.jsonl": ('{"text": "a", "label": 1.5}\n', "float.jsonl line 1 field 'label' is float 1.5"),
        "msgs.jsonl": ('{"messages": "hi"}\n', "msgs.jsonl line 1 field 'messages' must be a non-empty list"),
        "turn.jsonl": ('{"messages": [{"role": "user"}, 3]}\n', "turn.jsonl line 1 field 'messages' item 1 is 3"),
        # No target token: a NaN loss at step 1 before.
        "cut.jsonl": (
            '{"prompt": "a", "completion": "b"}\n{"prompt": "a b c d e f g h", "completion": "c"}\n',
            "cut.jsonl line 2: no target token is left after truncation to seq_len 8 (the completion starts at "
            "token 9); seq_len=10 or more fits it",
        ),
        "short.jsonl": ('{"text": ""}\n', "short.jsonl line 1: field 'text' holds fewer than 2 tokens"),
        # GRPO's prompts file: an AttributeError before.
        "prompts.jsonl": ('{"prompt": "a", "answer": 3}\n', "holds prompts alone"),
    }
    for name, (content, message) in cases.items():
        (tmp_path / name).write_text(content)
        with pytest.raises(zoo.data.DataFormatError) as info:
            zoo.data.load(tmp_path / name, folder, seq_len=8)
        assert message in str(info.value) and "\n" not in str(info.value), str(info.value)
    (tmp_path / "shards").mkdir()  # a folder of files: IsADirectoryError before
    with pytest.raises(zoo.data.DataFormatError, match="shards' is a folder; zoo reads one data file: join its files"):
        zoo.data.load(tmp_path / "shards", folder, seq_len=8)
    # Without an end-of-sequence token an empty completion has no target; a chat without an
    # assistant turn never has one (a tokenizer object: no folder, so no eos_token).
    tokenizer = zoo.hf.Tokenizer.from_pretrained(make_tokenizer(tmp_path / "chat"))
    template = zoo.data.ChatTemplate(PREFIX_TEMPLATE, {"eos_token": "</s>"})
    for content, message in [
        ('{"prompt": "a", "completion": ""}\n', "line 1: field 'completion' is empty and no end-of-sequence token"),
        ('{"messages": [{"role": "user", "content": "hi"}]}\n', "line 1: no assistant turn to train on"),
        # ShareGPT's roles: named, and the roles the loss counts (the template renders any role).
        ('{"messages": [{"role": "human", "content": "a"}, {"role": "gpt", "content": "b"}]}\n',
         "line 1: no assistant turn to train on (roles ['gpt', 'human']; only \"assistant\" turns are targets)"),
        ('{"messages": [{"role": "user", "content": "a b c d e f g"}, {"role": "assistant", "content": "hi"}]}\n',
         "(the first assistant turn starts at token 10); seq_len=11 or more fits it"),
    ]:  # fmt: skip
        write_jsonl(tmp_path / "t.jsonl", []).write_text(content)
        with pytest.raises(zoo.data.DataFormatError) as info:
            zoo.data.load(tmp_path / "t.jsonl", tokenizer, seq_len=8, chat_template=template)
        assert message in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_chat_template_errors_name_the_template_or_the_row(tmp_path):
    """A template that does not parse names its file and line (read only for data that
    renders conversations); a template's `raise_exception` names the row it refused."""
    broken = make_tokenizer(tmp_path / "broken", chat_template="{{ messages[0].content \n")
    chats = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CHATS])
    with pytest.raises(zoo.data.DataFormatError) as info:
        zoo.data.load(chats, broken, seq_len=32)
    message = str(info.value)
    assert f"{broken / 'tokenizer_config.json'}'s chat_template line 1: the chat template does not parse" in message
    assert message.endswith("; fix the template") and "\n" not in message, message
    texts = write_jsonl(tmp_path / "text.jsonl", [{"text": "a cat sat"}])
    assert zoo.data.load(texts, broken, seq_len=8)[0].kind == "text"  # no conversation: no template read
    refusing = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system turns') }}{% endif %}"
    template = zoo.data.ChatTemplate(refusing + PREFIX_TEMPLATE, {"eos_token": "</s>"})
    with pytest.raises(zoo.data.DataFormatError) as info:
        zoo.data.load(chats, make_tokenizer(tmp_path / "model"), seq_len=32, chat_template=template)
    assert str(info.value) == (
        "chat.jsonl line 2: the chat template refused this conversation: no system turns; fix the row or the template"
    )


def test_a_leading_utf8_bom_is_not_part_of_the_data(tmp_path):
    """Files saved with a byte-order mark (Windows editors, Excel's CSV UTF-8) read as
    without it; text that is not UTF-8 is still refused."""
    for name, content in [
        ("a.jsonl", '{"text": "a cat"}\n{"text": "a dog"}\n'),
        ("a.csv", "text,label\na cat,0\na dog,1\n"),
        ("a.txt", "a cat sat\n"),
    ]:
        (tmp_path / name).write_text(content, encoding="utf-8")
        (tmp_path / f"bom{name}").write_text(content, encoding="utf-8-sig")
        assert zoo.data.read_records(tmp_path / f"bom{name}") == zoo.data.read_records(tmp_path / name)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    with pytest.raises(UnicodeDecodeError):
        zoo.data.read_records(tmp_path / "latin1.txt")


def test_a_folders_json_files_with_a_utf8_bom_read_as_without(llama_dir, tmp_path):
    """A model folder's tokenizer_config.json (or config.json) saved with a byte-order mark
    failed with json's "Unexpected UTF-8 BOM": it reads as without, as the data files do."""
    folder = tmp_path / "bom"
    shutil.copytree(llama_dir, folder)
    for name in ("tokenizer_config.json", "config.json"):
        (folder / name).write_text((llama_dir / name).read_text(), encoding="utf-8-sig")
    plain, bom = zoo.hf.Tokenizer.from_pretrained(llama_dir), zoo.hf.Tokenizer.from_pretrained(folder)
    assert (bom.pad_id, bom.max_len) == (plain.pad_id, plain.max_len)
    chat = [{"role": "user", "content": "the cat"}]
    template = zoo.data.ChatTemplate.from_pretrained
    assert template(folder).render(chat) == template(llama_dir).render(chat)
    config = zoo.hf.from_pretrained(folder).config
    assert config == dataclasses.replace(zoo.hf.from_pretrained(llama_dir).config, source_dir=config.source_dir)


def test_packed_chat_loss_on_a_hugging_face_llama_equals_transformers(tmp_path):
    """The path of docs/data.md on a model folder: a tiny random Llama saved by transformers
    with the tokenizer beside it, chat data packed for it, the step's loss on 2 devices =
    transformers' loss on the assistant tokens of each conversation run alone."""
    import torch
    import transformers

    folder = make_tokenizer(tmp_path / "llama")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager",
    )  # fmt: skip
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(folder)
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CHATS * 2])
    train, _ = zoo.data.load(path, folder, seq_len=40)
    assert int(train.arrays["segment_ids"].max()) >= 2  # conversations share rows
    batch = next(train.batches(2, shuffle=False))
    with jax.set_mesh(data_mesh(2)):
        model = zoo.hf.from_pretrained(folder, rules=zoo.rules("dp"), mesh=data_mesh(2))
        loss, _ = zoo.TrainStep(zoo.models.next_token_loss, optax.sgd(0.1)).loss_and_grads(model, batch)

    def transformers_loss(hf):
        total, count = 0.0, 0.0
        for r in range(2):
            for s in range(1, batch["segment_ids"][r].max() + 1):
                where = batch["segment_ids"][r] == s
                tokens = torch.from_numpy(batch["tokens"][r][where].astype(np.int64))[None]
                weights = torch.from_numpy(batch["weights"][r][where])[1:]
                logits = hf(tokens).logits[0, :-1]
                nll = torch.nn.functional.cross_entropy(logits, tokens[0, 1:], reduction="none")
                total += float((nll * weights).sum())
                count += float(weights.sum())
        return total / count

    # As accurate as transformers' own float32 loss, against its float64 run.
    assert_as_accurate(float(loss), torch_reference(transformers_loss, hf), what="packed chat loss")


def test_byte_tokens_for_a_pretrained_vocabulary_are_warned_about(capsys):
    """A checkpoint folder without tokenizer.json trains on byte tokens: a vocabulary larger
    than bytes use (a pretrained model's, its tokenizer files left behind) gets a warning
    naming the fix; a byte-level vocabulary, or a tokenizer, gets none."""
    from zoo.train._task import check_vocab

    check_vocab(32_000, None, "--init llama")
    err = capsys.readouterr().err
    assert err.startswith("zoo: warning: --init llama has no tokenizer.json: the data is read as UTF-8 bytes"), err
    assert "32,000-token vocabulary" in err and "copy the model's tokenizer files" in err
    check_vocab(256, None, "--init bytes")
    check_vocab(32_000, object(), "--init llama")
    assert capsys.readouterr().err == ""
    with pytest.raises(zoo.train.ConfigError, match="byte tokens need 256"):
        check_vocab(100, None, "--init tiny")

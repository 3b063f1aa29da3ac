"""Preference tuning: DPO (sigmoid / ipo / hinge / robust) and ORPO equal TRL's own loss
code, the step keeps one gradient all-reduce, multi-device gradients equal single-device
ones, and the run/CLI/data pieces (bad data: one clear line each)."""

from __future__ import annotations

import functools
import json
import types
from collections import defaultdict

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import data_mesh, max_abs_diff, pairwise, tree_allclose
from test_peft import DECODER

import zoo

VOCAB, SEQ, PAIRS = 32, 12, 4
LLAMA = {**DECODER, "max_position_embeddings": SEQ}  # a Llama: grouped-query attention, untied head


def pair_batch(seed=0, pairs=PAIRS, seq=SEQ, vocab=VOCAB):
    """A preference batch of `pairs` rows: prompts of 2-4 tokens, completions of 1-6,
    right-padded with 0 (no real token is 0), lengths differing between the sides."""
    rng = np.random.default_rng(seed)
    out = {f"{s}_{k}": np.zeros((pairs, seq), np.int32) for s in ("chosen", "rejected") for k in ("tokens", "mask", "completion")}  # fmt: skip
    for i in range(pairs):
        prompt = rng.integers(1, vocab, rng.integers(2, 5))
        for side in ("chosen", "rejected"):
            completion = rng.integers(1, vocab, rng.integers(1, seq - len(prompt) + 1))
            row = np.concatenate([prompt, completion])
            out[f"{side}_tokens"][i, : len(row)] = row
            out[f"{side}_mask"][i, : len(row)] = 1
            out[f"{side}_completion"][i, len(prompt) : len(row)] = 1
    return out


# --------------------------------------------------------------------------- TRL's loss code


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(the peft LoRA Llama with TRL's fused head, the same in zoo): a tiny random Llama
    saved by transformers, a peft adapter with perturbed (non-zero) branches."""
    pytest.importorskip("torch")
    from helpers import peft_lora_llama

    outputs = ("log_probs", "entropy", "mean_logits", "is_top1")
    return peft_lora_llama(tmp_path_factory.mktemp("pref"), LLAMA, outputs=outputs)


class _Accelerator:
    device = "cpu"

    @staticmethod
    def gather_for_metrics(x):
        return x

    gather = gather_for_metrics

    @staticmethod
    def unwrap_model(m):
        return m


def trl_dpo(peft_model, batch, loss_type, beta, label_smoothing):
    """TRL 1.16's `DPOTrainer._compute_loss` itself on `batch` (chosen rows then rejected
    rows, as its collator lays them out), the reference being the peft model with its
    adapters disabled (TRL's own `use_adapter`): (loss, logged metrics)."""
    import torch
    from trl import DPOTrainer

    ids = np.concatenate([batch["chosen_tokens"], batch["rejected_tokens"]])
    inputs = {
        "input_ids": torch.tensor(ids, dtype=torch.long),
        "attention_mask": torch.tensor(np.concatenate([batch["chosen_mask"], batch["rejected_mask"]])),
        "completion_mask": torch.tensor(np.concatenate([batch["chosen_completion"], batch["rejected_completion"]])),
    }
    trainer = types.SimpleNamespace(
        model=peft_model, ref_model=None, accelerator=_Accelerator(), aux_loss_enabled=False, ld_alpha=None,
        precompute_ref_logps=False, args=types.SimpleNamespace(gradient_checkpointing_kwargs=None),
        f_divergence_type="reverse_kl", loss_types=[loss_type], loss_weights=[1.0], beta=beta,
        label_smoothing=label_smoothing, use_weighting=False, _metrics=defaultdict(lambda: defaultdict(list)),
        _total_train_tokens=0, _tp_size=1,
    )  # fmt: skip
    with torch.no_grad():
        loss = DPOTrainer._compute_loss(trainer, peft_model, inputs, False)
    return float(loss), {k: v[0] for k, v in trainer._metrics["eval"].items()}


def trl_orpo(peft_model, batch, beta):
    """TRL 1.16's `ORPOTrainer.get_batch_loss_metrics` (trl.experimental.orpo) itself:
    its concatenated forward, `odds_ratio_loss` and logged metrics."""
    import torch
    from trl.experimental.orpo import ORPOTrainer

    def labels(side):
        return np.where(batch[f"{side}_completion"] == 1, batch[f"{side}_tokens"], -100)

    inputs = {
        f"{side}_{k}": torch.tensor(v, dtype=torch.long)
        for side in ("chosen", "rejected")
        for k, v in (("input_ids", batch[f"{side}_tokens"]), ("attention_mask", batch[f"{side}_mask"]),
                     ("labels", labels(side)))
    }  # fmt: skip
    trainer = types.SimpleNamespace(
        accelerator=_Accelerator(), is_encoder_decoder=False, padding_value=0, aux_loss_enabled=False, beta=beta,
        label_pad_token_id=-100,
    )  # fmt: skip
    for name in ("concatenated_inputs", "concatenated_forward", "get_batch_logps", "odds_ratio_loss"):
        attr = ORPOTrainer.__dict__[name]
        setattr(trainer, name, attr.__get__(trainer) if not isinstance(attr, staticmethod) else attr.__func__)
    with torch.no_grad():
        loss, metrics = ORPOTrainer.get_batch_loss_metrics(trainer, peft_model, inputs, "train")
    return float(loss), {k: float(v) for k, v in metrics.items()}


def zoo_terms(objective, lora, batch):
    loss, metrics = jax.jit(lambda m, b: _means(objective.metrics(m, b)))(lora, {k: jnp.asarray(v) for k, v in batch.items()})  # fmt: skip
    return float(loss), {k: float(v) for k, v in metrics.items()}


def _means(terms):
    return jnp.mean(terms["loss"]), {k: jnp.mean(v) for k, v in terms.items() if k != "loss"}


@pytest.mark.numerics
@pytest.mark.parametrize(
    "loss_type,beta,smoothing",
    [("sigmoid", 0.1, 0.0), ("ipo", 0.5, 0.0), ("hinge", 3.0, 0.0), ("robust", 1.0, 0.2)],
)
def test_dpo_loss_and_metrics_equal_trl(models, loss_type, beta, smoothing):
    peft_model, lora = models
    batch = pair_batch()
    want_loss, want = trl_dpo(peft_model, batch, loss_type, beta, smoothing)
    objective = zoo.models.PreferenceLoss(
        "dpo", beta=beta, loss_type=loss_type, label_smoothing=smoothing, reference=zoo.lora.disabled_adapters
    )
    got_loss, got = zoo_terms(objective, lora, batch)
    assert abs(got_loss - want_loss) <= 1e-5, (got_loss, want_loss)
    for name in zoo.models._preference.METRICS:
        assert abs(got[name] - want[name]) <= 1e-5, (name, got[name], want[name])
    # Not a trivially equal case: the adapters move the rewards off zero and the loss off its start.
    assert abs(want["rewards/margins"]) > 1e-3 and 0 < want["rewards/accuracies"] < 1 or loss_type == "hinge"


@pytest.mark.numerics
def test_orpo_loss_and_metrics_equal_trl(models):
    peft_model, lora = models
    batch = pair_batch(seed=3)
    # TRL's NLL is a token mean over the batch's chosen sequences: the batch's mean count per row.
    batch["nll_norm"] = np.full(PAIRS, batch["chosen_mask"][:, 1:].sum(1).mean(), np.float32)
    want_loss, want = trl_orpo(peft_model, batch, beta=0.5)
    got_loss, got = zoo_terms(zoo.models.PreferenceLoss("orpo", beta=0.5), lora, batch)
    assert abs(got_loss - want_loss) <= 1e-5, (got_loss, want_loss)
    for name in (*zoo.models._preference.METRICS, *zoo.models._preference.ORPO_METRICS):
        assert abs(got[name] - want[name]) <= 1e-5, (name, got[name], want[name])


# --------------------------------------------------------------------------- the step


@functools.cache
def _lora_decoder():
    """(a LoRA decoder with non-zero branches, its trainable filter): built once per file."""
    from helpers import tiny_decoder

    config = zoo.lora.LoraConfig(r=2, lora_alpha=4, target_modules="all-linear", init_lora_weights=False)
    model = zoo.lora.add_lora(tiny_decoder(jax.random.key(0)), config, key=jax.random.key(1))
    return model, zoo.lora.trainable(model, config)


@functools.cache
def _grads(objective, preset, n, microbatches):
    """(loss, gradients) of a DPO/ORPO step of a LoRA decoder: on one device without a
    mesh (`preset` None), else on a `data=n` mesh under `preset`."""
    model, trainable = _lora_decoder()
    batch = pair_batch(seed=5, pairs=6, seq=8)
    batch["nll_norm"] = np.full(6, batch["chosen_mask"][:, 1:].sum(1).mean(), np.float32)
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    loss_fn = zoo.models.PreferenceLoss(objective, beta=0.5, reference=zoo.lora.disabled_adapters)
    if preset is None:
        step = zoo.TrainStep(loss_fn, optax.sgd(0.1), microbatches=microbatches, trainable=trainable)
        loss, grads = step.loss_and_grads(model, batch)
        return float(loss), step.partition(jax.tree.map(np.asarray, grads))[0]
    mesh = data_mesh(n)
    with jax.set_mesh(mesh):
        placed = zoo.shard(model, zoo.rules(preset), mesh)
        step = zoo.TrainStep(loss_fn, optax.sgd(0.1), microbatches=microbatches, trainable=trainable, preset=preset)
        loss, grads = step.loss_and_grads(placed, batch)
    return float(loss), step.partition(jax.tree.map(np.asarray, grads))[0]


_SLOW = pytest.mark.slow


# A pairwise cover of objective x preset x microbatches (issue 40 item 5): every pair of
# values of two axes meets in one case (4 of the 8); the microbatched ones in the fast phase.
GRADIENT_CASES = [
    pytest.param(*case, marks=[] if case[2] > 1 else [_SLOW])
    for case in pairwise(objective=("dpo", "orpo"), preset=("dp", "fsdp-once"), microbatches=(1, 3))
]


@pytest.mark.parametrize("objective,preset,microbatches", GRADIENT_CASES)
def test_multi_device_gradients_equal_single_device(objective, preset, microbatches):
    want_loss, want = _grads(objective, None, 1, 1)
    loss, grads = _grads(objective, preset, 2, microbatches)
    assert want_loss > 0.1 and max(float(np.max(np.abs(g))) for g in jax.tree.leaves(want)) > 1e-3
    assert abs(loss - want_loss) <= 1e-5 * max(1.0, abs(want_loss))
    assert tree_allclose(grads, want, rtol=1e-4, atol=1e-6), max_abs_diff(grads, want)


def test_the_reference_is_the_base_and_gets_no_gradient():
    model, trainable = _lora_decoder()
    batch = {k: jnp.asarray(v) for k, v in pair_batch(seed=6, pairs=2, seq=8).items()}
    dpo = zoo.models.PreferenceLoss("dpo", reference=zoo.lora.disabled_adapters)
    base = zoo.lora.disabled_adapters(model)
    assert not zoo.lora.modules(base, zoo.lora.LoraLinear)
    # The in-step reference equals log-probabilities precomputed on the base.
    precomputed = jax.jit(dpo.reference_logps)(base, batch)
    metrics = jax.jit(dpo.metrics)
    in_step = metrics(model, batch)
    with_ref = metrics(model, batch | precomputed)
    for name in ("rewards/chosen", "rewards/rejected"):
        np.testing.assert_allclose(in_step[name], with_ref[name], rtol=1e-5, atol=1e-6)
    # At the start of LoRA training (B = 0) the policy is the reference: rewards 0, loss log 2.
    # (`model`'s adapters, all-linear r=2, freshly initialised: its structure, its program.)
    fresh = zoo.lora.add_lora(base, zoo.lora.LoraConfig(r=2, lora_alpha=4, target_modules="all-linear"), key=jax.random.key(2))  # fmt: skip
    assert not any(np.any(np.asarray(b)) for b in _lora_b(fresh)) and any(np.any(np.asarray(b)) for b in _lora_b(model))
    start = metrics(fresh, batch)
    np.testing.assert_allclose(start["rewards/margins"], 0, atol=1e-6)
    np.testing.assert_allclose(start["loss"], np.log(2), rtol=1e-6)
    # The refusals come while tracing, before any program is compiled or run.
    with pytest.raises(ValueError, match="no adapters to disable"):
        jax.jit(dpo.loss)(base, batch)
    with pytest.raises(ValueError, match="needs a reference"):
        jax.jit(zoo.models.PreferenceLoss("dpo").loss)(model, batch)


def _lora_b(model):
    is_lora = lambda x: isinstance(x, zoo.lora.LoraLinear)  # noqa: E731
    return [m.lora_B for m in jax.tree.leaves(model, is_leaf=is_lora) if is_lora(m)]


@eqx.filter_jit
def _forward(model, tokens):
    """Compiled once per model structure, not op by op: the disabled model, which has the
    bare base's structure, runs the base's program."""
    return model(tokens)


@pytest.mark.parametrize(
    "kinds",
    [
        {"use_dora": True, "target_modules": ["q_proj", "v_proj"], "trainable_token_indices": [1, 5]},
        {"target_modules": ["token_embedding", "lm_head", "q_proj"], "ensure_weight_tying": True},
    ],
    ids=["dora+tokens", "embedding+tied-head"],
)
def test_every_adapter_kind_is_disabled_for_the_reference(kinds):
    """DoRA, embedding/head LoRA and trainable tokens are switched off too: the disabled
    model is the bare base, output for output; a merged adapter is refused."""
    model, _ = _lora_decoder()
    base = zoo.lora.disabled_adapters(model)
    tokens = jnp.asarray(pair_batch(seed=7, pairs=2, seq=8)["chosen_tokens"])
    want = _forward(base, tokens)
    config = zoo.lora.LoraConfig(r=2, lora_alpha=4, init_lora_weights=False, **kinds)
    adapted = zoo.lora.add_lora(base, config, key=jax.random.key(3))
    if "trainable_token_indices" in kinds:  # the token rows start as the base's: move them
        is_rows = lambda x: isinstance(x, zoo.lora.TrainableTokens)
        rows = lambda m: [t.trainable_tokens_delta for t in jax.tree.leaves(m, is_leaf=is_rows) if is_rows(t)]
        adapted = eqx.tree_at(rows, adapted, [x + 0.1 for x in rows(adapted)])
    assert float(jnp.max(jnp.abs(_forward(adapted, tokens) - want))) > 1e-3  # the adapters change the output
    np.testing.assert_array_equal(_forward(zoo.lora.disabled_adapters(adapted), tokens), want)
    with pytest.raises(ValueError, match="merged"):
        zoo.lora.disabled_adapters(eqx.filter_eval_shape(zoo.lora.merge, adapted, unload=False))


def test_the_pinned_preference_steps_keep_one_all_reduce_of_the_adapter_bytes():
    """tests/data/step_collectives.json (compared with the compiled steps by
    tests/test_compiled_steps.py) holds, for each DPO/ORPO step of the LoRA decoder: no
    all-reduce in a loop, one outside carrying the adapter gradients and the loss alone."""
    import test_compiled_steps as pinned
    from fixed_tasks import build_inspect_task, inspect_defaults

    from zoo.train import abstract_models
    from zoo.train._text import parse_lora

    with abstract_models():  # shapes only: the bytes are counted, nothing initialised
        model = build_inspect_task("transformer", 0).model
    lora = parse_lora("", inspect_defaults("transformer"))

    def trained(model):  # what the step trains: the adapters
        adapted = zoo.lora.add_lora(model, lora, key=jax.random.key(0))
        return zoo.internal.partition_trainable(adapted, zoo.lora.trainable(adapted, lora))[0]

    adapter_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(eqx.filter_eval_shape(trained, model)))
    names = [n for n in pinned.EXPECTED if "+dpo/" in n or "+orpo/" in n]
    assert sorted(names) == sorted(f"transformer+lora+{o}/{p}/data=8/explicit" for o in ("dpo", "orpo") for p in ("dp", "fsdp-once"))  # fmt: skip
    for name in names:
        reduces = [c for c in pinned.EXPECTED[name] if c["kind"] in ("all-reduce", "reduce-scatter")]
        assert [c["in_loop"] for c in reduces] == [False], (name, reduces)
        assert reduces[0]["bytes"] == adapter_bytes + 4, (name, reduces[0]["bytes"], adapter_bytes)
        assert not any(c["in_loop"] for c in pinned.EXPECTED[name]), name


# --------------------------------------------------------------------------- data


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _load(path, seq_len=16, **kwargs):
    from zoo.train._user_data import byte_tokenizer

    return zoo.data.load(path, byte_tokenizer(), seq_len=seq_len, **kwargs)[0]


def test_text_pairs_become_one_row_each_with_completion_masks(tmp_path):
    train = _load(_write(tmp_path / "p.jsonl", [{"prompt": "Q1", "chosen": "yes", "rejected": "no!!"}]))
    a = train.arrays
    assert train.kind == "preference" and len(train) == 1
    assert bytes(a["chosen_tokens"][0, :5].astype(np.uint8)) == b"Q1yes" and a["chosen_mask"][0].sum() == 5
    assert bytes(a["rejected_tokens"][0, :6].astype(np.uint8)) == b"Q1no!!"
    np.testing.assert_array_equal(a["chosen_completion"][0, :6], [0, 0, 1, 1, 1, 0])
    np.testing.assert_array_equal(a["rejected_completion"][0, :7], [0, 0, 1, 1, 1, 1, 0])


@pytest.mark.parametrize("truncation", ["keep_end", "keep_start"])
def test_too_long_pairs_cut_the_prompt_then_the_completions(tmp_path, truncation):
    pair = {"prompt": "abcdefghij", "chosen": "0123456789", "rejected": "xy"}
    a = _load(_write(tmp_path / "p.jsonl", [pair]), seq_len=12, max_prompt_len=4, truncation=truncation).arrays
    prompt = "ghij" if truncation == "keep_end" else "abcd"
    assert bytes(a["chosen_tokens"][0].astype(np.uint8)) == (prompt + "01234567").encode()
    assert bytes(a["rejected_tokens"][0, :6].astype(np.uint8)) == (prompt + "xy").encode()
    assert a["chosen_completion"][0].sum() == 8 and a["rejected_completion"][0].sum() == 2


def test_conversation_pairs_go_through_the_chat_template(tmp_path):
    template = zoo.data.ChatTemplate(
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    pair = {"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant", "content": "hello?"}],
            "rejected": [{"role": "assistant", "content": "go"}]}  # fmt: skip
    a = _load(_write(tmp_path / "p.jsonl", [pair]), seq_len=64, chat_template=template, system="be kind").arrays
    chosen = bytes(a["chosen_tokens"][0, : a["chosen_mask"][0].sum()].astype(np.uint8)).decode()
    assert chosen == "<system>be kind\n<user>hi\n<assistant>hello?\n"
    completion = bytes(a["chosen_tokens"][0][a["chosen_completion"][0] == 1].astype(np.uint8)).decode()
    assert completion == "hello?\n"


def test_an_implicit_prompt_is_the_shared_beginning_as_trls_extract_prompt(tmp_path):
    # TRL's implicit prompt: no "prompt", chosen and rejected whole conversations (or texts)
    # sharing it. Refused as "['prompt'] is missing" before.
    template = zoo.data.ChatTemplate(
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    user, yes, no = ({"role": r, "content": c} for r, c in [("user", "hi"), ("assistant", "yes"), ("assistant", "no")])
    implicit = _write(tmp_path / "i.jsonl", [{"chosen": [user, yes], "rejected": [user, no]}])
    explicit = _write(tmp_path / "e.jsonl", [{"prompt": [user], "chosen": [yes], "rejected": [no]}])
    got, want = (_load(p, seq_len=32, chat_template=template).arrays for p in (implicit, explicit))
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in got)
    # Texts: the shared characters, less the space where they part (TRL's `extract_prompt`).
    texts = _load(_write(tmp_path / "t.jsonl", [{"chosen": "Q1 yes", "rejected": "Q1 no!!"}])).arrays
    completion = texts["chosen_tokens"][0][texts["chosen_completion"][0] == 1].astype(np.uint8)
    assert bytes(texts["chosen_tokens"][0, :2].astype(np.uint8)) == b"Q1" and bytes(completion) == b" yes"


@pytest.mark.parametrize(
    "record,message",
    [
        ({"prompt": "q", "chosen": "a"}, "['rejected'] is missing"),
        ({"chosen": "a", "rejected": "b"}, "without a 'prompt' has its prompt in chosen and rejected (TRL's implicit"),
        ({"chosen": "q a", "rejected": "q a"}, 'differ in nothing past their shared one; add a "prompt" field'),
        ({"prompt": "q", "chosen": " ", "rejected": "b"}, "field 'chosen' is empty"),
        ({"prompt": "q", "chosen": "a", "rejected": []}, "mixes texts and message lists"),
        ({"prompt": "q", "chosen": "a", "rejected": 3}, "field 'rejected' is int 3"),
        ({"prompt": "q" * 20, "chosen": "a", "rejected": "b"}, "leaves no room for the completion at seq_len 16"),
    ],
)
def test_bad_pairs_are_refused_in_one_line_naming_the_line(tmp_path, record, message):
    path = _write(tmp_path / "bad.jsonl", [{"prompt": "ok", "chosen": "a", "rejected": "b"}, record])
    with pytest.raises(zoo.data.DataFormatError) as e:
        _load(path, truncation="error")
    assert message in str(e.value) and "bad.jsonl line 2" in str(e.value) and "\n" not in str(e.value)


# --------------------------------------------------------------------------- the run and the CLI

PAIRS_TEXT = [
    {"prompt": f"Q{i}:", "chosen": f" {i % 10} ok?", "rejected": f" {i % 10} ok."} for i in range(40)
]  # fmt: skip
SMALL = "d_model=16,num_layers=1,num_heads=2,mlp_dim=32"  # a from-scratch decoder, for the refusals


@pytest.fixture(scope="module")
def sft_base(tmp_path_factory):
    """A tiny random Llama-style decoder saved as a Hugging Face folder (the base to tune;
    byte tokens), the pairs and a prompt/completion file."""
    root = tmp_path_factory.mktemp("prefrun")
    config = zoo.models.TransformerConfig(vocab_size=256, d_model=16, num_layers=1, num_heads=2, num_kv_heads=2,
                                          mlp_dim=32, max_len=64, positions="rope", activation="swiglu",
                                          norm="rmsnorm", tie_embeddings=False)  # fmt: skip
    zoo.hf.save_pretrained(zoo.models.Transformer(config, key=jax.random.key(0)), root / "sft")
    _write(root / "sft.jsonl", [{"prompt": r["prompt"], "completion": r["chosen"]} for r in PAIRS_TEXT])
    return root, _write(root / "pairs.jsonl", PAIRS_TEXT)


def test_the_preference_defaults_are_trls():
    """A dpo / orpo run's unset learning rate, beta, loss and label smoothing are TRL's
    `DPOConfig` / `ORPOConfig` defaults (an sft run keeps the model's learning rate)."""
    import dataclasses
    import os

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl import DPOConfig
    from trl.experimental.orpo import ORPOConfig

    from zoo.train import RunConfig

    def default(config, name):
        field = config.__dataclass_fields__[name]
        return field.default_factory() if field.default is dataclasses.MISSING else field.default

    for objective, trl_config in (("dpo", DPOConfig), ("orpo", ORPOConfig)):
        ours = RunConfig(model="transformer", objective=objective).resolved("finetune")
        assert ours.optimizer.lr == default(trl_config, "learning_rate"), objective
        assert ours.beta == default(trl_config, "beta"), objective
    dpo = RunConfig(model="transformer", objective="dpo").resolved("finetune")
    assert [dpo.loss_type] == default(DPOConfig, "loss_type") and dpo.label_smoothing == default(
        DPOConfig, "label_smoothing"
    )
    sft = RunConfig(model="transformer").resolved("finetune")
    assert sft.optimizer.lr == 1e-2  # the model's (an SFT learning rate)
    given = RunConfig(model="transformer", objective="dpo", optimizer=dataclasses.replace(sft.optimizer, lr=5e-5))
    assert given.resolved("finetune").optimizer.lr == 5e-5


def _held_pairs(run, path):
    """A file of the pairs `run` held out (its validation split, by content hash); all of
    them where it held out none (it evaluated its training pairs)."""
    from zoo.data._dataset import _held_out

    validation = json.loads((run / "config.json").read_text())["validation"]
    held = _held_out([json.dumps(r, sort_keys=True).encode() for r in PAIRS_TEXT], validation) if validation else None
    return _write(path, PAIRS_TEXT if held is None else [r for r, h in zip(PAIRS_TEXT, held) if h])


@pytest.fixture(scope="module")
def dpo_cli_run(sft_base):
    """A finished 2-step `zoo finetune --objective dpo` LoRA run of sft_base (evaluated at
    every step; a learning rate that moves it off its reference): its folder, stdout, stderr."""
    from helpers import zoo_main

    root, pairs = sft_base
    rc, out, err = zoo_main("finetune", "transformer", "--init", root / "sft", "--data", pairs, "--seq-len", 16,
                            "--steps", 2, "--batch-size", 8, "--microbatches", 2, "--devices", 2, "--objective", "dpo",
                            "--beta", 0.5, "--lr", 1e-2, "--eval-every", 1, "--output", root / "cli",
                            "--tensorboard", root / "cli" / "tb")  # fmt: skip
    assert rc == 0, err
    return root / "cli", out, err


def test_cli_dpo_with_lora_logs_trls_metrics_and_is_the_python_config(sft_base, dpo_cli_run):
    root, pairs = sft_base
    _, out, err = dpo_cli_run
    assert "warning" not in err  # beta 0.5: in TRL's documented range
    assert "preference acc." in out and "reference: the base model (LoRA adapters disabled" in out
    assert "step 1: eval loss" in err and "rewards/margins" in err and "logps/chosen" in err  # the console: TRL's names
    rows = [json.loads(line) for line in (root / "cli" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r["kind"] == "eval"]
    for name in zoo.models._preference.METRICS:
        assert all(f"eval_{name}" in r for r in evals), name
    from test_train_api import _tensorboard_scalars

    scalars = _tensorboard_scalars(root / "cli" / "tb")
    for name in zoo.models._preference.METRICS:  # TensorBoard holds the same numbers (float32)
        assert scalars[f"eval_{name}"][2] == pytest.approx(evals[-1][f"eval_{name}"], rel=1e-6, abs=1e-7), name
    assert evals[0]["eval_rewards/margins"] == 0 and evals[0]["eval_loss"] == pytest.approx(np.log(2), abs=1e-6)
    summary = json.loads((root / "cli" / "summary.json").read_text())
    assert summary["eval_before"]["accuracy"] == 0 and summary["eval_after"]["accuracy"] is not None
    # The flags are RunConfig's fields: the run's config.json is the Python form of the same run.
    saved = json.loads((root / "cli" / "config.json").read_text())
    assert saved["objective"] == "dpo" and saved["beta"] == 0.5 and saved["loss_type"] == "sigmoid"
    python = zoo.train.RunConfig(model="transformer", init=str(root / "sft"), steps=2, batch_size=8, microbatches=2,
                                 devices=2, mesh={"data": 2}, objective="dpo", beta=0.5, eval_every=1,
                                 optimizer=zoo.train.OptimizerConfig(lr=1e-2),
                                 tensorboard=str(root / "cli" / "tb"),
                                 output=str(root / "cli"),
                                 data=zoo.train.DataConfig(source=str(pairs), seq_len=16))  # fmt: skip
    assert zoo.train.RunConfig.from_dict(saved) == python.resolved("finetune")


def test_eval_of_a_dpo_run_on_its_pairs_is_its_own_final_evaluation(sft_base, dpo_cli_run):
    """`zoo eval RUN --data pairs.jsonl` of a DPO run (it refused: "holds preference pairs
    but ... is a lm run") gives TRL's eval metrics as the run's own evaluation computes them:
    on the pairs it held out (its validation split, by content hash), its final ones,
    against its reference (the base: LoRA disabled)."""
    from helpers import zoo_ok

    root, _ = sft_base
    run, _, _ = dpo_cli_run
    pairs = _held_pairs(run, root / "held-pairs.jsonl")
    scores = json.loads(zoo_ok("eval", run, "--data", pairs, "--json"))
    after = json.loads((run / "summary.json").read_text())["eval_after"]
    assert scores["kind"] == "preference" and scores["objective"] == "dpo" and scores["pairs"] == after["examples"]
    assert "LoRA adapters disabled" in scores["reference"]
    for name in ["loss", "accuracy", *zoo.models._preference.METRICS]:
        assert scores[name] == pytest.approx(after[name], rel=1e-5, abs=1e-9), name
    assert abs(after["rewards/margins"]) > 1e-6  # the trained model is not its reference
    text = zoo_ok("eval", run, "--data", pairs)
    assert f"preference accuracy {100 * after['accuracy']:.1f}%  ({after['examples']} pairs; dpo; reference:" in text
    assert f"rewards/margins {after['rewards/margins']:.4f}" in text and "logps/rejected" in text


def test_a_huge_beta_trains_with_one_warning_line_naming_the_usual_range(sft_base):
    """--beta 50 (a slip for 0.5, say) is legal but saturates the loss: the run trains, and
    stderr says so once, before training, also with --quiet."""
    from helpers import zoo_main

    root, pairs = sft_base
    rc, out, err = zoo_main("finetune", "transformer", "--init", root / "sft", "--data", pairs, "--seq-len", 16,
                            "--steps", 1, "--batch-size", 8, "--microbatches", 2, "--devices", 2, "--objective", "dpo",
                            "--beta", 50, "--quiet", "--output", root / "huge-beta")  # fmt: skip
    assert rc == 0, err
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert warnings == [err.strip().splitlines()[0]], err  # one line, the first
    assert "--beta 50 is far past the usual range (DPO's beta: 0.1-0.5" in warnings[0] and "--beta 0.1" in warnings[0]
    assert (root / "huge-beta" / "adapter" / "adapter_model.safetensors").is_file()
    assert zoo.train._preference.beta_warning("dpo", 10.0) is None  # the edge: at most 10 is quiet
    assert "ORPO's lambda" in zoo.train._preference.beta_warning("orpo", 10.5)
    assert zoo.train._preference.beta_warning("sft", 50.0) is None


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("objective", ["dpo", "orpo"])
def test_full_weight_runs_dpo_against_precomputed_log_probs_and_orpo(sft_base, objective, capsys):
    root, pairs = sft_base
    config = zoo.train.RunConfig(
        model="transformer", init=str(root / "sft"), data=zoo.train.DataConfig(source=str(pairs), seq_len=16),
        steps=3, batch_size=8, microbatches=1, devices=2, objective=objective, output=str(root / f"full-{objective}"),
    )  # fmt: skip
    result = zoo.train.run(config)
    out = capsys.readouterr().out
    if objective == "dpo":
        assert "reference: the initial model's log-probabilities, computed once before training" in out
        assert result.summary["eval_before"]["rewards/margins"] == pytest.approx(0, abs=1e-5)
    else:
        assert "; reference:" not in out.split("data:")[1].splitlines()[0]
        assert "nll_loss" in result.summary["eval_after"]
    assert result.summary["eval_after"]["loss"] < result.summary["eval_before"]["loss"]
    # Evaluated on the pairs it evaluated, the saved run gives its final evaluation (DPO:
    # against the initial model's log-probabilities, computed again from its init).
    run = zoo.train.load_run(root / f"full-{objective}")
    scores = run.evaluate(_held_pairs(run.folder, root / f"held-{objective}.jsonl"))
    after = result.summary["eval_after"]
    names = ["loss", "accuracy", *zoo.models._preference.METRICS]
    names += list(zoo.models._preference.ORPO_METRICS) if objective == "orpo" else []
    for name in names:
        assert scores[name] == pytest.approx(after[name], rel=1e-5, abs=1e-9), name
    assert scores["pairs"] == after["examples"] and abs(after["rewards/margins"]) > 1e-6
    assert ("the model the run started from" in scores["reference"]) if objective == "dpo" else not scores["reference"]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--objective", "dpo"], "--objective dpo trains on preference pairs: pass --data FILE.jsonl"),
        (["--objective", "dpo", "--data", "SFT"], "holds prompt/completion records"),
        (["--data", "PAIRS"], "holds preference pairs (prompt, chosen, rejected): tune on them with --objective dpo"),
        (["--objective", "dpo", "--label-smoothing", "0.1", "--data", "PAIRS"], "used by loss_type 'robust' only"),
        (["--objective", "orpo", "--beta", "0", "--data", "PAIRS"], "beta must be a finite number > 0, got 0"),
        (["--objective", "dpo", "--beta", "inf", "--data", "PAIRS"], "beta must be a finite number > 0, got inf"),
    ],
)
def test_cli_refuses_preference_settings_in_one_line(sft_base, args, message):
    from helpers import one_line_error, zoo_main

    root, pairs = sft_base
    args = [{"SFT": root / "sft.jsonl", "PAIRS": pairs}.get(a, a) for a in args]
    rc, _, err = zoo_main("train", "transformer", "--model-config", SMALL, "--devices", 2, *args)
    one_line_error(rc, err, message)

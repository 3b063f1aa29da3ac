"""A run that trained several named adapters (`adapter/NAME/`) is usable by `zoo generate`
(`--adapter RUN/adapter/NAME` picks one, on the run's base) and `zoo serve` says in one
line how to serve them (each `--adapter NAME=DIR` beside the base), instead of calling the
run "a folder without model/"."""

import json

import jax
import numpy as np
import pytest
from helpers import one_line_error, zoo_main

import zoo


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A base decoder (Hugging Face folder, byte tokens) and a run folder holding two named
    adapters of it, as `zoo finetune` leaves a run of several adapters."""
    root = tmp_path_factory.mktemp("named")
    config = zoo.models.TransformerConfig(vocab_size=256, d_model=16, num_layers=1, num_heads=2, mlp_dim=32,
                                          max_len=32, positions="rope", activation="swiglu", norm="rmsnorm",
                                          num_kv_heads=2, tie_embeddings=False)  # fmt: skip
    base = zoo.models.Transformer(config, key=jax.random.key(0))
    zoo.hf.save_pretrained(base, root / "base")
    out = root / "run"
    lora = zoo.lora.LoraConfig(r=2, lora_alpha=4, target_modules=("q_proj", "v_proj"), init_lora_weights=False)
    for k, name in enumerate(("alpha", "beta")):
        adapted = zoo.lora.add_lora(base, lora, key=jax.random.key(k + 1))
        zoo.lora.save_adapter(adapted, lora, out / "adapter" / name, base_model_name_or_path=str(root / "base"))
    (out / "config.json").write_text(json.dumps({"model": "transformer", "init": str(root / "base"), "lora": "r=2"}))
    return root, out


def test_generate_on_a_run_of_several_adapters_names_them_and_the_flag(run):
    _, out = run
    rc, _, err = zoo_main("generate", out, "--prompt", "a", "--max-new-tokens", "2")
    one_line_error(rc, err, f"SOURCE {out}: a run of 2 adapters (alpha, beta); zoo generate takes one: --adapter ")
    assert f"--adapter alpha={out / 'adapter' / 'alpha'}" in err


def test_serve_on_a_run_of_several_adapters_says_how_to_serve_them(run):
    _, out = run
    rc, _, err = zoo_main("serve", out, "--port", "0")
    one_line_error(rc, err, "zoo serve BASE serves them all: --adapter alpha=")


@pytest.mark.parametrize("name", ["alpha", "beta"])
def test_generate_picks_one_adapter_of_the_run(run, name):
    root, out = run
    rc, text, err = zoo_main("generate", out, "--adapter", out / "adapter" / name, "--prompt", "ab",
                             "--max-new-tokens", "3", "--json")  # fmt: skip
    assert rc == 0, err
    # The same as the base with that adapter loaded by hand.
    base = zoo.hf.from_pretrained(root / "base")
    model, _ = zoo.lora.load_adapter(base, out / "adapter" / name)
    want = np.asarray(zoo.generate(model, np.array([list(b"ab")]), max_new_tokens=3))
    from zoo._cli._generate import Text

    assert json.loads(text)[0]["completion"] == Text().decode(want[0, 2:].tolist())


def test_export_merges_the_adapter_named_and_transformers_opens_it(llama_dir, data_files, tmp_path):
    """`zoo export RUN --merge` of a run of several adapters (trained by zoo finetune) names
    them and the flag in one line; `--adapter NAME` merges that one: a folder
    transformers opens with the logits of the run's base carrying that adapter."""
    import torch
    import transformers
    from helpers import assert_rounding_close
    from tiny_runs import TINY

    out = tmp_path / "run"
    data = f"alpha={data_files['text']},beta={data_files['chat']}"
    rc, _, err = zoo_main("finetune", "transformer", "--init", llama_dir, "--data", data, *TINY, "--steps", "2",
                          "--lora", "r=2,alpha=4", "--lr", "1e-1", "--output", out)  # fmt: skip
    assert rc == 0, err
    rc, _, err = zoo_main("export", out, "--merge", "--output", tmp_path / "none")
    one_line_error(rc, err, f"{out}: a run of 2 adapters (alpha, beta); no adapter named one to merge: --adapter NAME")
    rc, _, err = zoo_main("export", out, "--output", tmp_path / "none")
    one_line_error(rc, err, f"is {out / 'adapter'}/NAME for NAME in alpha, beta")
    rc, _, err = zoo_main("export", out, "--merge", "--adapter", "gamma", "--output", tmp_path / "none")
    one_line_error(rc, err, "adapter 'gamma' is not one of them")
    assert not (tmp_path / "none").exists()
    run = zoo.train.load_run(out)
    tokens = np.array([[1, 6, 8, 10, 12, 6, 14]], np.int32)
    logits = {}
    for name in ("alpha", "beta"):
        rc, _, err = zoo_main("export", out, "--merge", "--adapter", name, "--output", tmp_path / name)
        assert rc == 0, err
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / name)
        with torch.no_grad():
            logits[name] = hf(torch.from_numpy(tokens).long()).logits.numpy()
        want = np.asarray(zoo.lora.adapter(run.model, name)(tokens))
        assert_rounding_close(logits[name], want, terms=48, depth=14, what=f"merged adapter {name} vs zoo")
    assert np.abs(logits["alpha"] - logits["beta"]).max() > 1e-4  # two adapters, two models

"""Adapter runs from the command line. `zoo finetune --data` training several LoRA
adapters in one run (issue 27 item 5): one frozen base, each adapter on its own rows, in
one compiled step. The CLI's flags and `zoo.train.run` are one run; each adapter ends where
it ends trained alone on its own file with the same settings; each exported folder opens
in peft with zoo's logits; bad data is refused naming the file and line. The step's
collectives stay the promise (one gradient all-reduce, outside every loop). The library's
own equality (10 SGD steps, 2 devices x 2 microbatches, per-adapter clipping, AdamW) is
tests/test_named_adapters.py's. A run that trained several named adapters
(`adapter/NAME/`) is usable by `zoo generate` (`--adapter RUN/adapter/NAME` picks one, on
the run's base), `zoo export --merge --adapter NAME`, and `zoo serve` says in one line how
to serve them (each `--adapter NAME=DIR` beside the base), instead of calling the run "a
folder without model/"."""

import functools
import json
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import largest, one_line_error, zoo_main, zoo_ok

import zoo

WORDS = "a an to of it is we go up no".split()
SEQ = 32
# Every run: 3 steps of SGD (momentum) on 2 devices x 2 microbatches, evaluated each step.
SETTINGS = {"steps": 3, "devices": 2, "microbatches": 2, "eval_size": 8, "seq_len": SEQ, "optimizer": "sgd",
            "lr": 0.05}  # fmt: skip
K_BATCH = 8  # 4 rows of each adapter per step
DIFFS: dict[str, float] = {}  # the measured differences (pytest -s prints them)


def _lines(rng, n: int, prefix: str = "") -> list[dict]:
    def words() -> str:
        return " ".join(rng.choice(WORDS, rng.integers(2, 5)))

    return [{"prompt": prefix + words(), "completion": words()} for _ in range(n)]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """The adapters' data: a.jsonl and b.jsonl (prompt/completion records, b's of another
    style), and both in one file whose records name their adapter."""
    root = tmp_path_factory.mktemp("adapter_runs")
    rng = np.random.default_rng(0)
    records = {"a": _lines(rng, 30), "b": _lines(rng, 24, "Q: ")}
    for name, rows in records.items():
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    mixed = [r | {"adapter": n} for n, rows in records.items() for r in rows]
    (root / "mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in mixed))
    return {"a": root / "a.jsonl", "b": root / "b.jsonl", "mixed": root / "mixed.jsonl", "root": root}


@pytest.fixture(scope="module")
def base(files) -> Path:
    """A tiny random GPT-2 folder (transformers'): the frozen base every run adapts."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=256, n_embd=32, n_head=4, n_layer=1, n_positions=SEQ)
    transformers.GPT2LMHeadModel(config).save_pretrained(files["root"] / "base")
    return files["root"] / "base"


def _flags(settings: dict) -> list[str]:
    return [a for k, v in settings.items() for a in (f"--{k.replace('_', '-')}", str(v))]


def _library(base, out: Path, source, batch_size: int):
    from zoo.train import DataConfig, OptimizerConfig, RunConfig

    s = dict(SETTINGS)
    data = DataConfig(source=source, eval_size=s.pop("eval_size"), seq_len=s.pop("seq_len"))
    opt = OptimizerConfig(name=s.pop("optimizer"), lr=s.pop("lr"))
    config = RunConfig(model="transformer", init=str(base), batch_size=batch_size, data=data, optimizer=opt,
                       quiet=True, output=str(out), **s)  # fmt: skip
    return zoo.train.run(config, command="finetune")


@pytest.fixture(scope="module")
def runs(files, base):
    """The runs the tests share: the two adapters at once from the flags (one file per
    adapter) and from `zoo.train.run` (the records naming their adapter), and each adapter
    alone on its file, as a one-adapter fine-tune with half the batch (its share)."""
    root = files["root"]
    flags = [*_flags(SETTINGS), "--batch-size", K_BATCH, "--init", base, "--quiet"]
    zoo_ok("finetune", "transformer", "--data", f"a={files['a']},b={files['b']}", *flags, "--output", root / "flags")
    library = _library(base, root / "library", str(files["mixed"]), K_BATCH)
    alone = {n: _library(base, root / f"alone-{n}", str(files[n]), K_BATCH // 2) for n in ("a", "b")}
    return {"flags": root / "flags", "library": library, "alone": alone}


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@functools.cache
def _weights(folder: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(folder / "adapter_model.safetensors")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_flags_and_library_train_the_adapters_as_one_run(runs):
    """`--data a=A,b=B` (flags) and records naming their adapter (`RunConfig`, one file)
    train the same two adapters: the same losses and saved weights; the summary lists each
    adapter's folder and held-out loss, metrics.jsonl each one's `eval_loss/NAME`; the
    compiled step reduces both adapters once, outside every loop."""
    flags, library = runs["flags"], runs["library"]
    summary = json.loads((flags / "summary.json").read_text())
    assert summary["lora"]["adapters"] == ["a", "b"]
    assert set(summary["adapters"]) == {"a", "b"}
    for name, entry in summary["adapters"].items():
        assert Path(entry["folder"]) == flags / "adapter" / name
        assert (flags / "adapter" / name / "adapter_config.json").is_file()
        assert entry["eval_loss_after"] < entry["eval_loss_before"]
    assert summary["outputs"]["adapters"] == {n: str(flags / "adapter" / n) for n in ("a", "b")}
    evals = [r for r in _metrics(flags) if r["kind"] == "eval"]
    assert len(evals) == 4 and all(isinstance(r["eval_loss/a"], float) and r["eval_loss/b"] for r in evals)
    collectives = summary["collectives"]
    assert collectives["gradient_reductions"] == 1
    assert not [c for c in collectives["list"] if c["in_loop"]]
    # the all-reduce carries both adapters' bytes and the loss's scalars, nothing of the base
    assert collectives["gradient_bytes"] == summary["adapter_bytes"] + 8
    # the same run through the library, from one file whose records name the adapters
    mine = [(r["step"], r["loss"]) for r in _metrics(flags) if r["kind"] == "train"]
    theirs = [(r["step"], r["loss"]) for r in _metrics(library.output) if r["kind"] == "train"]
    assert mine == theirs and len(mine) == 3
    for name in ("a", "b"):
        got, want = _weights(library.output / "adapter" / name), _weights(flags / "adapter" / name)
        assert got.keys() == want.keys()
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"{name}: {key}")


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.numerics
def test_each_adapter_ends_where_it_ends_trained_alone(runs):
    """Each adapter of the two-adapter run (batch 8: 4 rows of each per step) equals a
    one-adapter fine-tune on its own file with batch 4 and the same settings: its saved
    weights, its held-out losses after every step, and the step's loss is the sum of the
    adapters' own."""
    together = _metrics(runs["flags"])
    train = np.zeros(3)
    for name, alone in runs["alone"].items():
        got, want = _weights(runs["flags"] / "adapter" / name), _weights(alone.output / "adapter")
        assert got.keys() == want.keys()
        diff = max(largest(got[k] - want[k]) / largest(want[k]) for k in want)
        DIFFS[f"weights {name} vs alone"] = diff
        assert diff < 1e-5, (name, diff)
        mine = [r[f"eval_loss/{name}"] for r in together if r["kind"] == "eval"]
        theirs = [r["eval_loss"] for r in _metrics(alone.output) if r["kind"] == "eval"]
        np.testing.assert_allclose(mine, theirs, rtol=1e-5)
        train += [r["loss"] for r in _metrics(alone.output) if r["kind"] == "train"]
    np.testing.assert_allclose([r["loss"] for r in together if r["kind"] == "train"], train, rtol=1e-5)
    print({k: f"{v:.2g}" for k, v in DIFFS.items()})


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.numerics
def test_each_exported_adapter_opens_in_peft_with_zoos_logits(runs, base):
    """adapter/NAME opens in peft (`PeftModel.from_pretrained(base, folder,
    adapter_name=NAME)`) with the logits the trained run's model gives rows of NAME."""
    import equinox as eqx
    import jax.numpy as jnp
    import peft
    import torch
    import transformers

    model = runs["library"].model
    tokens = np.random.default_rng(1).integers(1, 256, (4, 12))  # rows split over the run's 2 devices
    forward = eqx.filter_jit(lambda m, t, index: zoo.lora.route(m, index)(t))
    for k, name in enumerate(("a", "b")):
        ours = np.asarray(forward(model, jnp.asarray(tokens), jnp.full(len(tokens), k, jnp.int32)))
        hf = transformers.GPT2LMHeadModel.from_pretrained(base)
        opened = peft.PeftModel.from_pretrained(hf, runs["library"].output / "adapter" / name, adapter_name=name)
        with torch.no_grad():
            theirs = opened(torch.as_tensor(tokens)).logits.numpy()
        diff = largest(ours - theirs) / largest(theirs)
        DIFFS[f"peft logits {name}"] = diff
        assert diff <= 1e-5, (name, diff)
        bare = np.asarray(forward(model, jnp.asarray(tokens), jnp.full(len(tokens), -1, jnp.int32)))
        assert largest(ours - bare) > 100 * largest(ours - theirs)  # the adapter changes the logits
    print({k: f"{v:.2g}" for k, v in DIFFS.items()})


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.numerics
def test_zoo_eval_runs_each_record_through_its_own_adapter(runs, files, tmp_path):
    """`zoo eval RUN --data FILE` of the two-adapter run: each record through the adapter
    it names, the same loss as the adapter's one-adapter run on its own file; a record
    naming an adapter the run has not, or none, is refused."""
    scores = json.loads(zoo_ok("eval", runs["flags"], "--data", files["mixed"], "--json"))
    assert set(scores["adapters"]) == {"a", "b"}
    for name in ("a", "b"):
        alone = json.loads(zoo_ok("eval", runs["alone"][name].output, "--data", files[name], "--json"))
        assert scores["adapters"][name]["tokens"] == alone["tokens"]
        np.testing.assert_allclose(scores["adapters"][name]["loss"], alone["loss"], rtol=1e-5)
    unknown = _write(files, "unknown.jsonl", [{"prompt": "a", "completion": "to it", "adapter": "c"}])
    rc, _, err = zoo_main("eval", runs["flags"], "--data", unknown)
    one_line_error(rc, err, "adapters ['c'] are not among the run's ['a', 'b']")
    rc, _, err = zoo_main("eval", runs["flags"], "--data", files["a"])
    one_line_error(rc, err, "give each record its adapter's name")


def test_each_batch_holds_each_adapters_own_rows_unmixed(files):
    """A step's batch: `batch_size / K` rows of each adapter, each row one of that
    adapter's own packed rows (no row mixes two adapters' documents), the rows its own
    file gives a one-adapter run of batch `batch_size / K`; a file whose records name
    their adapter reads as one file per adapter; `adapter_norm` is each adapter's share."""
    from zoo.data import load
    from zoo.lora import adapter_norms
    from zoo.train._adapters import AdapterRows, read_adapter_records
    from zoo.train._user_data import byte_tokenizer

    pairs = read_adapter_records(f"a={files['a']},b={files['b']}")
    mixed = read_adapter_records(str(files["mixed"]))
    assert pairs.names == mixed.names == ("a", "b")
    assert all(pairs.located[n][:2] == mixed.located[n][:2] for n in ("a", "b"))  # kind, records (not lines)
    assert mixed.located["b"][2][0] == "mixed.jsonl line 31"
    assert read_adapter_records(str(files["a"])) is None  # no names: a one-adapter run
    own = {n: load(files[n], byte_tokenizer(), seq_len=SEQ, validation=0.1)[0] for n in ("a", "b")}
    located = {n: load(files[n], byte_tokenizer(), seq_len=SEQ, validation=0.1, located=mixed.located[n], data=b"")[0]
               for n in ("a", "b")}  # fmt: skip
    source = AdapterRows(("a", "b"), (located["a"], located["b"]))
    for step in (1, 2, 7):
        batch = source.batch_at(step, K_BATCH, seed=3)
        np.testing.assert_array_equal(batch["adapter"], [0, 0, 0, 0, 1, 1, 1, 1])
        for k, name in enumerate(("a", "b")):
            alone = own[name].batch_at(step, K_BATCH // 2, seed=3)
            for key, value in alone.items():
                np.testing.assert_array_equal(batch[key][4 * k : 4 * k + 4], value, err_msg=f"{name} {key}")
        counts = batch["weights"][:, 1:].sum(axis=1)
        np.testing.assert_array_equal(batch["adapter_norm"], adapter_norms(batch["adapter"], counts, 2))


# --- bad input: one clear error each, before anything is trained ---------------------------------


def _finetune(base, *args) -> tuple[int, str]:
    rc, _, err = zoo_main("finetune", "transformer", "--init", base, *_flags(SETTINGS), "--quiet", *args)
    return rc, err


def _write(files, name: str, lines: list[dict]) -> Path:
    path = files["root"] / name
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def test_bad_adapter_data_is_refused_naming_the_file_and_line(files, base, tmp_path):
    good = {"prompt": "a to", "completion": "it is"}
    cases = {
        "missing": ([good | {"adapter": "a"}, good | {"adapter": "b"}, good], "missing.jsonl line 3 has no 'adapter'"),
        "empty name": ([good | {"adapter": "a"}, good | {"adapter": ""}], "missing.jsonl line 2 field 'adapter'"),
        "folder name": ([good | {"adapter": "a"}, good | {"adapter": "x/y"}], "cannot name a folder"),
    }
    for what, (lines, message) in cases.items():
        path = _write(files, "missing.jsonl", lines)
        rc, err = _finetune(base, "--data", path, "--batch-size", 4, "--output", tmp_path / what)
        one_line_error(rc, err, message)
    # a pair's file holding another adapter's record
    other = _write(files, "other.jsonl", [good, good | {"adapter": "b"}])
    rc, err = _finetune(base, "--data", f"a={other},b={files['b']}", "--batch-size", 8, "--output", tmp_path / "o")
    one_line_error(rc, err, "other.jsonl line 2 names adapter 'b'")
    # an adapter with too few rows for its share of the batch
    few = _write(files, "few.jsonl", [good] * 3)
    rc, err = _finetune(base, "--data", f"a={files['a']},few={few}", "--batch-size", 8, "--output", tmp_path / "f")
    one_line_error(rc, err, "adapter 'few' (few.jsonl) has 1 training row after")
    # the batch must split evenly over the adapters; pairs name a file each, once each
    for data, batch, message in (
        (f"a={files['a']},b={files['b']},c={files['a']}", 8, "use a multiple of 3"),
        (f"a={files['a']},a={files['b']}", 8, "adapter 'a' is named twice"),
        (f"a={files['a']},b=", 8, "is not NAME=FILE"),
        (f"a={files['a']},b={tmp_path / 'none.jsonl'}", 8, "no such file"),
    ):
        rc, err = _finetune(base, "--data", data, "--batch-size", batch, "--output", tmp_path / "x")
        one_line_error(rc, err, message)
    # several adapters are a fine-tune's
    rc, _, err = zoo_main("train", "transformer", "--data", f"a={files['a']},b={files['b']}", "--quiet")
    one_line_error(rc, err, "zoo finetune")


# --------------------------------------------------------------------------- a run of several named adapters: generate, export, serve


@pytest.fixture(scope="module")
def named_run(tmp_path_factory):
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


def test_generate_on_a_run_of_several_adapters_names_them_and_the_flag(named_run):
    _, out = named_run
    rc, _, err = zoo_main("generate", out, "--prompt", "a", "--max-new-tokens", "2")
    one_line_error(rc, err, f"SOURCE {out}: a run of 2 adapters (alpha, beta); zoo generate takes one: --adapter ")
    assert f"--adapter alpha={out / 'adapter' / 'alpha'}" in err


def test_serve_on_a_run_of_several_adapters_says_how_to_serve_them(named_run):
    _, out = named_run
    rc, _, err = zoo_main("serve", out, "--port", "0")
    one_line_error(rc, err, "zoo serve BASE serves them all: --adapter alpha=")


@pytest.mark.parametrize("name", ["alpha", "beta"])
def test_generate_picks_one_adapter_of_the_run(named_run, name):
    root, out = named_run
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

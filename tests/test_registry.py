"""The model registry (`zoo.train.ModelSpec`, `register_model`, `model_spec`,
`model_names`, `build_task`): the built-ins, a model a user registers, `--init` checked
against the Hugging Face architecture registry, and `zoo info` / `zoo inspect` / `zoo
train` building the same model from the same flags.

Commands run in-process (`zoo_main`), on small models: the mlp run of
tests/tiny_runs.py's `TINY_MLP` (2 devices; the shapes of the session's finished mlp run, so
the programs are shared), the Hugging Face kinds as small (`d_model=32,num_layers=1`).
"""

import json
import math
import re

import pytest
from helpers import zoo_main
from helpers import zoo_ok as ok
from tiny_runs import TINY_MLP

# A small transformer (or encoder) as zoo train builds it from the registry's scratch config.
SMALL_LM = ["--model-config", "d_model=32,num_layers=1", "--seq-len", "16"]
# The run's sizes: 2 devices, batch 8, 1 microbatch, 16 eval rows (tiny_runs.TINY_MLP).
RUN = TINY_MLP[:-1]


def one_line_error(args, message: str) -> str:
    rc, _, err = zoo_main(*args)
    assert rc == 2, (rc, err)
    assert message in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


# --- the registry -------------------------------------------------------------------------------


def test_builtins_are_registered_with_their_defaults():
    import zoo

    assert zoo.train.model_names() == ["mlp", "transformer", "encoder", "minilm"]
    assert zoo.train.model_names("finetune") == ["transformer", "encoder", "minilm"]
    lm = zoo.train.model_spec("transformer")
    assert lm.kind == "lm" and lm.init_class is zoo.models.Transformer and lm.finetune_needs_init
    assert lm.defaults["train"]["seq_len"] == lm.defaults_for("train")["seq_len"] == 64
    assert (
        list(lm.datasets) == ["code", "prose"] and lm.data_for("train") == "code" and lm.data_for("finetune") == "prose"
    )
    assert zoo.train.model_spec("minilm").pretrained is not None and zoo.train.model_spec("encoder").classifier
    assert zoo.train.model_spec("mlp").dtypes == ("float32",) and zoo.train.model_spec("mlp").init_class is None
    with pytest.raises(TypeError):  # the tables are read-only: every command shares them
        lm.defaults["train"]["steps"] = 1


def test_classes_given_as_import_paths_read_and_compare_as_the_classes():
    """The built-in specs and families name their zoo classes by import path (registering
    and listing them imports no jax, tests/test_cli.py); read, each is the class, and two
    paths compare as their classes would: none of them subclasses another."""
    import dataclasses
    import inspect
    import itertools

    import zoo
    from zoo._lazy import is_subclass, resolve_class

    families = zoo.hf.families()
    paths = {inspect.getattr_static(f, "model_class").path for f in families.values()}
    assert paths == {"zoo.models.Transformer", "zoo.models.Encoder"}
    paths |= {"zoo.models.EncoderClassifier", "zoo.models.TransformerConfig", "zoo.models.EncoderConfig"}
    for a, b in itertools.product(paths, repeat=2):
        assert is_subclass(a, b) == issubclass(resolve_class(a), resolve_class(b)), (a, b)
    for name in zoo.train.model_names():
        spec = zoo.train.model_spec(name)
        by_class = [] if spec.init_class is None else zoo.train.init_families(spec.init_class)
        assert spec.init_families == by_class, name
    assert sorted(zoo.train.init_families("zoo.models.Transformer")) == sorted(zoo.hf.families(zoo.models.Transformer))
    assert families["llama"].model_class is zoo.models.Transformer
    assert families["bert"].config_class is zoo.models.EncoderConfig
    # A spec takes a class too, and `dataclasses.replace` keeps what it reads.
    spec = dataclasses.replace(zoo.train.model_spec("transformer"), init_class=zoo.models.Transformer)
    assert spec.init_class is zoo.models.Transformer
    assert spec.init_families == zoo.train.model_spec("transformer").init_families
    with pytest.raises(ImportError, match="'zoo.models.Transformr' names no class: give a class or its import path"):
        resolve_class("zoo.models.Transformr")


def test_unknown_model_is_a_config_error_listing_the_names():
    import zoo

    with pytest.raises(zoo.train.ConfigError, match=r"unknown model 'gpt9'; choose one of \['mlp', 'transformer'"):
        zoo.train.model_spec("gpt9")
    assert issubclass(zoo.train.ConfigError, ValueError)
    with pytest.raises(zoo.train.ConfigError, match="zoo finetune does not take 'mlp'.*zoo train mlp"):
        zoo.train.model_spec("mlp").defaults_for("finetune")
    # The CLI prints it as it prints its own errors: one line, exit 2.
    one_line_error(["info", "gpt9"], "unknown model 'gpt9'")
    one_line_error(["train", "gpt9", "--steps", "1"], "unknown model 'gpt9'")


def test_build_task_checks_the_settings_against_the_spec():
    import zoo

    def config(data="teacher", **changes):
        return zoo.train.RunConfig(model="mlp", data=zoo.train.DataConfig(source=data, eval_size=8), **changes)

    task = zoo.train.build_task(config().resolved(), rules=None, mesh=None)
    assert task.kind == "regression" and task.config == {"in_size": 16, "out_size": 1, "width": 64, "depth": 4}
    assert task.batch_at(1, 4)["x"].shape == (4, 16) and task.eval_data["y"].shape == (8, 1)
    for changes, message in [
        (dict(data="prose"), "DataConfig.source 'prose': mlp trains on teacher"),
        (dict(dtype="bfloat16"), "the mlp computes in float32 only"),
        (dict(init="somewhere"), "the mlp has no pretrained weights"),
        (dict(model_config={"height": 3}), "unknown mlp keys ['height']"),
    ]:
        with pytest.raises(zoo.train.ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
            zoo.train.build_task(config(**changes).resolved(), rules=None, mesh=None)
    with pytest.raises(zoo.train.ConfigError, match=r"defaults applied: pass config.resolved\(command\)"):
        zoo.train.build_task(config(), rules=None, mesh=None)


def test_cli_help_and_choices_come_from_the_registry():
    import zoo
    from zoo._cli._inspect import model_help as inspect_help
    from zoo.train._flags import fields_flags

    texts = {c: zoo.train.RunConfig.help_texts(c) for c in ("train", "finetune", "demo")}
    for name in zoo.train.model_names():
        spec = zoo.train.model_spec(name)
        assert f"{name} ({spec.help})" in texts["train"]["models"] and f"{name} ({spec.help})" in inspect_help()
        for command, values in spec.defaults.items():  # the --help tables of the model defaults
            assert f"{name}: steps {values['steps']}, batch-size {values['batch_size']}," in texts[command]["defaults"]
    assert [row.split(":")[0] for row in texts["finetune"]["defaults"].split("; ")] == zoo.train.model_names("finetune")
    assert "prose (transformer: pydoc_data.topics" in texts["train"]["data_sets"]
    for command in texts:  # the library fills every flag's help in: no {field} is left for the CLI
        flags = zoo.train.RunConfig.flags(command)
        assert flags and all(not re.search(r"\{\w+\}", f.help) and command in f.commands for f in flags), command
    assert {str(f.name) for f in zoo.train.RunConfig.flags("finetune")} - {
        str(f.name) for f in zoo.train.RunConfig.flags("train")
    } == {"lora", "quantize"} | {name for name, _ in fields_flags(zoo.train.GRPOConfig)}  # GRPO trains adapters


# --- a model a user registers ---------------------------------------------------------------------


class _TanhExamples:
    """`{"x", "y"}`: `y = tanh(x @ target)` of normal `x` in 8 inputs, fresh rows each step (a
    `zoo.data.BatchSource`)."""

    def __init__(self, target):
        self.target = target

    def batch_at(self, step, batch_size, *, seed=0, mesh=None, data_axes="data"):
        import numpy as np

        import zoo

        x = np.random.default_rng([seed, step]).normal(size=(batch_size, 8)).astype(np.float32)
        return zoo.data.local_batch({"x": x, "y": np.tanh(x @ self.target)}, mesh=mesh, data_axes=data_axes)


def _user_spec():
    """A 2-output MLP regressor (one hidden layer) of 8 inputs on its own synthetic data, built from the public
    pieces: `zoo.train.Task` and the regression loss and metrics."""
    import jax
    import numpy as np

    import zoo

    def build(config, *, rules, mesh):
        width = int(config.model_config.get("width", 32))
        model = zoo.nn.MLP(8, 2, width, 1, key=jax.random.key(config.seed))  # one hidden layer
        examples = _TanhExamples(np.random.default_rng(config.seed).normal(size=(8, 2)).astype(np.float32))

        return zoo.train.Task(
            model=model,
            kind="regression",
            loss_fn=zoo.train.regression_loss,
            metrics_fn=zoo.train.regression_metrics,
            train_source=examples,
            seed=config.seed,
            eval_data=examples.batch_at(0, config.data.eval_size or 64, seed=config.seed),
            train_data=None,
            data="tanh of a random linear map of 8 inputs",
            unit="examples",
            tokens_per_example=1,
            config={"width": width},
        )

    return zoo.train.ModelSpec(
        name="tiny-regressor",
        help="an MLP with one hidden layer and 2 outputs",
        kind="regression",
        build=build,
        defaults={"train": dict(steps=20, batch_size=32, microbatches=2, lr=1e-2, seq_len=None)},
        datasets={"tanh": "tanh of a random linear map of 8 inputs"},
        dtypes=("float32",),
    )


@pytest.fixture
def user_model(monkeypatch):
    """`tiny-regressor` registered for the test (the registry restored after it)."""
    import zoo
    from zoo.train import _registry

    monkeypatch.setattr(_registry, "_REGISTRY", dict(_registry._REGISTRY))
    return zoo.train.register_model(_user_spec())


def test_a_registered_model_builds_through_build_task_and_the_cli(user_model, tmp_path):
    import zoo

    assert "tiny-regressor" in zoo.train.model_names() and zoo.train.model_spec("tiny-regressor") is user_model
    config = zoo.train.RunConfig(model="tiny-regressor", model_config={"width": 16}).resolved()
    task = zoo.train.build_task(config, rules=None, mesh=None)
    assert task.config == {"width": 16} and task.batch_at(1, 4)["y"].shape == (4, 2)

    info = json.loads(ok("info", "tiny-regressor", "--model-config", "width=16", "--json"))
    assert info["command"] == "train" and info["config"] == {"width": 16}
    shapes = {leaf["path"]: leaf["shape"] for leaf in info["leaves"]}
    assert [8, 16] in shapes.values() or [16, 8] in shapes.values(), shapes
    assert info["totals"]["parameters"] == (8 * 16 + 16) + (16 * 2 + 2)

    report = json.loads(ok("inspect", "tiny-regressor", "--json"))
    assert report["batch_size"] == 32 and report["microbatches"] == 2  # the spec's train defaults
    assert report["summary"]["all_reduce_outside"] == 1 and report["summary"]["all_reduce_in_loop"] == 0

    out = tmp_path / "run"
    ok("train", "tiny-regressor", "--steps", "2", "--eval-size", "32", "--quiet", "--output", out)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["parameters"] == (8 * 32 + 32) + (32 * 2 + 2) and summary["steps"] == 2
    assert json.loads((out / "config.json").read_text())["data"] == "tanh"
    one_line_error(["finetune", "tiny-regressor"], "zoo finetune does not take 'tiny-regressor'")


def test_register_model_refuses_a_bad_spec(user_model):
    import dataclasses

    import zoo

    with pytest.raises(zoo.train.ConfigError, match="already registered; pass replace=True"):
        zoo.train.register_model(user_model)
    assert zoo.train.register_model(user_model, replace=True) is user_model
    for changes, message in [
        (dict(name="a/b"), "without '/'"),
        (dict(kind="ranking"), "kind 'ranking' is not one of"),
        (dict(defaults={"finetune": user_model.defaults["train"]}), "needs a 'train' entry"),
        (dict(defaults={"train": {"steps": 1}}), "the train defaults lack"),
        (dict(defaults={"train": {**user_model.defaults["train"], "lr_decay": 1}}), "hold \\['lr_decay'\\]"),
        (dict(datasets={}), "datasets is empty"),
    ]:
        with pytest.raises(zoo.train.ConfigError, match=message):
            zoo.train.register_model(dataclasses.replace(user_model, **changes), replace=True)


def test_a_registered_model_trains_on_data_files_with_its_own_file_model(monkeypatch, tmp_path):
    """`ModelSpec.file_model` builds the model for `--data FILE`: a registered language model
    gets its own, one without it is refused, and the file's kind must be the model's."""
    import dataclasses

    import zoo
    from zoo.train import _builtin, _registry

    monkeypatch.setattr(_registry, "_REGISTRY", dict(_registry._REGISTRY))
    calls = []

    def small_decoder(config, num_labels, *, rules, mesh):
        calls.append(num_labels)
        config = dataclasses.replace(config, model_config={"d_model": 24, "num_layers": 1})
        return _builtin.decoder_model(config, rules=rules, mesh=mesh)

    base = zoo.train.model_spec("transformer")
    zoo.train.register_model(dataclasses.replace(base, name="my-lm", file_model=small_decoder))
    zoo.train.register_model(dataclasses.replace(base, name="lm-without-files", file_model=None))
    text = tmp_path / "notes.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 20)
    labels = tmp_path / "labels.csv"
    labels.write_text("text,label\n" + "a b,x\nc d,y\n" * 10)

    def build(name, data):
        config = zoo.train.RunConfig(model=name, batch_size=2, data=zoo.train.DataConfig(source=str(data), seq_len=16))
        return zoo.train.build_task(config.resolved(), rules=None, mesh=None)

    task = build("my-lm", text)
    assert calls == [None] and task.config["d_model"] == 24 and task.config["num_layers"] == 1
    assert task.batch_at(1, 2)["tokens"].shape == (2, 16)
    with pytest.raises(zoo.train.ConfigError, match="trains on its own data sets only"):
        build("lm-without-files", text)
    with pytest.raises(zoo.train.ConfigError, match="but my-lm is a language model"):
        build("my-lm", labels)
    with pytest.raises(zoo.train.ConfigError, match="only a model of kind 'lm' or 'classification'"):
        zoo.train.register_model(dataclasses.replace(zoo.train.model_spec("mlp"), file_model=small_decoder),
                                 replace=True)  # fmt: skip


# --- --init and the architecture registry ---------------------------------------------------------


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A tiny random Llama checkpoint (transformers), no tokenizer."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    directory = tmp_path_factory.mktemp("llama")
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


def test_init_is_taken_by_the_spec_whose_class_the_family_builds(llama_dir):
    import zoo

    encoder_families = zoo.train.init_families(zoo.models.Encoder)
    decoder_families = zoo.train.init_families(zoo.models.Transformer)
    assert "bert" in encoder_families and "llama" in decoder_families
    assert set(encoder_families) | set(decoder_families) == set(zoo.hf.families())
    err = one_line_error(["info", "encoder", "--init", llama_dir], "holds a llama checkpoint")
    assert f"encoder takes {' / '.join(encoder_families)} checkpoints" in err and "transformer takes this one" in err
    one_line_error(["finetune", "encoder", "--init", llama_dir, "--steps", "1"], "holds a llama checkpoint")

    info = json.loads(ok("info", "transformer", "--init", llama_dir, "--seq-len", "16", "--json"))
    assert info["init"] == str(llama_dir) and info["config"]["family"] == "llama"
    assert info["config"]["vocab_size"] == 256 and info["config"]["d_model"] == 32
    # The folder alone names the same model (the spec whose --init takes a llama).
    alone = json.loads(ok("info", llama_dir, "--seq-len", "16", "--json"))
    assert alone["leaves"] == info["leaves"] and alone["config"] == info["config"]


# --- info, inspect and train agree -------------------------------------------------------------------


@pytest.mark.parametrize(
    "model, flags",
    [
        ("transformer", SMALL_LM),
        ("encoder", SMALL_LM),
        ("mlp", ["--model-config", "width=16,depth=2"]),  # the session's finished mlp run's model
    ],
)
def test_info_inspect_and_train_build_the_same_model(model, flags, tmp_path):
    """The same flags: `zoo info`'s leaf table, `zoo inspect`'s parameter count and the
    model `zoo train` trained (summary.json; for the Hugging Face models, the saved
    model/ folder read back) hold the same leaves."""
    import equinox as eqx
    import jax

    import zoo
    from zoo._tree import path_str

    info = json.loads(ok("info", model, *flags, "--devices", "2", "--json"))
    report = json.loads(ok("inspect", model, *flags, *RUN[:6], "--json"))
    out = tmp_path / "run"
    ok("train", model, *flags, *RUN, "--steps", "1", "--quiet", "--output", out)
    summary = json.loads((out / "summary.json").read_text())

    assert info["parameters"] == info["totals"]["parameters"] == report["parameters"] == summary["parameters"]
    assert info["config"] == report["config"]
    assert sum(math.prod(leaf["shape"]) for leaf in info["leaves"]) == summary["parameters"]
    if model == "mlp":
        assert info["config"]["width"] == 16 and info["config"]["depth"] == 2
        return
    assert info["config"]["d_model"] == 32 and info["config"]["num_layers"] == 1 and info["config"]["max_len"] == 16
    saved = zoo.hf.from_pretrained(out / "model")  # what train wrote, read back
    shapes = {
        path_str(path): list(x.shape)
        for path, x in jax.tree_util.tree_leaves_with_path(eqx.filter(saved, eqx.is_array))
    }
    info_shapes = {
        leaf["path"].replace("model.encoder.", "model.", 1): leaf["shape"]
        for leaf in info["leaves"]
        if not leaf["path"].startswith("model.head.")  # the classifier's new head is not in model/
    }
    assert info_shapes == shapes


def test_the_docs_model_of_your_own_runs_as_written(tmp_path, monkeypatch):
    """docs/models.md's "A model of your own" block, verbatim, run in a namespace of its own
    (it imports all it uses), then what its last comment says the registered model now does
    in this process: `zoo info` / `inspect` / `train` of it (through the CLI's entry; the
    registry restored after the test)."""
    from pathlib import Path

    from zoo.train import _registry

    monkeypatch.setattr(_registry, "_REGISTRY", dict(_registry._REGISTRY))
    root = Path(__file__).resolve().parent.parent
    text = (root / "docs" / "models.md").read_text()
    block = text.split("A model of your own:\n\n```python\n", 1)[1].split("```", 1)[0]
    exec(compile(block, "docs/models.md", "exec"), {"__name__": "model_of_your_own"})
    out = tmp_path / "run"
    ok("info", "tiny-regressor")
    json.loads(ok("inspect", "tiny-regressor", "--json"))
    ok("train", "tiny-regressor", "--steps", "2", "--quiet", "--output", out)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model"] == "tiny-regressor" and summary["steps"] == 2, summary
    assert summary["collectives"]["gradient_reductions"] == 1, summary["collectives"]


@pytest.mark.parametrize("model", ["transformer", "encoder"])
def test_model_config_remat_auto_by_default_none_turns_it_off(model):
    """The layers' remat through `--model-config`: `"auto"` by default (or named), `none` /
    `null` off, a policy name as given; a wrong name is one line naming them."""
    for given, want in [
        (None, "auto"),
        ("auto", "auto"),
        ("none", None),
        ("null", None),
        ("projections", "projections"),
    ]:
        extra = "" if given is None else f",remat={given}"
        info = json.loads(
            ok("info", model, "--model-config", f"d_model=32,num_layers=1{extra}", "--seq-len", "16", "--json")
        )
        assert info["config"]["remat"] == want, (given, info["config"])
    one_line_error(
        ["info", model, "--model-config", "d_model=32,num_layers=1,remat=sometimes", "--seq-len", "16"],
        "remat must be 'auto', None (no remat) or one of",
    )


def test_info_builds_shapes_alone_and_compiles_no_initialiser():
    """`zoo info` of a model built from scratch reads shapes, dtypes and axes without
    initialising a weight (`zoo.train.abstract_models`): no initialiser is compiled or run,
    so a large config's table costs seconds, not its gigabytes (initialising 0.87B
    parameters held 22 GB and ran for minutes). LoRA branches (DoRA's magnitudes, the norms
    of the base's columns) and a 4-bit base are shapes too; the tables equal the concrete
    model's (`test_info_inspect_and_train_build_the_same_model`)."""
    from helpers import backend_compiles

    # A config no other test builds: an initialiser compiled before would not show here.
    config = ["--model-config", "d_model=64,num_layers=3,num_heads=2,mlp_dim=128,vocab_size=96", "--seq-len", "16"]
    with backend_compiles() as compiled:
        info = json.loads(ok("info", "transformer", *config, "--json"))
        lora = json.loads(
            ok("info", "transformer", *config, "--lora", "r=4,use_dora=true", "--quantize", "nf4", "--json")
        )
    assert "jit(arrays_of)" not in compiled, compiled  # `init_compiled`'s program: the weights initialised
    totals = info["totals"]
    assert info["parameters"] == totals["parameters"] == totals["trainable_parameters"] > 0
    assert totals["bytes"] == 4 * totals["parameters"]
    # The 4-bit base: its projections' codes are bytes, two weights each; the branches train.
    assert "uint8" in {leaf["dtype"] for leaf in lora["leaves"]}
    assert lora["parameters"] == info["parameters"]  # the model's before LoRA, as a run reports
    trained = {leaf["path"].rsplit(".", 1)[1] for leaf in lora["leaves"] if leaf["trainable"]}
    assert trained == {"lora_A", "lora_B", "lora_magnitude_vector"}, trained

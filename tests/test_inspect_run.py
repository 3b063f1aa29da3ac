"""`zoo inspect` with a run's flags compiles that run's training step (`zoo.train.inspect`
builds it as `zoo.train.run` does: the same model, optimizer, placement and batch shapes):
for every rules preset, the collectives it lists (kind, inside or outside a loop, bytes,
mesh axes) are the ones the run's summary.json lists. One tiny decoder run per preset, on
2 or 4 devices, in-process.
"""

import json

import pytest
from helpers import dense_presets, zoo_main, zoo_ok
from tiny_runs import NO_SAMPLE

import zoo

# A tiny decoder (the smallest whose steps keep every preset's budget, which a run holds);
# the optimizer left to the defaults (adamw, clipping at norm 1), which `zoo inspect` must
# take as the run does.
STEP = ["--model-config", "d_model=32,num_layers=2,num_heads=2", "--seq-len", "16"]
STEP += ["--batch-size", "8", "--microbatches", "2"]
# What the run alone takes: its length, held-out set and outputs (no end-of-run sample:
# its generation programs are not the step's).
RUN_ONLY = ["--steps", "1", "--eval-size", "8", "--quiet", *NO_SAMPLE]


# The collectives `zoo inspect` listed for each preset's flags (`STEP`, its layout): the test
# of the step flags reads fsdp's instead of compiling the same step again.
INSPECTED: dict[str, list] = {}


def _layout(preset: str) -> list[str]:
    """Devices and mesh: a `model` axis for the presets that shard over one."""
    if "tp" in preset:
        return ["--devices", "4", "--mesh", "data=2,model=2"]
    return ["--devices", "2"]


@pytest.mark.parametrize("preset", dense_presets())  # the dense transformer: ep is refused for it (tests/test_moe.py)
def test_inspect_lists_the_collectives_of_the_run_with_the_same_flags(preset, tmp_path):
    flags = [*STEP, *_layout(preset), "--rules", preset]
    zoo_ok("train", "transformer", *flags, *RUN_ONLY, "--output", tmp_path / "run")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["sample"] is None  # --sample-tokens 0: no end-of-run sample
    ran = [zoo.Collective.from_json(row) for row in summary["collectives"]["list"]]
    assert any(c.kind == "all-reduce" and not c.in_loop for c in ran), summary["collectives"]
    rc, out, err = zoo_main("inspect", "transformer", *flags, "--against", tmp_path / "run" / "summary.json", "--json")
    assert rc == 0, (rc, err)  # exit 1: the collectives differ from the run's
    inspected = json.loads(out)
    INSPECTED[preset] = inspected["collectives"]
    assert inspected["against"] == {"path": str(tmp_path / "run" / "summary.json"), "added": [], "removed": []}
    key = lambda c: (c.kind, c.in_loop, c.bytes, tuple(c.mesh_axes))  # noqa: E731
    got = sorted(key(zoo.Collective.from_json(row)) for row in inspected["collectives"])
    assert got == sorted(key(c) for c in ran)
    assert inspected["rules"] == preset and inspected["command"] == "train"


def test_inspect_takes_the_step_flags_of_a_run():
    """The flags that shape a run's step (optimizer, clipping, skipping non-finite steps)
    change the inspected step as they change the run's: without clipping (`--clip 0`), no
    global norm is reduced over the sharded gradients of fsdp."""
    base = ["transformer", *STEP, *_layout("fsdp"), "--rules", "fsdp", "--json"]
    clipped = INSPECTED.get("fsdp") or json.loads(zoo_ok("inspect", *base))["collectives"]  # the same step
    plain = json.loads(zoo_ok("inspect", *base, "--clip", "0", "--optimizer", "sgd"))
    assert clipped != plain["collectives"]


def test_inspect_builds_a_model_from_scratch_as_shapes_alone():
    """`zoo.train.inspect` compiles the step of a model built from scratch from its shapes
    alone (`zoo.train.abstract_models`): no weight, branch or optimizer moment is made, so a
    billion-parameter config is inspected in seconds on a laptop (0.87B parameters: 8.9 s,
    0.3 GB, where initialising the model, placing it and the AdamW moments took more than
    24 GB). The collectives are the run's (the preset tests above); the sizes and budget
    are read from the shapes."""
    import jax

    config = zoo.train.RunConfig(
        model="transformer", model_config={"d_model": 32, "num_layers": 2, "num_heads": 2}, devices=2, rules="fsdp",
        batch_size=8, microbatches=2, lora=zoo.lora.LoraConfig(r=4, use_dora=True),
    )  # fmt: skip
    ins = zoo.train.inspect(config)
    for tree in (ins.model, ins.opt_state):
        kinds = {type(x) for x in jax.tree.leaves(tree)}
        assert kinds == {jax.ShapeDtypeStruct}, kinds
    # The placement the run's arrays get: the shapes carry it (fsdp splits the base over data).
    assert any("data" in str(x.sharding.spec) for x in jax.tree.leaves(ins.model))
    sizes = ins.sizes()
    assert 0 < sizes["trainable_bytes"] == sizes["adapter_bytes"] < sizes["model_bytes"]
    budget, budget_sizes = ins.budget()
    assert budget_sizes["parameters"] > budget_sizes["gradients"] > 0
    assert budget.breaches(ins.collectives, budget_sizes) == [], zoo.report(ins.collectives)


def test_info_and_inspect_of_a_finetune_run_need_no_merged_copy(chat_run, llama_dir, tmp_path, monkeypatch):
    """`zoo info RUN` / `zoo inspect RUN` of a `zoo finetune` run, and of a run chained on
    it (its init that run), read only shapes: the base's config.json, found through the
    runs' config.json files. From an empty zoo cache they work and merge nothing (a merged
    adapter changes no shape); they used to want the run merged into the cache first."""
    import shutil

    chained = tmp_path / "chained"  # a run whose init is chat_run (its files, its init changed)
    shutil.copytree(chat_run, chained)
    config = json.loads((chained / "config.json").read_text())
    (chained / "config.json").write_text(json.dumps(config | {"init": str(chat_run)}))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # zoo's cache, empty
    base = json.loads(zoo_ok("info", llama_dir, "--devices", "2", "--json"))
    for run in (chat_run, chained):
        info = json.loads(zoo_ok("info", run, "--devices", "2", "--json"))
        assert info["leaves"] == base["leaves"] and info["parameters"] == base["parameters"]
    step = ["--devices", "2", "--batch-size", "4", "--microbatches", "1", "--seq-len", "32", "--json"]
    inspected = json.loads(zoo_ok("inspect", chained, *step))
    assert inspected["param_bytes"] == base["totals"]["bytes"]
    assert not (tmp_path / "cache" / "zoo" / "merged").exists()

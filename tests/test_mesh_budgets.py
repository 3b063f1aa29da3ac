"""Budgets derive from the mesh: an axis of size 1 communicates nothing.

A data axis of size 1 holds one data replica, so there is no gradient reduction to make;
the budget of a preset on such a mesh (`Preset.budget_on`) expects none, and the CLI's runs
and `zoo inspect --budget` on it compile within it (they exited 4 before step 1). The
compiled steps on these meshes are pinned in tests/data/step_collectives.json.
"""

import json

import pytest
from helpers import zoo_main

import zoo

SMALL_LM = ["--batch-size", "4", "--microbatches", "1", "--seq-len", "16", "--model-config",
            "d_model=32,num_layers=1"]  # fmt: skip


@pytest.mark.parametrize("preset", ["dp", "fsdp", "fsdp-once", "zero1", "tp", "fsdp+tp"])
def test_a_data_axis_of_size_1_expects_no_gradient_reduction(preset):
    mesh = {"data": 1, "model": 2} if "tp" in preset else {"data": 1}
    budget = zoo.preset(preset).budget_on(mesh)
    assert not any("data" in (a.axes or ()) for a in budget.allowances), budget.allowances
    assert all(a.min_count == 0 for a in budget.allowances)
    # On a mesh whose data axis has several devices, the gradient reduction stays required.
    several = zoo.preset(preset).budget_on({"data": 2, "model": 2} if "tp" in preset else {"data": 2})
    assert several.allowances[0].what == "the gradient reduction" and several.allowances[0].min_count == 1
    assert several == zoo.preset(preset).budget  # `budget`: every axis taken to have several devices


def test_a_model_axis_of_size_1_expects_no_tensor_parallelism():
    budget = zoo.preset("tp").budget_on({"data": 4, "model": 1})
    assert [a.what for a in budget.allowances if a.what == "tensor parallelism"] == []
    assert budget.allowances[0].axes == ("data",)


def test_tp_on_data_1_trains_and_inspects_within_its_budget(tmp_path):
    rc, out, err = zoo_main("inspect", "transformer", *SMALL_LM, "--devices", "2", "--rules", "tp", "--mesh",
                            "data=1,model=2", "--budget", "--json")  # fmt: skip
    assert rc == 0, err
    result = json.loads(out)
    assert result["budget"]["within"], result["budget"]
    assert result["collectives"] and all(c["mesh_axes"] == ["model"] for c in result["collectives"])
    rc, _, err = zoo_main("train", "transformer", *SMALL_LM, "--devices", "2", "--rules", "tp", "--mesh",
                          "data=1,model=2", "--steps", "1", "--quiet", "--output", tmp_path / "run")  # fmt: skip
    assert rc == 0, err
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 1

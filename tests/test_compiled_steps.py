"""Every compiled training step communicates what the fixture recorded.

`tests/data/step_collectives.json` holds the collectives (kind, inside/outside loops,
bytes, mesh axes, group size) of the `zoo inspect` models' steps under every preset; a
change to zoo's code that is not meant to change any compiled step must keep them equal.
Regenerate the fixture (only for an intended change) with
`python tests/data/make_step_collectives.py`.
"""

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest

import zoo

_SPEC = importlib.util.spec_from_file_location(
    "make_step_collectives", Path(__file__).parent / "data" / "make_step_collectives.py"
)
make = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(make)

EXPECTED = json.loads(make.FIXTURE.read_text())

# A fast subset that still covers every preset, both modes and a LoRA step; the rest are slow.
_FAST = {
    "transformer/dp/data=8/explicit",
    "transformer/fsdp/data=8/explicit",
    "transformer/fsdp-once/data=8/explicit",
    "encoder/fsdp+tp/data=4,model=2/explicit",
    "transformer/zero1/data=8/explicit",
    "transformer+lora/tp/data=4,model=2/explicit",
    "transformer+dora/dp/data=8/explicit",
    "transformer+embedlora/dp/data=8/explicit",
    "transformer+lora+dpo/fsdp-once/data=8/explicit",
    "transformer+3adapters/dp/data=8/explicit",
    "mlp/dp/data=8/shard_map",
    "mlp/zero1/data=8/shard_map",
    "transformer/tp/data=1,model=2/explicit",
    "transformer/zero1/data=1/explicit",
    "mlp/dp/data=1/shard_map",
}


def _params():
    for case in make.CASES:
        name = make.case_name(*case)
        marks = () if name in _FAST else (pytest.mark.slow,)
        yield pytest.param(case, id=name, marks=marks)


def test_fixture_covers_every_case():
    assert sorted(EXPECTED) == sorted(make.case_name(*c) for c in make.CASES)
    assert _FAST <= set(EXPECTED)


@pytest.mark.parametrize("case", list(_params()))
def test_step_collectives_unchanged_and_within_the_preset_budget(case):
    colls, sizes = make.compile_case(*case)
    got = make.rows(colls)
    want = EXPECTED[make.case_name(*case)]
    assert got == want, (
        f"{make.case_name(*case)}: the compiled step's collectives changed.\n got: {got}\nwant: {want}\n"
        "If the change is intended, regenerate: python tests/data/make_step_collectives.py"
    )
    # The preset's budget on the case's mesh holds its step exactly: its gradient reduction
    # carries the gradients' bytes plus the loss scalars, nothing less and nothing more.
    mesh = case[2]
    budget = zoo.preset(case[1]).budget_on(mesh)
    assert budget.breaches(colls, sizes) == [], zoo.report(colls)
    if mesh["data"] == 1:  # nothing to add up over one data replica: no reduction over data at all
        assert not any("data" in c.mesh_axes for c in colls), zoo.report(colls)
        assert all(a.what == "tensor parallelism" for a in budget.allowances), budget.allowances
        return
    tight = dataclasses.replace(budget.allowances[0], slack=0)
    loose = dataclasses.replace(budget, allowances=(tight,) + budget.allowances[1:])
    assert len(loose.breaches(colls, sizes)) == 1, "the loss scalars ride with the gradients"

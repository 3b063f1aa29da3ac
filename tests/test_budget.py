"""Collective budgets: the promise as a guard every step checks when it compiles.

Each injected violation compiles a real zoo step whose program breaks its budget in a way
users meet (a batch mean in the loss, a reshard that drops the reduced cast, a layer that
gathers the batch, a trainable leaf left out of the cast) and asserts the error names the
collective and the source line that made it.
"""

import functools
import inspect
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import TokenRegressor, data_mesh, drawn_on_host, mse_per_example, on_host
from jax.sharding import PartitionSpec as P

import zoo
from zoo._budget import step_budget

N, M = 4, 2


def _line(fn, text: str) -> str:
    """`file:line` of the first line of `fn`'s source that contains `text`."""
    lines, start = inspect.getsourcelines(fn)
    offset = next(i for i, line in enumerate(lines) if text in line)
    return f"{inspect.getsourcefile(fn).rsplit('/', 1)[-1]}:{start + offset}"


@functools.cache
def _host_regressor():
    """The token regressor with weights drawn by numpy on the host: these tests read the
    step's collectives, which depend on the leaves' shapes, not their values; building it
    and placing it compile nothing (the compile-counting test starts from empty caches)."""
    return drawn_on_host(eqx.filter_eval_shape(TokenRegressor, key=jax.random.key(0)), 0, 0.3, device=False)


@functools.cache
def _host_batch(size):
    """`helpers.token_batch`'s ids and targets, in numpy."""
    ids = np.random.default_rng(size).integers(0, 11, (size, 5)).astype(np.int32)
    y = np.stack([np.sin(ids.sum(1) / 7.0), np.cos(ids[:, 0] / 3.0)], axis=1).astype(np.float32)
    return ids, y


def _step_error(loss_fn, *, budget="default", trainable=eqx.is_inexact_array, preset="dp"):
    """Compile and run one dp step of the token regressor; the BudgetError it raises (or None)."""
    mesh = data_mesh(N)
    with jax.set_mesh(mesh):
        model = zoo.shard(_host_regressor(), zoo.rules(preset), mesh)
        step = zoo.TrainStep(loss_fn, optax.sgd(0.1), microbatches=M, preset=preset, budget=budget, trainable=trainable)
        batch = _host_batch(16)
        try:
            step(model, step.init(model), batch)
        except zoo.BudgetError as e:
            return e, step
        return None, step


def batch_normalised_loss(model, batch):
    losses = mse_per_example(model, batch)
    scale = jax.lax.stop_gradient(jnp.mean(losses))  # a mean over the whole batch: in the loop
    return losses / (1.0 + scale)


def resharded_params_loss(model, batch):
    # "Fixing" the reduced parameters by resharding them to plain replicated arrays.
    model = jax.tree.map(lambda x: jax.reshard(x, P()) if eqx.is_inexact_array(x) else x, model)
    return mse_per_example(model, batch)


class GatheringLayer(eqx.Module):
    """A layer that constrains its activations to be replicated: it gathers the batch."""

    inner: TokenRegressor

    def __call__(self, ids):
        x = self.inner.embed(ids).mean(axis=1)
        x = jax.reshard(x, P())  # the constraint that gathers every row on every device
        return self.inner.mlp(x)


def gathering_layer_loss(model, batch):
    x, y = batch
    return jnp.mean(jnp.square(GatheringLayer(model)(x) - y), axis=-1)


@pytest.mark.parametrize(
    "loss_fn, source",
    [
        (batch_normalised_loss, lambda: _line(batch_normalised_loss, "jnp.mean(losses)")),
        # Plain parameters are reduced where they are used: the model's line that calls the layers.
        (resharded_params_loss, lambda: _line(TokenRegressor.__call__, "self.mlp(self.embed")),
        (gathering_layer_loss, lambda: _line(GatheringLayer.__call__, "jax.reshard(x, P())")),
    ],
    ids=["batch-mean-in-loss", "reshard-drops-reduced", "layer-gathers-batch"],
)
def test_injected_violations_are_refused_naming_their_source_line(loss_fn, source, full_tracebacks):
    error, _ = _step_error(loss_fn)
    assert error is not None, "the step should break the dp budget"
    message = str(error)
    where = source()
    assert where in message, message
    assert "INSIDE a loop over data" in message and "breaks the dp budget" in message, message
    assert "The dp budget allows:" in message and "the gradient reduction: exactly 1" in message, message
    assert error.breaches and all(c.in_loop for b in error.breaches for c in b.collectives if b.stray)
    assert any(where in c.origin for b in error.breaches for c in b.collectives)


def test_a_trainable_leaf_left_out_of_the_reduced_cast_is_refused(monkeypatch, full_tracebacks):
    """zoo's own cast made to skip one leaf: its gradient is reduced every microbatch."""
    import zoo._accumulate as accumulate

    real_cast, real_zeros = accumulate.reduced_cast, accumulate.unreduced_zeros

    def weight(m):
        return m.mlp.output_layer.weight

    def cast_skipping_the_output_layer(params, **kwargs):
        return eqx.tree_at(weight, real_cast(params, **kwargs), weight(params))

    def zeros_plain_for_the_output_layer(view, *args, **kwargs):
        return eqx.tree_at(weight, real_zeros(view, *args, **kwargs), jnp.zeros_like(weight(view)))

    monkeypatch.setattr(accumulate, "reduced_cast", cast_skipping_the_output_layer)
    monkeypatch.setattr(accumulate, "unreduced_zeros", zeros_plain_for_the_output_layer)
    error, _ = _step_error(mse_per_example)
    assert error is not None
    message = str(error)
    # Reduced where it is used: the transpose of the output layer's matmul, called from the model.
    assert "all-reduce INSIDE a loop over data, 128 B, at zoo/nn/_linear.py" in message, message
    assert f"called from tests/{_line(TokenRegressor.__call__, 'self.mlp(self.embed')}" in message, message
    # ... and the gradient reduction after the loop misses exactly that leaf's bytes.
    (short,) = [b for b in error.breaches if not b.stray]
    assert short.problem.startswith("the gradient reduction carries 3,500 B"), short.problem
    assert "exactly 3,624 B (the gradients)" in short.problem and 3624 - 3500 == 4 * 31


def test_within_budget_the_step_says_so_and_budget_none_does_not_check():
    error, step = _step_error(mse_per_example)
    assert error is None
    assert re.fullmatch(r"within the dp budget \(1 all-reduce outside, [\d,]+ B\)", step.budget_verdict)
    error, step = _step_error(batch_normalised_loss, budget=None)
    assert error is None and step.budget_verdict is None


def test_warn_only_warns_and_the_step_runs():
    with pytest.warns(zoo.BudgetWarning, match="breaks the dp budget"):
        error, step = _step_error(batch_normalised_loss, budget=zoo.preset("dp").budget.warn_only())
    assert error is None and step.budget_verdict.startswith("OVER the dp budget")


def test_a_users_own_budget_can_allow_what_the_preset_does_not():
    allow_loop = zoo.Allowance("the batch statistic", ("all-reduce",), "inside", ("data",), count=1, bytes=16)
    budget = zoo.Budget("mine", zoo.preset("dp").budget.allowances + (allow_loop,))
    error, step = _step_error(batch_normalised_loss, budget=budget)
    assert error is None, str(error)
    assert step.budget_verdict.startswith("within the mine budget")


def test_the_guard_compiles_nothing_more(monkeypatch):
    import jax._src.compiler as compiler

    real = compiler.compile_or_get_cached
    calls = []

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(compiler, "compile_or_get_cached", counting)
    counts = {}
    mesh = data_mesh(N)
    for budget, size in (("default", 24), (None, 32)):  # distinct shapes: nothing cached
        with jax.set_mesh(mesh):
            model = zoo.shard(_host_regressor(), zoo.rules("dp"), mesh)
            step = zoo.TrainStep(mse_per_example, optax.sgd(0.1), microbatches=M, budget=budget)
            opt_state = step.init(model)
            batch = _host_batch(size)
            calls.clear()
            for _ in range(2):
                model, opt_state, _loss = step(model, opt_state, batch)
            jax.block_until_ready(model)
            counts[budget] = len(calls)
    assert counts["default"] == counts[None] >= 1, counts


@pytest.mark.parametrize("name", zoo.RULE_PRESETS)
def test_every_preset_carries_a_budget_for_its_layout(name):
    budget = zoo.preset(name).budget
    assert budget.name == name
    what = [a.what for a in budget.allowances]
    assert what[0] == "the gradient reduction" and budget.allowances[0].where == "outside"
    assert budget.allowances[0].axes == ("data",)
    assert ("tensor parallelism" in what) == ("tp" in name)
    assert ("expert parallelism" in what) == name.startswith("ep")
    assert ("the per-use parameter gathers" in what) == (name in ("fsdp", "fsdp+tp", "ep+fsdp"))
    assert ("the parameter gathers" in what) == (name in ("fsdp-once", "zero1"))
    # Nothing but the preset's own tensor-parallel axis may communicate inside loops.
    inside = [a for a in budget.allowances if a.where != "outside"]
    assert all(a.axes in (("data",), ("model",)) for a in inside)
    if name in ("dp", "zero1", "fsdp-once"):
        assert not inside


def test_the_ep_budget_allows_expert_traffic_in_loops_and_no_gradient_reduction_over_model():
    """`ep`: over `model` (the experts' axis) activation traffic inside loops and an
    optimizer's scalars outside them, never a gradient reduction (each device holds its
    experts' whole gradients); over `data` the one gradient all-reduce outside loops."""
    budget = zoo.preset("ep").budget
    sizes = {"gradients": 1000, "parameters": 4000, "scalars": 40}

    def coll(in_loop, size, axes):
        return zoo.Collective("all-reduce", in_loop, size, axes, "x", 2)

    ok = [coll(False, 1008, ("data",)), coll(True, 2048, ("model",)), coll(False, 12, ("model",))]
    assert budget.check(ok, sizes).startswith("within the ep budget")
    for stray in (coll(False, 1000, ("model",)), coll(True, 1008, ("data",))):
        with pytest.raises(zoo.BudgetError):
            budget.check([*ok, stray], sizes)
    on_one_data_device = zoo.preset("ep").budget_on({"data": 1, "model": 2})
    assert on_one_data_device.check(ok[1:], sizes).startswith("within the ep budget")


def test_a_step_without_preset_derives_its_budget_from_its_layout():
    budget = step_budget("x", data_axes=("data",), other_axes=("model",), split_over_data=True)
    assert [a.what for a in budget.allowances] == [
        "the gradient reduction",
        "the per-use parameter gathers",
        "the per-use gradient reductions",
        "tensor parallelism",
    ]
    mesh = data_mesh(N)
    with jax.set_mesh(mesh):
        model = zoo.shard(_host_regressor(), zoo.rules("dp"), mesh)
        step = zoo.TrainStep(mse_per_example, optax.sgd(0.1))
        derived = step.budget_for(model)
    assert [a.what for a in derived.allowances] == [a.what for a in zoo.preset("dp").budget.allowances]


def test_bad_budgets_are_refused_with_the_fix():
    with pytest.raises(TypeError, match="budget must be a zoo.Budget"):
        zoo.TrainStep(mse_per_example, optax.sgd(0.1), budget="dp")
    with pytest.raises(ValueError, match="kinds must be some of"):
        zoo.Allowance("x", ("allreduce",), "outside")
    with pytest.raises(ValueError, match="where must be"):
        zoo.Allowance("x", ("all-reduce",), "in")
    with pytest.raises(ValueError, match="on_breach"):
        zoo.Budget("x", (), on_breach="log")


def test_compare_collectives_names_what_a_change_added_and_removed():

    before = [zoo.Collective("all-reduce", False, 100, ("data",), "a", 8)]
    after = [zoo.Collective("all-reduce", False, 100, ("data",), "b", 8, ("x.py:3 in f",)),
             zoo.Collective("all-reduce", True, 4, ("data",), "c", 8, ("/tmp/loss.py:12 in loss",))]  # fmt: skip
    assert not zoo.compare_collectives(before, before[:1]) and str(zoo.compare_collectives(before, before)) == (
        "the same collectives"
    )
    diff = zoo.compare_collectives(before, after)
    assert diff and diff.added == (after[1],) and diff.removed == ()
    assert str(diff).splitlines()[0] == "+ all-reduce IN LOOP over data, 4 B at /tmp/loss.py:12 in loss"
    back = zoo.compare_collectives(after, before)
    assert back.removed == (after[1],) and str(back).startswith("- all-reduce IN LOOP")
    # JSON round trip, as summary.json and zoo inspect --json hold them.
    assert [zoo.Collective.from_json(c.to_json()) for c in after] == after
    with pytest.raises(TypeError, match="takes the list of Collective"):
        zoo.compare_collectives("HloModule x", after)


# --- every family under every preset: each step within its preset's budget ---------------

# One preset per family in the fast suite (every preset and every family covered); the
# other pairs run in the slow suite.
_FAST_PAIRS = {
    ("llama", "dp"), ("llama_bias_tied", "fsdp"), ("llama3_scaled", "fsdp-once"), ("mistral", "zero1"),
    ("qwen2", "tp"), ("qwen3", "fsdp+tp"), ("gemma", "fsdp+tp"), ("phi3", "tp"), ("phi3_partial", "zero1"), ("olmo2", "tp"),
    ("qwen2_windowed", "dp"), ("smollm3", "fsdp"), ("gemma2", "tp"), ("gemma3_text", "fsdp"),
    ("qwen2_yarn", "fsdp-once"), ("phi3_longrope", "fsdp"),
}  # fmt: skip
# Families whose placed parameters are those of another family under every preset (the same
# paths and partition specs; test_stand_ins_place_their_parameters_as_the_families_they_stand_for;
# phi3's fused projections are split at load): the rest of their step (a banded mask, other
# RoPE frequencies, a per-layer pattern of windows and NoPE layers: scanned data, not a
# parameter) works on activations and adds no collective, so their slow pairs would
# compile the stand-in's program again. Each still compiles its fast pair(s).
# Gemma 3's text decoder holds the parameter kinds of Qwen3 (q/k norms over head_dim, a tied
# head), Gemma (a tied head; its (1 + weight) norms and sqrt(hidden) embedding scale are
# arithmetic on activations) and Gemma 2 (a norm before and after each sub-layer): theirs
# are a subset of its leaves, placed alike under every preset (Qwen3's head_dim 16 of
# another size: llama_bias_tied's head_dim 16 runs every preset); Phi-3's partial rotary
# rotates a slice of each head, no parameter: placed as llama.
_STAND_INS = {
    "llama3_scaled": "llama", "mistral": "llama", "phi3": "llama", "qwen2": "llama_bias_tied",
    "qwen2_windowed": "llama_bias_tied", "smollm3": "llama", "phi3_partial": "llama",
    "qwen3": "gemma3_text", "gemma": "gemma3_text", "gemma2": "gemma3_text",
    "qwen2_yarn": "llama_bias_tied", "phi3_longrope": "llama",
}  # fmt: skip


def _family_cases():
    from helpers import dense_presets
    from test_families import CASES

    for name in CASES:  # dense decoders: tests/test_presets.py runs ep on a mixture of experts
        for preset in dense_presets():
            if (name, preset) in _FAST_PAIRS:
                yield pytest.param(name, preset, id=f"{name}-{preset}")
            elif name not in _STAND_INS:
                yield pytest.param(name, preset, id=f"{name}-{preset}", marks=pytest.mark.slow)


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    """Each family of tests/test_families.py as a tiny transformers model on disk."""
    import torch
    import transformers
    from test_families import CASES

    out = {}
    for i, (name, (cls, values)) in enumerate(CASES.items()):
        torch.manual_seed(i)
        model = transformers.AutoModelForCausalLM.from_config(cls(**values))
        directory = tmp_path_factory.mktemp(name)
        model.save_pretrained(directory)
        out[name] = directory
    return out


def _specs(model, preset):
    """{parameter path: (shape, partition spec)} of `model` placed by `preset`."""
    from helpers import preset_mesh

    specs = zoo.partition_specs(model, zoo.rules(preset), preset_mesh(preset, 8))
    specs = {
        jax.tree_util.keystr(k): s for k, s in jax.tree.leaves_with_path(specs, is_leaf=lambda x: isinstance(x, P))
    }
    leaves = jax.tree.leaves_with_path(eqx.filter(model, eqx.is_array))
    return {jax.tree_util.keystr(k): (leaf.shape, specs.get(jax.tree_util.keystr(k))) for k, leaf in leaves}


def test_stand_ins_place_their_parameters_as_the_families_they_stand_for(family_dirs):
    """What lets the slow family x preset pairs skip a family (`_STAND_INS`): under every
    preset its parameters are placed as its stand-in's (the same specs; shapes too where the
    stand-in has the same sizes). qwen2's biases are a subset of llama_bias_tied's (which
    also has o_proj and MLP biases and another head_dim), as are qwen2_windowed's (3 layers)
    and qwen2_yarn's (its RoPE frequencies are arithmetic on activations);
    smollm3's 4 layers are placed as llama's 2; qwen3's, gemma's and gemma2's leaves are a
    subset of gemma3_text's (3 layers; qwen3's heads 16 wide), their specs the same."""
    # The vocabulary padded as placing it on 8 devices would (a multiple of 8 splits it under every preset).
    names = {*_STAND_INS, *_STAND_INS.values()}
    models = {n: zoo.hf.from_pretrained(family_dirs[n], config_overrides={"vocab_multiple": 8}) for n in names}
    for preset in zoo.RULE_PRESETS:
        for name, stand_in in _STAND_INS.items():
            ours, theirs = _specs(models[name], preset), _specs(models[stand_in], preset)
            assert ours.keys() <= theirs.keys(), (name, preset, ours.keys() - theirs.keys())
            if name in ("qwen2", "qwen2_windowed", "qwen2_yarn", "qwen3", "gemma", "gemma2"):
                assert ours.keys() < theirs.keys()
                assert {k: s for k, (_, s) in ours.items()} == {k: theirs[k][1] for k in ours}, (name, preset)
            elif name == "smollm3":  # 4 layers (its pattern needs them) on llama's 2: the same specs
                assert ours.keys() == theirs.keys()
                assert {k: s for k, (_, s) in ours.items()} == {k: s for k, (_, s) in theirs.items()}, (name, preset)
            else:
                assert ours == theirs, (name, preset)


@pytest.mark.parametrize("name, preset", list(_family_cases()))
def test_every_family_step_is_within_its_preset_budget(name, preset, family_dirs):
    from helpers import lm_batch, preset_mesh
    from test_families import VOCAB

    from zoo._jit import ONCE_COMPILER_OPTIONS

    mesh = preset_mesh(preset, 8)
    with jax.set_mesh(mesh):
        model = zoo.hf.from_pretrained(family_dirs[name], rules=zoo.rules(preset), mesh=mesh)
        step = zoo.TrainStep(zoo.models.next_token_loss, optax.adamw(1e-3), microbatches=M, preset=preset)
        batch = on_host(lm_batch(jax.random.key(0), 2 * M * mesh.shape["data"], seq=8, vocab=VOCAB))
        compiled = step.lower(model, step.init(model), batch).compile(compiler_options=ONCE_COMPILER_OPTIONS)
        colls = zoo.collectives(compiled)
        budget, sizes = step.budget_for(model), step.budget_sizes(model)
    assert budget.name == preset
    assert budget.breaches(colls, sizes) == [], budget.report(colls, sizes)
    assert zoo.count(colls, "all-reduce", in_loop=False) >= 1


def test_a_run_over_budget_stops_before_its_first_step_exit_4(monkeypatch, tmp_path):
    from helpers import zoo_main

    # A budget that allows nothing: the run's one gradient all-reduce breaks it.
    monkeypatch.setattr(zoo.Preset, "budget", property(lambda self: zoo.Budget("nothing-allowed", ())))
    rc, out, err = zoo_main("train", "mlp", "--steps", "2", "--devices", "4", "--output", tmp_path / "run")
    assert rc == 4, err
    assert err.startswith("zoo: error: the compiled training step breaks the nothing-allowed budget:"), err
    assert "all-reduce outside loops over data" in err and "no allowance admits it" in err
    assert not (tmp_path / "run" / "summary.json").exists()

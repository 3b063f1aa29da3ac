"""LoRA on a mixture of experts' expert weights (peft 0.21's `target_parameters`): both
ways with peft on transformers 5's Mixtral and Qwen3-MoE (the same logits; the merged
export opened by transformers), peft's `all-linear` adapter refused by name, the training
step under `dp` and `ep` (one gradient all-reduce outside every loop; the update = one
device's), decoding (`zoo.generate` = the merged model) and serving (`zoo.serve.Engine`: expert and
attention adapters and the bare base in one batch, each = `zoo.generate` alone; its
refusals)."""

import dataclasses
import functools
import json

import equinox as eqx
import jax
import numpy as np
import optax
import peft
import pytest
import torch
import transformers
from helpers import assert_rounding_close, backend_compiles, largest, lm_batch
from test_families import _check, _hf_logits, _torch, forward
from test_moe import (  # noqa: F401  (module fixtures)
    CASES,
    _moe_config,
    _open_hf,
    hf_dirs,
    sgd_reference,
    tokens,
)

import zoo
from zoo.lora import LoraConfig, LoraExpertLinear, add_lora, load_adapter, merge, save_adapter
from zoo.models import Transformer

# torch on one thread (conftest.torch_one_thread): its references are tiny models.
pytestmark = pytest.mark.usefixtures("torch_one_thread")

EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@pytest.fixture(scope="module")
def byte_mixtral(tmp_path_factory):
    """A tiny random transformers Mixtral on disk, its 300 ids room for zoo's byte
    tokenizer (no tokenizer.json: the command line reads text as bytes); the command-line
    tests only read it."""
    directory = tmp_path_factory.mktemp("byte-mixtral")
    torch.manual_seed(0)
    sizes = dict(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)
    experts = dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    hf_config = transformers.MixtralConfig(**sizes, **experts)
    transformers.AutoModelForCausalLM.from_config(hf_config).save_pretrained(directory)
    return directory


@functools.cache  # built once per file: the tests only read them
def _moe_model(**overrides):
    return Transformer(_moe_config(**overrides), key=jax.random.key(0))


def _peft_on(directory, **values):
    """peft's LoRA (random A and B: init_lora_weights=False) on the transformers model."""
    torch.manual_seed(5)
    return peft.get_peft_model(_open_hf(directory), peft.LoraConfig(init_lora_weights=False, **values)).eval()


@pytest.mark.numerics
@pytest.mark.parametrize("name", list(CASES))
def test_expert_lora_both_ways_with_peft(name, hf_dirs, tokens, tmp_path):  # noqa: F811
    """peft's expert branches (one rank-r branch per expert on `gate_up_proj` and
    `down_proj`, nested wrappers) load into zoo with peft's logits; zoo's (on gate, up,
    down: written as block-structured rank-2r on `gate_up_proj`; on up alone; on
    `gate_up_proj` alone, as peft names it) open in peft with zoo's logits and reload
    exactly; merged, transformers opens the export with the same logits."""
    base = zoo.hf.from_pretrained(hf_dirs[name])
    mask = np.ones(tokens.shape, bool)
    with torch.no_grad():  # the bare model's logits, for the test that the branches change them
        plain = _open_hf(hf_dirs[name])(_torch(tokens), attention_mask=_torch(mask)).logits.numpy()
    made = _peft_on(hf_dirs[name], r=2, lora_alpha=4, target_modules=["q_proj"], target_parameters=EXPERT_PARAMETERS)
    made.save_pretrained(tmp_path / "p")
    loaded, config = load_adapter(base, tmp_path / "p")
    assert sorted(config.target_parameters) == sorted(EXPERT_PARAMETERS)  # peft writes a set's order
    assert sorted(zoo.lora.modules(loaded, LoraExpertLinear)) == [
        f"layers.layers.mlp.{p}" for p in ("down", "gate", "up")
    ]
    want = _hf_logits(made, tokens, mask)
    assert largest(want.f64 - plain) > 0.05  # the experts' branches change the logits
    diff = _check(forward(loaded, tokens, mask), want, mask, f"{name} expert LoRA peft → zoo")
    print(f"MAX DIFF {name} expert LoRA peft → zoo {diff:.2e}")
    for targets in (["gate", "up", "down"], ["up"], ["mlp.experts.gate_up_proj"]):
        config = LoraConfig(
            r=2, lora_alpha=4, target_modules=["q_proj"], target_parameters=targets, init_lora_weights=False
        )
        adapted = add_lora(base, config, key=jax.random.key(3))
        save_adapter(adapted, config, tmp_path / "z")
        opened = peft.PeftModel.from_pretrained(_open_hf(hf_dirs[name]), tmp_path / "z").eval()
        got = forward(adapted, tokens, mask)
        diff = _check(got, _hf_logits(opened, tokens, mask), mask, f"{name} expert LoRA {targets} zoo → peft")
        print(f"MAX DIFF {name} expert LoRA {targets} zoo → peft {diff:.2e}")
        back, _ = load_adapter(base, tmp_path / "z")
        np.testing.assert_array_equal(np.asarray(forward(back, tokens, mask)), np.asarray(got))
        zoo.hf.save_pretrained(merge(adapted), tmp_path / "merged")
        reference = _hf_logits(_open_hf(tmp_path / "merged"), tokens, mask)
        diff = _check(got, reference, mask, f"{name} expert LoRA {targets} merged export")
        print(f"MAX DIFF {name} expert LoRA {targets} merged export {diff:.2e}")


def test_peft_all_linear_on_experts_is_refused_by_name(hf_dirs, tmp_path):  # noqa: F811
    """peft's `all-linear` on a transformers-5 Mixtral adds the router's `gate.weight` and
    `gate_up_proj` at rank 2r (its v4 → v5 conversion; keys under
    `mlp.experts.base_layer.lora_*`): refused, saying why and what to train instead."""
    made = _peft_on(hf_dirs["mixtral"], r=2, target_modules="all-linear")
    made.save_pretrained(tmp_path)
    assert any(".mlp.experts.base_layer.lora_A" in k for k in made.state_dict())
    with pytest.raises(ValueError, match=r"\['gate.weight'\] match no expert weight.*router's weight.*all-linear"):
        load_adapter(zoo.hf.from_pretrained(hf_dirs["mixtral"]), tmp_path)
    with pytest.raises(ValueError, match=r"name them in target_parameters, as peft does"):
        add_lora(_moe_model(), LoraConfig(target_modules=["down"]), key=jax.random.key(1))
    with pytest.raises(ValueError, match=r"target_parameters .*does not work with lora_dropout"):
        LoraConfig(target_parameters=["down"], lora_dropout=0.1)


LAYOUTS = {"dp": ("dp", (2, 1)), "ep": ("ep", (2, 2)), "ep+fsdp": ("ep+fsdp", (2, 2))}


@functools.cache  # one reference program for the three layouts: the same model, batch and rate
def _expert_lora_step():
    """`(model, flags, batch, lr, sgd_reference(...))` of the layout tests: LoRA on
    attention and every expert projection."""
    config = LoraConfig(
        r=2, target_modules=["q_proj", "v_proj"], target_parameters=["gate", "up", "down"], init_lora_weights=False
    )
    model = add_lora(_moe_model(), config, key=jax.random.key(1))
    flags = zoo.lora.trainable(model, config)
    batch, lr = lm_batch(jax.random.key(2), 8, vocab=32), 0.5
    return model, flags, batch, lr, sgd_reference(model, batch, lr, flags)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_expert_lora_step_keeps_one_all_reduce_and_equals_one_device(layout):
    """A LoRA step with branches on attention and every expert projection, 2 microbatches,
    under `dp` (data 2) and `ep` (data 2 x model 2: the experts and their branches split
    over `model`): the compiled step's only collective over `data` is one all-reduce
    outside every loop (the rest: `ep`'s expert traffic over `model`, in the loop), the
    branches lie where their base experts do, and the SGD update equals one device's.
    Under `ep+fsdp` (every weight also split over `data`) the step is within that preset's
    budget (fsdp's per-use gathers and per-microbatch reduce-scatters over `data`) and its
    update equals one device's too."""
    preset, (data, width) = LAYOUTS[layout]
    model, flags, batch, lr, (loss, params, want) = _expert_lora_step()
    assert flags.layers.layers.mlp.down.lora_A and not flags.layers.layers.mlp.down.base.weight
    mesh = jax.make_mesh((data, width), ("data", "model"), devices=jax.devices()[: data * width])
    with jax.set_mesh(mesh):
        sharded = zoo.shard(model, zoo.rules(preset), mesh)
        if preset.startswith("ep"):
            for leaf in ("lora_A", "lora_B"):
                assert jax.typeof(getattr(sharded.layers.layers.mlp.up, leaf)).sharding.spec[1] == "model"
        step = zoo.TrainStep(zoo.models.next_token_loss, optax.sgd(lr), microbatches=2, preset=preset, trainable=flags)
        opt_state = step.init(sharded)
        compiled = step.compile(sharded, opt_state, batch)  # raises if over the preset's budget
        new_model, _, got_loss = compiled(sharded, opt_state, batch)
    colls = zoo.collectives(compiled)
    on_data = [(c.kind, c.in_loop, c.mesh_axes) for c in colls if "data" in c.mesh_axes]
    assert step.budget_verdict.startswith(f"within the {preset} budget"), step.budget_verdict
    if preset != "ep+fsdp":
        assert on_data == [("all-reduce", False, ("data",))], zoo.report(colls)
    assert all(c.mesh_axes == ("model",) and c.in_loop for c in colls if "data" not in c.mesh_axes), zoo.report(colls)
    sums = {"terms": 8 * 8, "depth": 2 * (2 * 6 + 1)}
    assert_rounding_close(got_loss, loss, **sums)
    got = eqx.filter(eqx.partition(new_model, flags)[0], eqx.is_array)
    step_size = max(
        largest(np.asarray(w, np.float64) - np.asarray(p))
        for w, p in zip(jax.tree.leaves(want), jax.tree.leaves(params))
    )
    assert step_size > 0
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert_rounding_close(g, w, **sums, scale=max(largest(w), step_size))


def test_generate_with_expert_lora_is_the_merged_models():
    """`zoo.generate` with expert branches decodes the merged model's tokens (dense and
    sorted dispatch alike)."""
    config = LoraConfig(
        r=2, target_modules=["q_proj"], target_parameters=["gate", "up", "down"], init_lora_weights=False
    )
    prompts = np.array([[3, 5, 7, 9], [4, 6, 8, 10]], np.int32)
    zero = dataclasses.replace(config, init_lora_weights=True)  # B = 0: merged, the base's weights
    for dispatch in ("dense", "sorted"):
        base = _moe_model(max_len=16, moe_dispatch=dispatch)
        adapted = add_lora(base, config, key=jax.random.key(2))
        got = np.asarray(zoo.generate(adapted, prompts, max_new_tokens=6))
        np.testing.assert_array_equal(got, np.asarray(zoo.generate(merge(adapted), prompts, max_new_tokens=6)))
        # The bare base as `merge` returns it with zero branches: its weights bit for bit, and
        # its arrays placed as the merged model's are (jax compiles one program for both).
        bare = merge(add_lora(base, zero, key=jax.random.key(2)))
        for b, w in zip(
            jax.tree.leaves(eqx.filter(bare, eqx.is_array)),
            jax.tree.leaves(eqx.filter(base, eqx.is_array)),
            strict=True,
        ):
            np.testing.assert_array_equal(np.asarray(b), np.asarray(w))
        assert not np.array_equal(got, np.asarray(zoo.generate(bare, prompts, max_new_tokens=6)))


def test_the_engine_serves_expert_lora_beside_attention_lora_and_the_base(hf_dirs, tmp_path):  # noqa: F811
    """`zoo.serve.Engine` on a Mixtral with two peft adapters (one with LoRA on the experts,
    `target_parameters`, one on attention only) and the bare base in one mixed batch: each
    request gets `zoo.generate`'s tokens with its adapter alone; the bank holds expert room
    because an adapter given has expert branches; unloading the expert adapter and loading
    another in its slot while requests run compiles nothing."""
    from serving import alone

    from zoo.serve import Engine, Request

    base = zoo.hf.from_pretrained(hf_dirs["mixtral"])
    made = {
        "experts": dict(r=2, lora_alpha=4, target_modules=["q_proj"], target_parameters=EXPERT_PARAMETERS),
        "attention": dict(r=3, lora_alpha=6, target_modules=["k_proj", "o_proj"]),
    }
    for name, values in made.items():
        _peft_on(hf_dirs["mixtral"], **values).save_pretrained(tmp_path / name)
    models = {name: load_adapter(base, tmp_path / name)[0] for name in made}
    config = LoraConfig(r=4, lora_alpha=4, target_modules=[], target_parameters=["up"], init_lora_weights=False)
    other = add_lora(base, config, key=jax.random.key(7))  # experts alone, another rank
    engine = Engine(base, slots=3, max_len=32, adapters={n: tmp_path / n for n in made}, max_adapters=3)
    assert {f"layers.layers.mlp.{p}" for p in ("gate", "up", "down")} <= set(engine.bank.layers)
    engine.warm_up(tune=False)
    before = dict(engine.compiles)
    rng = np.random.default_rng(0)
    # Prompts of 5 and 3 tokens side by side in each batch; each adapter's of one length, so
    # that its reference below (zoo.generate alone, a program per model and prompt length)
    # is one program: the engine's programs are the same for any mix.
    plan = [(5, "experts"), (3, "attention"), (5, None), (5, "experts"), (3, "attention"), (3, None)]
    requests = [Request(rng.integers(3, 61, size=n).tolist(), max_tokens=6, adapter=a) for n, a in plan]
    with backend_compiles() as seen:
        handles = [engine.submit(r) for r in requests[:2]]
        engine.step()
        handles += [engine.submit(r) for r in requests[2:]]
        engine.step()
        assert engine.unload_adapter("experts") == 2  # its requests finish with it; its slot drains
        assert engine.load_adapter("again", tmp_path / "experts") == 2  # the same adapter read again
        handles.append(engine.submit(Request(requests[0].prompt, max_tokens=6, adapter="again")))
        engine.run_until_done()
    assert engine.compiles == before and seen == []
    assert engine.bank.names == [None, "attention", "again"]
    # Other shapes (rank 4, the up projection alone): the engine builds no program either
    # (XLA's count would show the finiteness check of the new adapter's arrays).
    assert engine.load_adapter("other", other) == 0
    late = [engine.submit(Request(requests[i].prompt, max_tokens=6, adapter="other")) for i in (0, 3)]
    late.append(engine.submit(Request(requests[1].prompt, max_tokens=6)))
    engine.run_until_done()
    assert engine.compiles == before
    models |= {"again": models["experts"], "other": other, None: base}
    changed = 0
    for handle in handles + late:  # each request's tokens: its adapter's model alone
        assert handle.ids == alone(models[handle.request.adapter], handle.request), handle.request
        changed += handle.request.adapter is not None and handle.ids != alone(base, handle.request)
    assert changed >= 5, "the adapters should change most requests' tokens"


@pytest.mark.timeout(120)
def test_cli_lora_parameters_give_the_engine_expert_room(byte_mixtral, tmp_path, monkeypatch):
    """`zoo serve --lora-targets none --lora-parameters gate_up_proj+down_proj`: the engine
    holds adapter room on the experts alone and serves an expert adapter there; an adapter
    with attention LoRA beside is refused in one line (the server is not started, nor
    warmed up: what the tests above check)."""
    from helpers import zoo_main

    import zoo.serve

    base = zoo.hf.from_pretrained(byte_mixtral)
    for name, targets in (("experts", []), ("both", ["q_proj"])):
        config = LoraConfig(r=2, target_modules=targets, target_parameters=["gate", "up", "down"])
        save_adapter(add_lora(base, config, key=jax.random.key(1)), config, tmp_path / name)
    engines = []
    monkeypatch.setattr(zoo.serve, "serve", lambda server, **_: engines.append(server.engine))
    monkeypatch.setattr(zoo.serve.Engine, "warm_up", lambda self, *a, **k: None)
    flags = ["--lora-targets", "none", "--lora-parameters", "gate_up_proj+down_proj", "--max-lora-rank", "2"]
    rc, _, err = zoo_main("serve", byte_mixtral, *flags, "--adapter", f"experts={tmp_path / 'experts'}")
    assert rc == 0, err
    (engine,) = engines
    assert sorted(engine.bank.layers) == [f"layers.layers.mlp.{p}" for p in ("down", "gate", "up")]
    assert engine.adapters == ["experts"]
    rc, _, err = zoo_main("serve", byte_mixtral, *flags, "--adapter", f"both={tmp_path / 'both'}")
    assert rc != 0 and "no adapter room" in err and "q_proj" in err and len(err.strip().splitlines()) == 1, err


def test_grpo_rollouts_serve_an_expert_lora_policy():
    """GRPO's rollout engine over a policy with expert branches (beside q_proj's, or alone)
    holds room where the policy has branches, experts included, and decodes its tokens as
    `zoo.generate` does with the policy."""
    from serving import alone

    from zoo.serve import Request
    from zoo.train._grpo import POLICY, _engine

    base = _moe_model(max_len=16)
    for targets in (["q_proj"], []):
        config = LoraConfig(r=2, target_modules=targets, target_parameters=["gate", "down"], init_lora_weights=False)
        policy = add_lora(base, config, key=jax.random.key(4))
        engine = _engine(policy, jax.devices()[0], slots=2, max_len=16)
        want = {"layers.layers.mlp.gate", "layers.layers.mlp.down"} | {f"layers.layers.attention.{t}" for t in targets}
        assert set(engine.bank.layers) == want
        handle = engine.submit(Request([3, 5, 7, 9], max_tokens=6, adapter=POLICY))
        engine.run_until_done()
        assert handle.ids == alone(policy, handle.request) != alone(base, handle.request)


def test_the_engines_refusals_of_expert_lora():
    """The bank refuses, saying the fix: an expert adapter where it holds no expert room, an
    expert rank above its max, expert room on the sorted dispatch (one folded weight for
    every row); the stacked expert branches refuse to fold into one weight, and to merge."""
    from zoo.serve import Engine

    config = LoraConfig(
        r=2, target_modules=["q_proj"], target_parameters=["gate", "up", "down"], init_lora_weights=False
    )
    base = _moe_model(max_len=16)
    experts = add_lora(base, config, key=jax.random.key(2))
    attention = add_lora(base, LoraConfig(r=2, target_modules=["v_proj"]), key=jax.random.key(3))
    engine = Engine(base, slots=2, adapters={"attention": attention}, max_adapters=2, max_lora_rank=2)
    assert not any(n.startswith("layers.layers.mlp") for n in engine.bank.layers)  # no expert room asked for
    with pytest.raises(ValueError, match=r"LoRA on the expert weights .* no adapter room.*--lora-parameters"):
        engine.load_adapter("experts", experts)
    assert engine.adapters == ["attention"]
    only = add_lora(base, LoraConfig(r=2, target_modules=[], target_parameters=["up"]), key=jax.random.key(4))
    narrow = Engine(base, slots=2, max_adapters=1, max_lora_rank=1, lora_targets=(), lora_parameters=["gate", "up"])
    assert sorted(narrow.bank.layers) == ["layers.layers.mlp.gate", "layers.layers.mlp.up"]
    with pytest.raises(ValueError, match=r"rank 2 \(at 'layers.layers.mlp.up'\) is above the server's max LoRA rank 1"):
        narrow.load_adapter("experts", only)
    layer = narrow.bank.model.layers.layers.mlp.gate
    assert isinstance(layer, zoo.lora.MultiLoraExpertLinear) and layer.lora_A.shape == (2, 1, 4, 16, 1)
    with pytest.raises(ValueError, match="moe_dispatch='dense'"):
        layer.stacked(np.float32)
    with pytest.raises(ValueError, match="several adapters' expert branches"):
        merge(narrow.bank.model)
    sorted_base = _moe_model(max_len=16, moe_dispatch="sorted")
    with pytest.raises(ValueError, match="expert LoRA room needs the dense token dispatch"):
        Engine(
            sorted_base, slots=2, adapters={"e": add_lora(sorted_base, config, key=jax.random.key(2))}, max_lora_rank=2
        )


def test_zoo_finetune_trains_expert_lora_that_peft_opens(byte_mixtral, tmp_path):
    """`zoo finetune --lora ...,parameters=gate_up_proj+down_proj` on a Mixtral trains
    branches on the experts (and q_proj); the run's adapter names them in
    `target_parameters` and peft opens it on the transformers model with zoo's logits. Its
    metrics.jsonl holds no `aux_loss`: the Mixtral does not train its router's loss."""
    from helpers import zoo_main
    from tiny_runs import TINY

    lora = "r=2,targets=q_proj,parameters=gate_up_proj+down_proj"
    loud = [f for f in TINY if f != "--quiet"]  # the header names the adapted layers
    flags = ["--init", byte_mixtral, "--lora", lora, *loud, "--steps", "3", "--output", tmp_path / "run"]
    rc, out, err = zoo_main("finetune", "transformer", *flags)
    assert rc == 0, err
    assert " Linear layers (down, gate, q_proj, up): " in out, out  # the experts' layers named too
    # A mixture of experts' run without the router's loss term (transformers' default: this
    # Mixtral's config.json leaves output_router_logits false) writes no `aux_loss` in
    # metrics.jsonl (a run with the term: test_moe.py::test_a_training_run_logs_the_router_loss_per_step).
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    base = zoo.hf.from_pretrained(byte_mixtral)
    assert not base.config.output_router_logits
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2, 3]
    assert not any("aux_loss" in r for r in rows), rows
    adapter = tmp_path / "run" / "adapter"
    values = json.loads((adapter / "adapter_config.json").read_text())
    assert values["target_parameters"] == EXPERT_PARAMETERS
    assert values["target_modules"] == [f"model.layers.{i}.self_attn.q_proj" for i in (0, 1)]
    ids = np.random.default_rng(0).integers(0, 300, (2, 8)).astype(np.int32)
    mask = np.ones(ids.shape, bool)
    loaded, _ = load_adapter(base, adapter)
    trained = loaded.layers.layers.mlp.down.lora_B
    assert np.abs(np.asarray(trained)).max() > 0  # B starts at zero: the experts' branches trained
    opened = peft.PeftModel.from_pretrained(_open_hf(byte_mixtral), adapter).eval()
    _check(forward(loaded, ids, mask), _hf_logits(opened, ids, mask), mask, "finetuned expert LoRA zoo → peft")

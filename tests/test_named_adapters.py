"""Several adapters on one base. Named adapters against peft: per-row routing vs peft's
`adapter_names=` (the bare base included), multi-adapter folders both ways,
`add_weighted_adapter` (linear, cat, svd) vs peft's, mixed-adapter `zoo.generate` vs
per-adapter runs and peft's generate, one compile for any mix; add / select / disable /
delete; the clear errors. Several adapters trained in one step over one frozen base (issue
27 item 5): each row of the batch trains its own adapter (`zoo.lora.routed`), equal to
training each adapter alone on its own rows; saved as one peft folder per adapter."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import peft
import pytest
import safetensors.numpy
import torch
import transformers
from helpers import ACCURACY_MARGIN, assert_tree_rounding_close, backend_compiles, data_mesh, largest, lm_batch
from test_peft import BERT, DECODER, GPT2, is_adapter, perturb

import zoo
from zoo.lora import (
    LoraConfig,
    adapter,
    adapter_names,
    adapter_norms,
    add_adapter,
    add_lora,
    clip_per_adapter,
    route,
    routed,
    set_adapter,
    stack_adapters,
    trainable,
)

TOLERANCE = 1e-5  # of the largest value: issue 27's bound
MEASURED: dict[str, float] = {}  # docs/lora.md's table (`pytest -s` prints it)
TOKENS = np.random.default_rng(3).integers(1, 32, (4, 6))
MIX = ["default", "b", "__base__", "b"]  # peft's names per row
MIX_INDEX = [0, 1, -1, 1]

# family → (transformers class, config, adapter "default"'s targets, adapter "b"'s targets)
FAMILIES = {
    "llama": ("LlamaForCausalLM", DECODER | {"max_position_embeddings": 16}, ["q_proj", "v_proj"],
              ["q_proj", "down_proj", "o_proj"]),
    "gpt2": ("GPT2LMHeadModel", GPT2, ["c_attn"], ["c_attn", "c_fc"]),
    "bert": ("BertModel", BERT, ["query", "value"], ["query", "key", "intermediate.dense"]),
}  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def report():
    yield
    for what, diff in sorted(MEASURED.items()):
        print(f"{what}: {diff:.1e}")


def relative(got, want, what: str, tolerance: float = TOLERANCE) -> float:
    """max|got − want| / max|want|, recorded under `what`, at most `tolerance`."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    got = got[..., : want.shape[-1]]  # a vocabulary padded for tensor parallelism
    assert got.shape == want.shape, (what, got.shape, want.shape)
    diff = largest(got - want) / largest(want)
    MEASURED[what] = max(diff, MEASURED.get(what, 0.0))
    assert diff <= tolerance, f"{what}: {diff:.3g} of the largest value > {tolerance}"
    return diff


@functools.cache
def hf_base(family: str, root: str) -> str:
    """A tiny random (perturbed) Hugging Face model saved under `root`."""
    cls, config, _, _ = FAMILIES[family]
    torch.manual_seed(0)
    model = getattr(transformers, cls)(transformers.AutoConfig.for_model(family, **config))
    folder = f"{root}/{family}"
    perturb(model, 1).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("named"))


@functools.cache
def peft_pair(family: str, root: str, rslora: bool = False):
    """A peft model holding adapters "default" (r=2) and "b" (r=4, other targets and
    scaling), every adapter leaf perturbed, saved with save_pretrained; and zoo's base."""
    cls, _, first, second = FAMILIES[family]
    folder = hf_base(family, root)
    hf = getattr(transformers, cls).from_pretrained(folder)
    torch.manual_seed(2)
    model = peft.get_peft_model(hf, peft.LoraConfig(r=2, lora_alpha=4, target_modules=first, use_rslora=rslora))
    model.add_adapter("b", peft.LoraConfig(r=4, lora_alpha=3, target_modules=second, use_rslora=rslora))
    perturb(model, 2, is_adapter)
    model.eval()
    saved = f"{root}/{family}-peft{'-rs' if rslora else ''}"
    model.save_pretrained(saved)
    return model, saved, zoo.hf.from_pretrained(folder)


def peft_run(model, tokens=TOKENS, **kwargs):
    with torch.no_grad():
        out = model(input_ids=torch.tensor(tokens), attention_mask=torch.ones(tokens.shape, dtype=torch.long), **kwargs)
    return (out.logits if hasattr(out, "logits") else out.last_hidden_state).numpy()


@jax.jit
def routed_forward(model, tokens, index):
    return route(model, index)(tokens)


@eqx.filter_jit
def _forward(model, tokens):
    return model(tokens)


def zoo_run(model, tokens=TOKENS):
    return np.asarray(_forward(model, jnp.asarray(tokens)))


@pytest.mark.numerics
@pytest.mark.parametrize("family", FAMILIES)
def test_mixed_batch_and_folders_both_ways_vs_peft(family, root, tmp_path):
    model, saved, base = peft_pair(family, root)
    # peft folder (default at the root, "b" in b/) → zoo
    zm, configs = zoo.lora.load_adapters(base, saved)
    assert adapter_names(zm) == ("default", "b") and configs["b"].r == 4
    want = peft_run(model, adapter_names=MIX)
    got = np.asarray(routed_forward(zm, jnp.asarray(TOKENS), jnp.asarray(MIX_INDEX)))
    relative(got, want, f"{family}: routed forward vs peft adapter_names (peft folder → zoo)")
    # each row equals its adapter alone, and the bare base
    alone = {
        "default": zoo_run(zoo.lora.adapter(zm, "default")),
        "b": zoo_run(set_adapter(zm, "b")),
        "__base__": zoo_run(set_adapter(zm, None)),
    }
    for row, name in enumerate(MIX):
        relative(got[row], alone[name][row], f"{family}: mixed batch vs each adapter alone (zoo)", 1e-6)
    # zoo → peft folder (save_adapters), opened as peft opens several adapters
    zoo.lora.save_adapters(zm, configs, tmp_path / "z")
    assert (tmp_path / "z/adapter_config.json").is_file() and (tmp_path / "z/b/adapter_config.json").is_file()
    hf = getattr(transformers, FAMILIES[family][0]).from_pretrained(hf_base(family, root))
    opened = peft.PeftModel.from_pretrained(hf, tmp_path / "z")
    opened.load_adapter(tmp_path / "z/b", adapter_name="b")
    opened.eval()
    relative(got, peft_run(opened, adapter_names=MIX), f"{family}: routed forward vs peft adapter_names (zoo → peft)")
    # and back: zoo's own folder loads to the same model
    again, _ = zoo.lora.load_adapters(base, tmp_path / "z")
    np.testing.assert_array_equal(np.asarray(routed_forward(again, jnp.asarray(TOKENS), jnp.asarray(MIX_INDEX))), got)


def peft_tensors(model, name, tmp_path):
    model.save_pretrained(tmp_path / "pw", selected_adapters=[name])
    return safetensors.numpy.load_file(tmp_path / "pw" / name / "adapter_model.safetensors")


def svd_exact(model, adapters, weights, svd_rank) -> dict[str, np.ndarray]:
    """peft module name → the float64 rank-`svd_rank` SVD truncation of Σ w·ΔW (`[out, in]`)."""
    exact = {}
    for name, module in model.named_modules():
        present = [(a, w) for a, w in zip(adapters, weights) if a in getattr(module, "lora_A", {})]
        if not present:
            continue
        delta = sum(w * module.get_delta_weight(a).detach().double().numpy() for a, w in present)
        delta = delta.T if module.fan_in_fan_out else delta
        u, s, vh = np.linalg.svd(delta)
        r = svd_rank or max(model.peft_config[a].r for a in adapters)
        exact[f"{name}"] = (u[:, :r] * s[:r]) @ vh[:r]
    return exact


# Each family with each combination it takes (linear: one rank, on Llama), and svd both with
# its default rank (the adapters' largest, on BERT) and a rank given (Llama 3, GPT-2's
# block-diagonal c_attn 6): every (family, kind), (kind, rank) and (family, rank) pair. A
# Llama svd at the default rank would meet no pair these do not (the same truncation, to 4).
@pytest.mark.numerics
@pytest.mark.parametrize(
    ("family", "kind", "svd_rank"),
    [("llama", "linear", None), ("llama", "cat", None), ("llama", "svd", 3),
     ("bert", "cat", None), ("bert", "svd", None), ("gpt2", "cat", None), ("gpt2", "svd", 6)],
)  # fmt: skip
def test_weighted_adapter_vs_peft(family, kind, svd_rank, root, tmp_path):
    model, saved, base = peft_pair(family, root)
    zm, configs = zoo.lora.load_adapters(base, saved)
    name = f"w-{kind}-{svd_rank}"
    # linear needs one rank: "b" with itself (peft allows it; the sign handling exercised)
    adapters, weights = (["default", "b"], [0.7, -0.4]) if kind != "linear" else (["b", "b"], [0.7, -0.4])
    model.add_weighted_adapter(adapters, weights, name, combination_type=kind, svd_rank=svd_rank)
    zm, config = zoo.lora.add_weighted_adapter(zm, adapters, weights, name, kind, svd_rank, configs=configs)
    try:
        model.set_adapter(name)
        want = peft_run(model)
    finally:
        model.set_adapter("default")
        model.delete_adapter(name)
    got = zoo_run(set_adapter(zm, name))
    relative(got, want, f"{family}: add_weighted_adapter {kind} outputs vs peft")
    # the combined branches as each writes them (peft's names and layout)
    zoo.lora.save_adapters(zm, configs | {name: config}, tmp_path / "z")
    ours = safetensors.numpy.load_file(tmp_path / "z" / name / "adapter_model.safetensors")
    model.add_weighted_adapter(adapters, weights, name, combination_type=kind, svd_rank=svd_rank)
    try:
        theirs = peft_tensors(model, name, tmp_path)
    finally:
        model.delete_adapter(name)
    assert sorted(ours) == sorted(theirs)
    exact = svd_exact(model, adapters, weights, svd_rank) if kind == "svd" else {}
    for key in (k for k in theirs if "lora_A" in k):
        b = key.replace("lora_A", "lora_B")
        if kind == "svd":  # singular vectors carry a sign of their own: B·A, as accurate as peft's
            want = exact[key.removesuffix(".lora_A.weight")]
            zoo_error = largest(ours[b] @ ours[key] - want) / largest(want)
            peft_error = largest(theirs[b] @ theirs[key] - want) / largest(want)
            for who, error in (("zoo", zoo_error), ("peft", peft_error)):
                what = f"{family}: svd combined B·A, {who}'s error vs a float64 SVD"
                MEASURED[what] = max(error, MEASURED.get(what, 0.0))
            assert zoo_error <= max(ACCURACY_MARGIN * peft_error, 1e-6), (key, zoo_error, peft_error)
            relative(ours[b] @ ours[key], theirs[b] @ theirs[key], f"{family}: {kind} combined B·A vs peft's", 1e-4)
        elif family == "gpt2":  # zoo writes c_attn's q/k/v branches block-diagonal (rank 3r): B·A
            relative(ours[b] @ ours[key], theirs[b] @ theirs[key], f"{family}: {kind} combined B·A vs peft's")
        else:
            relative(ours[key], theirs[key], f"{family}: {kind} combined A vs peft's")
            relative(ours[b], theirs[b], f"{family}: {kind} combined B vs peft's")


@pytest.mark.numerics
def test_weighted_adapter_rslora_scaling_as_peft(root):
    """The sources use rsLoRA; the combined adapter's scaling is 1 (r = lora_alpha, use_rslora
    off: the sources' scalings are inside A and B), as peft 0.22 on (up to 0.21 it kept the
    first config's use_rslora, scaling the result by √r once more)."""
    model, saved, base = peft_pair("llama", root, rslora=True)
    zm, configs = zoo.lora.load_adapters(base, saved)
    model.add_weighted_adapter(["default", "b"], [1.0, 1.0], "w", combination_type="cat")
    try:
        model.set_adapter("w")
        want = peft_run(model)
    finally:
        model.set_adapter("default")
        model.delete_adapter("w")
    zm, config = zoo.lora.add_weighted_adapter(zm, ["default", "b"], [1.0, 1.0], "w", "cat", configs=configs)
    assert configs["default"].use_rslora and not config.use_rslora and config.r == 6 and config.scaling == 1.0
    relative(zoo_run(set_adapter(zm, "w")), want, "llama: add_weighted_adapter cat rsLoRA vs peft")


def generate_settings():
    return dict(max_new_tokens=5, eos_token_id=None)


# 8 prompts: one row per device of the mesh test's data axis (none reaches the eos id 1 in 5
# tokens, where peft's generate would stop). A mix of every adapter and the bare base, twice.
PROMPTS = np.random.default_rng(8).integers(1, 32, (8, 5))
GEN_MIX = MIX * 2


@functools.cache
def named_llama(root: str):
    """zoo's Llama holding peft_pair's adapters "default" and "b" (both generate tests')."""
    _, saved, base = peft_pair("llama", root)
    return zoo.lora.load_adapters(base, saved)[0]


@pytest.mark.numerics
def test_generate_mixed_adapters_one_program_equal_to_each_alone_and_peft(root):
    model = peft_pair("llama", root)[0]
    zm = named_llama(root)
    with backend_compiles() as names:
        mixed = np.asarray(zoo.generate(zm, PROMPTS, adapter_names=GEN_MIX, **generate_settings()))
        first = sum("_generate_program" in n for n in names)
        other = np.asarray(
            zoo.generate(zm, PROMPTS, adapter_names=["b", 0, None, "default"] * 2, **generate_settings())
        )
        again = sum("_generate_program" in n for n in names) - first
    assert first == 1 and again == 0, names
    alone = {
        "default": np.asarray(zoo.generate(set_adapter(zm, "default"), PROMPTS, **generate_settings())),
        "b": np.asarray(zoo.generate(set_adapter(zm, "b"), PROMPTS, **generate_settings())),
        "__base__": np.asarray(zoo.generate(set_adapter(zm, None), PROMPTS, **generate_settings())),
    }
    for row, name in enumerate(GEN_MIX):
        np.testing.assert_array_equal(mixed[row], alone[name][row])
    for row, name in enumerate(["b", "default", "__base__", "default"] * 2):
        np.testing.assert_array_equal(other[row], alone[name][row])
    assert len({tuple(alone[n][1, 5:]) for n in alone}) > 1  # the adapters choose differently
    with torch.no_grad():
        theirs = model.generate(
            input_ids=torch.tensor(PROMPTS), adapter_names=GEN_MIX, do_sample=False, max_new_tokens=5, pad_token_id=0
        )
    np.testing.assert_array_equal(mixed, theirs.numpy())


@functools.cache
def tiny():
    from helpers import tiny_decoder

    return tiny_decoder(jax.random.key(0))


def tiny_adapter(r, targets, seed, **kw):
    return add_lora(
        tiny(), LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, init_lora_weights=False, **kw),
        key=jax.random.key(seed),
    )  # fmt: skip


@pytest.mark.numerics
def test_add_select_disable_delete():
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 32, (2, 8)))
    plain = tiny_adapter(2, ("q_proj",), 1)
    config_b = LoraConfig(r=3, lora_alpha=6, target_modules=("v_proj", "down"), init_lora_weights=False)
    m = add_adapter(plain, "b", config_b, key=jax.random.key(2))
    assert adapter_names(m) == ("default", "b")  # a plain LoRA model's adapter is peft's "default"
    b_alone = add_lora(tiny(), config_b, key=jax.random.key(2))
    # the active adapter stays "default" (peft's add_adapter does not activate the new one)
    relative(zoo_run(m, tokens), zoo_run(plain, tokens), "set_adapter: default", 1e-6)
    relative(zoo_run(set_adapter(m, "b"), tokens), zoo_run(b_alone, tokens), "set_adapter: b", 1e-6)
    relative(zoo_run(set_adapter(m, None), tokens), zoo_run(tiny(), tokens), "disabled: the bare base", 1e-6)
    first = add_adapter(tiny(), "only", config_b, key=jax.random.key(2))  # a bare base gets its first
    assert adapter_names(first) == ("only",)
    relative(zoo_run(first, tokens), zoo_run(b_alone, tokens), "bare base + add_adapter", 1e-6)
    left = zoo.lora.delete_adapter(m, "default")
    assert adapter_names(left) == ("b",)
    relative(zoo_run(set_adapter(left, "b"), tokens), zoo_run(b_alone, tokens), "after delete_adapter", 1e-6)
    gone = zoo.lora.delete_adapter(left, "b")
    assert not zoo.lora.modules(gone, zoo.lora.MultiLoraLinear)
    np.testing.assert_array_equal(zoo_run(gone, tokens), zoo_run(tiny(), tokens))
    # unload drops every named adapter too (unmerge passes MultiLoraLinear layers as they are)
    np.testing.assert_array_equal(zoo_run(zoo.lora.unload(m), tokens), zoo_run(tiny(), tokens))


def test_bad_input_one_clear_error_each():
    m = add_adapter(
        tiny_adapter(2, ("q_proj",), 1), "b", LoraConfig(r=4, target_modules=("q_proj",)), key=jax.random.key(2)
    )
    tokens = np.zeros((2, 4), np.int32)
    with pytest.raises(ValueError, match="no adapter named 'c': this model holds \\['default', 'b'\\]"):
        set_adapter(m, "c")
    with pytest.raises(ValueError, match="adapter_names\\[1\\]: no adapter named 'c'"):
        zoo.generate(m, tokens, max_new_tokens=1, adapter_names=["b", "c"])
    with pytest.raises(ValueError, match="adapter_names\\[0\\] = 2 is out of range: this model holds 2 adapters"):
        zoo.generate(m, tokens, max_new_tokens=1, adapter_names=[2, 0])
    with pytest.raises(ValueError, match="one adapter per prompt \\(2\\)"):
        zoo.generate(m, tokens, max_new_tokens=1, adapter_names=["b"])
    with pytest.raises(ValueError, match="adapter index 5 is out of range"):
        route(m, [0, 5])
    with pytest.raises(ValueError, match="holds no named adapters"):
        zoo.generate(tiny(), tokens, max_new_tokens=1, adapter_names=["b", "b"])
    with pytest.raises(ValueError, match="'linear' needs adapters of one rank"):
        zoo.lora.add_weighted_adapter(m, ["default", "b"], [1, 1], "w", "linear")
    with pytest.raises(ValueError, match="no adapter named \\['c'\\]"):
        zoo.lora.add_weighted_adapter(m, ["default", "c"], [1, 1], "w")
    with pytest.raises(ValueError, match="combination_type 'ties' is not supported"):
        zoo.lora.add_weighted_adapter(m, ["default", "b"], [1, 1], "w", "ties")
    with pytest.raises(ValueError, match="an adapter named 'b' exists already"):
        add_adapter(m, "b", LoraConfig(r=2), key=jax.random.key(0))
    with pytest.raises(ValueError, match="is a DoRA adapter"):
        add_adapter(m, "d", LoraConfig(r=2, target_modules=("q_proj",), use_dora=True), key=jax.random.key(0))
    with pytest.raises(ValueError, match="named adapters stack plain LoRA branches on Linear layers"):
        add_adapter(m, "e", LoraConfig(r=2, target_modules=("token_embedding",)), key=jax.random.key(0))


def test_generate_mixed_adapters_on_a_mesh_equals_one_device(root):
    """dp, tp, fsdp: the per-row adapter index is split over data like the batch. The model
    and prompts of the test above: its one-device program gives the reference here too."""
    from helpers import preset_mesh

    zm = named_llama(root)
    names = ["default", "b", "__base__", "b", "default", None, 1, 0]
    want = np.asarray(zoo.generate(zm, PROMPTS, adapter_names=names, **generate_settings()))
    for preset in ("dp", "tp", "fsdp"):
        mesh = preset_mesh(preset, 8)
        with jax.set_mesh(mesh):
            out = zoo.generate(zoo.shard(zm, zoo.rules(preset), mesh), PROMPTS, adapter_names=names,
                               **generate_settings())  # fmt: skip
            assert out.sharding.spec[0] == "data"
        np.testing.assert_array_equal(np.asarray(out), want, err_msg=preset)


# --------------------------------------------------------------------------- several adapters trained in one step

# Three adapters of different ranks, scalings and targets (every leaf perturbed:
# init_lora_weights=False gives B random too).
CONFIGS = {
    "a": LoraConfig(r=4, lora_alpha=8, target_modules=("q_proj", "v_proj"), init_lora_weights=False),
    "b": LoraConfig(r=2, lora_alpha=3, target_modules=("down", "q_proj"), init_lora_weights=False),
    "c": LoraConfig(r=3, lora_alpha=6, target_modules="all-linear", init_lora_weights=False),
}
BATCH, DEVICES, MICRO = 12, 2, 2
LR = 0.1  # 0.5 is past where this tiny model's 10 SGD steps stay well-conditioned
# Rounding (helpers.rounding_bound) as tests/test_lora.py's tiny decoder: the loss and
# gradient sums run over one step's 12 x 8 tokens, 2 layers of ~6 chained sums plus the head.
GRADIENTS = {"terms": BATCH * 8, "depth": 2 * (2 * 6 + 1)}


@functools.cache
def singles():
    base = tiny()
    return {n: add_lora(base, c, key=jax.random.key(i + 1)) for i, (n, c) in enumerate(CONFIGS.items())}


def batches(steps: int) -> list[dict[str, np.ndarray]]:
    """`steps` batches, each row's adapter drawn at random (every adapter present in each,
    with uneven counts of rows and of tokens)."""
    rng = np.random.default_rng(0)
    out = []
    for t in range(steps):
        b = {k: np.asarray(v) for k, v in lm_batch(jax.random.key(100 + t), BATCH).items()}
        index = np.concatenate([np.arange(3), rng.integers(0, 3, BATCH - 3)])
        b["adapter"] = rng.permutation(index).astype(np.int32)
        b["adapter_norm"] = adapter_norms(b["adapter"], b["mask"][:, 1:].sum(axis=1), len(CONFIGS))
        out.append(b)
    return out


def k_run(optimizer, steps: int):
    """All adapters in one step on DEVICES devices x MICRO microbatches."""
    model = stack_adapters(singles())
    mesh = data_mesh(DEVICES)
    with jax.set_mesh(mesh):
        model = zoo.shard(model, zoo.rules("dp"), mesh)
        step = zoo.TrainStep(routed(zoo.models.next_token_loss), optimizer, microbatches=MICRO,
                             trainable=trainable(model), preset="dp")  # fmt: skip
        opt = step.init(model)
        models, losses = [], []
        for b in batches(steps):
            model, opt, loss = step(model, opt, b)
            models.append(model)
            losses.append(float(loss))
    return models, losses


@functools.cache
def alone_step(name: str):
    """Adapter `name`'s one-device, one-microbatch TrainStep: its loss-and-gradients program
    serves every optimizer (`alone_run` applies the optimizer apart, as the step does)."""
    return zoo.TrainStep(zoo.models.next_token_loss, optax.sgd(LR), trainable=trainable(singles()[name]))


@eqx.filter_jit
def _apply(optimizer, params, grads, opt_state):
    """A TrainStep's update on one device: the optimizer's updates, applied."""
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def alone_run(name: str, optimizer, steps: int):
    """Adapter `name` alone, on its own rows of each batch, one device, one microbatch."""
    step = alone_step(name)
    params, frozen = step.partition(singles()[name])
    k = list(CONFIGS).index(name)
    opt = optimizer.init(params)
    models, losses = [], []
    for b in batches(steps):
        # Its rows, then the others' as padding (mask 0: no target counts): one shape, one compile.
        order = np.argsort(b["adapter"] != k, kind="stable")
        rows = {"tokens": b["tokens"][order], "mask": b["mask"][order] & (b["adapter"][order] == k)[:, None]}
        loss, grads = step.loss_and_grads(eqx.combine(params, frozen), rows)
        params, opt = _apply(optimizer, params, grads, opt)
        models.append(eqx.combine(params, frozen))
        losses.append(float(loss))
    return models, losses


OPTIMIZERS = {
    "sgd": (lambda: optax.sgd(LR), lambda: optax.sgd(LR)),
    # A limit below the gradients' norms: every step clips each adapter at its own norm.
    "clip+sgd": (lambda: optax.chain(clip_per_adapter(0.05), optax.sgd(LR)),
                 lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(LR))),
    "adamw": (lambda: optax.adamw(1e-2, weight_decay=0.1), lambda: optax.adamw(1e-2, weight_decay=0.1)),
}  # fmt: skip
# ~100 s each on 2 cores: AdamW (elementwise, as SGD) runs with the slow tests.
OPTIMIZER_CASES = ["sgd", "clip+sgd", pytest.param("adamw", marks=pytest.mark.slow)]


STEPS = 10
DIFFS: dict[str, float] = {}  # the measured differences, printed with -s


@pytest.mark.numerics
@pytest.mark.parametrize("opt", OPTIMIZER_CASES)
def test_k_adapters_in_one_step_equal_each_adapter_trained_alone(opt):
    """SGD (and per-adapter clipping, and AdamW, elementwise: its moments stacked per
    adapter), after 1 and after 10 steps: each adapter of the K-adapter run (2 devices x
    2 microbatches) equals that adapter trained alone on its rows (one device), within
    float32 rounding; the step's loss is the sum of the adapters' own losses."""
    together, losses = k_run(OPTIMIZERS[opt][0](), STEPS)
    alone_losses = np.zeros(STEPS)
    for name in CONFIGS:
        alone, own = alone_run(name, OPTIMIZERS[opt][1](), STEPS)
        alone_losses += own
        for steps in (1, STEPS):
            got = eqx.filter(adapter(together[steps - 1], name), trainable(alone[0]))
            want = eqx.filter(alone[steps - 1], trainable(alone[0]))
            # Each step adds one gradient's rounding (lr x it, below the adapters' scale).
            assert_tree_rounding_close(got, want, terms=GRADIENTS["terms"], depth=steps * GRADIENTS["depth"],
                                       what=f"{opt} {steps} steps, adapter {name}")  # fmt: skip
            diff = max(
                largest(np.asarray(g) - np.asarray(w)) for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want))
            )
            DIFFS[f"{opt}/{steps}/{name}"] = diff
    print({k: f"{v:.2g}" for k, v in DIFFS.items() if k.startswith(opt)})
    np.testing.assert_allclose(losses, alone_losses, rtol=1e-5)


@eqx.filter_jit
def _clipped_norms(models):
    """Each adapter's norm after `clip_per_adapter(1.0)` of a gradient of ones on every
    adapter's own entries (zero in the padding, as real ones): one program, not ~100 ops.
    `models`: `singles()`, an argument (built inside the trace, the cache would hold tracers)."""
    ones = {n: jax.tree.map(lambda x: jnp.ones_like(x) if eqx.is_inexact_array(x) else x, m) for n, m in models.items()}
    model = stack_adapters(ones)
    params = eqx.filter(model, trainable(model))
    grads = params
    clipped, _ = clip_per_adapter(1.0).update(grads, clip_per_adapter(1.0).init(params))
    return {name: optax.tree.norm(eqx.filter(adapter(clipped, name), eqx.is_array)) for name in CONFIGS}


def test_clip_per_adapter_clips_each_adapter_at_its_own_norm():
    for name, norm in _clipped_norms(singles()).items():
        assert abs(float(norm) - 1.0) < 1e-6, (name, float(norm))
    with pytest.raises(ValueError, match="outside the stacked adapters"):
        clip_per_adapter(1.0).update({"head": jnp.ones(3)}, optax.EmptyState())


def test_adapter_norms_weigh_each_adapter_by_its_own_count():
    norms = adapter_norms(np.array([0, 0, 1, -1, 2]), np.array([3.0, 1.0, 2.0, 4.0, 0.0]), 3)
    # total 10: adapter 0 counts 4, adapter 1 counts 2, adapter 2 counts nothing, -1 the bare base.
    np.testing.assert_array_equal(norms, np.array([2.5, 2.5, 5.0, 0.0, 0.0], np.float32))
    with pytest.raises(ValueError, match="out of range"):
        adapter_norms(np.array([0, 3]), None, 3)
    with pytest.raises(ValueError, match="no 'adapter' field"):
        routed(zoo.models.next_token_loss)(stack_adapters(singles()), {"tokens": np.zeros((2, 8), np.int32)})


def test_pinned_k_adapter_steps_reduce_all_k_adapters_once_and_nothing_of_the_base():
    """tests/data/step_collectives.json's 3-adapter steps (recompiled and compared by
    tests/test_compiled_steps.py): under dp one all-reduce outside every loop, carrying
    three times the one-adapter step's gradient bytes (same targets and rank) plus the
    loss's 8 B; under fsdp-once no reduction in a loop, the adapters' bytes and scalars."""
    import json
    from pathlib import Path

    pinned = json.loads((Path(__file__).parent / "data" / "step_collectives.json").read_text())
    one = pinned["transformer+lora/dp/data=8/explicit"]
    dp = pinned["transformer+3adapters/dp/data=8/explicit"]
    assert len(one) == 1 and len(dp) == 1 and not dp[0]["in_loop"] and dp[0]["kind"] == "all-reduce"
    adapter_bytes = one[0]["bytes"] - 8  # the inspect LoRA's trainable bytes
    assert dp[0]["bytes"] == 3 * adapter_bytes + 8
    once = pinned["transformer+3adapters/fsdp-once/data=8/explicit"]
    reduces = [r for r in once if r["kind"] in ("all-reduce", "reduce-scatter")]
    assert not [r for r in once if r["in_loop"]]
    # + the loss's 8 B and the per-adapter norms' partial sums (split gradients: 3 x 8 B)
    assert sum(r["bytes"] for r in reduces) == 3 * adapter_bytes + 8 + 3 * 8


@pytest.mark.numerics
def test_each_adapter_saves_as_its_own_peft_folder_with_the_same_outputs(tmp_path):
    """Two adapters of different configs on a tiny random Llama (transformers): each
    `save_adapter(adapter(model, name), config, folder)` opens in peft
    (`PeftModel.from_pretrained`) with the outputs zoo's routed rows of that adapter give."""
    import peft
    import transformers
    from test_peft import TOKENS, assert_close, hf_folder, hf_outputs

    folder = hf_folder("llama", str(tmp_path / "hf"))
    base = zoo.hf.from_pretrained(folder)
    configs = {
        "q": LoraConfig(r=4, lora_alpha=8, target_modules=("q_proj", "v_proj"), init_lora_weights=False),
        "all": LoraConfig(r=2, lora_alpha=3, target_modules="all-linear", init_lora_weights=False),
    }
    model = stack_adapters({n: add_lora(base, c, key=jax.random.key(i)) for i, (n, c) in enumerate(configs.items())})
    forward = eqx.filter_jit(lambda m, tokens, index: zoo.lora.route(m, index)(tokens))
    for k, (name, config) in enumerate(configs.items()):
        zoo.lora.save_adapter(adapter(model, name), config, tmp_path / name)
        ours = np.asarray(forward(model, jnp.asarray(TOKENS), jnp.full(len(TOKENS), k, jnp.int32)))
        hf = transformers.LlamaForCausalLM.from_pretrained(folder)
        opened = peft.PeftModel.from_pretrained(hf, tmp_path / name)
        assert_close(ours, hf_outputs(opened), f"adapter {name} in peft")

"""PiSSA and OLoRA initialisations against peft: the same branch and residual base from
the same weight; adapters both ways, as they are (the residual recomputed from the
original base on load) and converted to adapters of the original base
(`path_initial_model_for_weight_conversion`); the clear errors."""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import safetensors.numpy
import torch
import transformers
from helpers import UNIT_ROUNDOFF, Reference, assert_as_accurate, largest
from test_dora import compare_opened, hf_run, outputs, relative, report  # noqa: F401  (report: the measured table)
from test_peft import TOKENS, assert_close, hf_folder, hf_outputs, is_adapter, perturb

import zoo
from zoo.lora import LoraConfig, add_lora, load_adapter, save_adapter

pytestmark = pytest.mark.numerics

# family → (transformers class, AutoPeftModel class, zoo targets, peft targets, a target's zoo path, its HF module)
FAMILIES = {
    "llama": ("LlamaForCausalLM", "AutoPeftModelForCausalLM", ("q_proj", "down"), ["q_proj", "down_proj"],
              lambda m: m.layers.layers.attention.q_proj, lambda h: h.model.layers[1].self_attn.q_proj),
    # peft's olora_init takes a Conv1D's [in, out] weight as if it were [out, in]: PiSSA only.
    "gpt2": ("GPT2LMHeadModel", "AutoPeftModelForCausalLM", ("c_fc", "c_proj"), ["c_fc", "c_proj"],
             lambda m: m.layers.layers.mlp.up, lambda h: h.transformer.h[1].mlp.c_fc),
    "bert": ("BertModel", "AutoPeftModelForFeatureExtraction", ("query", "value"), ["query", "value"],
             lambda m: m.layers.layers.attention.q_proj, lambda h: h.encoder.layer[1].attention.self.query),
}  # fmt: skip
# Adapters as they are apply to a residual each side recomputes by its own float32 SVD / QR.
AS_IS = 1e-4
TASK = {"llama": "CAUSAL_LM", "gpt2": "CAUSAL_LM", "bert": "FEATURE_EXTRACTION"}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("hf"))


def trained(model, seed=5):
    """`model` with its branches moved as training would (A and B, every layer)."""
    branches, rest = eqx.partition(model, zoo.lora.trainable(model))
    rng = np.random.default_rng(seed)
    moved = jax.tree.map(lambda x: x + 0.05 * largest(x) * rng.standard_normal(x.shape).astype(np.float32), branches)
    return eqx.combine(moved, rest)


def torch_weight(layer):
    """A torch layer's weight as zoo holds it, `[in, out]` (a Conv1D's is already)."""
    w = layer.weight.detach().numpy()
    return w if type(layer).__name__ == "Conv1D" else w.T


def float64_init(weight, init, scaling, r=2):
    """peft's PiSSA / OLoRA of a `[in, out]` weight in float64 (numpy): (A `[in, r]`, B `[r, out]`, residual)."""
    wt = weight.astype(np.float64).T
    if init == "pissa":
        v, s, uh = np.linalg.svd(wt, full_matrices=False)
        root = np.sqrt(s[:r] / scaling)
        a_t, b_t = root[:, None] * uh[:r], v[:, :r] * root[None]
    else:
        q, rr = np.linalg.qr(wt)
        a_t, b_t = rr[:r], q[:, :r]
    return a_t.T, b_t.T, weight - scaling * (b_t @ a_t).T


def check_init(family, init, root, tmp_path):
    cls, auto, zoo_targets, peft_targets, zoo_layer, hf_layer = FAMILIES[family]
    folder = hf_folder(family, root)
    hf_class = getattr(transformers, cls)
    original = zoo.hf.from_pretrained(folder)
    config = LoraConfig(r=2, lora_alpha=4, target_modules=zoo_targets, init_lora_weights=init)
    initial = add_lora(original, config, key=jax.random.key(0))

    # The same branch and residual as peft's for the same weight (layer 1 of the stack).
    made = peft.get_peft_model(
        hf_class.from_pretrained(folder),
        peft.LoraConfig(r=2, lora_alpha=4, target_modules=peft_targets, init_lora_weights=init, task_type=TASK[family]),
    )
    ours, theirs = zoo_layer(initial), hf_layer(made.base_model.model)
    a, b = np.asarray(ours.lora_A[1]), np.asarray(ours.lora_B[1])
    a_ref, b_ref = theirs.lora_A.default.weight.detach().numpy().T, theirs.lora_B.default.weight.detach().numpy().T
    signs = np.sign(np.sum(a * a_ref, axis=0))  # singular vectors / QR columns: each up to a sign
    weight = torch_weight(hf_layer(hf_class.from_pretrained(folder)))
    exact = float64_init(weight, init, config.scaling)
    # The residual W - s·BA of a float32 SVD / QR is backward stable: within a modest multiple
    # of n·u·‖W‖₂ of the exact one (n the larger side), whichever library ran it; allowed: 8×.
    # peft's own error can be far smaller by luck: under `make test-numerics`' AVX2-only
    # kernels, Llama's 16×16 layer: peft 1.7e-7, zoo 2.0e-6 = 2.9·n·u·‖W‖₂.
    backward = 8 * max(weight.shape) * UNIT_ROUNDOFF * float(np.linalg.norm(weight.astype(np.float64), 2))
    # PiSSA's A and B are singular vectors scaled by √(σ/s): a backward error ε moves them by
    # up to ε / (the smallest gap between σ_1..σ_r+1) times that scale (Wedin's theorem).
    sv = np.linalg.svd(weight.astype(np.float64), compute_uv=False)
    vectors = backward / np.min(-np.diff(sv[: config.r + 1])) * np.sqrt(sv[0] / config.scaling)
    vectors = vectors if init == "pissa" else 0.0
    for value, peft_value, exact_value, what, floor in (
        (np.asarray(ours.base.weight[1]), torch_weight(theirs.base_layer), exact[2], "residual base", backward),
        (a * signs, a_ref, exact[0] * np.sign(np.sum(exact[0] * a_ref, axis=0)), "A", vectors),
        (b * signs[:, None], b_ref, exact[1] * np.sign(np.sum(exact[0] * a_ref, axis=0))[:, None], "B", vectors),
    ):
        # As accurate as peft's float32 decomposition (both are a float32 SVD / QR of the weight).
        assert_as_accurate(
            value, Reference(peft_value, exact_value), floor=floor, what=f"{init} {family} initial {what}"
        )
        relative(value, peft_value, f"{init} {family} initial A, B, residual base", tolerance=1e-3)
    np.testing.assert_allclose(outputs(initial), outputs(original), atol=1e-5 * largest(outputs(original)))

    # zoo → peft: as it is (peft decomposes the original base again), and converted.
    save_adapter(initial, config, tmp_path / "initial")
    model = trained(initial)
    save_adapter(model, config, tmp_path / "as_is")
    assert json.loads((tmp_path / "as_is/adapter_config.json").read_text())["init_lora_weights"] == init
    save_adapter(model, config, tmp_path / "converted", path_initial_model_for_weight_conversion=tmp_path / "initial")
    values = json.loads((tmp_path / "converted/adapter_config.json").read_text())
    assert values["init_lora_weights"] is True and values["r"] == 4 and values["lora_alpha"] == 8
    expected = outputs(model)
    assert not np.allclose(expected, outputs(original), atol=1e-3)
    opened = peft.PeftModel.from_pretrained(hf_class.from_pretrained(folder), tmp_path / "as_is")
    relative(expected, hf_outputs(opened).f32, f"{init} {family} outputs zoo → peft (as is)", tolerance=AS_IS)
    compare_opened(
        expected, tmp_path / "converted", hf_class, folder, auto, f"{init} {family} outputs zoo → peft (converted)"
    )
    # ... and back into zoo, onto the original base: as it is and converted.
    for folder_name in ("as_is", "converted"):
        loaded, _ = load_adapter(original, tmp_path / folder_name)
        relative(outputs(loaded), expected, f"{init} {family} zoo → zoo ({folder_name})", tolerance=AS_IS)

    # peft → zoo: as peft saves it (zoo decomposes the original base), and converted.
    torch.manual_seed(3)
    perturb(made, 3, is_adapter)
    made.save_pretrained(tmp_path / "peft_as_is")
    reference = hf_outputs(made)
    loaded, loaded_config = load_adapter(original, tmp_path / "peft_as_is")
    assert loaded_config.init_lora_weights == init
    # zoo's residual is its own float32 decomposition, peft's its own: they differ by as much as
    # each differs from the exact one (asserted above), so the outputs by a few times 1e-6.
    relative(outputs(loaded), reference.f32, f"{init} {family} outputs peft → zoo (as is)", tolerance=AS_IS)
    # peft's conversion needs its own initial adapter: a fresh model made from the same weights.
    fresh = peft.get_peft_model(
        hf_class.from_pretrained(folder),
        peft.LoraConfig(r=2, lora_alpha=4, target_modules=peft_targets, init_lora_weights=init, task_type=TASK[family]),
    )
    fresh.save_pretrained(tmp_path / "peft_initial")
    made.save_pretrained(
        tmp_path / "peft_converted", path_initial_model_for_weight_conversion=tmp_path / "peft_initial"
    )
    loaded, loaded_config = load_adapter(original, tmp_path / "peft_converted")
    assert loaded_config.r == 4 and loaded_config.init_lora_weights is True
    relative(outputs(loaded), reference.f32, f"{init} {family} outputs peft → zoo (converted)")


@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_init_llama(init, root, tmp_path):
    check_init("llama", init, root, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("family,init", [("gpt2", "pissa"), ("bert", "pissa"), ("bert", "olora")])
def test_init_families(family, init, root, tmp_path):
    check_init(family, init, root, tmp_path)


def test_init_errors_and_flag(root, tmp_path):
    with pytest.raises((ValueError, TypeError), match="init_lora_weights"):
        LoraConfig(init_lora_weights="svd")
    with pytest.raises(ValueError, match=r"pissa_niter_K is a randomized SVD.*'pissa' computes the exact SVD"):
        LoraConfig(init_lora_weights="pissa_niter_4")  # type: ignore[arg-type]
    folder = hf_folder("gpt2", root)
    base = zoo.hf.from_pretrained(folder)
    # PiSSA / OLoRA decompose a float base: an int8 one is refused, saying what to do.
    config = LoraConfig(r=2, target_modules=("c_fc",), init_lora_weights="pissa")
    plain = add_lora(base, LoraConfig(r=2, target_modules=("c_fc",)), key=jax.random.key(0))
    int8 = zoo.lora.unload(zoo.lora.cast_frozen(plain, jnp.int8))
    with pytest.raises(ValueError, match="which is int8: add the branches to the float model"):
        add_lora(int8, config, key=jax.random.key(0))
    # Parts of a fused module: saved as they are, peft would decompose the fused weight.
    fused = LoraConfig(r=2, target_modules=("c_attn",), init_lora_weights="olora")
    model = add_lora(base, fused, key=jax.random.key(0))
    with pytest.raises(
        ValueError, match="parts of transformer.h.0.attn.c_attn.*path_initial_model_for_weight_conversion"
    ):
        save_adapter(model, fused, tmp_path / "fused")
    # Converted, with the initial model itself (its parts cannot be saved as they are).
    save_adapter(trained(model), fused, tmp_path / "fused", path_initial_model_for_weight_conversion=model)
    loaded, loaded_config = load_adapter(base, tmp_path / "fused")  # converted: rank 4 per part, the original base
    relative(outputs(loaded), outputs(trained(model)), "olora gpt2 c_attn converted, zoo → zoo")
    opened = peft.PeftModel.from_pretrained(transformers.GPT2LMHeadModel.from_pretrained(folder), tmp_path / "fused")
    relative(outputs(trained(model)), hf_outputs(opened).f32, "olora gpt2 outputs zoo → peft (c_attn, converted)")
    with pytest.raises(ValueError, match="cannot read .*save the adapter there right after add_lora"):
        save_adapter(model, fused, tmp_path / "x", path_initial_model_for_weight_conversion=tmp_path / "nowhere")
    # A peft adapter whose base peft changed in a way zoo cannot recompute.
    peft.get_peft_model(
        transformers.GPT2LMHeadModel.from_pretrained(folder),
        peft.LoraConfig(r=2, target_modules=["c_fc"], init_lora_weights="pissa_niter_2", task_type="CAUSAL_LM"),
    ).save_pretrained(tmp_path / "niter")
    with pytest.raises(ValueError, match="pissa_niter_2.*path_initial_model_for_weight_conversion"):
        load_adapter(base, tmp_path / "niter")
    # The command line's --lora takes init_lora_weights and writes it back.
    from zoo.train._text import lora_text, parse_lora

    parsed = parse_lora("r=4,init_lora_weights=pissa", {})
    assert parsed.init_lora_weights == "pissa" and parse_lora(lora_text(parsed), {}) == parsed
    assert parse_lora("init_lora_weights=true", {}).init_lora_weights is True
    with pytest.raises(Exception, match="init_lora_weights must be one of"):
        parse_lora("init_lora_weights=svd", {})


# --------------------------------------------------------------------------- embedding and head

# case → (family, zoo targets, peft targets, ensure_weight_tying, gradients compared)
EMBEDDING = {
    # Llama's untied head: a Linear branch on lm_head, an embedding branch on embed_tokens.
    "llama": ("llama", ["embed_tokens", "lm_head", "q_proj"], ["embed_tokens", "lm_head", "q_proj"], False, True),
    # GPT-2's head is the token embedding: tied, one weight (peft's ensure_weight_tying).
    "gpt2-tied": ("gpt2", ["wte", "lm_head", "c_fc"], ["wte", "lm_head", "c_fc"], True, False),
    # Only the embedding named: the tied head keeps scoring the base table, as in peft.
    "gpt2-input": ("gpt2", ["token_embedding", "c_fc"], ["wte", "c_fc"], False, True),
    "bert": ("bert", ["word_embeddings", "query"], ["word_embeddings", "query"], False, True),
}


def check_embedding(case, root, tmp_path):
    from test_dora import compare_gradients, exported

    family, zoo_targets, peft_targets, tie, gradients = EMBEDDING[case]
    cls, auto = FAMILIES[family][:2]
    hf_class = getattr(transformers, cls)
    folder = hf_folder(family, root)
    base = zoo.hf.from_pretrained(folder)
    config = LoraConfig(r=2, lora_alpha=4, target_modules=zoo_targets, init_lora_weights=False,
                        ensure_weight_tying=tie)  # fmt: skip
    model = trained(add_lora(base, config, key=jax.random.key(1)))
    assert isinstance(model.token_embedding if family != "bert" else model.embeddings.word_embeddings,
                      zoo.lora.LoraEmbedding)  # fmt: skip
    save_adapter(model, config, tmp_path / "z")
    tensors = safetensors.numpy.load_file(tmp_path / "z/adapter_model.safetensors")
    assert any(k.endswith(".lora_embedding_A") for k in tensors) and any(
        k.endswith(".lora_embedding_B") for k in tensors
    )
    values = json.loads((tmp_path / "z/adapter_config.json").read_text())
    assert values["ensure_weight_tying"] is tie
    ours = outputs(model)
    m = compare_opened(ours, tmp_path / "z", hf_class, folder, auto, f"embedding/head {case} outputs zoo → peft")
    # Merged: zoo's exported weights against peft's merge_and_unload (a tied head stays tied).
    merged = zoo.lora.merge(model)
    if tie:
        assert merged.lm_head is None  # still one weight
    ours_merged = exported(merged, tmp_path / "merged")
    theirs = {k: v.detach().numpy() for k, v in m.merge_and_unload().state_dict().items()}
    for k in ours_merged:
        if k not in theirs:
            continue
        if tie and k == "transformer.wte.weight":
            # peft 0.21.2 merges the tied table twice (the embedding's branch, then the head's tied
            # copy into the same Parameter): W + 2Δ, and its merged model's outputs change.
            # zoo merges the one weight once: its merged model computes the adapter's outputs.
            table = np.asarray(base.token_embedding.weight)[: theirs[k].shape[0]]
            relative(2 * (ours_merged[k] - table), theirs[k] - table, f"embedding/head {case} merged Δ (peft: 2Δ)")
            continue
        relative(ours_merged[k], theirs[k][: ours_merged[k].shape[0]], f"embedding/head {case} merged weights")
    if case != "gpt2-input":  # there, as in peft, merging the one table adapts the tied head too
        relative(outputs(merged), ours, f"embedding/head {case} merged model outputs vs unmerged")
    if tie:
        reopened = hf_class.from_pretrained(tmp_path / "merged")
        assert reopened.lm_head.weight.data_ptr() == reopened.transformer.wte.weight.data_ptr()  # the tie kept

    # peft → zoo.
    torch.manual_seed(3)
    made = peft.get_peft_model(
        hf_class.from_pretrained(folder),
        peft.LoraConfig(
            r=2, lora_alpha=8, target_modules=peft_targets, ensure_weight_tying=tie, task_type=TASK[family]
        ),
    )
    perturb(made, 3, is_adapter)
    if tie:  # perturbing each tied tensor once more moved the head's and the embedding's apart: re-tie
        made = peft.get_peft_model(
            hf_class.from_pretrained(folder),
            peft.LoraConfig(r=2, lora_alpha=8, target_modules=peft_targets, ensure_weight_tying=tie,
                            task_type=TASK[family]),
        )  # fmt: skip
        with torch.no_grad():
            for n, p in made.named_parameters():
                if "lora_embedding" in n:
                    p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))
    made.save_pretrained(tmp_path / "p")
    loaded, loaded_config = load_adapter(base, tmp_path / "p")
    if tie:  # peft's tied branches (transposed views) refuse the float64 copy: float32 only
        made.eval()
        with torch.no_grad():
            reference = hf_run(made).numpy()
    else:
        reference = hf_outputs(made)
        assert_close(outputs(loaded), reference, f"{case} embedding LoRA peft → zoo")
        reference = reference.f32
    relative(outputs(loaded), reference, f"embedding/head {case} outputs peft → zoo")
    if gradients:
        compare_gradients(made, loaded, loaded_config, tmp_path / "grads", f"embedding/head {case} gradients")


@pytest.mark.parametrize("case", ["llama", "gpt2-tied"])
def test_embedding_and_head_lora(case, root, tmp_path):
    check_embedding(case, root, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", ["gpt2-input", "bert"])
def test_embedding_lora_families(case, root, tmp_path):
    check_embedding(case, root, tmp_path)


def test_embedding_lora_errors(root):
    base = zoo.hf.from_pretrained(hf_folder("gpt2", root))
    with pytest.raises(ValueError, match=r"DoRA wraps Linear layers only, and 'token_embedding' is an Embedding"):
        add_lora(base, LoraConfig(r=2, target_modules=["wte", "c_fc"], use_dora=True), key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"'pissa' decomposes Linear weights; 'token_embedding' is an Embedding"):
        add_lora(base, LoraConfig(r=2, target_modules=["wte"], init_lora_weights="pissa"), key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"head is its token embedding: set ensure_weight_tying=True"):
        add_lora(base, LoraConfig(r=2, target_modules=["wte", "lm_head"]), key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"the tied 'lm_head' is the token embedding; target it too"):
        add_lora(
            base, LoraConfig(r=2, target_modules=["c_fc", "lm_head"], ensure_weight_tying=True), key=jax.random.key(0)
        )
    # Trainable: the embedding's branch; the base table stays frozen.
    config = LoraConfig(r=2, target_modules=["wte"])
    train = zoo.lora.trainable(add_lora(base, config, key=jax.random.key(0)), config)
    assert train.token_embedding.lora_embedding_A is True and train.token_embedding.base.weight is False


# --------------------------------------------------------------------------- trainable tokens

TOKEN_IDS = [3, 9, 20]  # rows TOKENS uses


@pytest.mark.parametrize("family,targets", [("llama", ["q_proj"]), ("gpt2", ["c_fc"])])  # GPT-2: the tied head too
def test_trainable_tokens(family, targets, root, tmp_path):
    from test_dora import compare_gradients, exported

    assert set(TOKEN_IDS) <= set(TOKENS.ravel().tolist())
    cls, auto = FAMILIES[family][:2]
    hf_class = getattr(transformers, cls)
    folder = hf_folder(family, root)
    base = zoo.hf.from_pretrained(folder)
    config = LoraConfig(r=2, target_modules=targets, init_lora_weights=False, trainable_token_indices=TOKEN_IDS)
    model = trained(add_lora(base, config, key=jax.random.key(1)))
    layer = model.token_embedding
    assert isinstance(layer, zoo.lora.TrainableTokens) and layer.tie_head == (family == "gpt2")
    np.testing.assert_array_equal(layer.trainable_tokens_original, np.asarray(base.token_embedding.weight)[TOKEN_IDS])
    assert zoo.lora.trainable(model, config).token_embedding.base.weight is False
    save_adapter(model, config, tmp_path / "z")
    tensors = safetensors.numpy.load_file(tmp_path / "z/adapter_model.safetensors")
    hf_name = zoo.lora.hf_module_name(base, "token_embedding")
    key = f"base_model.model.{hf_name}.token_adapter.trainable_tokens_delta"
    assert tensors[key].shape == (3, 16) and not any("lm_head" in k for k in tensors)  # only the listed rows
    ours = outputs(model)
    m = compare_opened(ours, tmp_path / "z", hf_class, folder, auto, f"trainable tokens {family} outputs zoo → peft")
    merged = zoo.lora.merge(model)
    theirs = {k: v.detach().numpy() for k, v in m.merge_and_unload().state_dict().items()}
    for k, value in exported(merged, tmp_path / "merged").items():
        relative(value, theirs[k], f"trainable tokens {family} merged weights")
    relative(outputs(merged), ours, f"trainable tokens {family} merged model outputs vs unmerged")
    # peft → zoo, and gradients against peft's autograd (the tied head's use included).
    torch.manual_seed(3)
    made = peft.get_peft_model(
        hf_class.from_pretrained(folder),
        peft.LoraConfig(r=2, lora_alpha=8, target_modules=targets, trainable_token_indices=TOKEN_IDS,
                        task_type="CAUSAL_LM"),
    )  # fmt: skip
    perturb(made, 3, lambda n: is_adapter(n) or "trainable_tokens_delta" in n)
    made.save_pretrained(tmp_path / "p")
    loaded, loaded_config = load_adapter(base, tmp_path / "p")
    assert loaded_config.trainable_token_indices == tuple(TOKEN_IDS)
    made.eval()
    with torch.no_grad():
        reference = hf_run(made).numpy()
    relative(outputs(loaded), reference, f"trainable tokens {family} outputs peft → zoo")
    compare_gradients(made, loaded, loaded_config, tmp_path / "grads", f"trainable tokens {family} gradients")


def test_trainable_tokens_errors(root):
    base = zoo.hf.from_pretrained(hf_folder("llama", root))
    with pytest.raises(
        ValueError, match=r"trainable_token_indices \[32, 40\] are out of range for the vocabulary of 32"
    ):
        add_lora(
            base, LoraConfig(target_modules=["q_proj"], trainable_token_indices=[1, 32, 40]), key=jax.random.key(0)
        )
    with pytest.raises((ValueError, TypeError), match="trainable_token_indices"):
        LoraConfig(trainable_token_indices=[1, 1])
    with pytest.raises(ValueError, match="trainable_token_indices and a LoRA branch on 'token_embedding' at once"):
        add_lora(base, LoraConfig(target_modules=["embed_tokens"], trainable_token_indices=[1]), key=jax.random.key(0))
    # The command line's --lora takes the new fields and writes them back.
    from zoo.train._text import lora_text, parse_lora

    parsed = parse_lora("targets=wte+lm_head,ensure_weight_tying=true,trainable_token_indices=3+9", {})
    assert parsed.trainable_token_indices == (3, 9) and parsed.ensure_weight_tying
    assert parse_lora(lora_text(parsed), {}) == parsed
    with pytest.raises(Exception, match="token ids joined by"):
        parse_lora("trainable_token_indices=a+b", {})

"""The suite's numeric tolerances (tests/helpers.py: `rounding_bound`, `assert_as_accurate`)
are loose enough for float32 rounding on any machine and still fail every wrong formula they
guard against: each mutant below is patched into zoo and the comparison must fail.

The comparisons are those of the Hugging Face and peft tests (zoo against transformers /
peft, the exact value a float64 run of the reference); the mutants are the mistakes a port
makes: tanh- for erf-GELU, a missing bias, a mis-scaled attention, LoRA's `alpha / r` as
`alpha / sqrt(r)`, a dropped padding mask.
"""

import types

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import test_peft as tp
import torch
import transformers
from helpers import (
    UNIT_ROUNDOFF,
    assert_as_accurate,
    assert_rounding_close,
    rounding_bound,
    torch_reference,
)

import zoo
import zoo.lora._peft_config
import zoo.nn._attention
import zoo.nn._feedforward

# Also run under other CPU kernels and thread counts (`make test-numerics`).
pytestmark = pytest.mark.numerics

SEQ = tp.SEQ
LENGTHS = np.array([SEQ, SEQ - 3])  # the second row right-padded
MASK = np.arange(SEQ)[None, :] < LENGTHS[:, None]
TOKENS = np.where(MASK, tp.TOKENS, 0)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("hf"))


def _hf_reference(model):
    """The HF model's output on TOKENS with MASK, float32 and float64."""
    model.eval()

    def run(m):
        out = m(input_ids=torch.tensor(TOKENS), attention_mask=torch.tensor(MASK.astype(np.int64)))
        return out.logits if hasattr(out, "logits") else out.last_hidden_state

    return torch_reference(run, model)


def _zoo(model):
    """zoo's output on TOKENS with MASK, compiled afresh: a patched module must not hit a
    program compiled before the patch."""
    forward = eqx.filter_jit(lambda m, t, k: m(t, mask=k))
    return np.asarray(forward(model, jnp.asarray(TOKENS), jnp.asarray(MASK)))


def _compare(got, reference, what):
    """The comparison of the families/peft tests, over the real (unpadded) positions."""
    return assert_as_accurate(got[..., : reference.f32.shape[-1]][MASK], reference[MASK], what=what)


def _no_bias(model):
    """`model` with every Linear's bias set to zero: a loader that forgot the biases."""
    return jax.tree.map(
        lambda layer: (
            eqx.tree_at(lambda l: l.bias, layer, jnp.zeros_like(layer.bias))
            if isinstance(layer, zoo.nn.Linear) and layer.bias is not None
            else layer
        ),
        model,
        is_leaf=lambda x: isinstance(x, zoo.nn.Linear),
    )


_attend = zoo.nn.Attention.__call__


def _maskless(self, x, *, mask=None, **kwargs):
    """Attention that drops the padding mask it is given."""
    return _attend(self, x, **kwargs)


MUTANTS = {
    # name → (HF kind, patch(monkeypatch), model transform)
    "erf-GELU as tanh-GELU": (
        "bert",
        lambda mp: mp.setitem(zoo.nn._feedforward._ACTIVATIONS, "gelu", lambda x: jax.nn.gelu(x, approximate=True)),
        None,
    ),
    "tanh-GELU as erf-GELU": (
        "gpt2",
        lambda mp: mp.setitem(zoo.nn._feedforward._ACTIVATIONS, "gelu_tanh", zoo.nn._feedforward.gelu_exact),
        None,
    ),
    "missing bias": ("gpt2", None, _no_bias),
    "attention scaled by 1/d": (
        "llama",
        lambda mp: mp.setattr(zoo.nn._attention, "math", types.SimpleNamespace(sqrt=lambda v: v)),
        None,
    ),  # fmt: skip
    "dropped padding mask": ("bert", lambda mp: mp.setattr(zoo.nn.Attention, "__call__", _maskless), None),
}


@pytest.mark.parametrize("mutant", [None, *MUTANTS])
def test_model_comparison_fails_every_mutant(mutant, root, monkeypatch):
    kind, patch, transform = MUTANTS.get(mutant, ("bert", None, None))
    folder = tp.hf_folder(kind, root)
    hf = (transformers.AutoModel if kind == "bert" else transformers.AutoModelForCausalLM).from_pretrained(folder)
    reference = _hf_reference(hf)
    model = zoo.hf.from_pretrained(folder)
    if patch:
        patch(monkeypatch)
    if transform:
        model = transform(model)
    got = _zoo(model)
    if mutant is None:  # the comparison passes on the right formulas
        _compare(got, reference, "right formulas")
        return
    with pytest.raises(AssertionError) as info:
        _compare(got, reference, f"mutant {mutant}")
    print(f"{mutant}: {info.value}")


@pytest.mark.parametrize("rslora_mutant", [False, True])
def test_peft_comparison_fails_a_lora_scaling_of_alpha_over_sqrt_r(rslora_mutant, root, tmp_path, monkeypatch):
    """A peft adapter (r=4, alpha=8: scaling 2) loaded with `alpha / sqrt(r)` (4) fails the
    comparison the peft tests make; with the right scaling it passes."""
    folder = tp.hf_folder("llama", root)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder)
    opened = tp.peft_adapter(hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]), tmp_path)
    reference = _hf_reference(opened)
    if rslora_mutant:  # read as alpha / sqrt(r) both where zoo scales and where it checks peft's file
        monkeypatch.setattr(zoo.lora.LoraConfig, "scaling", property(lambda c: c.lora_alpha / c.r**0.5))
        monkeypatch.setattr(
            zoo.lora._peft_config, "_peft_scaling", lambda values, module, r: values["lora_alpha"] / r**0.5
        )
    model, _ = zoo.lora.load_adapter(zoo.hf.from_pretrained(folder), tmp_path)
    got = _zoo(model)
    if not rslora_mutant:
        _compare(got, reference, "right LoRA scaling")
        return
    with pytest.raises(AssertionError) as info:
        _compare(got, reference, "mutant alpha / sqrt(r)")
    print(info.value)


def test_rounding_bound_formula():
    """2·depth·γ_n·scale, γ_n = n·u/(1 − n·u); and a sum in another order stays inside it."""
    n = 1000
    assert rounding_bound(3.0, terms=n, depth=2) == pytest.approx(
        2 * 2 * n * UNIT_ROUNDOFF / (1 - n * UNIT_ROUNDOFF) * 3
    )
    with pytest.raises(AssertionError, match="terms"):
        rounding_bound(1.0, terms=2**24)
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    forward, backward = np.float32(0), np.float32(0)
    for v in x:
        forward = np.float32(forward + v)
    for v in x[::-1]:
        backward = np.float32(backward + v)
    assert forward != backward  # the order matters in float32
    assert_rounding_close(forward, backward, terms=n, scale=float(np.abs(x).sum()))
    assert abs(forward - x.astype(np.float64).sum()) <= rounding_bound(float(np.abs(x).sum()), terms=n) / 2

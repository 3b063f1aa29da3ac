"""Helpers the tests share: float32 rounding bounds, tree comparison, meshes, tiny models
and batches.

Imported by test modules (`from helpers import ...`); fixtures live in `conftest.py`.
`zoo` is imported inside the functions, not here: jaxtyping's import hook (installed by
pytest's `--jaxtyping-packages`) must see zoo's first import.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import io
import os
import sys
from typing import TYPE_CHECKING

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:
    import zoo


# --------------------------------------------------------------------------- rounding bounds
#
# Every numeric tolerance of the suite comes from here, in one of two ways (docs/claims.md,
# "Numeric tolerances"): a bound derived from float32's unit roundoff and the size of the
# sums (`rounding_bound`), or, for a whole model against a reference library, a float64 run
# of the reference as the exact value (`assert_as_accurate`). Neither is a number one machine
# measured: another instruction set, matmul kernel or thread count sums in another order
# and moves results by a few ulps, which both forms allow and a wrong formula exceeds by
# orders of magnitude (tests/test_tolerances.py runs those mutants).

UNIT_ROUNDOFF = 2.0**-24
"""float32's unit roundoff u: one rounding moves a value by at most u times its size."""

ACCURACY_MARGIN = 8
"""How many times the reference library's own float32 error zoo's may be (`assert_as_accurate`).

zoo and the reference evaluate the same formulas with the same sums, in float32, in other
orders and kernels (fused or not, another blocking), so each one's distance to the exact
value is a sum of as many roundings of the same sizes: of the same order, not equal.
Measured over the suite's 50-odd comparisons (x86 with AVX-512, XLA's and torch's default
kernels, 2 threads): zoo's error is 0.2-1.8x the reference's; with XLA on AVX2 and Eigen's
matmuls, torch on AVX2, 1 thread: 0.2-1.1x. 8 leaves room for a maximum over few values;
the nearest wrong formula (tanh- for erf-GELU on a tiny BERT, tests/test_tolerances.py)
still exceeds the bound 10x.
"""


def rounding_bound(scale: float, *, terms: int, depth: int = 1) -> float:
    """The largest difference two float32 evaluations of one computation may show when they
    differ only in the order of their sums (another kernel, instruction set, thread count,
    device count, microbatch split).

    A float32 sum of n terms, in any order, is within γ_n·Σ|x_i| of the exact sum, with
    γ_n = n·u / (1 − n·u) (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed.,
    eq. 4.4; dot products likewise with Σ|a_i·b_i|, eq. 3.5). Two orders are each within that
    of the exact sum, so within 2γ_n of each other. A value computed through a chain of
    `depth` such sums, each well-conditioned (an error entering a layer leaves it no larger:
    normalised layers, softmax, small weights), gathers at most `depth` of them.

    Args:
        scale: a bound on Σ|x_i| of each sum, in the units of the compared values: for values
            of order one, the largest |value| (times the reduced width where the terms do not
            shrink with it, e.g. a loss summed over a batch).
        terms: the longest sum on the way (hidden width, batch x sequence, ...).
        depth: sums in a chain on the way to one compared value (layers x sums per layer).

    Returns:
        The bound, an absolute difference: 2·depth·γ_terms·scale.
    """
    n_u = terms * UNIT_ROUNDOFF
    assert n_u < 0.5, f"{terms} terms: float32 bounds no such sum"
    return 2 * depth * n_u / (1 - n_u) * scale


def largest(x) -> float:
    """The largest |value| of an array (0 for an empty one)."""
    x = np.asarray(x, np.float64)
    return float(np.abs(x).max()) if x.size else 0.0


def assert_within(got, want, bound: float, what: str = "") -> float:
    """Largest |got − want| at most `bound`; returns that difference."""
    diff = largest(np.asarray(got, np.float64) - np.asarray(want, np.float64))
    assert diff <= bound, f"{what}: max difference {diff:.3g} > bound {bound:.3g} (scale {largest(want):.3g})"
    return diff


def assert_rounding_close(got, want, *, terms: int, depth: int = 1, scale: float | None = None, what: str = ""):
    """`got` equals `want` up to float32 rounding in another order: `rounding_bound` at the
    largest |want| (or `scale`). Returns the largest difference."""
    bound = rounding_bound(largest(want) if scale is None else scale, terms=terms, depth=depth)
    return assert_within(got, want, bound, what)


def assert_tree_rounding_close(got, want, *, terms: int, depth: int = 1, what: str = ""):
    """Two pytrees of one structure whose array leaves each pass `assert_rounding_close`
    (the scale of each leaf its own largest |value|)."""
    got_arrays, want_arrays = eqx.filter(got, eqx.is_array), eqx.filter(want, eqx.is_array)
    assert jax.tree.structure(got_arrays) == jax.tree.structure(want_arrays), what
    leaves = jax.tree.leaves_with_path(want_arrays)
    for (path, w), g in zip(leaves, jax.tree.leaves(got_arrays), strict=True):
        assert_rounding_close(g, w, terms=terms, depth=depth, what=f"{what}{jax.tree_util.keystr(path)}")


@dataclasses.dataclass(frozen=True)
class Reference:
    """A reference library's output in float32 (what its users get) and on a float64 copy
    of the same model (the exact value, up to float64's rounding). Indexing indexes both."""

    f32: np.ndarray
    f64: np.ndarray

    def __getitem__(self, index) -> Reference:
        return Reference(self.f32[index], self.f64[index])


def _float64_eager() -> str:
    """The name of an attention kernel registered with transformers: its eager attention
    (scaling, soft-capping, the additive mask) with the softmax in the inputs' dtype. Its
    own eager kernel upcasts to float32 only, which in float64 turns the mask value to
    -inf (fully masked padding rows give NaN that spreads) and rounds the probabilities
    to float32."""
    import torch
    import transformers
    from transformers.integrations.sdpa_attention import repeat_kv

    def attention(module, query, key, value, attention_mask, scaling=None, softcap=None, dropout=0.0, **kwargs):
        groups = module.num_key_value_groups
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
        scores = torch.matmul(query, key.transpose(2, 3)) * (module.head_dim**-0.5 if scaling is None else scaling)
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if attention_mask is not None:
            scores = scores + attention_mask
        probs = torch.softmax(scores, dim=-1)
        return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs

    transformers.AttentionInterface.register("eager_float64", attention)
    transformers.AttentionMaskInterface.register("eager_float64", transformers.masking_utils.eager_mask)
    return "eager_float64"


def torch_reference(run, model) -> Reference:
    """`run(model)` and `run(a float64 copy of model)`, both as numpy float64 arrays."""
    import torch

    def value(out):
        out = out.detach().numpy() if isinstance(out, torch.Tensor) else out
        return np.asarray(out, np.float64)

    exact = copy.deepcopy(model).double()
    # transformers' eager attention turns fully masked (padding) rows into NaN in float64
    # (its mask value twice overflows to -inf), and 0 x NaN spreads them; its sdpa does not.
    # (Models without sdpa, Gemma 2's soft-capped scores, stay eager.)
    eager = getattr(getattr(exact, "config", None), "_attn_implementation", None) == "eager"
    if eager and getattr(exact, "_supports_sdpa", True):
        exact.set_attn_implementation("sdpa")
    elif eager:  # Gemma 2's soft-capped scores: eager, with its softmax kept in float64
        exact.set_attn_implementation(_float64_eager())
    with torch.no_grad():
        f32 = value(run(model))
        f64 = value(run(exact))
    assert np.isfinite(f64).all(), "the float64 reference has non-finite values"
    return Reference(f32, f64)


def assert_as_accurate(
    got, reference: Reference, *, margin: float = ACCURACY_MARGIN, floor: float = 0.0, what: str = ""
) -> float:
    """`got`, a float32 result, is as close to the exact value as the reference library's
    own float32 result, within `margin` times (`ACCURACY_MARGIN`).

    The exact value is the reference run in float64; the allowance is `margin` times the
    reference's float32 error, measured in the same run on the same machine (so it follows
    the machine's instruction set and kernels), and at least a few ulps of the largest
    output (8·u·max|exact|) and `floor` (an algorithm's own float32 error bound, for
    results whose reference may land far closer by luck). Returns the largest |got − exact|.
    """
    ulps = max(8 * UNIT_ROUNDOFF * largest(reference.f64), floor / margin)
    own_error = largest(reference.f32 - reference.f64)
    if log := os.environ.get("ZOO_ACCURACY_LOG"):  # docs/claims.md's measured ratios come from here
        with open(log, "a") as f:
            diff = largest(np.asarray(got, np.float64) - reference.f64)
            f.write(f"{what}\t{diff:.3e}\t{own_error:.3e}\t{diff / max(own_error, ulps):.2f}\n")
    return assert_within(
        got, reference.f64, margin * max(own_error, ulps), f"{what} (reference's own error {own_error:.3g})"
    )


# --------------------------------------------------------------------------- narrow storage bounds
#
# A frozen base stored in bfloat16 or int8 (compute stays float32) changes the weights, not
# the sums: the outputs move by at most the first-order sum over weights of |d output / d w|
# times each weight's storage error (bfloat16: u = 2^-8 of |w|; int8, per output channel:
# half its scale, max |w| over the inputs / 127 / 2), doubled to cover the higher-order terms
# (products of errors of 2^-8 relative: far below the first-order ones).
BF16_ROUNDOFF = 2.0**-8


def storage_errors(model, config, dtype):
    """Per leaf of `model`, how far `cast_frozen(model, dtype, config=config)` may store it
    from its value (None for the trainable leaves, kept exactly)."""
    from zoo.lora import trainable
    from zoo.nn._quantized import stack_projections

    # int8: every projection of the layer stack (adapted: its base), and adapted bases outside it.
    stack = {jax.tree_util.keystr((*p, jax.tree_util.GetAttrKey("weight"))) for p in stack_projections(model)}
    errors = []
    flags = jax.tree.leaves(trainable(model, config))
    for (path, w), train in zip(jax.tree_util.tree_leaves_with_path(model), flags, strict=True):
        name = jax.tree_util.keystr(path)
        if train or not jnp.issubdtype(w.dtype, jnp.floating):
            errors.append(None)
        elif dtype == jnp.int8 and (name in stack or name.endswith("base.weight")):
            errors.append(jnp.max(jnp.abs(w), axis=-2, keepdims=True) / 127 / 2)
        else:
            errors.append(BF16_ROUNDOFF * jnp.abs(w))
    return errors


def storage_bound(f, model, errors):
    """2 x the first-order change of `f(model)` (per output) when each leaf moves by up to
    its error (jacobians, exact to first order)."""
    leaves, treedef = jax.tree.flatten(model)
    moved = [i for i, e in enumerate(errors) if e is not None]

    def of_moved(ws):
        new = list(leaves)
        for i, w in zip(moved, ws):
            new[i] = w
        return f(jax.tree.unflatten(treedef, new))

    out = jax.eval_shape(of_moved, [leaves[i] for i in moved])

    # One compiled program: op by op, the jacobian of a model's forward pass compiled a few
    # hundred small programs (most of a test's compiles).
    @jax.jit
    def first_order(ws, errs):
        jacobians = jax.jacrev(of_moved)(ws)
        return sum(
            jnp.sum(jnp.abs(j) * e, axis=tuple(range(len(out.shape), j.ndim)))
            for j, e in zip(jacobians, errs, strict=True)
        )

    return 2 * np.asarray(first_order([leaves[i] for i in moved], [errors[i] for i in moved]), np.float64)


def tree_allclose(a, b, *, rtol=1e-5, atol=1e-6) -> bool:
    """Same structure and every array leaf close (None leaves must match)."""
    a_arrays, a_static = eqx.partition(a, eqx.is_array)
    b_arrays, b_static = eqx.partition(b, eqx.is_array)
    if jax.tree.structure(a_arrays) != jax.tree.structure(b_arrays):
        return False
    return all(
        np.allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)
        for x, y in zip(jax.tree.leaves(a_arrays), jax.tree.leaves(b_arrays))
    )


def max_abs_diff(a, b) -> float:
    """Largest elementwise difference between two trees of arrays."""
    return max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
        for x, y in zip(jax.tree.leaves(eqx.filter(a, eqx.is_array)), jax.tree.leaves(eqx.filter(b, eqx.is_array)))
    )


@functools.cache
def data_mesh(n: int):
    """A 1-D explicit mesh `data=n` over the first n devices."""
    return jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])


def regression_batch(key, size: int, in_size: int, out_size: int = 1):
    """A deterministic regression batch `(x [size, in], y [size, out])`."""
    kx, kw = jax.random.split(key)
    x = jax.random.normal(kx, (size, in_size))
    w = jax.random.normal(kw, (in_size, out_size)) / np.sqrt(in_size)
    return x, jnp.sin(x @ w)


def mse_per_example(model, batch):
    """Per-example mean squared error: the loss_fn contract of zoo.TrainStep."""
    x, y = batch
    return jnp.mean(jnp.square(model(x) - y), axis=-1)


class TokenRegressor(eqx.Module):
    """Test model touching every zoo module: Embedding → mean over tokens → MLP."""

    embed: zoo.nn.Embedding
    mlp: zoo.nn.MLP

    def __init__(self, *, norm="layernorm", scan=True, vocab=11, dim=8, key):
        import zoo

        k1, k2 = jax.random.split(key)
        self.embed = zoo.nn.Embedding(vocab, dim, init_std=0.5, key=k1)
        self.mlp = zoo.nn.MLP(dim, 2, 16, 3, activation=jnp.tanh, norm=norm, scan=scan, key=k2)

    def __call__(self, ids):
        return self.mlp(self.embed(ids).mean(axis=1))


def token_batch(key, size: int, seq: int = 5, vocab: int = 11):
    """`(ids [size, seq], y [size, 2])`: a target that depends on the tokens."""
    ids = jax.random.randint(key, (size, seq), 0, vocab)
    y = jnp.stack([jnp.sin(ids.sum(1) / 7.0), jnp.cos(ids[:, 0] / 3.0)], axis=1)
    return ids, y


def drawn_on_host(shapes, seed: int, scale: float, *, norm: float = 0.0, device: bool = True):
    """`shapes` (an abstract model, as `eqx.filter_eval_shape` gives it) with every array
    drawn by numpy's `default_rng(seed)` in leaf order: `scale` N(0, 1), plus `norm` where
    the leaf's path names a norm. Building a model so compiles nothing (eagerly, each
    initialiser compiles for each shape), for tests that do not test the initialiser.
    `device=False` keeps numpy arrays (placing host arrays on a mesh compiles nothing either)."""
    rng = np.random.default_rng(seed)

    def draw(path, x):
        if not isinstance(x, jax.ShapeDtypeStruct):
            return x
        assert jnp.issubdtype(x.dtype, jnp.floating), (path, x)  # every array leaf a weight
        offset = norm if "norm" in jax.tree_util.keystr(path) else 0.0
        value = (offset + scale * rng.standard_normal(x.shape)).astype(x.dtype)
        return jax.device_put(value) if device else value

    return jax.tree_util.tree_map_with_path(draw, shapes, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))


def on_host(tree):
    """`tree` with its arrays as numpy arrays (PRNG keys kept): placing host arrays on a mesh
    copies their slices, where placing one device's arrays compiles a slicing program for
    each shape and layout."""

    def put(x):
        return np.asarray(x) if eqx.is_array(x) and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x

    return jax.tree.map(put, tree)


def tree_bytes(tree) -> int:
    """Bytes held by the array leaves of a pytree."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array)))


def dense_presets() -> tuple[str, ...]:
    """`zoo.RULE_PRESETS` but those that split a mixture of experts' `expert` axis (`ep`):
    on a model without experts such a preset is `dp` with a mesh axis repeating the same
    work (zoo train refuses it), so the tests of dense models leave it out."""
    import zoo

    return tuple(p for p in zoo.RULE_PRESETS if zoo.preset(p).layout["expert"] is None)


@functools.cache
def preset_mesh(preset: str, n: int):
    """`data=n` for data-parallel presets; `data=n/2, model=2` for tensor- and
    expert-parallel ones."""
    if "tp" in preset or "ep" in preset:
        return jax.make_mesh((n // 2, 2), ("data", "model"), devices=jax.devices()[:n])
    return data_mesh(n)


def pairwise(**axes) -> list[tuple]:
    """Cases that meet every pair of values of any two axes at least once (a covering array
    of strength 2), instead of the full product: a bug that needs two settings together
    shows, in far fewer cases (4x4x4x2 values: 16 cases instead of 128).

    Greedy and deterministic: each case, in the product's order, that covers the most pairs
    not yet met, until none is left; the first axis's values are each met as the product
    orders them. Returns tuples of values in the axes' order."""
    import itertools

    names = list(axes)

    def pairs(case):
        return {(i, case[i], j, case[j]) for i, j in itertools.combinations(range(len(case)), 2)}

    product = list(itertools.product(*axes.values()))
    missing = set().union(*map(pairs, product))
    cases = []
    while missing:
        best = max(product, key=lambda case: len(pairs(case) & missing))
        cases.append(best)
        missing -= pairs(best)
    assert all(set(values) <= {case[names.index(n)] for case in cases} for n, values in axes.items())
    return cases


def tiny_decoder(key, **overrides):
    """A small decoder LM exercising GQA, RoPE, SwiGLU, RMSNorm and an untied head."""
    import zoo

    config = dict(
        vocab_size=32,
        d_model=16,
        num_heads=4,
        num_kv_heads=2,
        num_layers=2,
        mlp_dim=32,
        max_len=8,
        positions="rope",
        activation="swiglu",
        norm="rmsnorm",
        tie_embeddings=False,
    )
    return zoo.models.Transformer(zoo.models.TransformerConfig(**(config | overrides)), key=key)


def tiny_encoder_classifier(key, **overrides):
    """A small BERT-style encoder (with dropout) plus a 3-way classification head."""
    import zoo

    config = dict(vocab_size=32, d_model=16, num_heads=4, num_layers=2, mlp_dim=32, max_len=8, dropout=0.1)
    k1, k2 = jax.random.split(key)
    encoder = zoo.models.Encoder(zoo.models.EncoderConfig(**(config | overrides)), key=k1)
    return zoo.models.EncoderClassifier(encoder, 3, key=k2)


def lm_batch(key, size: int, seq: int = 8, vocab: int = 32):
    """`{"tokens", "mask"}` with some right-padding, for `zoo.models.next_token_loss`."""
    tokens = jax.random.randint(key, (size, seq), 1, vocab)
    lengths = seq - (jnp.arange(size) % 3)
    mask = jnp.arange(seq)[None, :] < lengths[:, None]
    return {"tokens": jnp.where(mask, tokens, 0), "mask": mask}


def classification_batch(key, size: int, seq: int = 8, vocab: int = 32):
    """`{"tokens", "labels", "dropout_key"}` with padding (id 0), for the encoder classifier."""
    import zoo

    k1, k2, k3 = jax.random.split(key, 3)
    tokens = jax.random.randint(k1, (size, seq), 1, vocab)
    lengths = seq - (jnp.arange(size) % 4)
    tokens = jnp.where(jnp.arange(seq)[None, :] < lengths[:, None], tokens, 0)
    labels = jax.random.randint(k2, (size,), 0, 3)
    return {"tokens": tokens, "labels": labels, "dropout_key": zoo.nn.example_keys(k3, size)}


def zoo_main(*args) -> tuple[int, str, str]:
    """`zoo ARGS` in-process: (exit code, stdout, stderr); argparse's exits become codes."""
    from zoo._cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main([str(a) for a in args])
        except SystemExit as e:
            rc = e.code
    return rc, out.getvalue(), err.getvalue()


def zoo_ok(*args) -> str:
    """`zoo ARGS` in-process, which must succeed: its stdout."""
    rc, out, err = zoo_main(*args)
    assert rc == 0, f"zoo {' '.join(map(str, args))} exited {rc}\n{out}\n{err}"
    return out


# The XLA flags tests/conftest.py compiles the test processes with: LLVM's machine-code
# optimisation off (about half of every compile); XLA's passes, which place the collectives,
# unchanged.
FAST_COMPILE_FLAGS = (
    "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true --xla_cpu_use_fusion_emitters=false "
    "--xla_cpu_parallel_codegen_split_count=1"
)


def short_run_env() -> dict[str, str]:
    """The environment of a `zoo` process a test starts for a short run (a few steps, or
    one stopped by a signal): this process's (the suite's compile cache and collective
    timeout), the repository on PYTHONPATH, and the fast-compile flags (a short run's time
    is its compiling)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {FAST_COMPILE_FLAGS}"
    return env


def one_line_error(rc: int, err: str, message: str, code: int = 2) -> None:
    """A command's failure as the CLI promises it: exit `code`, one line on stderr holding
    `message`, no traceback."""
    assert rc == code, (rc, err)
    assert message in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def noisy(model, scale: float):
    """A transformers model (eval mode) with `scale` × standard normal noise added to every
    parameter: random initialisations are near-uniform, noise makes tokens differ."""
    import torch

    model = model.eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))
    return model


def save_word_tokenizer(words: list[str], folder) -> None:
    """A word-level tokenizer.json in `folder`: one id per word of `words`, split on
    whitespace, decoded with spaces between words."""
    import tokenizers

    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.decoder = tokenizers.decoders.WordPiece()  # joins words with spaces
    tok.save(str(folder / "tokenizer.json"))


# The event jax's monitoring reports once per program XLA compiles.
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def backend_compiles():
    """The names of the functions XLA compiles while inside (a list that grows)."""
    names = []

    def listen(event, _seconds, **kwargs):
        if event == BACKEND_COMPILE:
            names.append(kwargs.get("fun_name", ""))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


# `[*ZOO_TAKING_CTRL_C, ARGS...]` runs `python -m zoo ARGS` with SIGINT at Python's default
# handler and unblocked, as a process started from a terminal has it. A child inherits its
# parent's ignored and blocked signals, and a test process may hold either from what ran in
# it before (in full `make test` runs the Ctrl-C tests' children twice ignored SIGINT).
ZOO_TAKING_CTRL_C = [
    sys.executable, "-c",
    "import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT}); runpy.run_module('zoo', run_name='__main__')",
]  # fmt: skip


def sigint_state(pid: int) -> str:
    """Whether process `pid` blocks, ignores or catches SIGINT (from /proc; for messages)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if line.startswith(("SigBlk", "SigIgn", "SigCgt")))
    except OSError as e:
        return f"(no /proc status: {e})"
    return ", ".join(f"{k} {bool(int(v, 16) & 2)}" for k, v in fields.items())  # SIGINT is bit 1


def peft_lora_llama(root, llama: dict, *, temperature: float = 1.0, outputs: tuple[str, ...] = ("log_probs",)):
    """(a peft LoRA Llama with TRL's fused head, the same model in zoo): a tiny random Llama
    of `llama`'s `LlamaConfig` fields, its weights perturbed, saved by transformers under
    `root`, TRL's fused head (`temperature`, `outputs`) added, a peft adapter on every
    linear layer with perturbed (non-zero) branches, in eval mode; zoo loads the base and
    the adapter."""
    import peft
    import torch
    import transformers
    from trl.trainer.utils import add_fused_lm_head

    import zoo

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=generator))
    hf.save_pretrained(root / "base")
    add_fused_lm_head(hf, temperature=temperature, outputs=outputs)
    peft_model = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=generator))
    peft_model.save_pretrained(root / "adapter")
    peft_model.eval()
    lora, _ = zoo.lora.load_adapter(zoo.hf.from_pretrained(root / "base"), root / "adapter")
    return peft_model, lora

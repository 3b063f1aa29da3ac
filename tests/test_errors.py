"""The library's own error messages, as a user without runtime type checks sees them, and
what `ZOO_RUNTIME_CHECKS=1` adds.

This suite runs with jaxtyping's import hook on (`--jaxtyping-packages` in pyproject), so
for an argument an annotation also refuses (a `Literal`, an array shape) beartype raises
first and the library's own `ValueError` never runs in-process. Those checks are all a user
without the hook gets: one fresh process (tests/_errors_worker.py, plain `import zoo`) runs
a table of bad calls and the models' entry points with bad shapes, dtypes and ids, and
reports each exception's type and text, checked here; a second process imports zoo with
ZOO_RUNTIME_CHECKS=1 (read at import) and calls the same entry points.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import short_run_env

HERE = Path(__file__).resolve().parent

# case -> fragments of the message, each one required (what was wrong, and the fix).
EXPECTED = {
    "dropout_keys": ["dropout needs one PRNG key per example: keys of shape (2,) for activations of shape (4, 3)",
                     "zoo.nn.example_keys(key, batch_size)"],
    "dropout_rate": ["dropout rate must be in [0, 1), got 1.0"],
    "step_mode": ["mode must be 'explicit' or 'shard_map', got 'pmap'"],
    "step_gather": ["gather must be 'per_use' or 'once', got 'twice'"],
    "step_shard_optimizer": ["shard_optimizer must be True or False, got 'data'"],
    "step_microbatches": ["microbatches must be a positive int, got 0"],
    "step_batch": ["global batch size 40 is not divisible by data-parallel size 8 x microbatches 4 = 32",
                   "(e.g. 32 or 64)"],
    "step_loss_shape": ["must return per-example losses `[batch]`", "Got losses of shape () for a microbatch of 4"],
    "mlp_norm": ["norm must be 'layernorm', 'rmsnorm' or None, got 'batchnorm'"],
    "mlp_depth": ["depth must be >= 1 (number of hidden layers), got 0"],
    "feedforward_activation": ["unknown activation 'tanh'; choose one of ['gelu', 'gelu_tanh', 'relu', 'swiglu', 'geglu']"],
    "stacked_remat": ["unknown remat policy 'sometimes'; use one of ['nothing_saveable'"],
    "attention_kv_heads": ["num_kv_heads (3) must divide num_heads (4)"],
    "rope_odd": ["rotary embeddings need an even head_dim, got 7"],
    "config_activation": ["TransformerConfig.activation must be one of ['gelu', 'gelu_tanh', 'relu', 'swiglu', 'geglu'], got 'tanh'"],
    "config_dtype": ["TransformerConfig.dtype must be 'float32', 'bfloat16' or 'float16', got 'int8'"],
    "decoder_too_long": ["sequence length 9 exceeds the model's max_len 8"],
    "lora_bias": ["LoraConfig.bias: only 'none' is supported (biases stay frozen), got 'all'"],
    "lora_init": ["LoraConfig.init_lora_weights must be one of True, False, 'gaussian', 'pissa', 'olora', got 'svd'"],
    "lora_r": ["LoraConfig.r must be a positive int, got 0"],
    "shard_rules_none": ["rules must be a mapping of logical axis name -> mesh axes, got NoneType None",
                         "e.g. zoo.rules('dp')"],
    "shard_rules_name": ["got str 'dp'; for the preset pass zoo.rules('dp')"],
    "collectives_plain_function": ["collectives() got a function with arguments",
                                   "zoo.collectives(jax.jit(f), *args)"],
    "report_not_a_list": ["report() takes the list of Collective that zoo.collectives returns, got str",
                          "zoo.report(zoo.collectives(compiled))"],
    "count_not_a_list": ["count() takes the list of Collective"],
    "step_optimizer_name": ["optimizer must be an optax.GradientTransformation, got str 'adam'",
                            "e.g. optax.adam(1e-3)"],
    "run_config_width_0": ["RunConfig.model_config width=0: width must be an integer >= 1, e.g. width=64"],
    "run_config_bool_text": ["RunConfig.skip_nonfinite must be True or False, got 'no'"],
    "loss_returns_none": ["must return per-example losses `[batch]`", "Got None: does loss_fn end with `return"],
    "loss_returns_3_tuple": ["must return per-example losses `[batch]`", "Got a triple whose third value is a",
                             "not a dict of metrics"],
    "loss_returns_4_tuple": ["must return per-example losses `[batch]`", "Got a tuple of 4 values"],
    "loss_returns_b_plus_1": ["Got losses of shape (9,) for a microbatch of 8 examples"],
}  # fmt: skip

# The cases whose wrong argument is of the wrong type: a TypeError (the rest: ValueError).
TYPE_ERRORS = {"shard_rules_none", "shard_rules_name", "collectives_plain_function", "report_not_a_list",
               "count_not_a_list", "step_optimizer_name"}  # fmt: skip


def _worker(*args: str, checks: str) -> dict:
    """tests/_errors_worker.py's JSON, from a fresh process with ZOO_RUNTIME_CHECKS=`checks`."""
    proc = subprocess.run(
        [sys.executable, str(HERE / "_errors_worker.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=HERE.parent,
        env=short_run_env() | {"JAX_PLATFORMS": "cpu", "ZOO_RUNTIME_CHECKS": checks},
        check=False,  # the code is asserted below
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def unchecked_process() -> dict:
    """The worker's results without the jaxtyping hook: what a user gets by default."""
    return _worker(checks="0")


@pytest.fixture(scope="module")
def unchecked(unchecked_process):
    """Each case's `[exception type, message]`, from a process without the jaxtyping hook."""
    return unchecked_process["cases"]


def test_every_case_is_checked(unchecked):
    assert sorted(unchecked) == sorted(EXPECTED)


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_library_error_without_type_checks(unchecked, case):
    kind, message = unchecked[case]
    want = "builtins.TypeError" if case in TYPE_ERRORS else "builtins.ValueError"
    if case.startswith("run_config_"):
        want = "zoo.train._errors.ConfigError"  # a ValueError
    assert kind == want, (kind, message)  # not jaxtyping's TypeCheckError: no hook
    for fragment in EXPECTED[case]:
        assert fragment in message, (fragment, message)


def test_the_suite_itself_type_checks():
    """The other half of the reason for the subprocess: in this process the annotation
    refuses the same call first (so the in-process tests cannot see the library's text)."""
    import jax
    import jax.numpy as jnp
    import jaxtyping

    import zoo

    keys = zoo.nn.example_keys(jax.random.key(0), 2)
    with pytest.raises(jaxtyping.TypeCheckError):
        zoo.nn.dropout(jnp.ones((4, 3)), 0.5, keys)


# --- shapes and dtypes at model boundaries -----------------------------------------------------


def test_model_entry_points_check_rank_and_dtype_by_default(unchecked_process):
    out = unchecked_process["boundaries"]
    assert out["ok"] is None
    assert out["mlp_int"] == ("TypeError: MLP: x must be a float array, got int32 of shape (3, 4); cast it with "
                              ".astype(jnp.float32)")  # fmt: skip
    assert out["mlp_width"] == "ValueError: MLP: x must end with a dimension of size 4, got shape (3, 5)"
    assert out["lm_float"].startswith("TypeError: Transformer: tokens must be an int array, got float32")
    assert out["lm_rank"] == "ValueError: Transformer: tokens must have 2 dimensions, got shape (4,)"
    assert out["encoder_float"].startswith("TypeError: Encoder: tokens must be an int array")
    assert out["embedding_float"].startswith("TypeError: Embedding: ids must be an int array")
    assert out["loss_2d"].startswith("ValueError: loss_fn(model, batch) must return per-example losses `[batch]`")
    assert "Got losses of shape (4, 1) for a microbatch of 4 examples (reduce the other axes first" in out["loss_2d"]
    assert "Got losses of dtype int32: cast them to float32" in out["loss_int"]
    # Without the runtime checks a Linear's width mismatch is jnp's own error.
    assert out["linear_width"].startswith("ValueError") and "TypeCheckError" not in out["linear_width"]
    # Ids outside the vocabulary: refused where concrete; compiled code holds no check by default.
    assert out["lm_ids_eager"].startswith("ValueError: Embedding of 32 rows: ids holds 40 at position (0, 0)")
    assert out["lm_ids_jit"] is None and out["lm_ids_step"] is None


def test_zoo_runtime_checks_turns_on_beartype_for_the_package():
    out = _worker("boundaries", checks="1")["boundaries"]
    assert out["ok"] is None
    assert out["linear_width"].startswith("TypeCheckError: Type-check error whilst checking the parameters of "
                                          "zoo.nn._linear.Linear.__call__")  # fmt: skip
    # ... and checks ids inside compiled code too: a jitted call and a training step.
    for case in ("lm_ids_jit", "lm_ids_step"):
        assert out[case] is not None and "Embedding of 32 rows: ids outside [0, 32)" in out[case], out[case]

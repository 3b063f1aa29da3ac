"""The library's own error messages, as a user without runtime type checks sees them.

This suite runs with jaxtyping's import hook on (`--jaxtyping-packages` in pyproject), so
for an argument an annotation also refuses (a `Literal`, an array shape) beartype raises
first and the library's own `ValueError` never runs in-process. Those checks are all a user
without the hook gets: one fresh process (tests/_errors_worker.py, plain `import zoo`) runs
a table of bad calls and reports each exception's type and text, checked here.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

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
    "loss_returns_none": ["must return per-example losses `[batch]`", "Got None: does loss_fn end with `return"],
    "loss_returns_3_tuple": ["must return per-example losses `[batch]`", "Got a tuple of 3 values"],
    "loss_returns_b_plus_1": ["Got losses of shape (9,) for a microbatch of 8 examples"],
}  # fmt: skip

# The cases whose wrong argument is of the wrong type: a TypeError (the rest: ValueError).
TYPE_ERRORS = {"shard_rules_none", "shard_rules_name", "collectives_plain_function", "report_not_a_list",
               "count_not_a_list", "step_optimizer_name"}  # fmt: skip


@pytest.fixture(scope="module")
def unchecked():
    """Each case's `[exception type, message]`, from a process without the jaxtyping hook."""
    proc = subprocess.run(
        [sys.executable, str(HERE / "_errors_worker.py")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=HERE.parent,
        check=False,  # the code is asserted below
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_every_case_is_checked(unchecked):
    assert sorted(unchecked) == sorted(EXPECTED)


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_library_error_without_type_checks(unchecked, case):
    kind, message = unchecked[case]
    want = "builtins.TypeError" if case in TYPE_ERRORS else "builtins.ValueError"
    if case == "run_config_width_0":
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

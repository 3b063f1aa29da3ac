"""A fresh process for tests/test_errors.py: zoo as a user imports it, without jaxtyping's
import hook, so the library's own argument checks are what raises.

    python tests/_errors_worker.py             # {"cases": {case: [type, text]}, "boundaries": {...}}
    python tests/_errors_worker.py boundaries  # {"boundaries": {...}} only

`cases`: every one fails before anything is compiled. `boundaries`: calls at the models'
entry points and a training step's loss (shapes, dtypes, ids outside the vocabulary), what a
user gets by default (ZOO_RUNTIME_CHECKS=0) or with ZOO_RUNTIME_CHECKS=1 (read as zoo is
imported: a process each). conftest is not imported: the pytest process's hook stays out.
"""

import json
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import zoo  # noqa: E402


def _mse(model, batch):
    x, y = batch
    return jnp.mean(jnp.square(model(x) - y), axis=-1)


def _decoder(**overrides):
    config = {"vocab_size": 32, "d_model": 16, "num_heads": 4, "num_layers": 1, "max_len": 8} | overrides
    return zoo.models.Transformer(zoo.models.TransformerConfig(**config), key=jax.random.key(0))


def _step_on_indivisible_batch():
    mesh = jax.make_mesh((8,), ("data",))
    model = zoo.nn.MLP(3, 1, 4, 1, key=jax.random.key(0))
    step = zoo.TrainStep(_mse, optax.sgd(0.1), microbatches=4)
    with jax.set_mesh(mesh):
        model = zoo.shard(model, zoo.rules("dp"), mesh)
        step.check((jnp.ones((40, 3)), jnp.ones((40, 1))))


def _per_batch_loss():
    model = zoo.nn.MLP(3, 1, 4, 1, key=jax.random.key(0))
    step = zoo.TrainStep(lambda m, b: _mse(m, b).mean(), optax.sgd(0.1))
    step.loss_and_grads(model, (jnp.ones((4, 3)), jnp.ones((4, 1))))


def _loss_returning(make):
    """A step's loss that returns `make(per-example losses)`, run on an 8-device mesh."""
    mesh = jax.make_mesh((8,), ("data",))
    with jax.set_mesh(mesh):
        model = zoo.shard(zoo.nn.MLP(3, 1, 4, 1, key=jax.random.key(0)), zoo.rules("dp"), mesh)
        step = zoo.TrainStep(lambda m, b: make(_mse(m, b)), optax.sgd(0.1))
        step.loss_and_grads(model, (jnp.ones((8, 3)), jnp.ones((8, 1))))


def _mlp():
    return zoo.nn.MLP(3, 1, 4, 1, key=jax.random.key(0))


KEYS = zoo.nn.example_keys(jax.random.key(0), 2)

# Each case: a call that must fail. Most of these arguments are also refused by an
# annotation (a Literal, an array shape), so with runtime type checks on, beartype raises
# first and the library's own check never runs; here it does.
CASES = {
    "dropout_keys": lambda: zoo.nn.dropout(jnp.ones((4, 3)), 0.5, KEYS),
    "dropout_rate": lambda: zoo.nn.dropout(jnp.ones((2, 3)), 1.0, KEYS),
    "step_mode": lambda: zoo.TrainStep(_mse, optax.sgd(0.1), mode="pmap"),
    "step_gather": lambda: zoo.TrainStep(_mse, optax.sgd(0.1), gather="twice"),
    "step_shard_optimizer": lambda: zoo.TrainStep(_mse, optax.sgd(0.1), shard_optimizer="data"),
    "step_microbatches": lambda: zoo.TrainStep(_mse, optax.sgd(0.1), microbatches=0),
    "step_batch": _step_on_indivisible_batch,
    "step_loss_shape": _per_batch_loss,
    "mlp_norm": lambda: zoo.nn.MLP(2, 2, 4, 1, norm="batchnorm", key=jax.random.key(0)),
    "mlp_depth": lambda: zoo.nn.MLP(2, 2, 4, 0, key=jax.random.key(0)),
    "feedforward_activation": lambda: zoo.nn.FeedForward(8, 16, activation="tanh", key=jax.random.key(0)),
    "stacked_remat": lambda: zoo.nn.Stacked(
        lambda k: zoo.nn.Linear(2, 2, key=k), 2, remat="sometimes", key=jax.random.key(0)
    ),
    "attention_kv_heads": lambda: zoo.nn.Attention(16, 4, num_kv_heads=3, key=jax.random.key(0)),
    "rope_odd": lambda: zoo.nn.rope_tables(4, 7),
    "config_activation": lambda: zoo.models.TransformerConfig(
        vocab_size=8, d_model=16, num_heads=4, num_layers=1, activation="tanh"
    ),
    "config_dtype": lambda: zoo.models.TransformerConfig(
        vocab_size=8, d_model=16, num_heads=4, num_layers=1, dtype="int8"
    ),
    "decoder_too_long": lambda: _decoder()(jnp.zeros((1, 9), jnp.int32)),
    "lora_bias": lambda: zoo.lora.LoraConfig(r=4, bias="all"),
    "lora_init": lambda: zoo.lora.LoraConfig(r=4, init_lora_weights="svd"),
    "lora_r": lambda: zoo.lora.LoraConfig(r=0),
    # Misuses that ended in a Python or jax error of their own before.
    "shard_rules_none": lambda: zoo.shard(_mlp(), None, jax.make_mesh((8,), ("data",))),
    "shard_rules_name": lambda: zoo.shard(_mlp(), "dp", jax.make_mesh((8,), ("data",))),
    "collectives_plain_function": lambda: zoo.collectives(lambda x: x, jnp.ones(2)),
    "report_not_a_list": lambda: zoo.report("x"),
    "count_not_a_list": lambda: zoo.count("x"),
    "step_optimizer_name": lambda: zoo.TrainStep(_mse, "adam"),
    "run_config_width_0": lambda: zoo.train.RunConfig(model="mlp", model_config={"width": 0}),
    "run_config_bool_text": lambda: zoo.train.RunConfig(model="mlp", skip_nonfinite="no"),
    "loss_returns_none": lambda: _loss_returning(lambda losses: None),
    "loss_returns_3_tuple": lambda: _loss_returning(lambda losses: (losses, losses, losses)),
    "loss_returns_4_tuple": lambda: _loss_returning(lambda losses: (losses, losses, losses, losses)),
    "loss_returns_b_plus_1": lambda: _loss_returning(lambda losses: jnp.zeros(losses.shape[0] + 1) + losses.sum()),
}


def _error(f) -> str | None:
    """The exception `f()` raises, as "Type: first line of its text" (None if none)."""
    try:
        f()
    except Exception as e:  # noqa: BLE001 (the type is the result)
        return type(e).__name__ + ": " + str(e).splitlines()[0]
    return None


def _full_error(f) -> str | None:
    """As `_error`, the whole text: equinox's runtime errors put the message below a first
    line of their own."""
    try:
        f()
    except Exception as e:  # noqa: BLE001 (the type is the result)
        return type(e).__name__ + ": " + str(e)
    return None


def boundaries() -> dict[str, str | None]:
    """Calls at the models' entry points and a step's loss, each one's error (None: none)."""
    import equinox as eqx

    mlp = zoo.nn.MLP(4, 1, 8, 2, key=jax.random.key(0))
    config = {"vocab_size": 32, "d_model": 16, "num_heads": 2, "num_layers": 1, "max_len": 8}
    lm = zoo.models.Transformer(zoo.models.TransformerConfig(**config), key=jax.random.key(0))
    enc = zoo.models.Encoder(zoo.models.EncoderConfig(**config), key=jax.random.key(0))
    emb = zoo.nn.Embedding(10, 4, key=jax.random.key(0))
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    step = zoo.TrainStep(lambda m, b: (m(b["x"]) - b["y"]) ** 2, optax.sgd(0.1))
    int_loss = zoo.TrainStep(lambda m, b: (m(b["x"])[:, 0] > 0).astype(jnp.int32), optax.sgd(0.1))
    batch = {"x": jnp.ones((4, 4)), "y": jnp.ones((4, 1))}
    lm_step = zoo.TrainStep(zoo.models.next_token_loss, optax.sgd(0.1))
    bad_ids = jnp.full((2, 8), 40, jnp.int32)  # vocab 32: a lookup clamps them to row 31
    with jax.set_mesh(mesh):
        placed = zoo.shard(mlp, zoo.rules("dp"), mesh)
        placed_lm = zoo.shard(lm, zoo.rules("dp"), mesh)

        def lm_step_on_bad_ids():
            jax.block_until_ready(lm_step(placed_lm, lm_step.init(placed_lm), {"tokens": bad_ids}))

        return {
            "lm_ids_eager": _error(lambda: lm(bad_ids)),
            "lm_ids_jit": _full_error(lambda: jax.block_until_ready(eqx.filter_jit(lm)(bad_ids))),
            "lm_ids_step": _full_error(lm_step_on_bad_ids),
            "mlp_int": _error(lambda: eqx.filter_jit(mlp)(jnp.ones((3, 4), jnp.int32))),
            "mlp_width": _error(lambda: mlp(jnp.ones((3, 5)))),
            "lm_float": _error(lambda: lm(jnp.ones((2, 4)))),
            "lm_rank": _error(lambda: lm(jnp.ones((4,), jnp.int32))),
            "encoder_float": _error(lambda: enc(jnp.ones((2, 4)))),
            "embedding_float": _error(lambda: emb(jnp.ones((3,)))),
            "loss_2d": _error(lambda: step(placed, step.init(placed), batch)),
            "loss_int": _error(lambda: int_loss(placed, int_loss.init(placed), batch)),
            "linear_width": _error(lambda: zoo.nn.Linear(4, 3, key=jax.random.key(0))(jnp.ones((2, 5)))),
            "ok": _error(lambda: eqx.filter_jit(mlp)(jnp.ones((3, 4)))),
        }


def main() -> None:
    results = {}
    if sys.argv[1:] != ["boundaries"]:
        results["cases"] = {}
        for name, case in CASES.items():
            try:
                case()
            except Exception as e:  # noqa: BLE001 (the type is the result: a TypeCheckError here is a failure)
                results["cases"][name] = [f"{type(e).__module__}.{type(e).__qualname__}", str(e)]
            else:
                results["cases"][name] = ["no error", ""]
    results["boundaries"] = boundaries()
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()

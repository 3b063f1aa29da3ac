"""The README's example: train the zoo MLP on 8 simulated devices, print the collectives."""

import jax, jax.numpy as jnp, optax
jax.config.update("jax_num_cpu_devices", 8)  # simulated devices; before jax starts
import zoo

mesh = jax.make_mesh((8,), ("data",))
model = zoo.nn.MLP(16, 1, width=64, depth=4, norm="layernorm", scan=True, key=jax.random.key(0))

def loss_fn(model, batch):                   # per-example losses, shape [batch]
    x, y = batch
    return jnp.mean((model(x) - y) ** 2, axis=-1)

x = jax.random.normal(jax.random.key(1), (256, 16)); y = jnp.sin(x[:, :1])
with jax.set_mesh(mesh):
    model = zoo.shard(model, zoo.rules("dp"), mesh)            # place by annotations
    step = zoo.TrainStep(loss_fn, optax.adamw(3e-3), microbatches=4)
    opt_state = step.init(model)
    for _ in range(100):
        model, opt_state, loss = step(model, opt_state, (x, y))
    print(zoo.report(zoo.collectives(step.lower(model, opt_state, (x, y)))))

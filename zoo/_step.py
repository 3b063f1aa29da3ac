"""The training step: reduced cast → scan over microbatches → one all-reduce → optax."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from ._batch import (
    check_batch,
    data_axes_tuple,
    data_parallel_size,
    require_explicit,
    shard_batch,
    split_local_microbatches,
    split_microbatches,
)
from ._reduced import (
    FilterSpec,
    gather_over,
    manual_specs,
    pcast_unreduced,
    pcast_varying,
    plain_spec,
    reduce_unreduced,
    reduced_cast,
    reshard_tree,
    sharded_over,
    split_spec,
    unreduced_zeros,
)
from ._rules import batch_spec

Mode = Literal["explicit", "shard_map"]
Gather = Literal["per_use", "once"]
LossFn = Callable[[Any, Any], Any]

_LOSS_CONTRACT = (
    "loss_fn(model, batch) must return per-example losses `[batch]` (the step averages them "
    "over the global batch), or a pair `(loss_sums, weights)` of `[batch]` arrays (the step "
    "returns sum(loss_sums) / sum(weights) over the global batch, e.g. token-weighted means)."
)


def partition_trainable(model: Any, trainable: FilterSpec) -> tuple[Any, Any]:
    """Split `model` into (trainable float arrays, everything else), like `eqx.partition`.

    Leaves the filter selects but that are not inexact arrays (integer buffers, static
    values) go to the frozen side: they cannot have gradients.
    """
    selected, frozen = eqx.partition(model, trainable)
    params, extra = eqx.partition(selected, eqx.is_inexact_array)
    return params, eqx.combine(frozen, extra)


def _per_example(loss_fn: LossFn, model: Any, microbatch: Any, size: int):
    out = loss_fn(model, microbatch)
    losses, weights = out if isinstance(out, tuple) else (out, None)
    for name, arr in (("losses", losses), ("weights", weights)):
        if arr is None:
            continue
        if not hasattr(arr, "shape") or arr.ndim < 1 or arr.shape[0] != size:
            raise ValueError(
                f"{_LOSS_CONTRACT} Got {name} of shape {getattr(arr, 'shape', type(arr))} for a "
                f"microbatch of {size} examples."
            )
    return losses, weights


def _sum(x: jax.Array | None, axes: tuple[str, ...] | None) -> jax.Array | None:
    """Sum to a scalar; with `axes`, leave the cross-device part unreduced (no collective)."""
    if x is None:
        return None
    x = x.astype(jnp.float32)
    out_sharding = None if axes is None else P(unreduced=set(axes))
    return lax.reduce_sum(x, tuple(range(x.ndim)), out_sharding=out_sharding)


class _Jit:
    """`jax.jit` over a function of pytrees holding arrays and static leaves.

    Like `eqx.filter_jit` (arrays traced, everything else static), but dispatch stays
    asynchronous: equinox 0.13's `filter_jit` blocks until every call has finished, which
    would stop a training loop from queueing the next step or loading data meanwhile.
    """

    def __init__(self, fn: Callable, *, donate: tuple[int, ...] = ()):
        self._out_static: dict[Any, Any] = {}
        
        def run(static, *dynamic):
            in_treedef, in_static_leaves = static
            flat = [leaf for group in dynamic for leaf in group]
            args = jax.tree.unflatten(in_treedef, _merge(flat, in_static_leaves))
            out_leaves, out_treedef = jax.tree.flatten(fn(*args))
            arrays, out_static_leaves = _split(out_leaves)
            self._out_static[static] = (out_treedef, out_static_leaves)
            return arrays

        # The name shows in HLO op names: jit(train_step)/reshard.
        run.__name__ = getattr(fn, "__name__", "step").lstrip("_")
        self._jitted = jax.jit(run, static_argnums=(0,), donate_argnums=tuple(i + 1 for i in donate))

    def _prepare(self, args):
        leaves, treedef = jax.tree.flatten(args)
        arrays, static_leaves = _split(leaves)
        # One dynamic argument per top-level argument, so donation can pick them.
        counts = [len(jax.tree.leaves(a)) for a in args]
        groups, start = [], 0
        for c in counts:
            groups.append(arrays[start : start + c])
            start += c
        return (treedef, static_leaves), groups

    def __call__(self, *args):
        static, groups = self._prepare(args)
        arrays = self._jitted(static, *groups)
        out_treedef, out_static_leaves = self._out_static[static]
        return jax.tree.unflatten(out_treedef, _merge(arrays, out_static_leaves))

    def lower(self, *args):
        static, groups = self._prepare(args)
        return self._jitted.lower(static, *groups)

    def compile(self, *args) -> "Compiled":
        static, groups = self._prepare(args)
        return Compiled(self, static, self._jitted.lower(static, *groups).compile())


def _bounded_queue(owner: Any, latest: Any) -> None:
    """Keep at most two dispatched steps of `owner` unfinished: wait for the older one."""
    previous = getattr(owner, "_in_flight", None)
    if previous is not None:
        jax.block_until_ready(previous)
    owner._in_flight = latest


class Compiled:
    """A compiled step that can be both inspected and run, so the program whose collectives
    and memory you read is the one that runs.

    `compiled` is the `jax.stages.Compiled` (`zoo.collectives(this)` reads it; so do
    `.as_text()`, `.memory_analysis()`, `.cost_analysis()`). Calling it runs the program on
    arguments with the same structure, shapes and shardings as those it was compiled for.
    """

    def __init__(self, jit: "_Jit", static, compiled: jax.stages.Compiled):
        self._jit, self._static, self.compiled = jit, static, compiled

    def as_text(self) -> str:
        """The optimised HLO text of the program."""
        return self.compiled.as_text()

    def memory_analysis(self) -> Any:
        """XLA's memory analysis (argument, output and temporary bytes) of the program."""
        return self.compiled.memory_analysis()

    def cost_analysis(self) -> Any:
        """XLA's cost analysis (flops, bytes accessed) of the program."""
        return self.compiled.cost_analysis()

    def __call__(self, *args):
        out = self._run(*args)
        # Wait on the last output only (a step's loss): the others may be donated later.
        _bounded_queue(self, jax.tree.leaves(out)[-1:])
        return out

    def _run(self, *args):
        static, groups = self._jit._prepare(args)
        if static != self._static:
            raise ValueError(
                "these arguments differ in structure or static values from the ones the step was "
                "compiled for; compile again for them (or call the TrainStep itself)"
            )
        out_treedef, out_static_leaves = self._jit._out_static[static]
        return jax.tree.unflatten(out_treedef, _merge(self.compiled(*groups), out_static_leaves))


class _Static:
    """Marks a non-array leaf's slot; hashable so it can be part of a static argument."""

    def __init__(self, value):
        self.value = value

    def __hash__(self):
        return hash(self.value)

    def __eq__(self, other):
        return isinstance(other, _Static) and self.value == other.value


def _split(leaves):
    """Leaves → (array leaves with None in static slots, static leaves as a tuple)."""
    arrays = [x if eqx.is_array(x) else None for x in leaves]
    static = tuple(None if eqx.is_array(x) else _Static(x) for x in leaves)
    return arrays, static


def _merge(arrays, static):
    """Inverse of `_split`."""
    return [s.value if s is not None else a for a, s in zip(arrays, static)]


def _require_replicated_off_data(params, frozen, data_axes) -> None:
    """shard_map mode is manual over every mesh axis, so no array may be split over one."""
    mesh = jax.sharding.get_abstract_mesh()
    others = frozenset(mesh.axis_names) - set(data_axes)
    for leaf in jax.tree.leaves(eqx.filter((params, frozen), eqx.is_array)):
        if sharded_over(leaf, others):
            raise ValueError(
                f"a parameter of shape {leaf.shape} is sharded over mesh axes "
                f"{sorted(others & set(jax.tree.leaves(tuple(plain_spec(leaf)))))}; shard_map mode runs "
                "manual over every mesh axis (jax 0.10.2 takes reduced in_specs only in full "
                "manual mode), so parameters must be replicated off the data axes. Use "
                "mode='explicit' for tensor-parallel layouts."
            )


def _out_specs(carry: dict, params: Any, grad_specs: Any = None) -> dict:
    """Where the reduced carry lands: scalars replicated, gradients in their params' layout
    or in `grad_specs` (for a layout split over the data axes that reduction is a
    reduce-scatter: FSDP parameters, or the optimizer-state shards of `shard_optimizer`)."""
    out = {name: P() for name in carry if name != "grads"}
    out["grads"] = jax.tree.map(plain_spec, params) if grad_specs is None else grad_specs
    return out


def _array_specs(tree: Any) -> Any:
    """The plain `PartitionSpec` of each array leaf of `tree` (arrays or shape structs)."""

    def one(x):
        sharding = getattr(x, "sharding", None)
        if isinstance(x, jax.ShapeDtypeStruct):
            spec = sharding.spec if sharding is not None else P()
            return P(*spec, *([None] * (x.ndim - len(spec))))
        return plain_spec(x)

    return jax.tree.map(one, eqx.filter(tree, lambda x: eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)))


def _accumulate_body(objective, params):
    """Scan body: add one microbatch's loss (and weight) and gradients to the carry."""

    def body(carry, microbatch):
        (loss, weight), grads = jax.value_and_grad(objective, has_aux=True)(params, microbatch)
        new = {"loss": carry["loss"] + loss, "grads": jax.tree.map(jnp.add, carry["grads"], grads)}
        if "weight" in carry:
            new["weight"] = carry["weight"] + weight
        return new, None

    return body


class TrainStep:
    """A compiled training step whose gradient all-reduce runs exactly once, after the loop.

    The path: partition trainable/frozen → cast trainable leaves to reduced (free) →
    `lax.scan` over microbatches accumulating unreduced gradients and loss → one reshard
    (the all-reduce) → optax update on plain arrays. Parameters and optimizer state are
    plain at rest. The loss and gradients are means over the global batch, so they do not
    depend on the number of devices or microbatches.

    Call it under `jax.set_mesh(mesh)` with a model placed by `zoo.shard`; without a mesh it
    runs on one device with the same microbatching.
    """

    def __init__(
        self,
        loss_fn: LossFn,
        optimizer: optax.GradientTransformation,
        *,
        microbatches: int = 1,
        trainable: FilterSpec = eqx.is_inexact_array,
        mode: Mode = "explicit",
        data_axes: str | tuple[str, ...] = "data",
        gather: Gather = "per_use",
        shard_optimizer: bool = False,
        donate: bool = False,
    ):
        """**Arguments:**

        - `loss_fn`: `loss_fn(model, batch)` → per-example losses `[b]`, or a pair
          `(loss_sums [b], weights [b])` for weighted means (e.g. masked tokens).
        - `optimizer`: any `optax.GradientTransformation`.
        - `microbatches`: M; the global batch is split into M microbatches per step.
        - `trainable`: which leaves train, as in `eqx.partition` (bool pytree prefix or a
          callable). Frozen leaves get no gradient computed and no communication.
        - `mode`: `"explicit"` (global-view code under explicit sharding) or `"shard_map"`
          (the microbatch loop runs per device inside `jax.shard_map`).
        - `data_axes`: the mesh axis (or axes) the batch is split over.
        - `gather`: what happens to parameters split over the data axes (FSDP layouts).
          `"per_use"`: each layer all-gathers its weight when it uses it and the gradient
          is reduce-scattered per microbatch (least memory; communication in the loop).
          `"once"`: all-gather every parameter once per step into a reduced copy,
          accumulate unreduced gradients, reduce-scatter once after the loop (one full
          copy of the parameters in memory for the step; no communication in the loop).
          Parameters not split over the data axes are unaffected.
        - `shard_optimizer`: ZeRO-1 (the `"zero1"` preset). The optimizer state is kept
          split over the data axes: each trainable leaf's moments are split along the
          first dimension that is not already sharded and that the data-parallel size N
          divides (`zoo.split_spec`); leaves with no such dimension, and scalars such as
          Adam's count, stay replicated. `init` places the state that way. In the step,
          after the microbatch loop, the accumulated gradients are reduced straight into
          that layout (one reduce-scatter; XLA's CPU backend emits it as all-reduce +
          dynamic-slice), the parameters are sliced to the same layout (local, free),
          `optimizer.update` and `apply_updates` run on the shards, and the updated
          parameters are all-gathered once back to their own layout. Optimizer-state
          memory per device falls about N-fold; no collective enters the loop. The
          optimizer sees global-view arrays, so any optax transformation gives the
          unsharded result: a global norm (`optax.clip_by_global_norm`) adds an
          all-reduce of per-device partial sums of squares, outside the loop (XLA may
          merge those scalars into the gradient reductions; see docs/design.md). Parameters
          already split over the data axes (FSDP) keep their layout. No effect without a
          mesh or with one data shard. Works in both modes.
        - `donate`: donate the model and optimizer state buffers to the step.
        """
        if mode not in ("explicit", "shard_map"):
            raise ValueError(f"mode must be 'explicit' or 'shard_map', got {mode!r}")
        if gather not in ("per_use", "once"):
            raise ValueError(f"gather must be 'per_use' or 'once', got {gather!r}")
        if not isinstance(shard_optimizer, bool):
            raise ValueError(f"shard_optimizer must be True or False, got {shard_optimizer!r}")
        if not isinstance(microbatches, int) or microbatches < 1:
            raise ValueError(f"microbatches must be a positive int, got {microbatches!r}")
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.microbatches = microbatches
        self.trainable = trainable
        self.mode = mode
        self.data_axes = data_axes_tuple(data_axes)
        self.gather = gather
        self.shard_optimizer = shard_optimizer
        self._grads = _Jit(self._loss_and_grads)
        self._init = _Jit(self._sharded_init)
        self._step = _Jit(self._train_step, donate=(0, 1) if donate else ())

    # -- public API -------------------------------------------------------------------
    def partition(self, model: Any) -> tuple[Any, Any]:
        """(trainable float leaves, frozen rest) of `model` under this step's filter."""
        return partition_trainable(model, self.trainable)

    def init(self, model: Any) -> optax.OptState:
        """The optimizer state for `model`'s trainable leaves (plain arrays, like the params).

        With `shard_optimizer=True` (under a mesh with more than one data shard) each leaf
        is split over the data axes as described in `__init__`; call it under the mesh.
        """
        params = self.partition(model)[0]
        if not self._zero():
            return self.optimizer.init(params)
        return self._init(params)

    def _sharded_init(self, params):
        # Moments built from the sliced parameters (`zeros_like`) inherit their layout.
        return self.optimizer.init(reshard_tree(params, self._shard_specs(params)))

    def check(self, batch: Any) -> int:
        """Raise a clear error unless the batch divides into devices × microbatches."""
        mesh = jax.sharding.get_abstract_mesh()
        return check_batch(batch, data_parallel_size(mesh, self.data_axes), self.microbatches)

    def loss_and_grads(self, model: Any, batch: Any) -> tuple[jax.Array, Any]:
        """(mean loss, mean gradients of the trainable leaves; `None` for frozen leaves)."""
        self.check(batch)
        return self._grads(model, batch)

    def __call__(self, model: Any, opt_state: optax.OptState, batch: Any):
        """One optimizer step. Returns `(model, opt_state, loss)`.

        Dispatch is asynchronous, with at most two steps in flight: before queueing a
        step, the one before the last is waited for. The next batch still loads while a
        step runs, and a loop that never reads the loss cannot pile up an unbounded queue
        of multi-device programs (a long queue of them once stalled XLA's CPU collectives).
        """
        self.check(batch)
        out = self._step(model, opt_state, batch)
        _bounded_queue(self, out[2])
        return out

    def lower(self, model: Any, opt_state: optax.OptState, batch: Any):
        """The lowered step (`.compile()` it, or hand it to `zoo.collectives`)."""
        self.check(batch)
        return self._step.lower(model, opt_state, batch)

    def compile(self, model: Any, opt_state: optax.OptState, batch: Any) -> Compiled:
        """The compiled step for these arguments: inspect it (`zoo.collectives(compiled)`,
        `.memory_analysis()`) and run it (`compiled(model, opt_state, batch)`) without
        compiling twice."""
        self.check(batch)
        return self._step.compile(model, opt_state, batch)

    # -- traced -----------------------------------------------------------------------
    def _zero(self) -> bool:
        """Whether the optimizer state is sharded here (option on, more than one data shard)."""
        mesh = jax.sharding.get_abstract_mesh()
        return self.shard_optimizer and not mesh.empty and data_parallel_size(mesh, self.data_axes) > 1

    def _shard_specs(self, params):
        """The ZeRO layout of each trainable leaf (and so of its optimizer moments)."""
        n = data_parallel_size(jax.sharding.get_abstract_mesh(), self.data_axes)
        return jax.tree.map(lambda x: split_spec(x, self.data_axes, n), params)

    def _train_step(self, model, opt_state, batch):
        if self._zero():
            return self._sharded_train_step(model, opt_state, batch)
        loss, grads = self._loss_and_grads(model, batch)
        params, frozen = self.partition(model)
        updates, opt_state = self.optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return eqx.combine(params, frozen), opt_state, loss

    def _sharded_train_step(self, model, opt_state, batch):
        """ZeRO-1: reduce-scatter the gradients, update the shards, all-gather the params."""
        params, frozen = self.partition(model)
        shard_specs = self._shard_specs(params)
        # The loop, then one reduction of the accumulator straight into the shards' layout.
        loss, grads = self._loss_and_grads(model, batch, grad_specs=shard_specs)
        shards = reshard_tree(params, shard_specs)  # replicated → split: a local slice
        state_specs = _array_specs(jax.eval_shape(self.optimizer.init, shards))
        opt_state = reshard_tree(opt_state, state_specs)  # no-op for a state from `init`
        updates, opt_state = self.optimizer.update(grads, opt_state, shards)
        shards = optax.apply_updates(shards, updates)
        params = reshard_tree(shards, jax.tree.map(plain_spec, params))  # the all-gather
        return eqx.combine(params, frozen), reshard_tree(opt_state, state_specs), loss

    def _loss_and_grads(self, model, batch, grad_specs=None):
        mesh = jax.sharding.get_abstract_mesh()
        params, frozen = self.partition(model)
        size = check_batch(batch, data_parallel_size(mesh, self.data_axes), self.microbatches)
        if mesh.empty:
            loss_sum, weight, grads = self._accumulate(params, frozen, batch, None, 1)
        elif self.mode == "explicit" or data_parallel_size(mesh, self.data_axes) == 1:
            # One data shard leaves nothing to reduce; jax 0.10.2 also fails to lower
            # unreduced shard_map outputs over a size-1 axis, so run the explicit path.
            require_explicit(mesh)
            n = data_parallel_size(mesh, self.data_axes)
            loss_sum, weight, grads = self._accumulate(params, frozen, batch, self.data_axes, n, grad_specs)
        else:
            loss_sum, weight, grads = self._accumulate_shard_map(params, frozen, batch, grad_specs)
        if weight is None:
            weight = size
        grads = jax.tree.map(lambda g: (g / weight).astype(g.dtype), grads)
        return loss_sum / weight, grads

    def _accumulate(self, params, frozen, batch, axes, n, grad_specs=None):
        """Explicit mode (or no mesh when `axes` is None): sums over the global batch."""
        m = self.microbatches
        if axes is not None:
            batch = shard_batch(batch, axes)
            params_view = reduced_cast(params, axes=axes, gather=self.gather == "once")
            if self.gather == "once":
                frozen = gather_over(frozen, axes=axes)  # once, not per layer per microbatch
            microbatches = split_microbatches(batch, m, n, axes)
            zeros = unreduced_zeros(params_view, axes=axes)
            scalar_zero = jax.reshard(jnp.zeros((), jnp.float32), P(unreduced=set(axes)))
        else:
            params_view = params
            microbatches = split_local_microbatches(batch, m)
            zeros = jax.tree.map(jnp.zeros_like, params)
            scalar_zero = jnp.zeros((), jnp.float32)
        mb_size = jax.tree.leaves(microbatches)[0].shape[1]

        def objective(p, mb):
            losses, weights = _per_example(self.loss_fn, eqx.combine(p, frozen), mb, mb_size)
            return _sum(losses, axes), _sum(weights, axes)

        weighted = self._returns_weights(params, frozen, batch)

        init = {"loss": scalar_zero, "grads": zeros}
        if weighted:
            init["weight"] = scalar_zero
        carry, _ = lax.scan(_accumulate_body(objective, params_view), init, microbatches)
        if axes is not None:
            carry = reduce_unreduced(carry, _out_specs(carry, params, grad_specs))  # the one all-reduce
        return carry["loss"], carry.get("weight"), carry["grads"]

    def _accumulate_shard_map(self, params, frozen, batch, grad_specs=None):
        """Manual mode: the loop runs per device; varying partial sums leave it unreduced."""
        axes, m = self.data_axes, self.microbatches
        params_view = reduced_cast(params, axes=axes, gather=self.gather == "once")
        if self.gather == "once":
            frozen = gather_over(frozen, axes=axes)
        param_specs = manual_specs(params_view, axes=axes, state="reduced")  # checks the layout
        _require_replicated_off_data(params_view, frozen, axes)
        batch = shard_batch(batch, axes)
        frozen_arrays, frozen_static = eqx.partition(frozen, eqx.is_array)
        weighted = self._returns_weights(params, frozen, batch)

        def body_fn(p_reduced, frozen_arrays, local_batch):
            p = pcast_varying(p_reduced, axes=axes)
            fz = eqx.combine(frozen_arrays, frozen_static)
            microbatches = split_local_microbatches(local_batch, m)
            mb_size = jax.tree.leaves(microbatches)[0].shape[1]

            def objective(p, mb):
                losses, weights = _per_example(self.loss_fn, eqx.combine(p, fz), mb, mb_size)
                return _sum(losses, None), _sum(weights, None)

            zero = pcast_varying(jnp.zeros((), jnp.float32), axes=axes)
            init = {"loss": zero, "grads": jax.tree.map(jnp.zeros_like, p)}
            if weighted:
                init["weight"] = zero
            carry, _ = lax.scan(_accumulate_body(objective, p), init, microbatches)
            return pcast_unreduced(carry, axes=axes)

        unreduced = P(unreduced=set(axes))
        out_specs = {"loss": unreduced, "grads": manual_specs(params_view, axes=axes, state="unreduced")}
        if weighted:
            out_specs["weight"] = unreduced
        in_specs = (
            param_specs,
            jax.tree.map(lambda x: P(*([None] * x.ndim)), frozen_arrays),
            jax.tree.map(lambda x: batch_spec(x.ndim, axes), batch),
        )
        # Manual over every mesh axis: jax 0.10.2 accepts reduced in_specs only then.
        mapped = jax.shard_map(body_fn, in_specs=in_specs, out_specs=out_specs)
        carry = mapped(params_view, frozen_arrays, batch)
        carry = reduce_unreduced(carry, _out_specs(carry, params, grad_specs))  # the one all-reduce
        return carry["loss"], carry.get("weight"), carry["grads"]

    def _returns_weights(self, params, frozen, batch) -> bool:
        """Whether `loss_fn` returns `(loss_sums, weights)` (decided by abstract evaluation)."""
        rows = jax.tree.leaves(batch)[0].shape[0] // self.microbatches

        def like(x):
            # A microbatch as the loop sees it: same dtype and sharding, fewer rows.
            return jax.ShapeDtypeStruct((rows, *x.shape[1:]), x.dtype, sharding=jax.typeof(x).sharding)

        example = jax.tree.map(like, batch)
        out = jax.eval_shape(lambda p, mb: self.loss_fn(eqx.combine(p, frozen), mb), params, example)
        return isinstance(out, tuple)

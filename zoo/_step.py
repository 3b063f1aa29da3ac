"""The training step: reduced cast → scan over microbatches → one all-reduce → optax."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from ._accumulate import accumulate
from ._batch import check_batch, data_axes_tuple, data_parallel_size, require_explicit
from ._budget import LEAF_SCALAR_BYTES, LOSS_SCALAR_BYTES, Budget, replica_bytes, split_over, step_budget
from ._inspect import collectives
from ._jit import Compiled, Jit, bounded_queue
from ._presets import Gather, Preset
from ._presets import preset as _preset
from ._reduced import FilterSpec
from ._tree import is_array_like, is_inexact_array_like
from ._zero import shard_specs, sharded_init, sharded_update, zero_active

Mode = Literal["explicit", "shard_map"]
LossFn = Callable[[Any, Any], Any]

LOSS_CONTRACT = (
    "loss_fn(model, batch) must return per-example losses `[batch]` (the step averages them "
    "over the global batch), or a pair `(loss_sums, weights)` of `[batch]` arrays (the step "
    "returns sum(loss_sums) / sum(weights) over the global batch, e.g. token-weighted means; a "
    "batch whose weights sum to 0 gives loss 0 and zero gradients), or a triple `(loss_sums, "
    "weights, metrics)` with `metrics` a dict of per-example sums `[batch]` the step reports "
    "beside the loss, each divided by the same weights (the step then returns them as a fourth "
    "output)."
)


def per_example(loss_fn: LossFn) -> Callable[[Any, Any], tuple[Any, Any, dict[str, Any]]]:
    """`loss_fn` held to `LOSS_CONTRACT`: `(model, microbatch)` → `(losses, weights or None,
    metrics)`, with a clear error when what it returns does not have one entry per example."""

    def checked(model, microbatch):
        size = jax.tree.leaves(microbatch)[0].shape[0]
        out = loss_fn(model, microbatch)
        if out is None:
            raise ValueError(f"{LOSS_CONTRACT} Got None: does loss_fn end with `return losses`?")
        if isinstance(out, tuple | list) and len(out) not in (2, 3):
            raise ValueError(
                f"{LOSS_CONTRACT} Got a {type(out).__name__} of {len(out)} values: return one array, a pair or a "
                "triple."
            )
        losses, weights, metrics = (*out, {})[:3] if isinstance(out, tuple | list) else (out, None, {})
        if not isinstance(metrics, dict):
            raise ValueError(
                f"{LOSS_CONTRACT} Got a triple whose third value is a {type(metrics).__name__}, not a dict of "
                "metrics: return (loss_sums, weights, {'name': per_example_sums}), or the pair alone."
            )
        if metrics and weights is None:
            raise ValueError(
                f"{LOSS_CONTRACT} Got metrics with weights None: each metric is divided by the weights' sum, so "
                "return (loss_sums, weights, metrics) with the weights (ones for a plain mean)."
            )
        named = {f"metric {k!r}": v for k, v in metrics.items()}
        for name, arr in (("losses", losses), ("weights", weights), *named.items()):
            if arr is None and name == "losses":
                raise ValueError(f"{LOSS_CONTRACT} Got (None, weights): the loss sums come first.")
            if arr is None and name == "weights":
                continue
            if not hasattr(arr, "shape") or arr.ndim != 1 or arr.shape[0] != size:
                extra = " (reduce the other axes first, e.g. .mean(axis=-1))" if getattr(arr, "ndim", 0) > 1 else ""
                raise ValueError(
                    f"{LOSS_CONTRACT} Got {name} of shape {getattr(arr, 'shape', type(arr))} for a "
                    f"microbatch of {size} examples{extra}."
                )
            if name == "losses" and not jnp.issubdtype(arr.dtype, jnp.floating):
                raise TypeError(f"{LOSS_CONTRACT} Got {name} of dtype {arr.dtype}: cast them to float32.")
        if weights is None:
            return losses, None, {}
        return losses, _laid_out_as(weights, losses), {k: _laid_out_as(v, losses) for k, v in metrics.items()}

    return checked


def _laid_out_as(weights: Any, losses: Any) -> Any:
    """`weights` in the layout of `losses`: weights made without the batch's sharding (e.g.
    `jnp.ones(b)`, replicated) are moved to its rows, so the step's sums see one layout."""
    want, have = jax.typeof(losses).sharding, jax.typeof(weights).sharding
    want_spec, have_spec = getattr(want, "spec", None), getattr(have, "spec", None)
    if want_spec is None or have_spec is None or want_spec == have_spec or getattr(want.mesh, "empty", True):
        return weights
    return jax.reshard(weights, want_spec)


def partition_trainable(model: Any, trainable: FilterSpec) -> tuple[Any, Any]:
    """Split `model` into (trainable float arrays, everything else), like `eqx.partition`.

    Leaves the filter selects but that are not inexact arrays (integer buffers, static
    values) go to the frozen side: they cannot have gradients. An abstract model's leaves
    (`jax.ShapeDtypeStruct`, lowered but never run) are read as the arrays they stand for.
    """
    selected, frozen = eqx.partition(model, trainable)
    params, extra = eqx.partition(selected, is_inexact_array_like)
    return params, eqx.combine(frozen, extra)


def _check_arguments(loss_fn: Any, optimizer: Any, mode: Any, budget: Any) -> None:
    """`TrainStep`'s arguments of the wrong kind: a one-line error naming the fix."""
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be a function (model, batch) -> losses, got {type(loss_fn).__name__}")
    if not isinstance(optimizer, optax.GradientTransformation):
        raise TypeError(
            f"optimizer must be an optax.GradientTransformation, got {type(optimizer).__name__} {optimizer!r}; "
            "build one, e.g. optax.adam(1e-3) (or zoo.train.OptimizerConfig(...).build(steps))"
        )
    if mode not in ("explicit", "shard_map"):
        raise ValueError(f"mode must be 'explicit' or 'shard_map', got {mode!r}")
    if not (budget is None or budget == "default" or isinstance(budget, Budget)):
        raise TypeError(
            f"budget must be a zoo.Budget, 'default' or None, got {type(budget).__name__} {budget!r}; "
            "e.g. budget=zoo.preset('dp').budget, or budget=None to not check"
        )


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
        trainable: FilterSpec = is_inexact_array_like,
        mode: Mode = "explicit",
        data_axes: str | tuple[str, ...] = "data",
        gather: Gather | None = None,
        shard_optimizer: bool | None = None,
        preset: str | Preset | None = None,
        donate: bool = False,
        budget: Budget | str | None = "default",  # "default" only: checked below, naming the fix
    ):
        """**Arguments:**

        - `loss_fn`: `loss_fn(model, batch)` → per-example losses `[b]`, or a pair
          `(loss_sums [b], weights [b])` for weighted means (e.g. masked tokens).
        - `optimizer`: any `optax.GradientTransformation`.
        - `microbatches`: M; the global batch is split into M microbatches per step.
        - `trainable`: which leaves train, as in `eqx.partition` (bool pytree prefix or a
          callable; by default every float leaf, `eqx.is_inexact_array` that also reads a
          `jax.ShapeDtypeStruct`, so a model of shapes alone lowers). Frozen leaves get no
          gradient computed and no communication.
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
          divides (`zoo.internal.split_spec`); leaves with no such dimension, and scalars such as
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
        - `preset`: a `zoo.Preset` or its name: sets `gather` and `shard_optimizer` to the
          preset's (`"fsdp-once"` → `gather="once"`, `"zero1"` → `shard_optimizer=True`).
          `gather=` / `shard_optimizer=` given explicitly win. The model must be placed
          with the preset's rules (`zoo.shard(model, zoo.rules(preset))`).
        - `donate`: donate the model and optimizer state buffers to the step.
        - `budget`: the collectives the compiled step may hold (`zoo.Budget`), checked
          the first time each program compiles (it compiles nothing again): a step over
          budget raises `zoo.BudgetError`, naming each collective over budget and its
          source line. `"default"`: the preset's budget (`zoo.preset(name).budget`), or
          without a preset one derived from the step's options and the model's layout
          (`step.budget_for(model)`). `budget.warn_only()` warns instead; `None` does
          not check.
        """
        _check_arguments(loss_fn, optimizer, mode, budget)
        self.preset = _preset(preset) if preset is not None else None
        options = self.preset.step_options if preset is not None else {}
        gather = options.get("gather", "per_use") if gather is None else gather
        shard_optimizer = options.get("shard_optimizer", False) if shard_optimizer is None else shard_optimizer
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
        self._grads = Jit(self._loss_and_grads)
        self._init = Jit(self._sharded_init)
        # One program, not each leaf's zeros compiled alone (~10 ms each). Not compiled as a
        # run-once initialiser: without LLVM's optimisation a full fine-tune's zeros fill 2-3x slower.
        self._plain_init = Jit(self.optimizer.init)
        self.budget = budget
        self.budget_verdict: str | None = None
        self._step = Jit(
            self._train_step,
            donate=(0, 1) if donate else (),
            on_compile=None if budget is None else self._check_budget,
        )

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
            return self._plain_init(params)
        return self._init(params)

    def check(self, batch: Any) -> int:
        """Raise a clear error unless the batch divides into devices × microbatches."""
        mesh = jax.sharding.get_abstract_mesh()
        return check_batch(batch, data_parallel_size(mesh, self.data_axes), self.microbatches)

    def loss_and_grads(self, model: Any, batch: Any) -> tuple[jax.Array, Any]:
        """(mean loss, mean gradients of the trainable leaves; `None` for frozen leaves)."""
        self.check(batch)
        return self._grads(model, batch)

    def __call__(self, model: Any, opt_state: optax.OptState, batch: Any):
        """One optimizer step. Returns `(model, opt_state, loss)`, and a fourth output, the
        loss's metrics (a dict of scalars), when `loss_fn` returns them (`LOSS_CONTRACT`).

        Dispatch is asynchronous, with at most two steps in flight: before queueing a
        step, the one before the last is waited for. The next batch still loads while a
        step runs, and a loop that never reads the loss cannot pile up an unbounded queue
        of multi-device programs (a long queue of them once stalled XLA's CPU collectives).
        """
        self.check(batch)
        out = self._step(model, opt_state, batch)
        bounded_queue(self, out[2])
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

    def budget_for(self, model: Any) -> Budget | None:
        """The budget this step's program is checked against for `model` (see `budget`)."""
        if self.budget != "default":
            return self.budget
        mesh = jax.sharding.get_abstract_mesh()
        if self.preset is not None:
            # Its budget for several devices on every axis, unless the mesh gives one axis one device.
            single = not mesh.empty and any(mesh.shape.get(a, 1) == 1 for a in self.preset.mesh_axes)
            return self.preset.budget_on(mesh) if single else self.preset.budget
        data = tuple(a for a in self.data_axes if mesh.shape.get(a, 1) > 1)
        return step_budget(
            "this step's",
            data_axes=data,
            other_axes=tuple(a for a, n in mesh.shape.items() if a not in data and n > 1),
            split_over_data=any(split_over(x, data) for x in jax.tree.leaves(eqx.filter(model, eqx.is_array))),
            gather_once=self.gather == "once",
            shard_optimizer=self._zero(),
        )

    def budget_sizes(self, model: Any) -> dict[str, int]:
        """The symbolic sizes a budget's allowances may name, for `model` on the current
        mesh: `"gradients"`, the trainable bytes reduced after the loop (per data replica;
        with per-use gathers, those of the leaves not split over the data axes),
        `"parameters"`, the whole model's bytes per data replica as collectives carry them
        (`zoo._budget.wire_itemsize`: bfloat16 widened to float32 on CPU), `"scalars"`, the loss
        sums and an optimizer's per-leaf scalars, and `"loss_scalars"`, the loss sums alone
        (with the loss's metrics, once a program is traced; see `zoo.Allowance`)."""
        params = jax.tree.leaves(self.partition(model)[0])
        arrays = [x for x in jax.tree.leaves(model) if is_array_like(x)]
        per_use = self.gather == "per_use"
        loss_scalars = LOSS_SCALAR_BYTES + 4 * len(getattr(self, "_metric_names", ()))
        return {
            "gradients": sum(
                replica_bytes(x, self.data_axes) for x in params if not (per_use and split_over(x, self.data_axes))
            ),
            # What gathering them moves (a bfloat16 leaf 4 bytes a value on CPU).
            "parameters": sum(replica_bytes(x, self.data_axes, on_the_wire=True) for x in arrays),
            # The loss's metrics (LOSS_CONTRACT's triple) ride in the same reduction, 4 B each.
            "scalars": loss_scalars + LEAF_SCALAR_BYTES * len(params),
            "loss_scalars": loss_scalars,
        }

    def _check_budget(self, compiled: jax.stages.Compiled, args: tuple) -> None:
        """Check a newly compiled step program against this step's budget."""
        model = args[0]
        budget = self.budget_for(model)
        if budget is None:
            return
        colls = collectives(compiled)
        if not colls:
            self.budget_verdict = f"within the {budget.name} budget (no collectives)"
            return
        self.budget_verdict = budget.check(colls, self.budget_sizes(model), what="the compiled training step")

    # -- traced -----------------------------------------------------------------------
    def _zero(self) -> bool:
        return zero_active(self.shard_optimizer, self.data_axes)

    def _sharded_init(self, params):
        return sharded_init(self.optimizer, params, self.data_axes)

    def _train_step(self, model, opt_state, batch):
        params, frozen = self.partition(model)
        specs = shard_specs(params, self.data_axes) if self._zero() else None
        # ZeRO: the loop, then one reduction of the accumulator straight into the shards.
        loss, grads, metrics = self._loss_grads_metrics(model, batch, grad_specs=specs)
        if specs is None:
            updates, opt_state = self.optimizer.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
        else:
            params, opt_state = sharded_update(self.optimizer, params, grads, opt_state, specs)
        # A loss returning metrics (LOSS_CONTRACT's triple) gets them as a fourth output.
        return (eqx.combine(params, frozen), opt_state, loss) + ((metrics,) if metrics else ())

    def _loss_and_grads(self, model, batch, grad_specs=None):
        return self._loss_grads_metrics(model, batch, grad_specs)[:2]

    def _loss_grads_metrics(self, model, batch, grad_specs=None):
        mesh = jax.sharding.get_abstract_mesh()
        params, frozen = self.partition(model)
        n = data_parallel_size(mesh, self.data_axes)
        size = check_batch(batch, n, self.microbatches)
        # One data shard leaves nothing to reduce; jax 0.10.2 also fails to lower unreduced
        # shard_map outputs over a size-1 axis, so it runs the explicit path.
        mode = "explicit" if n == 1 else self.mode
        if not mesh.empty and mode == "explicit":
            require_explicit(mesh)
        loss_sum, weight, grads, metrics = accumulate(
            per_example(self.loss_fn),
            params,
            frozen,
            batch,
            microbatches=self.microbatches,
            axes=None if mesh.empty else self.data_axes,
            data_size=n,
            mode=mode,
            gather_once=self.gather == "once",
            grad_specs=grad_specs,
        )
        if weight is None:
            weight = size
        else:
            # A batch with no weight at all (e.g. GRPO completions all empty) has zero sums:
            # loss 0 and zero gradients, as TRL's `mask.sum().clamp(min=1)`, not 0/0.
            weight = jnp.where(weight > 0, weight, 1.0)
        grads = jax.tree.map(lambda g: (g / weight).astype(g.dtype), grads)
        self._metric_names = tuple(metrics)  # traced once per program: the budget's scalars count them
        return loss_sum / weight, grads, {k: v / weight for k, v in metrics.items()}

"""Collective budgets: what a compiled step may communicate, checked when it compiles."""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from ._inspect import COLLECTIVE_KINDS, Collective

# The step's own scalars reduced with the gradients: the loss sum and the weight sum (f32).
LOSS_SCALAR_BYTES = 8
# Per trainable leaf, what an optimizer may reduce of gradients split over the data axes:
# a partial sum of squares (a global norm) and a finite flag (`optax.apply_if_finite`).
LEAF_SCALAR_BYTES = 8
_REDUCTIONS = ("all-reduce", "reduce-scatter")
_SIZES = ("gradients", "parameters", "scalars", "loss_scalars")


def payload(c: Collective) -> int:
    """Bytes a collective moves into its result: a reduce-scatter reduces `group_size` times
    its result (so a gradient reduction weighs the same whether XLA emits it as an
    all-reduce or as a reduce-scatter); every other kind, its result."""
    return c.bytes * max(c.group_size, 1) if c.kind == "reduce-scatter" else c.bytes


@dataclasses.dataclass(frozen=True)
class Allowance:
    """One kind of communication a compiled step may hold.

    **Arguments:**

    - `what`: what it is for, as the error names it (`"the gradient reduction"`).
    - `kinds`: the collective kinds it allows (`zoo.collectives`' names: `"all-reduce"`, ...).
    - `where`: `"inside"` loops, `"outside"` them, or `"anywhere"`.
    - `axes`: the mesh axes its collectives may span (each collective's axes must be among
      them); `None`: any.
    - `count`: at most this many such collectives (`None`: any number); `min_count`: at least.
    - `bytes`: their bytes in all (see `payload`), an int or a size the step knows when it
      compiles: `"gradients"` (the trainable bytes it reduces after the loop) or
      `"parameters"` (the model's bytes, as one data replica holds them once gathered) or
      `"scalars"` (the loss sums, and per trainable leaf the scalars an optimizer reduces
      of split gradients: a global norm's partial sums, finite flags) or `"loss_scalars"`
      (the loss sums alone: `LOSS_SCALAR_BYTES`, plus 4 B per metric the loss returns).
      `None`: any.
    - `exact_bytes`: the total must be `bytes` plus at most `slack` bytes (else at most
      `bytes + slack`); `slack` is an int or one of the sizes above.
    """

    what: str
    kinds: tuple[str, ...]
    where: str  # "inside", "outside" or "anywhere": checked in __post_init__, naming the fix
    axes: tuple[str, ...] | None = None
    count: int | None = None
    min_count: int = 0
    bytes: int | str | None = None
    exact_bytes: bool = False
    slack: int | str = 0

    def __post_init__(self):
        unknown = [k for k in self.kinds if k not in COLLECTIVE_KINDS]
        if not self.kinds or unknown:
            raise ValueError(f"Allowance {self.what!r}: kinds must be some of {COLLECTIVE_KINDS}, got {self.kinds!r}")
        if self.where not in ("inside", "outside", "anywhere"):
            raise ValueError(f"Allowance {self.what!r}: where must be 'inside', 'outside' or 'anywhere'")
        for name in ("bytes", "slack"):
            value = getattr(self, name)
            if isinstance(value, str) and value not in _SIZES:
                raise ValueError(f"Allowance {self.what!r}: {name} must be an int, None or one of {_SIZES}")

    def admits(self, c: Collective) -> bool:
        """Whether `c` is of a kind, place and set of axes this allowance covers."""
        place = self.where == "anywhere" or (self.where == "inside") == c.in_loop
        axes = self.axes is None or set(c.mesh_axes) <= set(self.axes)
        return c.kind in self.kinds and place and axes

    def describe(self, sizes: Mapping[str, int] | None = None) -> str:
        """One line: what it is for and what it allows."""
        return f"{self.what}: {self.rule(sizes)}"

    def rule(self, sizes: Mapping[str, int] | None = None) -> str:
        """What it allows: count, kinds, place, axes and bytes."""
        count = "any number of" if self.count is None else f"at most {self.count}"
        if self.count is not None and self.min_count == self.count:
            count = f"exactly {self.count}"
        elif self.min_count:
            count = f"{self.min_count} to {self.count}" if self.count is not None else f"at least {self.min_count}"
        place = {"inside": "inside loops", "outside": "outside loops", "anywhere": "anywhere"}[self.where]
        axes = "any axes" if self.axes is None else "+".join(self.axes)
        line = f"{count} {'/'.join(self.kinds)} {place}, over {axes}"
        if self.bytes is not None:
            target = _resolve(self.bytes, sizes)
            shown = f"{target:,} B" if target is not None else "?"
            if isinstance(self.bytes, str):
                shown += f" (the {self.bytes})"
            slack = _resolve(self.slack, sizes)
            slack = f" + up to {slack if slack is not None else '?'} B of scalars" if self.slack else ""
            line += f", {'exactly' if self.exact_bytes else 'at most'} {shown}{slack}"
        return line


def _resolve(value: int | str | None, sizes: Mapping[str, int] | None) -> int | None:
    # The loss sums alone are known without the step: a loss without metrics has two.
    default = LOSS_SCALAR_BYTES if value == "loss_scalars" else None
    if isinstance(value, str):
        return default if sizes is None else sizes.get(value, default)
    return value


@dataclasses.dataclass(frozen=True)
class Breach:
    """A way a compiled step broke its budget: the collectives involved and why."""

    problem: str
    collectives: tuple[Collective, ...]
    stray: bool = False


@dataclasses.dataclass(frozen=True)
class Budget:
    """Which collectives a compiled training step may hold.

    Each collective of the program is given to an allowance that admits it (its kind,
    inside or outside loops, its mesh axes), the largest first, while the allowance has
    room; a collective no allowance admits breaks the budget, and so does an allowance
    whose count or bytes end outside what it states.

    **Arguments:**

    - `name`: the budget's name (a preset's budget bears the preset's).
    - `allowances`: the `Allowance`s; nothing else may communicate.
    - `on_breach`: `"raise"` a `zoo.BudgetError`, or `"warn"` (a `BudgetWarning`) and go on.

    Every preset carries one (`zoo.preset("dp").budget`); `zoo.TrainStep` checks its
    compiled program against its preset's (or one derived from its options and layout)
    the first time it compiles each program.
    """

    name: str
    allowances: tuple[Allowance, ...]
    on_breach: str = "raise"  # or "warn": checked in __post_init__

    def __post_init__(self):
        if self.on_breach not in ("raise", "warn"):
            raise ValueError(f"Budget.on_breach must be 'raise' or 'warn', got {self.on_breach!r}")
        object.__setattr__(self, "allowances", tuple(self.allowances))

    def warn_only(self) -> Budget:
        """This budget, warning instead of raising."""
        return dataclasses.replace(self, on_breach="warn")

    def breaches(self, colls: Sequence[Collective], sizes: Mapping[str, int] | None = None) -> list[Breach]:
        """Every way `colls` break this budget (empty: within it).

        **Arguments:** `colls`, what `zoo.collectives` returns; `sizes`, the values of the
        symbolic byte sizes (`"gradients"`, `"parameters"`) for this program."""
        given: list[list[Collective]] = [[] for _ in self.allowances]
        stray: list[Collective] = []
        for c in sorted(colls, key=lambda c: -payload(c)):
            admitting = [i for i, a in enumerate(self.allowances) if a.admits(c)]
            with_room = [
                i for i in admitting if self.allowances[i].count is None or len(given[i]) < self.allowances[i].count
            ]
            if with_room or admitting:
                given[(with_room or admitting)[0]].append(c)
            else:
                stray.append(c)
        out = [Breach("no allowance admits it", (c,), stray=True) for c in stray]
        for allowance, mine in zip(self.allowances, given):
            n = len(mine)
            if (allowance.count is not None and n > allowance.count) or n < allowance.min_count:
                out.append(Breach(f"{n} ops of {allowance.what}, which allows {allowance.rule(sizes)}", tuple(mine)))
            target = _resolve(allowance.bytes, sizes)
            if target is None or (not mine and not allowance.min_count):
                continue
            total = sum(payload(c) for c in mine)
            low = target if allowance.exact_bytes else 0
            if not low <= total <= target + (_resolve(allowance.slack, sizes) or 0):
                out.append(
                    Breach(f"{allowance.what} carries {total:,} B, and allows {allowance.rule(sizes)}", tuple(mine))
                )
        return out

    def report(self, colls: Sequence[Collective], sizes: Mapping[str, int] | None = None, *, what: str = "") -> str:
        """The check as text, raising nothing: the one-line verdict when `colls` are within
        this budget, else each collective over budget with its source line, and the budget."""
        breaches = self.breaches(colls, sizes)
        if breaches:
            return breach_message(self, breaches, sizes, what=what)
        return f"within the {self.name} budget ({summary_line(colls)})"

    def check(self, colls: Sequence[Collective], sizes: Mapping[str, int] | None = None, *, what: str = "") -> str:
        """Raise `zoo.BudgetError` (or warn, see `on_breach`) unless `colls` are within this
        budget. Returns a one-line verdict: `"within the dp budget (1 all-reduce outside,
        1,330,188 B)"`."""
        breaches = self.breaches(colls, sizes)
        if breaches:
            message = breach_message(self, breaches, sizes, what=what)
            if self.on_breach == "raise":
                raise BudgetError(message, breaches=breaches, budget=self)
            warnings.warn(message, BudgetWarning, stacklevel=2)
            return f"OVER the {self.name} budget ({len(breaches)} breaches; see the warning)"
        return f"within the {self.name} budget ({summary_line(colls)})"


class BudgetError(RuntimeError):
    """A compiled step holds collectives its budget does not allow.

    `breaches` lists them (`Breach`: the problem and the collectives, each with its source
    line); `budget` is the budget it broke."""

    def __init__(self, message: str, *, breaches: Sequence[Breach] = (), budget: Budget | None = None):
        super().__init__(message)
        self.breaches = list(breaches)
        self.budget = budget


class BudgetWarning(UserWarning):
    """A compiled step broke a budget whose `on_breach` is `"warn"`."""


def summary_line(colls: Sequence[Collective]) -> str:
    """`1 all-reduce outside, 1,330,188 B`: counts by kind and place, and the bytes."""
    if not colls:
        return "no collectives"
    groups: dict[tuple[str, bool], int] = {}
    for c in colls:
        groups[(c.kind, c.in_loop)] = groups.get((c.kind, c.in_loop), 0) + 1
    parts = [
        f"{n} {kind}{'s' if n > 1 else ''} {'inside loops' if inside else 'outside'}"
        for (kind, inside), n in sorted(groups.items())
    ]
    return f"{', '.join(parts)}, {sum(payload(c) for c in colls):,} B"


def _row(c: Collective) -> str:
    place = "INSIDE a loop" if c.in_loop else "outside loops"
    axes = "+".join(c.mesh_axes) or "no mesh axis"
    return f"{c.kind} {place} over {axes}, {payload(c):,} B, at {c.origin} [{c.op_name or 'no op name'}]"


def breach_message(budget: Budget, breaches: Sequence[Breach], sizes: Mapping[str, int] | None, what: str) -> str:
    """The error's text: each collective over budget with its source line, then the budget."""
    lines = [f"{what or 'the compiled step'} breaks the {budget.name} budget:"]
    for breach in breaches:
        rows = [_row(c) for c in breach.collectives]
        if breach.stray:
            lines.append(f"  - {rows[0]}: no allowance admits it")
        else:
            lines.append(f"  - {breach.problem}:")
            lines.extend(f"      {row}" for row in rows)
    lines.append(f"The {budget.name} budget allows:")
    lines.extend(f"  - {a.describe(sizes)}" for a in budget.allowances)
    lines.append("Nothing else may communicate.")
    if any(c.in_loop for b in breaches for c in b.collectives):
        lines.append(
            "A collective inside a loop runs once per microbatch (or layer). Look at the source line: a "
            "reduction over the batch inside loss_fn (e.g. jnp.mean over the global batch: return per-example "
            "losses instead), a sharding constraint or reshard that gathers the batch, a reshard of the (reduced) "
            "parameters, or a trainable array the step's `trainable` filter does not select are the usual causes (docs/design.md, 'Budgets')."
        )
    lines.append(
        "If this communication is intended, pass a budget of your own (zoo.TrainStep(..., budget=zoo.Budget(...)); "
        "this one is step.budget_for(model)), this one's .warn_only() to only warn, or budget=None to not check."
    )
    return "\n".join(line for line in lines if line)


def step_budget(
    name: str,
    *,
    data_axes: tuple[str, ...],
    other_axes: tuple[str, ...] = (),
    split_over_data: bool = False,
    gather_once: bool = False,
    shard_optimizer: bool = False,
    expert_axes: tuple[str, ...] = (),
) -> Budget:
    """The budget of a zoo training step, from what its layout and options imply.

    - The gradient reduction: all-reduces/reduce-scatters outside loops over the data axes,
      carrying exactly the gradients' bytes plus the loss scalars: one op; where gradients
      are split over the data axes (FSDP, ZeRO-1), as many as XLA emits, and the
      optimizer's per-leaf scalars may ride with them.
    - Where parameters or optimizer state are split over the data axes: all-gathers of at
      most the parameters' bytes outside loops (`gather_once`, ZeRO-1), and with
      per-use gathers (FSDP) all-gathers and gradient reductions over data inside loops.
    - Otherwise, small all-reduces of scalars outside loops (an optimizer's own).
    - Tensor parallelism: anything over `other_axes` (never over the data axes).
    - Expert parallelism (`expert_axes`, the axes only experts are split over): activation
      traffic inside loops over them (the sum over experts split across devices and its
      backward: all-reduces, gathers, all-to-alls), and outside loops only an optimizer's
      scalars (a global norm's partial sums over the split experts), never a gradient
      reduction: each device holds its experts' whole gradients.

    With no data axes (every one of size 1 on the mesh) there is nothing to reduce over
    data: the budget is tensor and expert parallelism's alone.
    """
    parallel = _model_parallel(other_axes, expert_axes)
    if not data_axes:
        return Budget(name, parallel)
    splits = split_over_data or shard_optimizer
    # Gradients split over the data axes are reduced into their shards: XLA may emit
    # several reductions and merge an optimizer's per-leaf scalars into them.
    allow = [
        Allowance(
            "the gradient reduction",
            _REDUCTIONS,
            "outside",
            data_axes,
            count=None if splits else 1,
            min_count=1,
            bytes="gradients",
            exact_bytes=True,
            slack="scalars" if splits else "loss_scalars",
        )
    ]
    if split_over_data and not gather_once:
        allow += [
            Allowance("the per-use parameter gathers", ("all-gather",), "anywhere", data_axes, bytes="parameters"),
            Allowance("the per-use gradient reductions", _REDUCTIONS, "inside", data_axes, bytes="parameters"),
        ]
    elif splits:
        allow.append(Allowance("the parameter gathers", ("all-gather",), "outside", data_axes, bytes="parameters"))
    if not splits:
        allow.append(Allowance("the optimizer's scalars", ("all-reduce",), "outside", data_axes, bytes="scalars"))
    return Budget(name, (*allow, *parallel))


def _model_parallel(other_axes: tuple[str, ...], expert_axes: tuple[str, ...]) -> tuple[Allowance, ...]:
    """The allowances of tensor parallelism over `other_axes` and expert parallelism over
    `expert_axes` (see `step_budget`)."""
    allow = []
    if other_axes:
        allow.append(Allowance("tensor parallelism", COLLECTIVE_KINDS, "anywhere", tuple(other_axes)))
    if expert_axes:
        kinds = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")
        scalars = Allowance("the optimizer's scalars", ("all-reduce",), "outside", expert_axes, bytes="scalars")
        allow += [Allowance("expert parallelism", kinds, "inside", expert_axes), scalars]
    return tuple(allow)


def _spec_axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple | list) else (entry,)


def wire_itemsize(dtype: Any) -> int:
    """Bytes per element a collective of `dtype` carries on this backend: XLA's CPU backend
    widens bfloat16 / float16 collectives to float32 (its float normalisation: a bfloat16
    frozen base gathered under FSDP moves 4 bytes a value there); GPUs and TPUs carry them
    as they are."""
    import jax
    import jax.numpy as jnp

    dtype = jnp.dtype(dtype)
    if jax.default_backend() == "cpu" and jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
        return 4
    return dtype.itemsize


def replica_bytes(x: Any, data_axes: tuple[str, ...], *, on_the_wire: bool = False) -> int:
    """Bytes of `x` as one data replica holds it: split by its non-data mesh axes only (as
    a collective carries them with `on_the_wire`: `wire_itemsize`)."""
    sharding = getattr(x, "sharding", None)
    spec = getattr(sharding, "spec", None)
    mesh_shape = dict(getattr(getattr(sharding, "mesh", None), "shape", {}) or {})
    n = math.prod(x.shape)
    if spec is not None:
        for entry in spec:
            n //= math.prod(mesh_shape.get(a, 1) for a in _spec_axes(entry) if a not in data_axes)
    return n * (wire_itemsize(x.dtype) if on_the_wire else x.dtype.itemsize)


def split_over(x: Any, axes: tuple[str, ...]) -> bool:
    """Whether `x`'s layout splits it over any of `axes`."""
    spec = getattr(getattr(x, "sharding", None), "spec", None)
    return spec is not None and any(a in axes for entry in spec for a in _spec_axes(entry))

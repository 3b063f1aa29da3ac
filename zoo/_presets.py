"""Named sharding presets: a layout (rules) plus the training-step options it implies."""

from __future__ import annotations

import dataclasses
import difflib
import types
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

from ._axis_names import LOGICAL_AXES, MeshAxes

if TYPE_CHECKING:
    from ._budget import Budget

Gather = Literal["per_use", "once"]


@dataclasses.dataclass(frozen=True)
class Preset:
    """A named sharding preset: the rules that lay parameters out on the mesh, and the
    `zoo.TrainStep` options that go with that layout.

    **Arguments:**

    - `name`: the preset's name (`zoo.preset(name)` returns it).
    - `layout`: logical axis → mesh axes (or `None` to replicate), for every axis in
      `zoo.LOGICAL_AXES`.
    - `gather`: the step's `gather` option (`"per_use"` or `"once"`).
    - `shard_optimizer`: the step's `shard_optimizer` option (ZeRO-1).
    - `description`: one line on what the preset does.

    Pass it to `zoo.rules(preset, **overrides)` for an editable dict of rules, and to
    `zoo.TrainStep(..., preset=preset)` (or `**preset.step_options`) for its step options.
    """

    name: str
    layout: Mapping[str, MeshAxes]
    gather: Gather = "per_use"
    shard_optimizer: bool = False
    description: str = ""

    def __post_init__(self):
        missing = [axis for axis in LOGICAL_AXES if axis not in self.layout]
        if missing:
            raise ValueError(
                f"preset {self.name!r} maps no mesh axes for logical axes {missing}; map each of "
                "them, to None to replicate it (e.g. start from zoo.rules('dp', ...))"
            )
        # Read-only, so a preset cannot be edited by accident; `rules()` hands out copies.
        object.__setattr__(self, "layout", types.MappingProxyType(dict(self.layout)))

    def __hash__(self):
        return hash((self.name, tuple(self.layout.items()), self.gather, self.shard_optimizer))

    @property
    def budget(self) -> Budget:
        """The collectives a `zoo.TrainStep` with this preset may hold (`zoo.Budget`): the
        gradient reduction over the batch's mesh axes once outside loops, the gathers its
        layout implies, and anything over the other mesh axes it names (tensor parallelism).
        Every mesh axis is taken to have several devices; `budget_on(mesh)` is the budget
        on one mesh (where an axis of size 1 communicates nothing)."""
        return self.budget_on(None)

    @property
    def mesh_axes(self) -> tuple[str, ...]:
        """The mesh axes its layout names, in order of first use."""
        return tuple(dict.fromkeys(a for value in self.layout.values() for a in _axes_tuple(value)))

    def budget_on(self, mesh: Any) -> Budget:
        """This preset's budget on `mesh` (a `Mesh`, an abstract mesh, a `{axis: size}`
        mapping, or `None` for `budget`'s): mesh axes of size 1 carry no collective, so a
        data axis of size 1 holds no gradient reduction (nothing to add up) and splits
        nothing over it, and a model axis of size 1 no tensor parallelism.

        **Returns:** a `zoo.Budget`."""
        from ._budget import step_budget

        shape = None if mesh is None else dict(getattr(mesh, "shape", mesh))

        def several(axis: str) -> bool:  # an axis the mesh lacks has one device
            return shape is None or shape.get(axis, 1) > 1

        data = tuple(a for a in _axes_tuple(self.layout.get("batch")) if several(a))
        named = {a for value in self.layout.values() for a in _axes_tuple(value) if several(a)}
        # Axes only the experts are split over: expert parallelism's (activations in loops).
        others = {a for k, v in self.layout.items() if k != "expert" for a in _axes_tuple(v)}
        experts = {a for a in _axes_tuple(self.layout.get("expert")) if several(a)} - others - set(data)
        split = any(set(_axes_tuple(v)) & set(data) for k, v in self.layout.items() if k != "batch")
        return step_budget(
            self.name,
            data_axes=data,
            other_axes=tuple(sorted(named - set(data) - experts)),
            expert_axes=tuple(sorted(experts)),
            split_over_data=split,
            gather_once=self.gather == "once",
            shard_optimizer=self.shard_optimizer,
        )

    @property
    def step_options(self) -> dict[str, Any]:
        """The `zoo.TrainStep` keyword arguments this preset sets beyond their defaults."""
        options: dict[str, Any] = {}
        if self.gather != "per_use":
            options["gather"] = self.gather
        if self.shard_optimizer:
            options["shard_optimizer"] = True
        return options

    def rules(self, **overrides: Any) -> dict[str, MeshAxes]:  # values checked below, naming the fix
        """A plain `dict` copy of the layout with some logical axes overridden.

        **Raises:** `ValueError` for an override of a logical axis the layout does not have
        (a typo: `embedd=`; a logical axis of your own modules is added to the returned
        dict instead), `TypeError` for a value that is not a mesh axis name, a tuple of
        them, or `None`.
        """
        for name, value in overrides.items():
            if name not in self.layout:
                close = difflib.get_close_matches(name, list(self.layout), n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise ValueError(
                    f"zoo.rules({self.name!r}, {name}=...): {name!r} is not a logical axis of the zoo's modules; "
                    f"{hint}the zoo's are {list(self.layout)}. For a logical axis of your own modules, add it to "
                    f"the dict: rules = zoo.rules({self.name!r}); rules[{name!r}] = ..."
                )
            _check_mesh_axes(name, value)
        return dict(self.layout) | {k: tuple(v) if isinstance(v, list) else v for k, v in overrides.items()}


def _axes_tuple(value: MeshAxes) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def _check_mesh_axes(name: str, value: Any) -> None:
    """A rule's value: a mesh axis name, a tuple of distinct names, or None."""
    ok = (
        value is None
        or (isinstance(value, str) and value)
        or (
            isinstance(value, tuple | list)
            and all(isinstance(v, str) and v for v in value)
            and len(set(value)) == len(value)
        )
    )
    if not ok:
        raise TypeError(
            f"zoo.rules(..., {name}={value!r}): a rule maps a logical axis to a mesh axis name ({name}='data'), "
            f"a tuple of distinct names ({name}=('data', 'model')), or None to replicate it; "
            f"got {type(value).__name__} {value!r}"
        )


_DP: dict[str, MeshAxes] = {name: None for name in LOGICAL_AXES} | {"batch": "data"}
_TP: dict[str, MeshAxes] = {"heads": "model", "kv_heads": "model", "mlp": "model", "vocab": "model"}
_FSDP = _DP | {"embed": "data"}

DP = Preset("dp", _DP, description="every parameter replicated, the batch split over `data`")
FSDP = Preset(
    "fsdp",
    _FSDP,
    description="every parameter split over `data` along its embed axis; layers gather each "
    "weight when they use it, gradients are reduce-scattered per microbatch",
)
FSDP_ONCE = Preset(
    "fsdp-once",
    _FSDP,
    gather="once",
    description="the fsdp layout; the step gathers every parameter once per step into a reduced "
    "copy and reduce-scatters the accumulated gradients once",
)
TP = Preset(
    "tp",
    _DP | _TP,
    description="Megatron tensor parallelism on a (data, model) mesh: heads, mlp width and vocab "
    "split over `model`, the batch over `data`",
)
FSDP_TP = Preset("fsdp+tp", _FSDP | _TP, description="both: embed over `data`, heads/mlp/vocab over `model`")
ZERO1 = Preset(
    "zero1",
    _DP,
    shard_optimizer=True,
    description="the dp layout; the step keeps the optimizer state split over `data`, "
    "reduce-scatters the gradients and all-gathers the updated parameters once per step",
)

EP = Preset(
    "ep",
    _DP | {"expert": "model"},
    description="expert parallelism on a (data, model) mesh: a mixture of experts' stacked experts "
    "split over `model`, every other parameter replicated, the batch over `data`",
)

EP_FSDP = Preset(
    "ep+fsdp",
    _FSDP | {"expert": "model"},
    description="expert parallelism and fsdp on a (data, model) mesh: the stacked experts split over "
    "`model`, every parameter over `data` along its embed axis (gathered per use), the batch over `data`",
)

PRESETS: dict[str, Preset] = {p.name: p for p in (DP, FSDP, FSDP_ONCE, ZERO1, TP, FSDP_TP, EP, EP_FSDP)}
RULE_PRESETS = tuple(PRESETS)


def preset(name: str | Preset) -> Preset:
    """The named sharding preset (a `Preset` is returned as it is).

    **Arguments:**

    - `name`: one of `zoo.RULE_PRESETS`: `"dp"`, `"fsdp"`, `"fsdp-once"`, `"zero1"`, `"tp"`,
      `"fsdp+tp"`, `"ep"`, `"ep+fsdp"`.

    **Returns:** the frozen `zoo.Preset`.
    """
    if isinstance(name, Preset):
        return name
    if name not in PRESETS:
        raise ValueError(
            f"unknown rules preset {name!r}; the presets are {sorted(PRESETS)}. "
            "Pass one of them, or build your own dict of logical axis -> mesh axis."
        )
    return PRESETS[name]


def rules(preset: str | Preset = "dp", **overrides: Any) -> dict[str, MeshAxes]:  # values checked below, naming the fix
    """A copy of a preset's sharding rules, optionally with some axes overridden.

    **Arguments:**

    - `preset`: a `zoo.Preset` or one of `zoo.RULE_PRESETS`: `"dp"` (parameters
      replicated, batch on `data`), `"fsdp"` / `"fsdp-once"` (parameters split over `data`
      along their embed axis; the two differ in the step), `"zero1"` (the "dp" layout; the
      step shards the optimizer state over `data`), `"tp"` (heads, mlp width and vocab over
      `model`), `"fsdp+tp"`, `"ep"` (a mixture of experts' experts over `model`), `"ep+fsdp"` (those and `fsdp`'s).
    - `overrides`: logical axis → mesh axis (or tuple of mesh axes, or `None`).

    **Returns:** a plain `dict` a user can print, copy and edit.
    """
    return _lookup(preset).rules(**overrides)


_lookup = preset

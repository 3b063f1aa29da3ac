"""An asynchronous filtered `jax.jit`, and a compiled step that can be inspected and run."""

from __future__ import annotations

import functools
import hashlib
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax

from ._tree import is_array_like

# XLA options for programs compiled once and run once (the initialisers): no LLVM
# optimisation of the machine code, and XLA's older fusion emitters (the LoRA branches'
# initialiser of a 0.4B model: 0.56 -> 0.43 s to compile, the same run time).
ONCE_COMPILER_OPTIONS = {
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
    "xla_cpu_use_fusion_emitters": False,
}
# Unoptimised machine code runs several times slower: a program run once that makes this
# many bytes or more runs long enough that XLA's default options pay for their compile. A
# decoder's initialiser, measured side by side on 2 cores: 0.7 MB 0.9 s with these options
# vs 6.7 s with XLA's (compile + run), 20 MB 1.9-2.3 vs 6.9-7.2, 111 MB 6.6-8.9 vs 9.1-12.5,
# 540 MB 26-42 vs 11.5-12.3 s; 0.87B parameters (3.5 GB) took 182 s.
ONCE_OPTIMISED_FROM_BYTES = 256 * 2**20


def once_compiler_options(lowered: Any) -> dict[str, Any]:
    """The compiler options of a program compiled and run once (`lowered`, a
    `jax.stages.Lowered`): `ONCE_COMPILER_OPTIONS`, or XLA's defaults for one whose outputs
    hold `ONCE_OPTIMISED_FROM_BYTES` or more (a large model's initialiser)."""
    made = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(lowered.out_info))
    return {} if made >= ONCE_OPTIMISED_FROM_BYTES else dict(ONCE_COMPILER_OPTIONS)


class _Static:
    """Marks a non-array leaf's slot; hashable so it can be part of a static argument."""

    def __init__(self, value):
        self.value = value

    def __hash__(self):
        return hash(self.value)

    def __eq__(self, other):
        return isinstance(other, _Static) and self.value == other.value


def _split(leaves):
    """Leaves → (array leaves with None in static slots, static leaves as a tuple). An
    abstract array (`jax.ShapeDtypeStruct`) is traced too: lowered, never run."""
    arrays = [x if is_array_like(x) else None for x in leaves]
    static = tuple(None if is_array_like(x) else _Static(x) for x in leaves)
    return arrays, static


def _merge(arrays, static):
    """Inverse of `_split`."""
    return [s.value if s is not None else a for a, s in zip(arrays, static)]


def _forwardable(groups, donate: tuple[int, ...]) -> list:
    """The flat input leaves, with `None` for those of donated arguments."""
    return [None if g in donate else leaf for g, group in enumerate(groups) for leaf in group]


def bounded_queue(owner: Any, latest: Any) -> None:
    """Keep at most two dispatched steps of `owner` unfinished: wait for the older one."""
    previous = getattr(owner, "_in_flight", None)
    if previous is not None:
        jax.block_until_ready(previous)
    owner._in_flight = latest


class _Structure:
    """The non-array part of a `Flattened` tree, as a program's static key: hashed once,
    and compared in full only when it is not the very same object (a tree rebuilt with
    the same structure, e.g. after an adapter is loaded, finds the program compiled)."""

    def __init__(self, treedef, static):
        self.treedef, self.static = treedef, static
        self._hash = hash((treedef, static))

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        if self is other:
            return True
        return isinstance(other, _Structure) and (self.treedef, self.static) == (other.treedef, other.static)


@jax.tree_util.register_pytree_node_class
class Flattened:
    """A pytree of arrays and static leaves (a model), flattened once.

    A `Jit` call flattens its arguments every time; for an Equinox model that is a walk of
    every module in Python (~1-2 ms for a decoder of 8 layers). Passed as `Flattened(tree)`,
    the tree costs one tuple of arrays per call; the program gets it back with `.tree`.
    Build a new one when the tree changes (same structure: no new program).
    """

    def __init__(self, tree, *, _parts=None):
        if _parts is None:
            arrays, static = eqx.partition(tree, eqx.is_array)
            leaves, treedef = jax.tree.flatten(arrays)
            _parts = (tuple(leaves), _Structure(treedef, static))
        self.leaves, self.structure = _parts

    @functools.cached_property
    def signature(self) -> tuple:
        """The leaves' shapes, dtypes and shardings (what a `Jit` keys its programs by)."""
        return _signature(None, self.leaves)

    @property
    def tree(self):
        """The tree as given (inside a program: its arrays traced)."""
        arrays = jax.tree.unflatten(self.structure.treedef, self.leaves)
        return eqx.combine(arrays, self.structure.static)

    def tree_flatten(self):
        return self.leaves, self.structure

    @classmethod
    def tree_unflatten(cls, structure, leaves):
        return cls(None, _parts=(tuple(leaves), structure))


def _signature(arg, arrays) -> tuple:
    """What decides the program for one argument's arrays: their shapes, dtypes and shardings
    (a `Flattened` tree's, worked out once)."""
    if isinstance(arg, Flattened):
        return arg.signature
    return tuple((a.shape, a.dtype, getattr(a, "sharding", None)) if a is not None else None for a in arrays)


# Compiled programs by what they compute: a `Jit` built anew for the same computation (a
# run's step built again in one process, a second engine of the same model) runs the
# program already compiled instead of compiling it again (jax's own caches key programs by
# the Python function, which each `Jit` makes anew). A few are kept: each holds its code.
_PROGRAMS: OrderedDict[tuple, jax.stages.Compiled] = OrderedDict()
PROGRAMS_KEPT = 16


def clear_programs() -> None:
    """Forget the compiled programs `Jit`s share (their memory is freed with the last user)."""
    _PROGRAMS.clear()


def _devices(sharding) -> tuple:
    """The devices a sharding places on, in its order (the HLO text names positions only)."""
    try:
        return tuple(d.id for d in sharding._device_assignment)
    except AttributeError:
        return tuple(sorted(d.id for d in sharding.device_set))


def _program_key(lowered: jax.stages.Lowered, groups, compiler_options) -> tuple:
    """The lowered program's text (shapes, shardings, donations, the computation itself),
    the compiler options and the devices its arguments are placed on."""
    text = hashlib.sha256(lowered.as_text().encode()).hexdigest()
    shardings = {getattr(leaf, "sharding", None) for group in groups for leaf in group if leaf is not None}
    devices = tuple(sorted({_devices(s) for s in shardings if s is not None}))
    return text, repr(sorted((compiler_options or {}).items())), devices


class Jit:
    """`jax.jit` over a function of pytrees holding arrays and static leaves.

    Like `eqx.filter_jit` (arrays traced, everything else static), but dispatch stays
    asynchronous: equinox 0.13's `filter_jit` blocks until every call has finished, which
    would stop a training loop from queueing the next step or loading data meanwhile.

    An input array that the function returns unchanged (a frozen base passed through a
    LoRA step) is handed back as the caller's own array instead of an output of the
    program: XLA would otherwise copy it into a fresh buffer on every call. Donated
    arguments are not forwarded (their buffers are given to the program).

    **Arguments:**

    - `fn`: the function; its arguments and result are pytrees.
    - `donate`: positions of the arguments whose array buffers are donated.
    - `on_compile`: called as `on_compile(compiled, args)` with each new program (a
      `jax.stages.Compiled`) before it first runs; the call then reuses that compilation.
    """

    def __init__(
        self,
        fn: Callable,
        *,
        donate: tuple[int, ...] = (),
        on_compile: Callable[[jax.stages.Compiled, tuple], None] | None = None,
        compiler_options: dict[str, Any] | None = None,
    ):
        self._out_static: dict[Any, Any] = {}
        self._on_compile = on_compile
        self._compiler_options = compiler_options
        self._seen: dict[Any, jax.stages.Compiled] = {}

        def run(static, *dynamic):
            in_treedef, in_static_leaves = static
            flat = [leaf for group in dynamic for leaf in group]
            args = jax.tree.unflatten(in_treedef, _merge(flat, in_static_leaves))
            out_leaves, out_treedef = jax.tree.flatten(fn(*args))
            arrays, out_static_leaves = _split(out_leaves)
            # Outputs that are inputs, untouched: the program returns nothing for them.
            position = {id(leaf): i for i, leaf in enumerate(_forwardable(dynamic, donate)) if leaf is not None}
            forwarded = tuple(position.get(id(a)) if a is not None else None for a in arrays)
            arrays = [None if i is not None else a for a, i in zip(arrays, forwarded)]
            self._out_static[static] = (out_treedef, out_static_leaves, forwarded)
            return arrays

        # The name shows in HLO op names: jit(train_step)/reshard.
        run.__name__ = getattr(fn, "__name__", "step").lstrip("_")
        donate_argnums = tuple(i + 1 for i in donate)
        self._jitted = jax.jit(
            run, static_argnums=(0,), donate_argnums=donate_argnums, compiler_options=compiler_options
        )

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

    def _unflatten(self, static, arrays, groups):
        out_treedef, out_static_leaves, forwarded = self._out_static[static]
        inputs = [leaf for group in groups for leaf in group]
        arrays = [inputs[i] if i is not None else a for a, i in zip(arrays, forwarded)]
        return jax.tree.unflatten(out_treedef, _merge(arrays, out_static_leaves))

    def __call__(self, *args):
        static, groups = self._prepare(args)
        if self._on_compile is not None:
            # The program handed to `on_compile` is the one that runs.
            return self._unflatten(static, self._compiled(static, groups, args)(*groups), groups)
        return self._unflatten(static, self._jitted(static, *groups), groups)

    def _compiled(self, static, groups, args) -> jax.stages.Compiled:
        """The program for these arguments; a new one is handed to `on_compile` first.
        A program another `Jit` compiled for the same computation is reused (`_PROGRAMS`)."""
        key = (static, tuple(_signature(arg, group) for arg, group in zip(args, groups)))
        compiled = self._seen.get(key)
        if compiled is None:
            lowered = self._jitted.lower(static, *groups)
            program = _program_key(lowered, groups, self._compiler_options)
            compiled = _PROGRAMS.get(program)
            if compiled is None:
                compiled = lowered.compile()
                _PROGRAMS[program] = compiled
                while len(_PROGRAMS) > PROGRAMS_KEPT:
                    _PROGRAMS.popitem(last=False)
            else:
                _PROGRAMS.move_to_end(program)
            if self._on_compile is not None:
                self._on_compile(compiled, args)
            self._seen[key] = compiled
        return compiled

    def lower(self, *args):
        """The lowered program for these arguments (a `jax.stages.Lowered`)."""
        static, groups = self._prepare(args)
        return self._jitted.lower(static, *groups)

    def compile(self, *args) -> Compiled:
        """The compiled program for these arguments, runnable (see `Compiled`)."""
        static, groups = self._prepare(args)
        return Compiled(self, static, self._compiled(static, groups, args))


class Compiled:
    """A compiled step that can be both inspected and run, so the program whose collectives
    and memory you read is the one that runs.

    `compiled` is the `jax.stages.Compiled` (`zoo.collectives(this)` reads it; so do
    `.as_text()`, `.memory_analysis()`, `.cost_analysis()`). Calling it runs the program on
    arguments with the same structure, shapes and shardings as those it was compiled for.
    """

    def __init__(self, jit: Jit, static, compiled: jax.stages.Compiled):
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
        bounded_queue(self, jax.tree.leaves(out)[-1:])
        return out

    def _run(self, *args):
        static, groups = self._jit._prepare(args)
        if static != self._static:
            raise ValueError(
                "these arguments differ in structure or static values from the ones the step was "
                "compiled for; compile again for them (or call the TrainStep itself)"
            )
        return self._jit._unflatten(static, self.compiled(*groups), groups)

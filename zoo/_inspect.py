"""Collective inspector: every collective in a compiled program, and whether it is in a loop."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
from collections import deque
from typing import Any, no_type_check

import jax
import numpy as np

COLLECTIVE_KINDS = (
    "all-reduce",
    "reduce-scatter",
    "all-gather",
    "collective-permute",
    "all-to-all",
    "ragged-all-to-all",
    "collective-broadcast",
)

_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
    "s4": 0.5, "u4": 0.5, "s2": 0.25, "u2": 0.25,
}  # fmt: skip

_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"(?<![\w.\-%])([a-z][a-z0-9\-]*)\(")
_CALLED = re.compile(
    r"\b(?:body|condition|to_apply|calls|branch_computations|true_computation|false_computation)"
    r"=(\{[^}]*\}|%?[\w.\-]+)"
)
# What a line `collectives` reads holds: a computation's header (`->`), a called computation
# (`_CALLED`'s keys), a `while` or a collective.
_OF_INTEREST = ("->", "body=", "condition=", "to_apply=", "calls=", "_computation", "while(", *COLLECTIVE_KINDS)
_WHILE_PARTS = re.compile(r"\b(?:body|condition)=%?([\w.\-]+)")
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective op of a compiled program.

    - `kind`: `all-reduce`, `reduce-scatter`, `all-gather`, `collective-permute`,
      `all-to-all`, ... (async `-start` forms are reported under their base kind).
    - `in_loop`: whether it sits in a `while` body or condition, at any depth of calls.
    - `bytes`: size of its result (for an all-reduce: the bytes reduced).
    - `mesh_axes`: the mesh axes along which the devices of one of its groups differ, in
      mesh order (empty when no mesh is known: HLO text given without `mesh=`).
    - `op_name`: the JAX source op from the HLO metadata.
    - `group_size`: devices per replica group (0 if not stated).
    - `source`: the Python source lines of the op it came from, innermost first, each
      `"path:line in function"` (empty for HLO text, which does not carry them).
    """

    kind: str
    in_loop: bool
    bytes: int
    mesh_axes: tuple[str, ...]
    op_name: str
    group_size: int = 0
    source: tuple[str, ...] = ()

    @property
    def origin(self) -> str:
        """Where it comes from, as one line: the innermost source line, and when that is in
        zoo's own code (or a library's), the first line of yours it was called from."""
        if not self.source:
            return "no source line in the program"
        first = self.source[0]
        if _library(first):
            yours = next((f for f in self.source if not _library(f)), None)
            if yours is not None:
                return f"{_shown(first)}, called from {_shown(yours)}"
        return _shown(first)

    def to_json(self) -> dict:
        """A JSON-ready dict of this collective."""
        return dataclasses.asdict(self) | {"mesh_axes": list(self.mesh_axes), "source": list(self.source)}

    @classmethod
    def from_json(cls, row: dict) -> Collective:
        """The collective `to_json` wrote (fields it lacks take their defaults)."""
        names = {f.name for f in dataclasses.fields(cls)}
        missing = {"kind", "in_loop", "bytes"} - set(row)
        if missing:
            raise ValueError(f"a collective's JSON needs {sorted(missing)}; got the keys {sorted(row)}")
        values = {k: v for k, v in row.items() if k in names}
        values.setdefault("mesh_axes", ())
        values.setdefault("op_name", "")
        return cls(**values | {"mesh_axes": tuple(values["mesh_axes"]), "source": tuple(values.get("source", ()))})


_ZOO_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _library(frame: str) -> bool:
    """Whether a source line is zoo's own or an installed library's (not the user's)."""
    return frame.startswith(_ZOO_DIR) or f"{os.sep}site-packages{os.sep}" in frame


def _shown(frame: str) -> str:
    """A source line with its path relative to the working directory when under it."""
    path, rest = frame.rsplit(":", 1)
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive
        rel = path
    return f"{path if rel.startswith('..') else rel}:{rest}"


def _program(obj: Any, args: tuple, kwargs: dict) -> tuple[str, jax.stages.Compiled | None]:
    """The HLO text of `obj`, and the compiled program it came from (None for text)."""
    if isinstance(obj, str):
        if not re.search(r"^\s*HloModule\s", obj, re.MULTILINE):
            shown = obj if len(obj) <= 40 else obj[:40] + "..."
            raise ValueError(
                f"collectives() got a string that is not an HLO module (no 'HloModule' line): {shown!r}. "
                "Pass the compiled program itself, or its text: `compiled.as_text()`."
            )
        return obj, None
    if args or kwargs:
        if not hasattr(obj, "lower"):
            raise TypeError(
                f"collectives() got a {type(obj).__name__} with arguments, which has no compiled program; jit it "
                "first: zoo.collectives(jax.jit(f), *args) (or pass f's Lowered/Compiled object or HLO text)"
            )
        obj = obj.lower(*args, **kwargs)
    # Equinox's stage objects wrap jax's; zoo's compiled step holds jax's as `.compiled`.
    obj = getattr(obj, "lowered", obj)
    obj = getattr(obj, "compiled", obj)
    if isinstance(obj, jax.stages.Lowered):
        obj = obj.compile()
    if not isinstance(obj, jax.stages.Compiled):
        hint = "; pass its arguments too: zoo.collectives(jax.jit(f), *args)" if callable(obj) else ""
        raise TypeError(
            "collectives() takes a jitted function with its arguments, a Lowered/Compiled "
            f"object or HLO text; got {type(obj).__name__}{hint}"
        )
    return obj.as_text(), obj


# The two readers below run ~10k times per program: runtime type checks (the tests'
# import hook) would cost a second per program for nothing, so they are exempt.
@no_type_check
def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, i


@no_type_check
def _fields(data: bytes):
    """(field number, value) of a protobuf message, read from the wire format."""
    i = 0
    while i < len(data):
        key, i = _varint(data, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(data, i)
        elif wire == 2:
            size, i = _varint(data, i)
            value, i = data[i : i + size], i + size
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            value, i = data[i : i + size], i + size
        else:
            raise ValueError(f"unreadable protobuf wire type {wire}")
        yield number, value


def _stack_frames(compiled: jax.stages.Compiled | None, wanted: set[int]) -> dict[int, tuple[str, ...]]:
    """`stack_frame_id` → source lines (innermost first) for the ids in `wanted`, from the HLO
    module's stack frame index (HloModuleProto field 17: file and function names, locations,
    frames; ids 1-based). Empty when the program does not expose it."""
    if not wanted:
        return {}
    try:
        module = compiled.runtime_executable().hlo_modules()[0]
        proto = module.as_serialized_hlo_module_proto()
    except Exception:  # HLO text, or a runtime without the module: no sources
        return {}
    index = next((v for n, v in _fields(proto) if n == 17), b"")
    files, functions, locations, frames = [], [], [], []
    for number, value in _fields(index):
        if number == 1:
            files.append(value.decode(errors="replace"))
        elif number == 2:
            functions.append(value.decode(errors="replace"))
        elif number == 3:
            locations.append(value)  # read when a wanted frame's chain reaches it
        elif number == 4:
            frames.append(value)

    @functools.cache
    def frame(frame_id: int) -> tuple[int, int]:
        fields = dict(_fields(frames[frame_id - 1]))
        return fields.get(1, 0), fields.get(2, 0)  # location id, parent frame id

    @functools.cache
    def line(location_id: int) -> str:
        fields = dict(_fields(locations[location_id - 1]))
        file_id, function_id, lineno = fields.get(1, 0), fields.get(2, 0), fields.get(3, 0)
        file = files[file_id - 1] if 0 < file_id <= len(files) else "?"
        function = functions[function_id - 1] if 0 < function_id <= len(functions) else "?"
        return f"{file}:{lineno} in {function}"

    out: dict[int, tuple[str, ...]] = {}
    for frame_id in wanted:
        chain, seen, current = [], set(), frame_id
        while 0 < current <= len(frames) and current not in seen and len(chain) < 256:
            seen.add(current)
            location_id, current = frame(current)
            if 0 < location_id <= len(locations) and (not chain or chain[-1] != line(location_id)):
                chain.append(line(location_id))
        out[frame_id] = tuple(chain)
    return out


def _split_top(type_str: str) -> list[str]:
    """Top-level elements of a tuple type `(a, (b, c), d)`; `[type_str]` if not a tuple."""
    s = type_str.strip()
    if not s.startswith("("):
        return [s]
    depth, start, parts = 0, 1, []
    for i, ch in enumerate(s):
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
            if depth == 0:
                parts.append(s[start:i])
                break
        elif ch == "," and depth == 1:
            parts.append(s[start:i])
            start = i + 1
    return parts


def _type_bytes(type_str: str) -> int:
    total = 0.0
    for dtype, dims in _ARRAY.findall(type_str):
        size = _DTYPE_BYTES.get(dtype, 1 if dtype.startswith("f8") else 0)
        total += size * math.prod(int(d) for d in dims.split(",") if d)
    return int(total)


def _ints(text: str) -> list[int]:
    return [int(d) for d in text.split(",") if d.strip()]


def _iota(dims: list[int], reshape: list[int], perm: list[int] | None) -> np.ndarray:
    """XLA's iota tile assignment `[dims]<=[reshape]T(perm)`."""
    ids = np.arange(math.prod(reshape)).reshape(reshape)
    if perm:
        ids = ids.transpose(perm)
    return ids.reshape(dims)


def _mesh_groups(sizes: list[tuple[str, int]], device_ids: str | None, axes: str) -> list[list[int]]:
    """Replica groups of XLA's named-mesh form `mesh[a=2,b=4], device_ids=(...) {a, b:(1)2}`."""
    dims = [size for _, size in sizes]
    names = [name for name, _ in sizes]
    if device_ids is None:
        ids = np.arange(math.prod(dims)).reshape(dims)
    else:
        m = re.fullmatch(r"\s*(?:\[([\d,]+)\]<=)?\[([\d,]+)\](?:T\(([\d,]+)\))?\s*", device_ids)
        if m:  # iota form; `[reshape]T(perm)` when the dims are the mesh's own
            ids = _iota(dims, _ints(m.group(2)), _ints(m.group(3)) if m.group(3) else None)
        else:
            ids = np.array(_ints(re.sub(r"[\[\]{}]", ",", device_ids))).reshape(dims)
    # Each grouped axis (or sub-axis `name:(pre)size`) becomes one dim of a finer reshape.
    refs = []
    for name, pre, size in re.findall(r"'?([^',:{}()\s]+)'?(?::\((\d+)\)(\d+))?", axes):
        if name not in names:
            raise ValueError(f"replica groups name mesh axis {name!r}, which is not in mesh {names}")
        refs.append((names.index(name), int(pre) if pre else None, int(size) if size else None))
    fine_dims, grouped = [], []
    for k, full in enumerate(dims):
        subs = sorted((pre, size, i) for i, (axis, pre, size) in enumerate(refs) if axis == k)
        if not subs:
            fine_dims.append(full)
            continue
        if subs[0][0] is None:  # the whole axis
            grouped.append((subs[0][2], len(fine_dims)))
            fine_dims.append(full)
            continue
        done = 1
        for pre, size, i in subs:
            if pre != done:
                fine_dims.append(pre // done)
                done = pre
            grouped.append((i, len(fine_dims)))
            fine_dims.append(size)
            done *= size
        if done != full:
            fine_dims.append(full // done)
    order = [dim for _, dim in sorted(grouped)]
    rest = [d for d in range(len(fine_dims)) if d not in order]
    group_size = math.prod(fine_dims[d] for d in order)
    return ids.reshape(fine_dims).transpose(rest + order).reshape(-1, group_size).tolist()


def _components(pairs: list[list[int]]) -> list[list[int]]:
    """Devices linked by collective-permute pairs, as groups (a ring over an axis → its groups)."""
    parent: dict[int, int] = {}

    def root(i: int) -> int:
        while parent.setdefault(i, i) != i:
            i = parent[i]
        return i

    for pair in pairs:
        for j in pair[1:]:
            parent[root(j)] = root(pair[0])
    groups: dict[int, list[int]] = {}
    for i in sorted(parent):
        groups.setdefault(root(i), []).append(i)
    return list(groups.values())


def _parse_groups(line: str, num_devices: int | None) -> list[list[int]]:
    """The device groups of one collective, in the logical device ids of the program."""
    m = re.search(
        r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(([^)]*(?:\([^)]*\))?[^)]*)\))?\s*\{([^}]*)\}", line
    )
    if m:
        sizes = [(name, int(size)) for name, size in re.findall(r"'?([^',=\s]+)'?=(\d+)", m.group(1))]
        return _mesh_groups(sizes, m.group(2), m.group(3))
    if re.search(r"replica_groups=maximal_mesh\[", line):
        return []
    m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if m:
        return _iota(_ints(m.group(1)), _ints(m.group(2)), _ints(m.group(3)) if m.group(3) else None).tolist()
    m = re.search(r"source_target_pairs=\{((?:\{[\d,]*\},?)*)\}", line)
    if m:
        return _components([_ints(g) for g in re.findall(r"\{([\d,]*)\}", m.group(1))])
    m = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", line)
    if m:
        groups = [_ints(g) for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
        if not groups and num_devices:  # `{}`: one group of every device
            return [list(range(num_devices))]
        return groups
    return []


def _mesh_axes(groups: list[list[int]], mesh: Any, devices: list[Any] | None) -> tuple[str, ...]:
    """The mesh axes along which the devices of some group differ.

    Group entries are the program's logical device ids: id `i` is `devices[i]` of the
    compiled program (else position `i` of the mesh's device array).
    """
    if mesh is None or not groups:
        return ()
    shape = tuple(mesh.shape.values())
    names = tuple(mesh.shape.keys())
    size = math.prod(shape)
    coords_of = {i: np.unravel_index(i, shape) for i in range(size)}
    mesh_devices = mesh.devices if isinstance(mesh, jax.sharding.Mesh) else None
    if devices is not None and mesh_devices is not None:
        position = {d: np.unravel_index(k, shape) for k, d in enumerate(mesh_devices.flat)}
        if all(d in position for d in devices):  # else: a mesh of other devices, read by position
            coords_of = {i: position[d] for i, d in enumerate(devices)}
    spanned = set()
    for group in groups:
        if any(i not in coords_of for i in group):
            raise ValueError(
                f"a collective's replica groups name device {max(group)}, outside the {size} devices of "
                f"mesh {dict(mesh.shape)}; pass the mesh the program was compiled for (mesh=...)"
            )
        coords = np.array([coords_of[i] for i in group])
        spanned |= {names[k] for k in range(len(names)) if len(set(coords[:, k])) > 1}
    return tuple(n for n in names if n in spanned)


def _lines_of_interest(text: str) -> list[str]:
    """The lines of `text` that hold one of `_OF_INTEREST`, in order: found with `str.find`
    over the whole text, not tested line by line (a program is thousands of lines, most of
    them none of these)."""
    starts = set()
    for needle in _OF_INTEREST:
        pos = text.find(needle)
        while pos >= 0:
            start = text.rfind("\n", 0, pos) + 1
            starts.add(start)
            end = text.find("\n", pos)
            if end < 0:
                break
            pos = text.find(needle, end)
    lines = []
    for start in sorted(starts):
        end = text.find("\n", start)
        lines.append(text[start : len(text) if end < 0 else end])
    return lines


def _program_mesh(compiled: jax.stages.Compiled) -> tuple[Any, list[Any] | None]:
    """The mesh of a compiled program's input/output shardings, and its device order."""
    devices = None
    unloaded = getattr(getattr(compiled, "_executable", None), "_unloaded_executable", None)
    if getattr(unloaded, "device_list", None) is not None:
        devices = list(unloaded.device_list)
    shardings = jax.tree.leaves((compiled.input_shardings, compiled.output_shardings))
    meshes = [s.mesh for s in shardings if isinstance(s, jax.sharding.NamedSharding)]
    meshes = [m for m in meshes if isinstance(m, jax.sharding.Mesh)]
    if devices is not None:  # the mesh that spans the program's devices
        meshes = [m for m in meshes if m.devices.size == len(devices)] or meshes
    # Prefer the mesh with the most axes (a program may also hold 1-D meshes' arrays).
    mesh = max(meshes, key=lambda m: len(m.shape), default=None)
    return mesh, devices


def collectives(obj: Any, *args: Any, mesh: Any = None, **kwargs: Any) -> list[Collective]:
    """List every collective in a compiled program.

    **Arguments:**

    - `obj`: a jitted function (then `args`/`kwargs` are its arguments), a `Lowered` or
      `Compiled` object (jax, equinox or `zoo.TrainStep.compile`'s), or HLO text (the
      text of `compiled.as_text()`; anything else raises `ValueError`).
    - `mesh`: the mesh whose axis names `Collective.mesh_axes` uses. By default the mesh of
      the compiled program's own input/output shardings, wherever it is called (inside
      `jax.set_mesh` or not); HLO text carries no mesh, so pass it there to name axes.

    **Returns:** a list of `Collective`, in program order.
    """
    text, compiled = _program(obj, args, kwargs)
    devices = None
    if compiled is not None:
        program_mesh, devices = _program_mesh(compiled)
        mesh = program_mesh if mesh is None else mesh
    num_devices = len(devices) if devices is not None else None
    if num_devices is None and mesh is not None:
        num_devices = math.prod(mesh.shape.values())

    calls: dict[str, set[str]] = {}
    loop_roots: set[str] = set()
    found: list[tuple[str, str, str, str]] = []  # (computation, kind, type, line)
    current = None
    for line in _lines_of_interest(text):
        comp = _COMPUTATION.match(line)
        if comp and "=" not in line.split("(")[0]:
            current = comp.group(1)
            calls.setdefault(current, set())
            continue
        inst = _INSTRUCTION.match(line)
        if not inst or current is None:
            continue
        rhs = inst.group(2)
        for target in _CALLED.findall(rhs):
            calls[current].update(re.findall(r"[\w.\-]+", target.replace("%", " ")))
        op = _OPCODE.search(rhs)
        if not op:
            continue
        opcode = op.group(1)
        if opcode == "while":
            loop_roots.update(_WHILE_PARTS.findall(rhs))
        base = opcode.removesuffix("-start")
        if base in COLLECTIVE_KINDS:
            found.append((current, base, rhs[: op.start()], line))

    in_loop: set[str] = set()
    queue = deque(loop_roots)
    while queue:
        name = queue.popleft()
        if name in in_loop:
            continue
        in_loop.add(name)
        queue.extend(calls.get(name, ()))

    frame_ids = [re.search(r"stack_frame_id=(\d+)", line) for *_, line in found]
    sources = _stack_frames(compiled, {int(f.group(1)) for f in frame_ids if f})
    out = []
    for (comp, kind, type_str, line), frame in zip(found, frame_ids):
        parts = _split_top(type_str)
        if kind in ("all-gather", "collective-permute", "all-to-all") and len(parts) > 1 and "-start(" in line:
            type_str = parts[1]  # async start: (operand, result, ...)
        groups = _parse_groups(line, num_devices)
        op_name = re.search(r'op_name="([^"]*)"', line)
        out.append(
            Collective(
                kind=kind,
                in_loop=comp in in_loop,
                bytes=_type_bytes(type_str),
                mesh_axes=_mesh_axes(groups, mesh, devices),
                op_name=op_name.group(1) if op_name else "",
                group_size=len(groups[0]) if groups else 0,
                source=sources.get(int(frame.group(1)), ()) if frame else (),
            )
        )
    return out


def _check_collectives(colls: Any, what: str) -> None:
    """Refuse anything but a list of `Collective` (e.g. a compiled program or its text)."""
    if isinstance(colls, list | tuple) and all(isinstance(c, Collective) for c in colls):
        return
    raise TypeError(
        f"{what}() takes the list of Collective that zoo.collectives returns, got {type(colls).__name__}; "
        f"call zoo.{what}(zoo.collectives(compiled))"
    )


def count(colls: list[Collective], kind: str | None = "all-reduce", *, in_loop: bool | None = None) -> int:
    """How many collectives of `kind` (any kind if `kind` is None), optionally by location."""
    _check_collectives(colls, "count")
    return sum(1 for c in colls if (kind is None or c.kind == kind) and (in_loop is None or c.in_loop == in_loop))


def report(colls: list[Collective]) -> str:
    """A readable table of collectives, loop ones flagged, with a one-line verdict.

    **Arguments:** `colls`, the list `zoo.collectives` returns.

    **Returns:** the table, as text."""
    _check_collectives(colls, "report")
    rows = [("kind", "where", "bytes", "mesh axes", "source", "op")]
    for c in colls:
        where = "IN LOOP" if c.in_loop else "outside"
        source = c.origin if c.source else "-"
        rows.append((c.kind, where, f"{c.bytes:,}", ",".join(c.mesh_axes) or "-", source, c.op_name))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = ["  ".join(r[i].ljust(widths[i]) for i in range(5)) + "  " + r[5] for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths) + "  " + "-" * 2)
    if not colls:
        lines.append("(no collectives)")
    loop_ar = count(colls, "all-reduce", in_loop=True)
    out_ar = count(colls, "all-reduce", in_loop=False)
    lines.append(f"all-reduces: {loop_ar} inside loops, {out_ar} outside")
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class CollectiveDiff:
    """What changed between two programs' collectives (`zoo.compare_collectives`).

    `added` / `removed`: the collectives one program holds beyond the other, matched by
    kind, place, bytes, mesh axes and group size (op names and source lines may differ).
    It is false when nothing changed; `str()` gives one `+`/`-` line per collective."""

    added: tuple[Collective, ...]
    removed: tuple[Collective, ...]

    def __bool__(self) -> bool:
        return bool(self.added or self.removed)

    def __str__(self) -> str:
        if not self:
            return "the same collectives"

        def line(sign: str, c: Collective) -> str:
            place = "IN LOOP" if c.in_loop else "outside"
            axes = ",".join(c.mesh_axes) or "-"
            source = f" at {c.origin}" if c.source else ""
            return f"{sign} {c.kind} {place} over {axes}, {c.bytes:,} B{source}"

        lines = [line("-", c) for c in self.removed] + [line("+", c) for c in self.added]
        summary = (
            f"all-reduces inside loops {count(list(self.removed), in_loop=True)} removed, "
            f"{count(list(self.added), in_loop=True)} added"
        )
        return "\n".join([*lines, summary])


def compare_collectives(before: Any, after: Any) -> CollectiveDiff:  # lists of Collective: checked below
    """What `after` (a program's collectives, from `zoo.collectives`) adds to and removes
    from `before`: for a CI that pins a step's communication across code changes.

    **Returns:** a `CollectiveDiff`, false when both hold the same collectives."""
    _check_collectives(before, "compare_collectives")
    _check_collectives(after, "compare_collectives")

    def key(c: Collective) -> tuple:
        return (c.kind, c.in_loop, c.bytes, c.mesh_axes, c.group_size)

    remaining = list(before)
    added = []
    for c in after:
        match = next((i for i, b in enumerate(remaining) if key(b) == key(c)), None)
        if match is None:
            added.append(c)
        else:
            remaining.pop(match)
    return CollectiveDiff(tuple(added), tuple(remaining))


def collective_summary(colls) -> dict[str, Any]:
    """Counts of the collectives by kind and place, and the mesh axes they span."""

    def axes(in_loop: bool) -> list[str]:
        return sorted({a for c in colls if c.in_loop == in_loop for a in c.mesh_axes})

    return {
        "all_reduce_in_loop": count(colls, "all-reduce", in_loop=True),
        "all_reduce_outside": count(colls, "all-reduce", in_loop=False),
        "all_gather_in_loop": count(colls, "all-gather", in_loop=True),
        "all_gather_outside": count(colls, "all-gather", in_loop=False),
        "reduce_scatter_in_loop": count(colls, "reduce-scatter", in_loop=True),
        "reduce_scatter_outside": count(colls, "reduce-scatter", in_loop=False),
        "collectives_in_loop": sum(c.in_loop for c in colls),
        "collectives_total": len(colls),
        "in_loop_mesh_axes": axes(True),
        "outside_mesh_axes": axes(False),
    }

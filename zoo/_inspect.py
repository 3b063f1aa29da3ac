"""Collective inspector: every collective in a compiled program, and whether it is in a loop."""

from __future__ import annotations

import dataclasses
import math
import re
from collections import deque
from typing import Any

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
_WHILE_PARTS = re.compile(r"\b(?:body|condition)=%?([\w.\-]+)")
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective op of a compiled program.

    - `kind`: `all-reduce`, `reduce-scatter`, `all-gather`, `collective-permute`,
      `all-to-all`, ... (async `-start` forms are reported under their base kind).
    - `in_loop`: whether it sits in a `while` body or condition, at any depth of calls.
    - `bytes`: size of its result (for an all-reduce: the bytes reduced).
    - `mesh_axes`: mesh axes its replica groups span (empty if it spans none / unknown mesh).
    - `op_name`: the JAX source op from the HLO metadata.
    - `group_size`: devices per replica group (0 if not stated).
    """

    kind: str
    in_loop: bool
    bytes: int
    mesh_axes: tuple[str, ...]
    op_name: str
    group_size: int = 0

    def to_json(self) -> dict:
        """A JSON-ready dict of this collective."""
        return dataclasses.asdict(self) | {"mesh_axes": list(self.mesh_axes)}


def _hlo_text(obj: Any, args: tuple, kwargs: dict) -> str:
    if isinstance(obj, str):
        return obj
    if args or kwargs:
        obj = obj.lower(*args, **kwargs)
    # Equinox's stage objects wrap jax's.
    obj = getattr(obj, "lowered", obj)
    obj = getattr(obj, "compiled", obj)
    if isinstance(obj, jax.stages.Lowered):
        obj = obj.compile()
    if not isinstance(obj, jax.stages.Compiled):
        raise TypeError(
            "collectives() takes a jitted function with its arguments, a Lowered/Compiled "
            f"object or HLO text; got {type(obj).__name__}"
        )
    return obj.as_text()


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


def _parse_groups(line: str, num_devices: int | None) -> list[list[int]]:
    # Named form: replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if m:
        sizes = [(name, int(size)) for name, size in re.findall(r"'([^']+)'=(\d+)", m.group(1))]
        names = [name for name, _ in sizes]
        grouped = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(2)) if a in names]
        ids = np.arange(math.prod(size for _, size in sizes)).reshape([size for _, size in sizes])
        rest = [k for k in range(len(sizes)) if k not in grouped]
        group_size = math.prod(sizes[k][1] for k in grouped)
        return ids.transpose(rest + grouped).reshape(-1, group_size).tolist()
    m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if m:
        out_shape = [int(d) for d in m.group(1).split(",")]
        ids = np.arange(math.prod(int(d) for d in m.group(2).split(",")))
        ids = ids.reshape([int(d) for d in m.group(2).split(",")])
        if m.group(3):
            ids = ids.transpose([int(d) for d in m.group(3).split(",")])
        return ids.reshape(out_shape).tolist()
    m = re.search(r"(?:replica_groups|source_target_pairs)=\{(.*?)\}\}", line)
    if m:
        return [[int(i) for i in g.split(",") if i] for g in re.findall(r"\{([\d,]*)", m.group(1) + "}")]
    if re.search(r"replica_groups=\{\}", line) and num_devices:
        return [list(range(num_devices))]
    return []


def _mesh_axes(groups: list[list[int]], mesh: Any) -> tuple[str, ...]:
    if mesh is None or not groups:
        return ()
    shape = tuple(mesh.shape.values())
    names = tuple(mesh.shape.keys())
    size = math.prod(shape)
    spanned = set()
    for group in groups:
        if any(i >= size for i in group):
            return ()
        coords = np.array([np.unravel_index(i, shape) for i in group])
        spanned |= {names[k] for k in range(len(names)) if len(set(coords[:, k])) > 1}
    return tuple(n for n in names if n in spanned)


def collectives(obj: Any, *args: Any, mesh: Any = None, **kwargs: Any) -> list[Collective]:
    """List every collective in a compiled program.

    **Arguments:**

    - `obj`: a jitted function (then `args`/`kwargs` are its arguments), a `Lowered` or
      `Compiled` object (jax or equinox), or HLO text.
    - `mesh`: the mesh the program runs on, to name the axes each collective spans;
      defaults to the mesh set by `jax.set_mesh`.

    **Returns:** a list of `Collective`, in program order.
    """
    if mesh is None:
        mesh = jax.sharding.get_abstract_mesh()
        mesh = None if mesh.empty else mesh
    text = _hlo_text(obj, args, kwargs)
    num_devices = None if mesh is None else math.prod(mesh.shape.values())

    calls: dict[str, set[str]] = {}
    loop_roots: set[str] = set()
    found: list[tuple[str, str, str, str]] = []  # (computation, kind, type, line)
    current = None
    for line in text.splitlines():
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
        base = opcode[: -len("-start")] if opcode.endswith("-start") else opcode
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

    out = []
    for comp, kind, type_str, line in found:
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
                mesh_axes=_mesh_axes(groups, mesh),
                op_name=op_name.group(1) if op_name else "",
                group_size=len(groups[0]) if groups else 0,
            )
        )
    return out


def count(colls: list[Collective], kind: str | None = "all-reduce", *, in_loop: bool | None = None) -> int:
    """How many collectives of `kind` (any kind if `kind` is None), optionally by location."""
    return sum(
        1
        for c in colls
        if (kind is None or c.kind == kind) and (in_loop is None or c.in_loop == in_loop)
    )


def report(colls: list[Collective]) -> str:
    """A readable table of collectives, loop ones flagged, with a one-line verdict."""
    rows = [("kind", "where", "bytes", "mesh axes", "op")]
    for c in colls:
        rows.append(
            (c.kind, "IN LOOP" if c.in_loop else "outside", f"{c.bytes:,}", ",".join(c.mesh_axes) or "-", c.op_name)
        )
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(r[i].ljust(widths[i]) for i in range(4)) + "  " + r[4] for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths) + "  " + "-" * 2)
    if not colls:
        lines.append("(no collectives)")
    loop_ar = count(colls, "all-reduce", in_loop=True)
    out_ar = count(colls, "all-reduce", in_loop=False)
    lines.append(f"all-reduces: {loop_ar} inside loops, {out_ar} outside")
    return "\n".join(lines)

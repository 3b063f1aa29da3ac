"""Multi-process training: start JAX's distributed runtime, and build global batches from
each process's rows.

One Python process per host (or per accelerator group) runs the same program. After
`distributed_init`, `jax.devices()` lists every process's devices, a mesh built from it
spans them all, and `zoo.TrainStep` runs unchanged on global arrays: nothing in model
code changes. Each process loads only its rows of a global batch (`local_rows`) and
`global_batch` assembles them into one `jax.Array` split over the data axes.
"""

from __future__ import annotations

import errno
import math
import os
import signal
import socket
import sys
import threading
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ._batch import batch_spec, data_axes_tuple, data_entry, data_parallel_size

_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
_LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")

# What this process was started with (None until `distributed_init` starts the runtime).
_started: tuple[str | None, int, int] | None = None


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"environment variable {name}={value!r} is not an integer; set it to one, or unset it"
        ) from None


def distributed_init(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_count: int | None = None,
) -> tuple[int, int]:
    """Start JAX's multi-process runtime (`jax.distributed.initialize`) in this process.

    Call it in every process, before anything touches jax's devices. Arguments left
    `None` come from the environment: `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`,
    `JAX_PROCESS_ID`, else what `jax.distributed` detects itself (SLURM, Open MPI, TPU
    pods, Kubernetes). On CPU, cross-process collectives use gloo. Idempotent: a second
    call with the same (or no) arguments does nothing; with different ones it raises.

    **Arguments:**

    - `coordinator`: `"HOST:PORT"` of process 0's coordinator service (every process
      passes the same). A loopback host (127.0.0.1, localhost) binds the service to
      loopback only.
    - `num_processes`: how many processes take part.
    - `process_id`: this process's index, `0 <= process_id < num_processes`.
    - `local_device_count`: on CPU, the number of simulated devices of this process
      (`jax_num_cpu_devices`); ignored on accelerators.

    **Returns:** `(process_id, process_count)` as jax sees them.
    """
    global _started
    coordinator = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS") or None
    if num_processes is None:
        num_processes = _env_int("JAX_NUM_PROCESSES")
    if process_id is None:
        process_id = _env_int("JAX_PROCESS_ID")
    if _started is not None or jax.distributed.is_initialized():
        wanted = (coordinator, num_processes, process_id)
        have = _started or (None, jax.process_count(), jax.process_index())
        for given, got, what in zip(wanted, have, ("coordinator", "num_processes", "process_id")):
            if given is not None and got is not None and given != got:
                raise RuntimeError(
                    f"the distributed runtime is already running with {what}={got!r}; it cannot restart with "
                    f"{what}={given!r} in the same process (start a new process)"
                )
        return jax.process_index(), jax.process_count()
    if num_processes is not None and num_processes < 1:
        raise ValueError(f"num_processes must be >= 1, got {num_processes}")
    if process_id is not None and num_processes is not None and not 0 <= process_id < num_processes:
        raise ValueError(f"process_id must be in [0, {num_processes}), got {process_id}")
    if coordinator is not None and (":" not in coordinator or not coordinator.rsplit(":", 1)[1].isdigit()):
        raise ValueError(f"coordinator must be HOST:PORT (e.g. 10.0.0.1:1234), got {coordinator!r}")
    if coordinator is not None and process_id == 0:
        _check_port_free(coordinator)
    try:
        if local_device_count is not None:
            jax.config.update("jax_num_cpu_devices", local_device_count)
        # Harmless on GPU/TPU; on CPU, without it cross-process collectives have no transport.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except RuntimeError as e:
        raise RuntimeError(
            "zoo.distributed_init must run before anything touches jax's devices (jax.devices(), an array, "
            f"a jit call); move it to the top of the program ({e})"
        ) from e
    kwargs: dict[str, Any] = {}
    if coordinator is not None and coordinator.rsplit(":", 1)[0] in _LOOPBACK:
        kwargs["coordinator_bind_address"] = coordinator  # the default binds every interface
    # A missing process or an unreachable coordinator blocks here without a word until jax
    # aborts the process (DEADLINE_EXCEEDED after 300 s): say what is awaited meanwhile.
    note = threading.Timer(_WAIT_NOTE_S, _note_waiting, (coordinator, num_processes, process_id))
    note.daemon = True
    note.start()
    try:
        jax.distributed.initialize(coordinator, num_processes, process_id, **kwargs)
    except ValueError as e:
        raise ValueError(
            f"{e} Pass coordinator='HOST:PORT', num_processes and process_id (zoo train / finetune: "
            f"--coordinator HOST:PORT --num-processes N --process-id I; or set {', '.join(_ENV)}) in every process."
        ) from e
    finally:
        note.cancel()
    _started = (coordinator, jax.process_count(), jax.process_index())
    # jax's preemption notifier has just taken SIGTERM and only logs it: note it here until a
    # run's own handler (`zoo.train`'s Preemption) takes over and stops at an agreed step.
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _note_sigterm)
    return jax.process_index(), jax.process_count()


_WAIT_NOTE_S = 20.0  # seconds in `jax.distributed.initialize` before saying what it waits for


def _note_waiting(coordinator: str | None, num_processes: int | None, process_id: int | None) -> None:
    who = f"process {process_id} of {num_processes}" if process_id is not None else "this process"
    where = f"the coordinator at {coordinator}" if coordinator else "the coordinator"
    print(
        f"zoo: {who} has waited {_WAIT_NOTE_S:.0f} s to join {where}: check that every process is started with "
        "the same coordinator and process count, and that process 0's host and port are reachable from here "
        "(jax aborts the process after 300 s)",
        file=sys.stderr,
        flush=True,
    )


def _check_port_free(coordinator: str) -> None:
    """Raise if process 0 could not host the coordinator service at `coordinator`: jax's
    gRPC server only logs a failed bind and then crashes the process (a segfault)."""
    host, port = coordinator.rsplit(":", 1)
    bind_host = host.strip("[]") if host in _LOOPBACK else "::"  # jax's default binds [::]:PORT
    family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does
            probe.bind((bind_host, int(port)))
    except OSError as e:
        if e.errno != errno.EADDRINUSE:
            return  # e.g. no IPv6 here: leave the bind to jax
        with socket.socket(family, socket.SOCK_STREAM) as free:
            free.bind((bind_host, 0))
            suggestion = f"{host}:{free.getsockname()[1]}"
        raise RuntimeError(
            f"the coordinator port {port} is already in use on this machine, so process 0 cannot host the "
            f"coordinator at {coordinator}; pass a free port in every process (e.g. --coordinator {suggestion}, "
            "or coordinator= / JAX_COORDINATOR_ADDRESS), or stop the program using it"
        ) from None


_sigterm_noted = False


def _note_sigterm(signum, frame) -> None:
    global _sigterm_noted
    _sigterm_noted = True


def sigterm_noted() -> bool:
    """Whether this process got SIGTERM after `distributed_init` and before a run took the
    signal over (the run then stops after its first step, in every process)."""
    return _sigterm_noted


def is_main_process() -> bool:
    """Whether this is process 0, the one that prints, writes metrics and plots."""
    return jax.process_index() == 0


def _concrete_mesh(mesh):
    if mesh is not None:
        return mesh
    mesh = jax.sharding.get_mesh()
    if mesh is None or mesh.empty:
        raise ValueError("no mesh: pass mesh=, or call under `with jax.set_mesh(mesh):`")
    return mesh


def _process_slices(mesh, data_axes: tuple[str, ...], rows: int) -> list[tuple[int, int]]:
    """The distinct `(start, stop)` row ranges of a `[rows]` array split over the data axes
    that this process's devices hold, in order."""
    sharding = NamedSharding(mesh, P(data_entry(data_axes)))
    ranges = {
        (idx[0].start or 0, rows if idx[0].stop is None else idx[0].stop)
        for idx in sharding.addressable_devices_indices_map((rows,)).values()
    }
    return sorted(ranges)


def local_rows(global_rows: int, mesh=None, data_axes: str | tuple[str, ...] = "data") -> slice:
    """The rows of a global batch of `global_rows` rows that this process loads.

    With the batch split over `data_axes` of `mesh` (default: the mesh set by
    `jax.set_mesh`), this process's devices hold one contiguous block of rows, in the
    order of the mesh's devices along the data axes (process 0 the first block on a mesh
    built by `jax.make_mesh`). One process: every row.

    **Returns:** a `slice` of the global rows. Raises `ValueError` if the rows do not
    divide over the data axes, or if this process's rows are not contiguous (build the
    mesh with each process's devices next to each other along the data axes).
    """
    mesh = _concrete_mesh(mesh)
    axes = data_axes_tuple(data_axes)
    n = data_parallel_size(mesh, axes)
    if global_rows % n:
        raise ValueError(f"global batch of {global_rows} rows does not divide over data-parallel size {n}")
    ranges = _process_slices(mesh, axes, global_rows)
    for (_, stop), (start, _) in zip(ranges, ranges[1:]):
        if stop != start:
            raise ValueError(
                f"this process's devices hold rows {ranges} of the batch, not one block; build the mesh so each "
                "process's devices are adjacent along the data axes (jax.make_mesh does)"
            )
    return slice(ranges[0][0], ranges[-1][1])


def global_batch(local_batch: Any, mesh=None, data_axes: str | tuple[str, ...] = "data") -> Any:
    """A global batch, split over the data axes, from this process's rows.

    Each process passes its own rows (a pytree of numpy or jax arrays, all with the same
    leading size: this process's share, `local_rows`); the result holds one
    `jax.Array` per leaf with the global leading size, dim 0 split over `data_axes` of
    `mesh` (default: the mesh set by `jax.set_mesh`), other dims replicated. With one
    process it is `jax.device_put` of the batch. `zoo.TrainStep` takes it as is.

    **Returns:** the global batch. Raises `ValueError` naming the expected local size if
    the rows do not divide evenly over this process's devices.
    """
    mesh = _concrete_mesh(mesh)
    axes = data_axes_tuple(data_axes)
    n = data_parallel_size(mesh, axes)
    # How many of the N data shards this process holds: its share of the global rows.
    shards = len(_process_slices(mesh, axes, n))

    def one(x):
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            # Typed keys (per-example dropout keys) travel as their key data.
            return jax.random.wrap_key_data(one(jax.random.key_data(x)), impl=jax.random.key_impl(x))
        x = np.asarray(x)
        if x.ndim < 1:
            raise ValueError("every batch leaf needs a leading batch dimension; found a scalar")
        rows = x.shape[0]
        if rows % shards:
            raise ValueError(
                f"this process passed {rows} rows, but its devices hold {shards} of the {n} data shards: pass a "
                f"multiple of {shards} rows (its share of the global batch, global_rows * {shards} / {n}; "
                "zoo.local_rows(global_rows) says which)"
            )
        global_shape = (rows * n // shards, *x.shape[1:])
        sharding = NamedSharding(mesh, batch_spec(x.ndim, axes))
        return jax.make_array_from_process_local_data(sharding, x, global_shape)

    leaves = jax.tree.leaves(local_batch)
    if len({math.prod(np.shape(x)[:1]) for x in leaves}) > 1:
        raise ValueError(f"batch leaves disagree on the local batch size: {sorted({np.shape(x)[0] for x in leaves})}")
    return jax.tree.map(one, local_batch)

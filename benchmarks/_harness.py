"""What the step-time benchmarks (`step_time.py`, `lm_step_time.py`) share.

A benchmark script runs each simulated CPU device count in its own worker process (a
process can simulate only one CPU device count): the driver (`parse_args`, `run_worker`)
starts `python <script> --worker N --rounds R`, the worker (`data_mesh`, `time_rounds`,
`all_reduces`) prints its results as one JSON line, and the driver prints the report
(`report_lines`, `table`, `in_loop_outside`, `other_collectives`, `verdict_lines`) and
the JSON summary (`write_summary`).

The scripts run as `python benchmarks/<script>.py`, which puts this folder on `sys.path`:
they import this module as `_harness`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import jax
from jax.sharding import AxisType

import zoo

# -- worker: one device count per process --------------------------------------------------


def data_mesh(n: int) -> jax.sharding.Mesh:
    """A 1-D explicit `data` mesh over `n` simulated CPU devices; call before jax starts."""
    jax.config.update("jax_num_cpu_devices", n)  # before anything touches the backend
    return jax.make_mesh((n,), ("data",), axis_types=(AxisType.Explicit,))


def cpu_seconds() -> tuple[float, float, float] | None:
    """(wall clock, busy CPU seconds of the whole machine, of this process); None off Linux."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:9]]
    except OSError:
        return None
    busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # minus idle, iowait
    own = os.times()
    return time.perf_counter(), busy, own.user + own.system


def all_reduces(colls, **extra) -> dict:
    """All-reduce counts inside/outside loops (`zoo.count`), `extra`, the other collectives."""
    return {
        "in_loop": zoo.count(colls, "all-reduce", in_loop=True),
        "outside": zoo.count(colls, "all-reduce", in_loop=False),
        **extra,
        "other_collectives": sorted({c.kind for c in colls if c.kind != "all-reduce"}),
    }


@dataclass
class Timing:
    times: dict[str, list[float]]  # variant → step times in ms, one per round
    other_cpus: float | None  # CPUs other processes kept busy meanwhile; None off Linux

    def medians(self) -> dict[str, float]:
        return {name: statistics.median(ts) for name, ts in self.times.items()}

    def ratio(self, slow: str, fast: str) -> float:
        """How many times faster `fast` ran than `slow`: the median of per-round ratios.

        The calls of a round run back to back, so a change of load between rounds cancels
        out (a ratio of medians would not).
        """
        return statistics.median(s / f for s, f in zip(self.times[slow], self.times[fast]))


def time_rounds(call: Callable[[str], object], variants: Sequence[str], rounds: int) -> Timing:
    """One more warm-up `call` of each variant, then `rounds` timed rounds of all of them.

    The variants run interleaved, so load on a shared machine hits them alike, and the
    order rotates round by round, so no variant always runs right after the same one (two
    variants alternate) and each goes first equally often over a multiple of their number.
    """
    variants = tuple(variants)
    for name in variants:  # second warm-up call
        call(name)
    times = {name: [] for name in variants}
    before = cpu_seconds()
    for r in range(rounds):
        k = r % len(variants)
        for name in variants[k:] + variants[:k]:
            t0 = time.perf_counter()
            call(name)
            times[name].append(1e3 * (time.perf_counter() - t0))
    # Other processes' CPU use shrinks the speedups over replicated; record it with them.
    after = cpu_seconds()
    other_cpus = None
    if before and after:
        wall, busy, own = (a - b for a, b in zip(after, before))
        other_cpus = max(busy - own, 0.0) / wall
    return Timing(times, other_cpus)


# -- driver: launch the workers, print the report ------------------------------------------


def loadavg() -> str:
    """The machine's 1, 5 and 15 minute load averages, or "n/a" off Linux."""
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "n/a"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def parse_args(
    doc: str,
    default_rounds: dict[int, int],
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
) -> argparse.Namespace:
    """--devices, --rounds, the script's own flags (`add_arguments`), --json, --worker.

    `args.rounds_for(n)` is the number of timed rounds for `n` devices.
    """
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--devices", type=int, nargs="+", default=[2, 8], help="simulated CPU device counts")
    parser.add_argument("--rounds", type=int, help=f"timed rounds per device count (default {default_rounds}, else 10)")
    if add_arguments:
        add_arguments(parser)
    parser.add_argument("--json", metavar="PATH", help="also write the results here")
    # Internal: run one device count and print its results as a JSON line.
    parser.add_argument("--worker", type=int, metavar="N", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.rounds_for = lambda n: args.rounds or default_rounds.get(n, 10)
    return args


def print_worker_result(result: dict) -> None:
    print(json.dumps(result), flush=True)


def run_worker(script: str, n: int, rounds: int, flags: Iterable[str] = (), note: str = "") -> dict:
    """Run `script`'s worker for `n` devices in a fresh process; its results."""
    log(f"running {n} devices, {rounds} rounds{note} ...")
    cmd = [sys.executable, script, "--worker", str(n), "--rounds", str(rounds), *flags]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def command_line() -> str:
    return shlex.join([sys.executable, *sys.argv])


def table(header: Sequence[str], rows: Iterable[Sequence[str]], left: int = 0) -> list[str]:
    """A markdown table's lines; the first `left` columns left-aligned, the rest right."""
    align = ["---"] * left + ["---:"] * (len(header) - left)
    return [_row(header), "|" + "|".join(align) + "|", *map(_row, rows)]


def _row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def report_lines(
    title: str,
    header: Sequence[str],
    rows: Iterable[Sequence[str]],
    results: list[dict],
    note: Callable[[dict], str],
) -> list[str]:
    """`title`, the table of step times, then a line per worker's results: `timing_note`, `note`."""
    return [title, "", *table(header, rows), "", *(f"{timing_note(r)} {note(r)}" for r in results)]


def timing_note(r: dict) -> str:
    """How many rounds a worker timed and how many CPUs other processes kept busy meanwhile."""
    other = "?" if r["other_processes_cpus"] is None else f"{r['other_processes_cpus']:.2f}"
    return (
        f"- {r['devices']} devices, {r['rounds']} rounds, other processes busy on {other} of "
        f"{os.cpu_count()} CPUs while timing."
    )


def in_loop_outside(h: dict) -> str:
    """A variant's all-reduce counts (`all_reduces`) as `in loops/outside`."""
    return f"{h['in_loop']}/{h['outside']}"


def other_collectives(hlo: dict, variants: Sequence[str]) -> str:
    """The collectives other than all-reduces in each variant's step, or 'none'."""
    colls = "; ".join(f"{v}: {', '.join(hlo[v]['other_collectives'])}" for v in variants if hlo[v]["other_collectives"])
    return colls or "none"


def verdict(target: str, value: float | None, passed: bool) -> dict:
    return {"target": target, "value": value, "pass": passed}


def verdict_lines(verdicts: Iterable[dict], miss: str = "FAIL") -> list[str]:
    """`- target T: value → PASS` (or `miss`); no value where a verdict has none."""
    lines = []
    for v in verdicts:
        value = "" if v["value"] is None else f": {v['value']:.3f}"
        lines.append(f"- target {v['target']}{value} → {'PASS' if v['pass'] else miss}")
    return lines


def write_summary(summary: dict, path: str | None) -> None:
    """Print `summary` as a JSON line without per-round times; write it all to `path` too."""
    brief = [{k: v for k, v in r.items() if k != "times_ms"} for r in summary["results"]]
    print(json.dumps(summary | {"results": brief}))
    if path:
        with open(path, "w") as f:
            json.dump(summary, f, indent=2)

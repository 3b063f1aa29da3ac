"""What each test file costs: a pytest plugin that records it, and a script that prints it.

As a plugin (tests/conftest.py registers it when ZOO_TEST_TIMELINE names a folder), every
pytest process (each xdist worker, or the one process without xdist) appends one JSON line
per test to `FOLDER/<worker>.jsonl`: the test's wall and CPU seconds (setup and teardown
included, so a module fixture's work counts to the test that starts it, and the file's
freeing of programs to its last test), the CPU seconds of the subprocesses it waited for,
the programs XLA compiled and their seconds, and the processes it started (`zoo` ones
apart). Lines are written as tests end, so a worker that dies still leaves its records.

As a script, `python tests/tools/timeline.py FOLDER [FOLDER_AFTER]` prints per test file
what the records of all workers add up to, most CPU first, and the totals; with a second
folder, the two side by side. `--tests N` prints the N costliest tests instead.

With ZOO_TEST_TIMELINE_PROGRAMS=1 as well, each process also appends one JSON line per XLA
compile to `FOLDER/programs/<worker>-<pid>.jsonl`: a fingerprint of the program (the lowered
module's text without locations, and the serialized compile options, which name the devices),
its compile seconds (wall, and the process's CPU meanwhile), the wall-clock time and the
test. `--programs` then prints how many
compile seconds went to programs some process had compiled before (what one compilation
cache shared by every process could save at most), by the program's compile time.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import subprocess
import sys
import time

import pytest

FIELDS = ("wall", "cpu", "child_cpu", "compiles", "compile_s", "trace_s", "lower_s", "procs", "zoo_procs")
# jax's own timers (wall seconds): tracing a function to a jaxpr, lowering it to a module,
# XLA compiling the module.
_EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace_s",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
}


class Timeline:
    """The plugin: one record per test, appended to `folder/<worker id>.jsonl`."""

    def __init__(self, folder: str, worker: str):
        self.path = pathlib.Path(folder) / f"{worker}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.compiles = 0
        self.compile_s = 0.0
        self.seconds = dict.fromkeys(_EVENTS.values(), 0.0)
        self.procs = 0
        self.zoo_procs = 0
        import jax

        def listen(event, seconds, **_):
            if event == "/jax/core/compile/backend_compile_duration":
                self.compiles += 1
                self.compile_s += seconds
            elif event in _EVENTS:
                self.seconds[_EVENTS[event]] += seconds

        jax.monitoring.register_event_duration_secs_listener(listen)
        original_init = subprocess.Popen.__init__
        timeline = self

        def counting_init(self, args, *a, **k):
            timeline.procs += 1
            words = [str(args)] if isinstance(args, (str, bytes, os.PathLike)) else [str(w) for w in args]
            text = " ".join(words)
            if any(os.path.basename(w) == "zoo" for w in words) or "-m zoo" in text or "run_module('zoo'" in text:
                timeline.zoo_procs += 1
            original_init(self, args, *a, **k)

        subprocess.Popen.__init__ = counting_init
        self.test = ""
        if os.environ.get("ZOO_TEST_TIMELINE_PROGRAMS"):
            self._record_programs(folder, worker)

    def _record_programs(self, folder: str, worker: str) -> None:
        """Wrap jax's backend compile: one line per compile with the program's fingerprint."""
        import hashlib

        from jax._src import compiler
        from jax._src.lib.mlir import ir

        path = pathlib.Path(folder) / "programs" / f"{worker}-{os.getpid()}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        original = compiler.backend_compile_and_load
        timeline = self

        def fingerprinted(backend, module, executable_devices, options, host_callbacks):
            start, cpu = time.perf_counter(), time.process_time()
            result = original(backend, module, executable_devices, options, host_callbacks)
            seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
            digest = hashlib.sha256(module.operation.get_asm(binary=True, enable_debug_info=False))
            digest.update(options.SerializeAsString())
            record = {
                "fp": digest.hexdigest()[:24],
                "name": ir.StringAttr(module.operation.attributes["sym_name"]).value,
                "s": round(seconds, 5),
                # The process's CPU seconds meanwhile: XLA compiles on a thread of its own.
                "cpu": round(cpu, 5),
                "t": time.time(),
                "pid": os.getpid(),
                "test": timeline.test,
                "callbacks": bool(host_callbacks),
            }
            with open(path, "a") as f:
                f.write(json.dumps(record) + "\n")
            return result

        compiler.backend_compile_and_load = fingerprinted

    def _now(self):
        t = os.times()
        return {
            "wall": time.perf_counter(),
            "cpu": t.user + t.system,
            "child_cpu": t.children_user + t.children_system,
            "compiles": self.compiles,
            "compile_s": self.compile_s,
            **self.seconds,
            "procs": self.procs,
            "zoo_procs": self.zoo_procs,
        }

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        self.test = item.nodeid
        start = self._now()
        yield
        end = self._now()
        record = {"test": item.nodeid, "file": item.nodeid.split("::")[0]}
        record |= {k: round(end[k] - start[k], 4) for k in FIELDS}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def register(config) -> None:
    """Register the plugin on `config` if ZOO_TEST_TIMELINE names a folder (from conftest)."""
    folder = os.environ.get("ZOO_TEST_TIMELINE")
    if folder:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        config.pluginmanager.register(Timeline(folder, worker), "zoo-timeline")


def _load(folder) -> list[dict]:
    records = []
    for path in sorted(pathlib.Path(folder).glob("*.jsonl")):
        with open(path) as f:
            records += [json.loads(line) | {"worker": path.stem} for line in f if line.strip()]
    return records


def _per(records, key) -> dict[str, dict]:
    rows = collections.defaultdict(lambda: dict.fromkeys(("tests", *FIELDS), 0))
    for r in records:
        row = rows[r[key]]
        row["tests"] += 1
        for k in FIELDS:
            row[k] += r.get(k, 0)  # records of older runs lack the newer fields
    return rows


def _line(name, row, width) -> str:
    return (
        f"{name:<{width}} {row['tests']:>5} {row['wall']:>8.1f} {row['cpu']:>8.1f} {row['child_cpu']:>8.1f}"
        f" {row['compiles']:>6} {row['compile_s']:>8.1f} {row['trace_s']:>7.1f} {row['lower_s']:>7.1f}"
        f" {row['procs']:>5} {row['zoo_procs']:>5}"
    )


BUCKETS = (0.1, 0.3, 1.0, 3.0)


def programs(folder) -> None:
    """Compile seconds spent on programs compiled before (by any process of the run), by
    where the earlier compile was and by the program's compile time."""
    records = []
    for path in sorted((pathlib.Path(folder) / "programs").glob("*.jsonl")):
        with open(path) as f:
            records += [json.loads(line) for line in f if line.strip()]
    records.sort(key=lambda r: r["t"])
    first = {}
    rows = collections.defaultdict(lambda: [0, 0.0])  # (where, bucket) -> compiles, seconds
    edges = [0.0, *BUCKETS]
    for r in records:
        bucket = sum(r["s"] >= edge for edge in BUCKETS)
        earlier = first.get(r["fp"])
        if earlier is None:
            where = "first"
            first[r["fp"]] = r
        elif earlier["pid"] != r["pid"]:
            where = "again, another process"
        elif earlier["test"].split("::")[0] != r["test"].split("::")[0]:
            where = "again, same process, another file"
        else:
            where = "again, same process and file"
        rows[where, bucket][0] += 1
        rows[where, bucket][1] += r["s"]
    names = [f"< {BUCKETS[0]} s"] + [f"{a}-{b} s" for a, b in zip(BUCKETS, BUCKETS[1:])] + [f">= {BUCKETS[-1]} s"]
    print(
        f"{len(records)} compiles, {sum(r['s'] for r in records):.1f} s, {len(first)} distinct programs, "
        f"{len({r['pid'] for r in records})} processes"
    )
    print("| compiled | " + " | ".join(names) + " | all |")
    print("|---|" + "---:|" * (len(names) + 1))
    wheres = ["first", "again, another process", "again, same process, another file", "again, same process and file"]
    for where in wheres:
        cells = [rows[where, b] for b in range(len(names))]
        total = [sum(c[0] for c in cells), sum(c[1] for c in cells)]
        print(f"| {where} | " + " | ".join(f"{c[0]}, {c[1]:.1f} s" for c in [*cells, total]) + " |")
    again = [sum(rows[w, b][1] for w in wheres[1:]) for b in range(len(names))]
    print(
        "compile seconds of repeats at or over a program compile time of:",
        ", ".join(f"{edge} s: {sum(again[i:]):.1f}" for i, edge in enumerate(edges)),
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", help="a ZOO_TEST_TIMELINE folder")
    parser.add_argument("after", nargs="?", help="a second folder: print both side by side")
    parser.add_argument("--tests", type=int, default=0, help="print the N costliest tests instead of files")
    parser.add_argument("--top", type=int, default=0, help="print only the N costliest files (and the total)")
    parser.add_argument("--markdown", action="store_true", help="a markdown table (for docs/testing.md)")
    parser.add_argument(
        "--programs", action="store_true", help="compiles of programs compiled before (ZOO_TEST_TIMELINE_PROGRAMS=1)"
    )
    args = parser.parse_args(argv)
    if args.programs:
        programs(args.folder)
        return
    before = _load(args.folder)
    key = "test" if args.tests else "file"
    rows = _per(before, key)
    order = sorted(rows, key=lambda k: -rows[k]["cpu"])[: args.tests or args.top or None]
    total = _per([r | {"all": "total"} for r in before], "all")["total"]
    if args.after:
        after_rows = _per(_load(args.after), key)
        after_total = _per([r | {"all": "total"} for r in _load(args.after)], "all")["total"]
        names = sorted(set(rows) | set(after_rows), key=lambda k: -rows.get(k, {"cpu": 0})["cpu"])
        empty = dict.fromkeys(("tests", *FIELDS), 0)
        print(
            "| file | tests | CPU s | compiles | procs (zoo) | tests after | CPU s after | compiles after | procs after |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for name in [*names, "total"]:
            b = total if name == "total" else rows.get(name, empty)
            a = after_total if name == "total" else after_rows.get(name, empty)
            print(
                f"| {name} | {b['tests']} | {b['cpu']:.0f} | {b['compiles']} | {b['procs']} ({b['zoo_procs']})"
                f" | {a['tests']} | {a['cpu']:.0f} | {a['compiles']} | {a['procs']} ({a['zoo_procs']}) |"
            )
        return
    if args.markdown:
        print("| file | tests | wall s | CPU s | child CPU s | compiles | compile s | procs | zoo procs |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for name in [*order, "total"]:
            row = total if name == "total" else rows[name]
            print(
                f"| {name} | {row['tests']} | {row['wall']:.0f} | {row['cpu']:.0f} | {row['child_cpu']:.0f}"
                f" | {row['compiles']} | {row['compile_s']:.0f} | {row['procs']} | {row['zoo_procs']} |"
            )
        return
    width = max(len(n) for n in [*order, "total"])
    print(
        f"{'':<{width}} {'tests':>5} {'wall s':>8} {'CPU s':>8} {'child s':>8} {'comp.':>6} {'comp. s':>8} {'trace s':>7} {'lower s':>7}"
        f" {'procs':>5} {'zoo':>5}"
    )
    for name in order:
        print(_line(name, rows[name], width))
    print(_line("total", total, width))
    workers = _per(before, "worker")
    for name in sorted(workers):
        print(f"worker {name}: wall {workers[name]['wall']:.0f} s, CPU {workers[name]['cpu']:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()

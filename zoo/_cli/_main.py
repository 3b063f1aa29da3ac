"""The `zoo` command: its parser and entry point."""

from __future__ import annotations

import argparse
import difflib
import errno
import logging
import os
import sys

from .. import __version__
from ..internal import without_closed_loop_tracebacks
from ..train import ConfigError, Interrupted, Preempted, RunStopped
from ._common import CLIError, flag_names

DESCRIPTION = (
    "eqx-zoo's command line: train and LoRA-fine-tune zoo models on simulated or real devices, "
    "inspect the collectives and leaves of their training steps, generate text with decoders, and use a "
    "finished run: predict, evaluate on a file, export merged."
)


NO_CACHE_HELP = (
    "do not use the persistent compilation cache (default: compiled programs are kept in "
    "$ZOO_COMPILE_CACHE_DIR, else $XDG_CACHE_HOME/zoo/jax or ~/.cache/zoo/jax, so a second identical "
    "run skips compiling; ZOO_NO_COMPILE_CACHE=1 also turns it off)"
)


KEEP_MEMORY_HELP = (
    "call zoo.keep_freed_memory() first: glibc's malloc keeps freed memory, so a step's large CPU buffers "
    "reuse pages the process holds instead of faulting in fresh ones (faster on one device; slower with "
    "several simulated devices and for compiling, one malloc arena for every thread; the process keeps its "
    "peak memory; docs/performance.md)"
)


# How `main` reports the library's errors: (prefix, exit code). A ConfigError is 2, as a
# usage error; SIGTERM is 143 = 128 + 15, as a shell reports a process the signal ended.
# Ctrl-C is 130 (128 + 2) whether it saved a checkpoint (Interrupted) or stopped at once.
_EXITS = {
    ConfigError: ("error", 2),
    RunStopped: ("error", 3),
    Interrupted: ("interrupted", 130),
    Preempted: ("stopped", 143),
}


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line naming the fix (`--help`), not a usage
    block, and that takes flags as written only: argparse's prefix matching would read
    `--step 3` as `--steps 3` (a typo becomes another setting). Its commands' parsers are
    of this class too."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The `zoo` parser and its commands' parsers by name."""
    from . import _generate, _info, _inspect, _serve, _train, _use

    parser = _Parser(
        prog="zoo",
        description=DESCRIPTION,
        epilog="`zoo COMMAND --help` lists a command's flags; docs/cli.md has the whole story.",
    )
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    parser.add_argument(
        "--version", action="version", version=f"zoo {__version__}", help="print zoo's version and exit"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands = dict(_train.add_parsers(sub))
    commands["inspect"] = _inspect.add_parser(sub)
    commands["info"] = _info.add_parser(sub)
    commands["generate"] = _generate.add_parser(sub)
    commands["serve"] = _serve.add_parser(sub)
    commands |= _use.add_parsers(sub)
    for flag, text in (("--no-compile-cache", NO_CACHE_HELP), ("--keep-memory", KEEP_MEMORY_HELP)):
        parser.add_argument(flag, action="store_true", help=text)
        for command in commands.values():  # also accepted after the command
            command.add_argument(flag, action="store_true", default=argparse.SUPPRESS, help=text)
    return parser, commands


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `zoo` (exposed for tests and docs)."""
    return build_parsers()[0]


def _parse(parser, commands, argv) -> argparse.Namespace:
    """Parse `argv`; an unknown flag is reported by its command's parser (`zoo train: error:
    unrecognized arguments: ... (see zoo train --help)`)."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        command = commands[args.command]
        flags = [o for a in command._actions for o in a.option_strings if o.startswith("--")]
        close = [m for e in extra if e.startswith("--") for m in difflib.get_close_matches(e.split("=")[0], flags, 1)]
        hint = f"; did you mean {' / '.join(dict.fromkeys(close))}?" if close else ""
        command.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
    return args


def _check_model(args: argparse.Namespace) -> None:
    """Refuse a MODEL no command takes before anything imports jax (a second or more): a
    misspelt name (`zoo.train.check_model_name`), or a registered one the command does
    not take (`zoo finetune mlp`). Reads the registries only."""
    model = getattr(args, "model", None)
    if not isinstance(model, str):
        return
    from ..train import check_model_name, model_names, model_spec

    check_model_name(model)
    if model in model_names() and args.command in ("train", "finetune", "demo"):
        model_spec(model).defaults_for(args.command)


def _continue(e: Interrupted, argv: list[str] | None) -> str:
    """The command that continues a run Ctrl-C stopped: this one, with its --output and
    --resume (and without --overwrite, which would delete what was saved)."""
    import shlex

    args = [a for a in (sys.argv[1:] if argv is None else argv) if a not in ("--resume", "--overwrite")]
    if e.output is not None and not any(a == "--output" or a.startswith("--output=") for a in args):
        args += ["--output", str(e.output)]
    return f"; continue with: zoo {shlex.join(args + ['--resume'])}"


def _not_an_interrupt(record: logging.LogRecord) -> bool:
    """Drop a log record carrying a Ctrl-C (orbax logs "Save Finalize thread failed" with
    the KeyboardInterrupt's traceback when it lands while a save finishes): the command
    reports the interruption itself, in one line."""
    return not (record.exc_info and isinstance(record.exc_info[1], KeyboardInterrupt))


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `zoo` console script: exit 0 on success, 2 on a usage error
    (one line on stderr), 1 when the demo's loss did not fall, 3 when a run stopped because
    its loss or weights went non-finite, 4 when the compiled step breaks its collective budget
    (`zoo.BudgetError`), 130 when interrupted (Ctrl-C), 143 when stopped by
    SIGTERM after saving a checkpoint."""
    # A full disk during a checkpoint save ends with one line: tensorstore's writes still in
    # flight then print "Event loop is closed" tracebacks from orbax's stopped loop.
    stderr = sys.stderr
    sys.stderr = without_closed_loop_tracebacks(stderr)
    logging.getLogger("absl").addFilter(_not_an_interrupt)  # orbax logs through absl's logger
    try:
        return _main(argv)
    finally:
        sys.stderr.flush()
        sys.stderr = stderr


def _main(argv: list[str] | None) -> int:
    parser, commands = build_parsers()
    args = _parse(parser, commands, argv)
    debug = bool(getattr(args, "debug", False))
    try:
        if getattr(args, "config", None):
            from ._config_file import config_defaults

            commands[args.command].set_defaults(**config_defaults(args.config, commands[args.command], args.command))
            args = _parse(parser, commands, argv)
            debug = bool(getattr(args, "debug", False))
        _check_model(args)
        import zoo

        if getattr(args, "keep_memory", False):
            # Before the first jax computation, so XLA's threads take the one arena.
            zoo.keep_freed_memory()
        if not getattr(args, "no_compile_cache", False):
            zoo.enable_compilation_cache()
        return args.func(args)
    except (ConfigError, RunStopped, Preempted) as e:
        # The CLI's own checks (CLIError) and the library's: one line, an exit code each;
        # the config fields the library's errors name, as flags (`--batch-size`).
        if isinstance(e, RunStopped) and flag_names(str(e)) != str(e):
            e = RunStopped(flag_names(str(e)))
        if isinstance(e, ConfigError) and not isinstance(e, CLIError) and flag_names(str(e)) != str(e):
            named = CLIError(flag_names(str(e)))
            if debug:
                raise named from e
            e = named
        if debug:
            raise
        if isinstance(e, CLIError):
            prefix, code = e.prefix, e.exit_code
        else:
            prefix, code = next(v for k, v in _EXITS.items() if isinstance(e, k))
        print(f"zoo: {prefix}: {e}" + (_continue(e, argv) if isinstance(e, Interrupted) else ""), file=sys.stderr)
        return code
    except KeyboardInterrupt:
        if debug:
            raise
        print("\nzoo: interrupted", file=sys.stderr)
        return 130
    except OSError as e:
        if debug:
            raise
        if e.errno == errno.ENOSPC:
            where = f" writing {e.filename}" if e.filename else ""
            print(
                f"zoo: error: no space left on the device{where}; free some space or choose another --output / "
                "--checkpoint-dir (saved checkpoints are whole: continue with --resume)",
                file=sys.stderr,
            )
            if argv is None:  # the `zoo` program itself, not a caller in the same process
                # tensorstore's writes still in flight complete into orbax's closed event
                # loop while Python shuts down, each printing a "RuntimeError: Event loop is
                # closed" traceback after this line. Nothing is left to save: end here.
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(1)
        else:
            print(f"zoo: error: {type(e).__name__}: {e} (rerun with --debug for the traceback)", file=sys.stderr)
        return 1
    except Exception as e:  # a bug or an environment problem: still one line, unless --debug
        if debug:
            raise
        import zoo

        if isinstance(e, zoo.BudgetError):  # its lines are the report: each collective, its source line
            print(f"zoo: error: {e}", file=sys.stderr)
            return 4
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"zoo: error: {type(e).__name__}: {first} (rerun with --debug for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

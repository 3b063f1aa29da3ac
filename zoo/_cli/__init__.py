"""`zoo` / `python -m zoo`: train, finetune, demo, inspect, info, generate, predict, eval, export.

A private package of one module per concept: `_common` (errors, devices), `_inspect` (the
run's step through `zoo.train.inspect`), `_info`, `_generate`, `_use` (predict / eval /
export of a finished run, through `zoo.train.load_run`), `_train` (the flags of
train/finetune/demo, generated from the config fields' `zoo.train.Flag`s, their help filled
in by the library: `RunConfig.flags(command)`; a `zoo.train.RunConfig` handed to
`zoo.train.run`, which holds the loop), `_config_file` (`--config`), `_main` (parser and
entry point: the one place errors become exit codes and the library's field names flags).

The CLI only parses: it uses the library's public names (`zoo`, `zoo.train`, `zoo.serve`,
and a few low-level helpers of `zoo.internal`; tests/test_structure.py holds it), never the
other way round: nothing under zoo/ but this package imports it.

Building the parser imports no jax: the names it reads (the registries, the config
fields' flags and their help, the presets) live in modules that load without it, and the
commands import what they run (`zoo.train.make_mesh(...)`, `import zoo` inside a
command), so `--help` and argparse's errors answer at once (tests/test_cli.py holds it).
"""

from ._common import CLIError
from ._main import build_parser, main

__all__ = ["CLIError", "build_parser", "main"]

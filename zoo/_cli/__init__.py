"""`zoo` / `python -m zoo`: train, finetune, demo, inspect, info.

A private package of one module per concept: `_common` (errors, devices, the mesh flag),
`_tasks` (the fixed tiny models of the collectives fixture; models are built by
`zoo.train`'s registry), `_lora_flag` (`--lora`'s help and defaults), `_inspect`, `_info`,
`_train` (flags and defaults of train/finetune/demo: a `zoo.train.RunConfig` handed to
`zoo.train.run`, which holds the loop), `_output` (the run's outputs, from `zoo.train`),
`_config_file` (`--config`), `_main` (parser and entry point: the one place errors become
exit codes).

The CLI uses the library's pieces (the `--lora` text form, meshes, the folder lock, sizes),
never the other way round: nothing under zoo/ but this package imports it.
"""

from ..train._lora import parse_lora
from ._common import CLIError, parse_mesh
from ._main import build_parser, main

__all__ = ["CLIError", "build_parser", "main", "parse_lora", "parse_mesh"]

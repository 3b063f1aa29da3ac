"""`zoo serve SOURCE`: an OpenAI-compatible server over a decoder (`zoo.serve`).

SOURCE is read as `zoo generate` reads it (a Hugging Face folder, a cached model id, a
`zoo train` / `zoo finetune` run folder; a LoRA run's adapter is served by the run's name
beside its base); `--adapter NAME=DIR` adds adapters. The command parses, loads and hands
the base and the adapters to `zoo.serve.Engine` and `zoo.serve.Server`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .. import internal
from ._common import CLIError, init_devices
from ._generate import add_quantize, add_revision, add_source, chat_template, load, resolve_source


def _model_name(source: str) -> str:
    """The name requests give in `model`: the folder's name, or the model id."""
    folder = Path(source).expanduser()
    return folder.resolve().name if folder.exists() else source


def _adapter_flags(values: list[str]) -> dict[str, Path]:
    """`--adapter NAME=DIR` (or `DIR`: named by its folder, or its run's) → {name: folder}."""
    out: dict[str, Path] = {}
    for value in values:
        name, sep, folder = value.partition("=")
        if not sep:
            folder, name = value, ""
        path = Path(folder).expanduser()
        if not name:
            name = (path.resolve().parent if path.name == "adapter" else path.resolve()).name
        if name in out:
            raise CLIError(f"--adapter {value}: the name {name!r} is given twice; name each adapter NAME=DIR")
        out[name] = path
    return out


def _targets_flag(value: str) -> str | tuple[str, ...]:
    """`--lora-targets all-linear`, `none` or `NAME+NAME...` → `LoraConfig.target_modules`."""
    if value in ("all-linear", "none"):
        return () if value == "none" else value
    names = tuple(n.strip() for n in value.split("+"))
    if not all(names):
        raise CLIError(
            f"--lora-targets {value!r}: give Linear names joined by '+' (e.g. q_proj+v_proj), all-linear or none"
        )
    return names


def _parameters_flag(value: str | None) -> tuple[str, ...] | None:
    """`--lora-parameters NAME+NAME...` → `LoraConfig.target_parameters` (None: not given)."""
    if value is None:
        return None
    names = tuple(n.strip() for n in value.split("+"))
    if not all(names):
        raise CLIError(
            f"--lora-parameters {value!r}: give expert weight names joined by '+' (e.g. gate_up_proj+down_proj, "
            "or zoo's gate+up+down)"
        )
    return names


def cmd_serve(args) -> int:
    if args.slots < 1:
        raise CLIError(f"--slots must be >= 1, got {args.slots}")
    if args.max_queue < 0:
        raise CLIError(f"--max-queue must be >= 0, got {args.max_queue}")
    for flag in ("max_adapters", "max_lora_rank"):
        value = getattr(args, flag)
        if value is not None and value < (0 if flag == "max_adapters" else 1):
            raise CLIError(f"--{flag.replace('_', '-')} must be >= {0 if flag == 'max_adapters' else 1}, got {value}")
    flags = _adapter_flags(args.adapter or [])
    targets = _targets_flag(args.lora_targets)
    parameters = _parameters_flag(args.lora_parameters)
    init_devices(1)
    try:
        import zoo.serve
    except ImportError as e:
        raise CLIError(str(e)) from e
    try:  # before anything loads or compiles
        zoo.serve.check_address(args.host, args.port)
    except ValueError as e:
        raise CLIError(str(e)) from None
    import zoo

    resolved = resolve_source(args.source, None, args.revision)
    folder, run_adapter, _ = resolved
    model, text, eos, where = load(
        args.source, None, rules=None, mesh=None, dtype=args.dtype, quantize=args.quantize, resolved=resolved
    )
    if run_adapter is not None:  # a LoRA run: its adapter by the run's name, beside the base
        model = zoo.lora.unload(model)
        flags = {Path(args.source).expanduser().resolve().name: run_adapter} | flags
    max_len = model.config.max_len if args.max_len is None else args.max_len
    if not 1 < max_len <= model.config.max_len:
        raise CLIError(f"--max-len must be in [2, {model.config.max_len}] (the model's max_len), got {max_len}")
    try:
        template = chat_template(args.source, args.chat_template, folder)
    except CLIError:
        if args.chat_template is not None:
            raise
        template = None  # /v1/chat/completions answers 400
    name = args.name or _model_name(str(folder) if run_adapter is not None else args.source)
    if name in flags:
        raise CLIError(f"--adapter {name}: the base model is served as {name!r}; give the adapter another name")
    try:
        engine = zoo.serve.Engine(
            model,
            slots=args.slots,
            max_len=max_len,
            max_queue=args.max_queue,
            adapters=flags,
            max_adapters=args.max_adapters,
            max_lora_rank=args.max_lora_rank,
            lora_targets=targets,
            lora_parameters=parameters,
        )
    except MemoryError as e:  # the cache or queue asked for: the line names the flag and a value that fits
        raise CLIError(str(e)) from None
    except ValueError as e:
        raise CLIError(f"--adapter: {str(e).splitlines()[0]}") from None
    if engine.bank is not None:
        bank = engine.bank
        where += f", {internal.counted(len(flags), 'adapter')} in {internal.counted(bank.capacity, 'slot')}"
        where += f" of rank <= {bank.max_rank}"
    print(
        f"zoo serve: {where}, {internal.counted(args.slots, 'slot')} of {max_len} tokens; compiling...",
        file=sys.stderr,
        flush=True,
    )
    engine.warm_up()
    if engine.kernels:  # what the timing chose, per number of rows a step runs (docs/serving.md)
        chosen = ", ".join(f"{n} row{'s' * (n > 1)} {kernel}" for n, kernel in sorted(engine.kernels.items()))
        print(f"zoo serve: decode step matmul kernels, timed here: {chosen}", file=sys.stderr, flush=True)
    server = zoo.serve.Server(
        engine,
        model_name=name,
        tokenizer=text.tokenizer,
        chat_template=template,
        eos_id=eos,
        adapter_paths={n: str(p) for n, p in flags.items()},
    )
    zoo.serve.serve(server, host=args.host, port=args.port)
    return 0


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "serve",
        help="serve a decoder over the OpenAI API (completions, chat) with continuous batching",
        description="An OpenAI-compatible HTTP server (GET /v1/models, POST /v1/completions, POST "
        "/v1/chat/completions, GET /health) over zoo.serve.Engine: a fixed set of slots sharing one key/value "
        "cache and one compiled decode step; requests join and leave between steps. SOURCE as zoo generate "
        "reads it. Prints the address, the model's name and 'ready' once it answers; SIGTERM finishes the "
        "requests in flight and exits 0. Needs the serve extra: pip install 'eqx-zoo[serve]'.",
        epilog="Example: zoo serve path/to/llama --port 8000 --slots 16, then "
        "openai.OpenAI(base_url='http://127.0.0.1:8000/v1', api_key='none').completions.create(model='llama', "
        "prompt='Hello', max_tokens=16)",
    )
    add_source(p)
    add_revision(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free port, printed)")
    p.add_argument("--slots", type=int, default=8, metavar="N", help="requests decoded together (default 8)")
    p.add_argument(
        "--max-len",
        type=int,
        default=None,
        metavar="L",
        help="tokens of one request, prompt + completion (default the model's max_len); longer prompts get 400",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=256,
        metavar="N",
        help="requests that may wait for a slot; beyond, 429 with Retry-After (default 256)",
    )
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="compute dtype (default the model's)")
    add_quantize(p)
    p.add_argument("--name", help="the model name clients give (default SOURCE's folder name, or the model id)")
    p.add_argument(
        "--adapter",
        action="append",
        metavar="NAME=DIR",
        help="serve a LoRA adapter (a peft folder or a zoo finetune run) beside the base, as model NAME (default: "
        "the folder's name); repeat for more. Requests name the base or an adapter in 'model'",
    )
    p.add_argument(
        "--max-adapters",
        type=int,
        default=None,
        metavar="N",
        help="adapter slots held beside the base, for --adapter and POST /v1/load_lora_adapter (default 4, or the "
        "number of --adapter, when any are given; else 0)",
    )
    p.add_argument(
        "--max-lora-rank",
        type=int,
        default=None,
        metavar="R",
        help="the largest adapter rank a slot holds (default 16, or the largest --adapter's); larger ones get 400",
    )
    p.add_argument(
        "--lora-targets",
        default="all-linear",
        metavar="NAMES",
        help="the layers given adapter room: Linear names joined by '+' (e.g. q_proj+v_proj: less memory and work "
        "per step), all-linear (default: every Linear but the output head) or none; adapters on other layers get 400",
    )
    p.add_argument(
        "--lora-parameters",
        default=None,
        metavar="NAMES",
        help="a mixture of experts' expert weights given adapter room (peft's target_parameters): names joined by '+' "
        "(e.g. gate_up_proj+down_proj, or gate+up+down); default: those the --adapter adapters adapt, else none",
    )
    p.add_argument("--chat-template", metavar="FILE", help="a jinja2 chat template file instead of the model's own")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show full tracebacks")
    p.set_defaults(func=cmd_serve)
    return p

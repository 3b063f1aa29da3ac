"""`zoo generate SOURCE --prompt TEXT`: continue prompts with a decoder (`zoo.generate`).

SOURCE is a Hugging Face folder or a `zoo train` / `zoo finetune` output folder. Text goes
through the model's tokenizer (`tokenizer.json`), or through UTF-8 bytes for the
byte-level models `zoo train transformer` builds. A single prompt is printed as it is
generated: a host callback in the compiled decode loop hands each new token to the printer.
"""

from __future__ import annotations

import argparse
import codecs
import json
import sys
from pathlib import Path
from typing import Any

from .. import RULE_PRESETS, internal
from ..train import ConfigError, init_families
from ._common import CLIError, init_devices, mesh_for

DEFAULT_NEW_TOKENS = 64


class Text:
    """Prompts → left-padded `(tokens, mask)`; ids → text. A `zoo.hf.Tokenizer`, or bytes."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer

    @property
    def kind(self) -> str:
        return "bytes" if self.tokenizer is None else "tokenizer.json"

    def encode(self, texts: list[str], pad_id: int = 0):
        import numpy as np

        if self.tokenizer is None:
            rows = [list(t.encode("utf-8")) for t in texts]
        else:
            self.tokenizer.tokenizer.no_truncation()
            rows = [e.ids for e in self.tokenizer.tokenizer.encode_batch(list(texts))]
        if any(not r for r in rows):
            raise CLIError("--prompt: a prompt is empty (no tokens); give every prompt some text")
        width = max(len(r) for r in rows)
        tokens = np.full((len(rows), width), pad_id, np.int32)
        mask = np.zeros((len(rows), width), bool)
        for i, r in enumerate(rows):  # left padding: the prompt ends where generation starts
            tokens[i, width - len(r) :] = r
            mask[i, width - len(r) :] = True
        return tokens, mask

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        if self.tokenizer is None:
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return self.tokenizer.decode(ids)


class Printer:
    """Prints one row's new tokens as they come: the text decoded so far, minus what is
    already on screen (a token may complete a character or merge with the previous one)."""

    def __init__(self, text: Text, eos: int | None, stream=None):
        self.text, self.eos, self.stream = text, eos, stream or sys.stdout
        self.ids: list[int] = []
        self.shown = ""
        self.done = False
        self.bytes = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def __call__(self, tokens) -> None:
        if self.done:
            return
        token = int(tokens[0])
        if token == self.eos:
            self.done = True
            return
        if self.text.tokenizer is None:  # ids past the 256 bytes have no text (as `Text.decode`)
            piece = self.bytes.decode(bytes([token])) if token < 256 else ""
        else:
            self.ids.append(token)
            full = self.text.decode(self.ids)
            piece, self.shown = full[len(self.shown) :], full
        self.stream.write(piece)
        self.stream.flush()


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _hf_folder(folder: Path) -> bool:
    values = _read_json(folder / "config.json")
    return bool(values and "model_type" in values and any(folder.glob("model*.safetensors*")))


def resolve_source(source: str, adapter: str | None) -> tuple[Path, Path | None, str]:
    """`(Hugging Face folder, adapter folder or None, what it is in words)` of SOURCE."""
    folder = Path(source).expanduser()
    if not folder.exists():
        import zoo

        try:  # a model id already in the local Hugging Face cache
            folder = zoo.hf.resolve_model_dir(source)
        except FileNotFoundError as e:
            raise CLIError(f"SOURCE {source}: no such folder, and {str(e).split(': ', 1)[-1]}") from None
    adapter_dir = Path(adapter).expanduser() if adapter else None
    if adapter_dir is not None and not (adapter_dir / "adapter_config.json").is_file():
        raise CLIError(
            f"--adapter {adapter}: no adapter_config.json there (a `zoo finetune` run's adapter/ folder, or peft's)"
        )
    if _hf_folder(folder):
        return folder, adapter_dir, f"the Hugging Face folder {folder}"
    if _hf_folder(folder / "model"):
        return folder / "model", adapter_dir, f"the model of the run {folder}"
    run = _read_json(folder / "config.json")
    if run is not None and (folder / "adapter" / "adapter_config.json").is_file():
        init = run.get("init")
        if not init:
            raise CLIError(f"SOURCE {source}: its config.json names no --init base model for the adapter in adapter/")
        try:
            base = internal.resolve_init(init)
        except ConfigError as e:
            raise CLIError(f"SOURCE {source}: the base model of its adapter: {e}") from e
        return base, adapter_dir or folder / "adapter", f"the LoRA run {folder} on {base}"
    if run is not None and run.get("model") not in (None, "transformer"):
        raise CLIError(f"SOURCE {source}: a run of the {run.get('model')} model, which does not generate text")
    if run is not None:
        raise CLIError(
            f"SOURCE {source}: a run folder without model/ (its decoder has no Hugging Face layout and was saved as "
            "checkpoints only); zoo generate reads Hugging Face folders and runs that saved model/ or adapter/"
        )
    raise CLIError(
        f"SOURCE {source}: neither a Hugging Face model folder (config.json with model_type + model.safetensors) "
        "nor a `zoo train` / `zoo finetune` output folder"
    )


def _refusal(message: str, error: BaseException) -> CLIError:
    """The one line of a model that cannot generate: exit 1 for weights holding NaN or inf
    (a damaged file, not a usage mistake), else 2."""
    refusal = CLIError(message)
    if isinstance(error, internal.NonFiniteWeightsError):
        refusal.exit_code = 1
    return refusal


def load(source: str, adapter: str | None, *, rules, mesh):
    """`(model, Text, eos id or None, description)` of SOURCE (with --adapter)."""
    import zoo

    folder, adapter_dir, where = resolve_source(source, adapter)
    try:
        model = zoo.hf.from_pretrained(
            folder, rules=rules, mesh=mesh, config_overrides={"dropout": 0.0, "attention_dropout": 0.0}
        )
    except (ValueError, TypeError, FileNotFoundError) as e:
        raise _refusal(f"SOURCE {source}: {str(e).splitlines()[0]}", e) from e
    if not isinstance(model, zoo.models.Transformer):
        raise CLIError(
            f"SOURCE {source} holds a {type(model).__name__}; zoo generate needs a decoder (GPT-2, Llama, ...)"
        )
    if adapter_dir is not None:
        try:
            model, _ = zoo.lora.load_adapter(model, adapter_dir)
            zoo.internal.check_finite(model, where="the model with it")
        except (ValueError, FileNotFoundError) as e:
            raise _refusal(f"adapter {adapter_dir}: {str(e).splitlines()[0]}", e) from e
        where += f" with the adapter {adapter_dir}"
    tokenizer = zoo.hf.Tokenizer.from_pretrained(folder) if (folder / "tokenizer.json").is_file() else None
    if tokenizer is None and model.config.vocab_size < 256:
        raise CLIError(
            f"SOURCE {source}: no tokenizer.json and a vocabulary of {model.config.vocab_size} ids (bytes need 256)"
        )
    eos = (_read_json(folder / "config.json") or {}).get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    eos = eos if isinstance(eos, int) and eos < model.config.vocab_size else None
    return model, Text(tokenizer), eos, where


def first_row(out):
    """Row values of a generated array as numpy, from this process's copy (any process count)."""
    import numpy as np

    return np.asarray(out.addressable_data(0)) if out.is_fully_replicated else np.asarray(out)


def cmd_generate(args) -> int:
    """Load SOURCE, encode the prompts, generate, print."""
    devices = init_devices(args.devices if args.devices is not None else 1)
    mesh_shape = mesh_for(args.mesh, devices)
    internal.check_rules_fit_mesh(args.rules, mesh_shape, devices)
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise CLIError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    try:
        internal.check_sampling(args.temperature, args.top_k, args.top_p)
    except ValueError as e:
        raise CLIError(f"{e} (--temperature, --top-k, --top-p)") from e
    import jax

    import zoo

    mesh = internal.make_mesh(mesh_shape)
    with jax.set_mesh(mesh):
        model, text, eos, where = load(args.source, args.adapter, rules=zoo.rules(args.rules), mesh=mesh)
        pad = text.tokenizer.pad_id if text.tokenizer is not None else 0
        tokens, mask = text.encode(args.prompt, pad)
        room = model.config.max_len - tokens.shape[1]
        if room < 1:
            raise CLIError(
                f"--prompt: {tokens.shape[1]} tokens fill the model's max_len {model.config.max_len}; shorten it"
            )
        new = min(DEFAULT_NEW_TOKENS, room) if args.max_new_tokens is None else args.max_new_tokens
        if new > room:
            raise CLIError(
                f"--max-new-tokens {new}: the longest prompt has {tokens.shape[1]} tokens and the model's max_len is "
                f"{model.config.max_len}; use --max-new-tokens {room} or less"
            )
        single = len(args.prompt) == 1
        printer = Printer(text, eos) if single and not args.json else None
        if not args.json:
            how = (
                "greedy"
                if args.temperature == 0
                else f"temperature {args.temperature:g}"
                + (f", top-k {args.top_k}" if args.top_k else "")
                + (f", top-p {args.top_p:g}" if args.top_p else "")
            )
            print(f"zoo generate: {where} ({text.kind}), {how}, up to {new} new tokens, mesh {internal.mesh_text(mesh_shape)} "
                  f"rules {args.rules}", file=sys.stderr, flush=True)  # fmt: skip
        if printer is not None:
            sys.stdout.write(args.prompt[0])
            sys.stdout.flush()
        try:
            out = zoo.generate(
                model, tokens, mask=mask, max_new_tokens=new, temperature=args.temperature, top_k=args.top_k,
                top_p=args.top_p, eos_token_id=eos, key=jax.random.key(args.seed), stream=printer,
            )  # fmt: skip
        except ValueError as e:
            raise CLIError(str(e).splitlines()[0]) from e
        rows = first_row(out)
        jax.effects_barrier()
    completions = []
    for row in rows:
        ids = [int(i) for i in row[tokens.shape[1] :]]
        if eos is not None and eos in ids:
            ids = ids[: ids.index(eos)]
        completions.append(text.decode(ids))
    if args.json:
        print(json.dumps([{"prompt": p, "completion": c} for p, c in zip(args.prompt, completions)], indent=2))
    elif printer is not None:
        print()
    else:
        for p, c in zip(args.prompt, completions):
            print(f"{p}{c}")
            print("---")
    return 0


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "generate",
        help="continue prompts with a decoder (a Hugging Face folder or a zoo train/finetune run)",
        description="Generate text with zoo.generate (a key/value cache, one compiled decode loop). SOURCE: a "
        f"Hugging Face model folder ({', '.join(sorted(init_families('zoo.models.Transformer')))}: config.json + model.safetensors; "
        "tokenizer.json when present, else UTF-8 bytes), the output folder of `zoo train transformer` (its "
        "model/) or of `zoo finetune transformer` (its base model, from config.json's init, plus adapter/). "
        "One prompt is printed as it is generated (a host callback in the loop); several are generated as "
        "one left-padded batch and printed at the end, separated by ---.",
        epilog="Examples: zoo generate runs/lm --prompt 'def ' ; zoo generate path/to/gpt2 --prompt 'Hello' "
        "--prompt 'The' --temperature 0.8 --top-p 0.9 --seed 1; zoo generate runs/tuned --max-new-tokens 32",
    )
    p.add_argument(
        "source",
        metavar="SOURCE",
        help="a Hugging Face folder (or a model id in the local Hugging Face cache), or a zoo train / "
        "finetune output folder",
    )
    p.add_argument("--prompt", action="append", required=True, metavar="TEXT", help="a prompt (repeat for a batch)")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        metavar="N",
        help=f"tokens to add to each prompt; prompt + N <= the model's max_len (default {DEFAULT_NEW_TOKENS}, "
        "or what the model's max_len leaves room for)",
    )
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0: greedy (default); > 0: sampling")
    p.add_argument("--top-k", type=int, default=None, metavar="K", help="sample among the K most likely tokens")
    p.add_argument(
        "--top-p",
        type=float,
        default=None,
        metavar="P",
        help="sample among the most likely tokens up to total probability P, in (0, 1]",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling (default 0)")
    p.add_argument("--adapter", metavar="DIR", help="a LoRA adapter folder (peft's layout) to load onto the model")
    p.add_argument("--devices", type=int, metavar="N", help="devices (default 1; simulated CPU devices on CPU)")
    p.add_argument("--mesh", metavar="AXIS=SIZE,...", help="mesh shape, e.g. data=2,model=2 (default data=DEVICES)")
    p.add_argument(
        "--rules",
        default="dp",
        metavar="PRESET",
        help=f"how the model is placed: {', '.join(RULE_PRESETS)} (default dp: replicated); the batch is "
        "split over data when it divides, heads over model under tp; fsdp presets are gathered for decoding",
    )
    p.add_argument("--json", action="store_true", help="print [{prompt, completion}] as JSON, nothing streamed")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show full tracebacks")
    p.set_defaults(func=cmd_generate)
    return p


def sample(model, task, *, prompt_len: int = 16, new_tokens: int = 32) -> dict[str, Any]:
    """A short greedy continuation of the start of the first validation window, for the
    end of `zoo train transformer` / `zoo finetune transformer`: `{"prompt", "completion",
    "new_tokens"}` as text."""
    import numpy as np

    import zoo

    max_len = model.config.max_len
    prompt_len = min(prompt_len, max_len // 2)
    new_tokens = min(new_tokens, max_len - prompt_len)
    tokens = np.asarray(task.eval_data["tokens"][:1, :prompt_len], np.int32)
    tokenizer = zoo.hf.Tokenizer.from_pretrained(task.tokenizer_dir) if task.tokenizer_dir is not None else None
    text = Text(tokenizer)
    out = first_row(zoo.generate(model, tokens, max_new_tokens=new_tokens))
    return {"prompt": text.decode(tokens[0]), "completion": text.decode(out[0, prompt_len:]), "new_tokens": new_tokens}

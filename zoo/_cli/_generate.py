"""`zoo generate SOURCE --prompt TEXT`: continue prompts with a decoder (`zoo.generate`).

SOURCE is a Hugging Face folder or a `zoo train` / `zoo finetune` output folder. Text goes
through the model's tokenizer (`tokenizer.json`), or through UTF-8 bytes for the
byte-level models `zoo train transformer` builds. A single prompt is printed as it is
generated: a host callback in the compiled decode loop hands each new token to the printer.
`--chat` renders each prompt as a user turn with the model's chat template (a chat SFT run
is prompted in its training format); `--stop` cuts the text at a stop string.
"""

from __future__ import annotations

import argparse
import codecs
import json
import sys
from pathlib import Path
from typing import Any

from .. import RULE_PRESETS, internal
from ..train import ConfigError, init_families, model_names, model_spec, resolve_init
from ._common import CLIError, flag_names, init_devices

DEFAULT_NEW_TOKENS = 64


class Text:
    """Prompts → left-padded `(tokens, mask)`; ids → text. A `zoo.hf.Tokenizer`, or bytes."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer

    @property
    def kind(self) -> str:
        return "bytes" if self.tokenizer is None else "tokenizer.json"

    def encode(self, texts: list[str], pad_id: int = 0, *, special_tokens: bool = True):
        """Left-padded `(tokens, mask)`; `special_tokens=False` adds none (a chat template's
        text holds its own, as transformers' `apply_chat_template` encodes it)."""
        import numpy as np

        if self.tokenizer is None:
            rows = [list(t.encode("utf-8")) for t in texts]
        else:
            self.tokenizer.tokenizer.no_truncation()
            encoded = self.tokenizer.tokenizer.encode_batch(list(texts), add_special_tokens=special_tokens)
            rows = [e.ids for e in encoded]
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


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """`text` up to the first of the `stops` in it (not included), and whether one was."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[: min(found)], True) if found else (text, False)


class Printer:
    """Prints one row's new tokens as they come: the text decoded so far, minus what is
    already on screen (a token may complete a character or merge with the previous one).
    Text that may be the start of a stop string waits until it is known not to be one."""

    def __init__(self, text: Text, eos: int | None, stops: list[str] | None = None, stream=None):
        self.text, self.eos, self.stops, self.stream = text, eos, list(stops or []), stream or sys.stdout
        self.ids: list[int] = []
        self.shown = ""
        self.held = ""  # decoded, not printed: it may begin a stop string
        self.done = False
        self.bytes = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def __call__(self, tokens) -> None:
        if self.done:
            return
        token = int(tokens[0])
        if token == self.eos:
            self.finish()
            return
        if self.text.tokenizer is None:  # ids past the 256 bytes have no text (as `Text.decode`)
            piece = self.bytes.decode(bytes([token])) if token < 256 else ""
        else:
            self.ids.append(token)
            full = self.text.decode(self.ids)
            piece, self.shown = full[len(self.shown) :], full
        text, stopped = cut_at_stop(self.held + piece, self.stops)
        # The longest end of the text that begins a stop string is held back.
        keep = (
            0 if stopped else max((n for s in self.stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
        )
        self.held = text[len(text) - keep :]
        self._write(text[: len(text) - keep])
        self.done = stopped

    def finish(self) -> None:
        """The end of the row (its eos, or the last token): print what was held back."""
        if not self.done:
            self._write(self.held)
            self.held, self.done = "", True

    def _write(self, piece: str) -> None:
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


def resolve_source(source: str, adapter: str | None, revision: str | None = None) -> tuple[Path, Path | None, str]:
    """`(Hugging Face folder, adapter folder or None, what it is in words)` of SOURCE, a Hub
    id at `revision` (--revision; a run's base at the commit its config.json records)."""
    folder = Path(source).expanduser()
    if revision and folder.exists():
        raise CLIError(
            f"--revision {revision}: SOURCE {source} is a local folder, which has no revisions (a run pins its "
            "base's commit in its config.json): drop --revision, or give the model's Hub id (org/name)"
        )
    if not folder.exists() and source in model_names():
        raise CLIError(
            f"SOURCE {source}: a registered model's name, which holds no weights; give a Hugging Face folder, a "
            "`zoo train`/`zoo finetune` run or a Hub id (org/name)"
        )
    if not folder.exists():
        import zoo

        try:  # a model id: in the local Hugging Face cache, else fetched from the Hub
            folder = zoo.hf.resolve_model_dir(source, revision=revision)
        except FileNotFoundError as e:
            raise CLIError(f"SOURCE {source}: {e}") from None
    adapter_dir = Path(adapter).expanduser() if adapter else None
    if adapter_dir is not None and not (adapter_dir / "adapter_config.json").is_file():
        raise CLIError(
            f"--adapter {adapter}: no adapter_config.json there (a `zoo finetune` run's adapter/ folder, or peft's)"
        )
    run = _read_json(folder / "config.json")
    if run is not None and "model_type" not in run and run.get("model") in model_names():
        if model_spec(run["model"]).classifier:
            raise CLIError(
                f"SOURCE {source}: a classifier run (the {run['model']}), which generates no text: use zoo "
                f"predict {source} --text TEXT"
            )
    if _hf_folder(folder):
        return folder, adapter_dir, f"the Hugging Face folder {folder}"
    if _hf_folder(folder / "model"):
        return folder / "model", adapter_dir, f"the model of the run {folder}"
    run = _read_json(folder / "config.json")
    named = _named_adapters(folder / "adapter") if run is not None else []
    if named and adapter_dir is None:  # several adapters trained at once: which one is the user's to say
        first = folder / "adapter" / named[0]
        quantize = run.get("quantize")  # their base quantised as in training
        on = f" with --quantize {quantize}, as they trained" if quantize else ""
        raise CLIError(
            f"SOURCE {source}: a run of {len(named)} adapters ({', '.join(named)}); zoo generate takes one: "
            f"--adapter {first} (any adapter/NAME); zoo serve BASE serves them all: --adapter {named[0]}={first} "
            f"for each, BASE its config.json's init{on}"
        )
    if run is not None and ((folder / "adapter" / "adapter_config.json").is_file() or named):
        init = run.get("init")
        if not init:
            raise CLIError(f"SOURCE {source}: its config.json names no --init base model for the adapter in adapter/")
        gone = Path(init).expanduser()
        if gone.is_absolute() and not gone.exists():  # a run stores its base folder's full path (as load_run says)
            raise CLIError(
                f"SOURCE {source}: the base model of its adapter, {gone}, is gone; put it back there, or set "
                f'"init" in {folder / "config.json"} to where it is now'
            )
        try:
            import zoo

            zoo.train.merge_run(init)  # a `zoo finetune` run as its init: merged into zoo's cache if missing
            base = resolve_init(init, revision=run.get("revision"))
        except ConfigError as e:
            raise CLIError(f"SOURCE {source}: the base model of its adapter: {flag_names(str(e))}") from e
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


def _named_adapters(folder: Path) -> list[str]:
    """The adapters of a run that trained several (`adapter/NAME/adapter_config.json`)."""
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if (p / "adapter_config.json").is_file())


def _refusal(message: str, error: BaseException) -> CLIError:
    """The one line of a model that cannot generate: exit 1 for weights holding NaN or inf
    (a damaged file, not a usage mistake), else 2."""
    refusal = CLIError(message)
    if isinstance(error, internal.NonFiniteWeightsError):
        refusal.exit_code = 1
    return refusal


def _run_quantize(source: str) -> str | None:
    """The `--quantize` a `zoo finetune` run SOURCE trained its adapter on, if any."""
    run = _read_json(Path(source).expanduser() / "config.json") or {}
    return None if "model_type" in run else run.get("quantize")


def load(
    source: str,
    adapter: str | None,
    *,
    rules,
    mesh,
    dtype: str | None = None,
    quantize: str | None = None,
    resolved=None,
):
    """`(model, Text, eos id or None, description)` of SOURCE (with --adapter), computing
    in `dtype` (default the folder's), its projections stored as `quantize` says (quantised
    while loading; default float, or for a run that trained on a quantised base, that base
    rebuilt as the run built it). `resolved`: what `resolve_source` gave for them, when the
    caller has it already."""
    import zoo

    folder, adapter_dir, where = resolved or resolve_source(source, adapter)
    trained_on = _run_quantize(source) if quantize is None and adapter_dir is not None else None
    overrides = {"dropout": 0.0, "attention_dropout": 0.0} | ({} if dtype is None else {"dtype": dtype})
    try:
        model = zoo.hf.from_pretrained(folder, rules=rules, mesh=mesh, config_overrides=overrides, quantize=quantize)
    except internal.PlacementError as e:  # the library's fix (zoo.rules(...), a rules mapping) is no flag
        fix = "choose other --rules (dp replicates every weight)"
        if e.where is None and e.size is not None:  # a head count the mesh axes splitting heads do not divide
            fix += f", or a --mesh whose axis that splits heads divides {e.size}"
        raise CLIError(
            f"--rules cannot place {source} on this mesh: {e.problem.removeprefix(f'{folder}: ')}; {fix}"
        ) from e
    except (ValueError, TypeError, FileNotFoundError) as e:
        flag = "--quantize" if quantize is not None and "quantiz" in str(e) else f"SOURCE {source}"
        first = str(e).splitlines()[0].replace("pass quantize='", "pass --quantize ").replace(":BLOCK',", ":BLOCK,")
        raise _refusal(f"{flag}: {first}", e) from e
    if quantize is not None:
        where += f", its projections {quantize.partition(':')[0]}"
    if not isinstance(model, zoo.models.Transformer):
        raise CLIError(
            f"SOURCE {source} holds a {type(model).__name__}; zoo generate needs a decoder (GPT-2, Llama, ...)"
        )
    if adapter_dir is not None:
        try:
            model, lora = zoo.lora.load_adapter(model, adapter_dir)
            zoo.internal.check_finite(model, where="the model with it")
        except (ValueError, FileNotFoundError) as e:
            raise _refusal(f"adapter {adapter_dir}: {str(e).splitlines()[0]}", e) from e
        where += f" with the adapter {adapter_dir}"
        if trained_on is not None:  # the base the adapter trained on, as the run built it
            model = quantized_as_the_run(model, lora, trained_on, rules, mesh)
            where += f" on its {trained_on.partition(':')[0]} base"
    tokenizer = zoo.hf.Tokenizer.from_pretrained(folder) if (folder / "tokenizer.json").is_file() else None
    if tokenizer is None and model.config.vocab_size < 256:
        raise CLIError(
            f"SOURCE {source}: no tokenizer.json and a vocabulary of {model.config.vocab_size} ids (bytes need 256)"
        )
    eos = (_read_json(folder / "config.json") or {}).get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    eos = eos if isinstance(eos, int) and eos < model.config.vocab_size else None
    return model, Text(tokenizer), eos, where


def quantized_as_the_run(model, lora, quantize: str, rules, mesh):
    """`model` (a LoRA run's base with its adapter) with the frozen base stored as the run
    stored it (`zoo.lora.cast_frozen` of the run's `--quantize` text, as `load_run`), placed again."""
    import zoo

    model = zoo.lora.cast_frozen(model, quantize, config=lora)
    return zoo.shard(model, rules, mesh) if mesh is not None else model


def first_row(out):
    """Row values of a generated array as numpy, from this process's copy (any process count)."""
    import numpy as np

    return np.asarray(out.addressable_data(0)) if out.is_fully_replicated else np.asarray(out)


def _run_config(folder: Path) -> dict[str, Any] | None:
    """The flat config (config.json) of a `zoo train` / `zoo finetune` run folder, else None."""
    values = _read_json(folder / "config.json")
    return values if values is not None and "model" in values and "model_type" not in values else None


def chat_template(source: str, file: str | None, folder: Path):
    """The `zoo.data.ChatTemplate` `--chat` renders prompts with: `--chat-template FILE`,
    else the one the run SOURCE trained with (its config.json's `chat_template`), else the
    tokenizer folder's own; the special tokens are those of `folder` (SOURCE's Hugging Face
    folder, as `resolve_source` gave it)."""
    import zoo

    run = _run_config(Path(source).expanduser()) or {}
    given = file if file is not None else run.get("chat_template")
    if given is not None:
        candidates = [Path(given).expanduser(), Path(source).expanduser() / given]
        path = next((c for c in candidates if c.is_file()), None)
        if path is None:
            what = "--chat-template" if file is not None else f"SOURCE {source} trained with the chat template"
            raise CLIError(f"{what} {given}: no such file; pass the template as --chat-template FILE")
        text = path.read_text(encoding="utf-8-sig")
        try:
            return zoo.data.ChatTemplate.from_pretrained(folder, template=text, name=f"--chat-template {path}")
        except zoo.data.DataFormatError as e:
            raise CLIError(str(e)) from None
    try:
        template = zoo.data.ChatTemplate.from_pretrained(folder)
    except zoo.data.DataFormatError as e:
        raise CLIError(f"{e}; or pass --chat-template FILE") from None
    if template is None:
        raise CLIError(
            f"--chat: SOURCE {source} has no chat template (no chat_template.jinja, no chat_template in "
            "tokenizer_config.json); pass one as --chat-template FILE"
        )
    return template


def _how(args, new: int) -> str:
    """The decoding settings in words, for the line on stderr."""
    how = "greedy" if args.temperature == 0 else f"temperature {args.temperature:g}"
    how += f", top-k {args.top_k}" if args.top_k and args.temperature else ""
    how += f", top-p {args.top_p:g}" if args.top_p and args.temperature else ""
    how += f", repetition penalty {args.repetition_penalty:g}" if args.repetition_penalty != 1 else ""
    how += f", stops {args.stop}" if args.stop else ""
    return f"{how}, up to {new} new tokens"


def _new_tokens(args, model, tokens) -> int:
    """`--max-new-tokens`, or the default, checked against the room the prompts leave."""
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
    return new


def cmd_generate(args) -> int:
    """Load SOURCE, encode the prompts (as chat turns with --chat), generate, print."""
    devices = init_devices(args.devices if args.devices is not None else 1)
    import jax

    import zoo

    mesh = zoo.train.make_mesh(args.mesh, rules=args.rules, devices=devices)
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise CLIError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    try:
        internal.check_sampling(args.temperature, args.top_k, args.top_p, args.repetition_penalty)
    except ValueError as e:
        raise CLIError(f"{e} (--temperature, --top-k, --top-p, --repetition-penalty)") from e
    if any(not s for s in args.stop or ()):
        raise CLIError("--stop: a stop string is empty; give each --stop some text")
    # Outside the mesh: a run's init may be merged first (`merge_run`). Resolved once, here.
    resolved = resolve_source(args.source, args.adapter, args.revision)
    chat = args.chat or args.chat_template is not None
    template = chat_template(args.source, args.chat_template, resolved[0]) if chat else None
    prompts = list(args.prompt)
    if template is not None:
        prompts = [template.render([{"role": "user", "content": p}], add_generation_prompt=True) for p in prompts]
    with jax.set_mesh(mesh):
        model, text, eos, where = load(
            args.source, args.adapter, rules=zoo.rules(args.rules), mesh=mesh, quantize=args.quantize, resolved=resolved
        )
        pad = text.tokenizer.pad_id if text.tokenizer is not None else 0
        tokens, mask = text.encode(prompts, pad, special_tokens=template is None)
        new = _new_tokens(args, model, tokens)
        printer = Printer(text, eos, args.stop) if len(prompts) == 1 and not args.json else None
        if not args.json:
            print(
                f"zoo generate: {where} ({text.kind}{', chat template' if chat else ''}), {_how(args, new)}, "
                f"mesh {','.join(f'{k}={v}' for k, v in mesh.shape.items())} rules {args.rules}",
                file=sys.stderr,
                flush=True,
            )
        if printer is not None and not chat:  # a chat prints the reply alone
            sys.stdout.write(args.prompt[0])
            sys.stdout.flush()
        try:
            out = zoo.generate(
                model,
                tokens,
                mask=mask,
                max_new_tokens=new,
                temperature=args.temperature,
                top_k=args.top_k,
                top_p=args.top_p,
                eos_token_id=eos,
                repetition_penalty=args.repetition_penalty,
                key=jax.random.key(args.seed),
                stream=printer,
            )
        except ValueError as e:
            raise CLIError(str(e).splitlines()[0]) from e
        rows = first_row(out)
        jax.effects_barrier()
    completions, ended = [], []
    for row in rows:
        ids = [int(i) for i in row[tokens.shape[1] :]]
        ended.append(eos is not None and bool(ids) and ids[0] == eos)
        if eos is not None and eos in ids:
            ids = ids[: ids.index(eos)]
        completions.append(cut_at_stop(text.decode(ids), args.stop or [])[0])
    if not args.json and any(ended):  # an empty completion would look like nothing happened
        which = "" if len(rows) == 1 else f" (prompts {', '.join(str(i + 1) for i, e in enumerate(ended) if e)})"
        print(
            f"zoo generate: the model ended the text at once{which}: its first new token was end-of-sequence",
            file=sys.stderr,
            flush=True,
        )
    if args.json:
        print(json.dumps([{"prompt": p, "completion": c} for p, c in zip(args.prompt, completions)], indent=2))
    elif printer is not None:
        printer.finish()
        print()
    else:
        for p, c in zip(args.prompt, completions):
            print(c if chat else f"{p}{c}")
            print("---")
    return 0


SOURCE_HELP = (
    "a Hugging Face folder (or a model id in the local Hugging Face cache), or a zoo train / finetune output folder"
)


def add_quantize(p: argparse.ArgumentParser) -> None:
    """--quantize, read by `load` (zoo generate, zoo serve)."""
    p.add_argument(
        "--quantize",
        metavar="KIND",
        help="store the projections of the model's layers as it loads: nf4 or int4 (4 bits, KIND:BLOCK for another "
        "block of inputs per scale, e.g. nf4:32; nf4:dq or nf4:32:dq: NF4's scales in 8 bits) or int8; embeddings, norms and head stay float (default: float, "
        "or the base a --quantize finetune run trained on)",
    )


def add_source(p: argparse.ArgumentParser) -> None:
    """The SOURCE argument, read by `load` (zoo generate, zoo serve)."""
    p.add_argument("source", metavar="SOURCE", help=SOURCE_HELP)


def add_revision(p: argparse.ArgumentParser) -> None:
    """--revision: a Hub id's branch, tag or commit (zoo generate, zoo serve, zoo info, zoo inspect)."""
    p.add_argument(
        "--revision",
        metavar="REV",
        help="the branch, tag or commit of a Hub model id (default main); a local folder or run has none",
    )


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
    add_source(p)
    add_revision(p)
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
    p.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        metavar="P",
        help="as transformers': the logits of tokens the text already holds divided by P where positive, "
        "multiplied by P where negative, before choosing (default 1: none; e.g. 1.2 discourages repeats)",
    )
    p.add_argument(
        "--stop",
        action="append",
        metavar="STRING",
        help="cut each completion at the first occurrence of STRING, not included (repeat for several)",
    )
    p.add_argument(
        "--chat",
        action="store_true",
        help="each prompt is a user turn rendered with the model's chat template and its generation prompt "
        "(a chat SFT run: the template it trained with); the reply alone is printed",
    )
    p.add_argument(
        "--chat-template",
        metavar="FILE",
        help="a jinja2 chat template file for --chat (implies it), instead of the model's own",
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
    add_quantize(p)
    p.add_argument("--json", action="store_true", help="print [{prompt, completion}] as JSON, nothing streamed")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show full tracebacks")
    p.set_defaults(func=cmd_generate)
    return p

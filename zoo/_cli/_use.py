"""The commands that use a finished run (`zoo.train.load_run`): `zoo predict RUN` (a
classifier's labels of texts, a regressor's outputs), `zoo eval RUN --data FILE` (scores on a
data file), `zoo export RUN --merge --output DIR` (a merged Hugging Face folder)."""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import sys
from pathlib import Path
from typing import Any

from .. import internal
from ._common import CLIError, init_devices


def _check_batch_size(args) -> None:
    if args.batch_size < 1:
        raise CLIError(f"--batch-size must be >= 1 (rows per forward pass), got {args.batch_size}")


def _load(folder: str, command: str):
    """The run in `folder` on one device; its notes on stderr."""
    init_devices(1)
    import zoo  # here, not at the top: reading zoo.train.load_run imports jax

    run = zoo.train.load_run(folder)
    for note in run.notes:
        print(f"zoo {command}: note: {note}", file=sys.stderr)
    return run


# --- zoo predict ------------------------------------------------------------------------------


def _numbers(text: str, where: str) -> list[float]:
    try:
        return [float(v) for v in text.replace(",", " ").split()]
    except ValueError:
        raise CLIError(f"{where}: {text.strip()[:40]!r} is not numbers separated by commas or spaces") from None


def _read_inputs(path: Path, regressor: bool) -> list[Any]:
    """The inputs of `--input FILE`: `.jsonl` objects' `text` (a regressor's `x`), a `.csv`'s
    `text` column (a regressor's: every column, numbers), else one per non-empty line."""
    if not path.is_file():
        raise CLIError(f"--input {path}: no such file; check the path")
    try:
        text = path.read_text(encoding="utf-8-sig")  # a leading BOM is no text, as in the data files
    except UnicodeDecodeError as e:
        raise CLIError(f"--input {path} is not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8") from None
    key = "x" if regressor else "text"
    lines = [(i, line) for i, line in enumerate(text.splitlines(), 1) if line.strip()]
    if path.suffix.lower() == ".jsonl":
        out = []
        for i, line in lines:
            try:
                value = json.loads(line)[key]
            except (ValueError, TypeError, KeyError):
                raise CLIError(f"--input {path} line {i} is no JSON object with {key!r}") from None
            out.append(value)
        return out
    if path.suffix.lower() == ".csv" and not regressor:
        rows = list(csv.DictReader(io.StringIO(text)))
        if rows and "text" not in rows[0]:
            raise CLIError(f"--input {path}: its header has no 'text' column")
        return [r["text"] for r in rows]
    return [_numbers(line, f"--input {path} line {i}") if regressor else line for i, line in lines]


def cmd_predict(args) -> int:
    """Load RUN, read the inputs, print one prediction per input."""
    _check_batch_size(args)
    run = _load(args.run, "predict")
    if run.kind == "lm":
        raise CLIError(f"RUN {args.run} is a language model run: it predicts no labels; use zoo generate {args.run}")
    regressor = run.kind == "regression"
    if args.input is not None:
        inputs = _read_inputs(Path(args.input).expanduser(), regressor)
    else:
        inputs = [_numbers(t, "--text") for t in args.text] if regressor else list(args.text)
    if not inputs:
        raise CLIError(f"--input {args.input}: no inputs in it")
    outputs = run.predict(inputs, batch_size=args.batch_size)
    if not args.json:
        print(f"zoo predict: {run.weights}, {internal.counted(len(inputs), 'input')}", file=sys.stderr, flush=True)
    for given, out in zip(inputs, outputs):
        values = [float(v) for v in out]
        if regressor:
            record = {"input": given, "prediction": values}
            line = " ".join(f"{v:.6g}" for v in values)
        else:
            best = int(max(range(len(values)), key=values.__getitem__))
            top = max(values)
            p = 1 / sum(math.exp(v - top) for v in values)
            record = {"text": given, "label": run.label_names[best], "logits": values}
            line = f"{run.label_names[best]}\t{p:.3f}\t{given}"
        print(json.dumps(record) if args.json else line)
    return 0


# --- zoo eval ---------------------------------------------------------------------------------


def _table(scores: dict[str, Any]) -> list[str]:
    width = max([5, *(len(n) for n in scores["per_class"])])
    lines = [f"{'class':<{width}}  precision  recall  f1     support"]
    for name, s in scores["per_class"].items():
        lines.append(f"{name:<{width}}  {s['precision']:<9.3f}  {s['recall']:<6.3f}  {s['f1']:<5.3f}  {s['support']}")
    return lines


def cmd_eval(args) -> int:
    """Load RUN, evaluate it on --data, print the scores."""
    _check_batch_size(args)
    run = _load(args.run, "eval")
    scores = run.evaluate(args.data, batch_size=args.batch_size)
    if args.json:
        print(json.dumps(scores, indent=2))
        return 0
    print(f"zoo eval: {run.weights} on {args.data}")
    if scores["kind"] == "lm":
        print(
            f"loss {scores['loss']:.4f}  perplexity {scores['perplexity']:.4g}  next-token accuracy "
            f"{100 * scores['accuracy']:.1f}%  ({internal.counted(scores['tokens'], 'target token')} in {internal.counted(scores['rows'], 'row')})"
        )
        for name, own in scores.get("adapters", {}).items():  # a run of several adapters: each on its records
            print(
                f"  adapter {name}: loss {own['loss']:.4f}  perplexity {own['perplexity']:.4g}  ({own['tokens']} "
                f"target tokens)"
            )
        return 0
    if scores["kind"] == "preference":  # TRL's eval metrics, by their names
        reference = f"; reference: {scores['reference']}" if scores["reference"] else ""
        print(
            f"loss {scores['loss']:.4f}  preference accuracy {100 * scores['accuracy']:.1f}%  "
            f"({internal.counted(scores['pairs'], 'pair')}; {scores['objective']}{reference})"
        )
        names = [k for k in scores if "/" in k] + [
            k for k in ("nll_loss", "log_odds_ratio", "log_odds_chosen") if k in scores
        ]
        print("  ".join(f"{name} {scores[name]:.4f}" for name in names))
        return 0
    print(
        f"loss {scores['loss']:.4f}  accuracy {100 * scores['accuracy']:.1f}%  macro-F1 {scores['macro_f1']:.3f}  "
        f"({internal.counted(scores['examples'], 'example')})"
    )
    print("\n".join(_table(scores)))
    return 0


# --- zoo export -------------------------------------------------------------------------------


def cmd_export(args) -> int:
    """Load RUN, write its merged Hugging Face folder."""
    folder = Path(args.output).expanduser()
    if folder.exists() and not folder.is_dir():  # before loading the run: seconds
        raise CLIError(f"--output {folder} is a file, not a folder; choose a folder (it is created if missing)")
    run = _load(args.run, "export")
    import zoo  # loaded already by _load

    if run.config.lora is not None and not args.merge:
        several = zoo.lora.adapter_names(run.model)
        where = f"{run.folder / 'adapter'}/NAME for NAME in {', '.join(several)}" if several else run.folder / "adapter"
        raise CLIError(
            f"RUN {args.run} is a LoRA run: pass --merge to fold its adapter into the base model (the adapter "
            f"itself, in peft's layout, is {where})"
        )
    before = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    created = not folder.exists()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CLIError(
            f"--output {folder}: cannot create the folder ({e.strerror}); choose a folder you can write"
        ) from None
    try:
        written = run.export(folder, adapter=args.adapter, dtype=args.dtype)
    except FileExistsError as e:
        raise CLIError(str(e).splitlines()[0].replace("zoo export: ", "--output: ")) from e
    finally:
        if created and folder.is_dir() and not any(folder.iterdir()):  # a failed export leaves no folder
            folder.rmdir()
    size = sum(p.stat().st_size for p in written if p.is_file())
    names = sorted(p.name for p in written)
    print(f"zoo export: {run.weights} → {args.output}: {', '.join(names)} ({internal.human_bytes(size)})")
    others = [n for n in before if n not in names]
    if others:  # the user's own files: said, never touched
        shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
        print(
            f"zoo export: {args.output} also holds {internal.counted(len(others), 'file')} it did not write, "
            f"left as they were: {shown}"
        )
    return 0


# --- the parsers ------------------------------------------------------------------------------

RUN_HELP = "the output folder of a zoo train / finetune / demo run"


def add_parsers(sub) -> dict[str, argparse.ArgumentParser]:
    predict = sub.add_parser(
        "predict",
        help="a classifier run's labels of texts (a regressor's outputs of numbers)",
        description="Load a finished run (its adapter/, model/ or last checkpoint) and predict: a classifier's "
        "label of each text (read as it read its training texts: its tokenizer, cut at its --seq-len), by name; "
        "a regressor's outputs of each row of numbers. Plain output: one line per input (label, its probability, "
        "text); --json: one JSON object per line.",
        epilog="Examples: zoo predict runs/cls --text 'the cat sat' --text 'a red log'; zoo predict runs/cls "
        "--input texts.txt --json; zoo predict runs/mlp --text '0.1,0.2,...'",
    )
    predict.add_argument("run", metavar="RUN", help=RUN_HELP)
    given = predict.add_mutually_exclusive_group(required=True)
    given.add_argument(
        "--input",
        metavar="FILE",
        help="inputs, one per line (.txt), the 'text' of each .jsonl object or .csv row (a regressor: 'x' "
        "lists, or rows of numbers)",
    )
    given.add_argument("--text", action="append", metavar="TEXT", help="an input (repeat for several)")
    predict.add_argument("--json", action="store_true", help='print {"text", "label", "logits"} per input, a line each')
    predict.set_defaults(func=cmd_predict)

    evaluate = sub.add_parser(
        "eval",
        help="a run's scores on a data file: loss, perplexity (LMs), accuracy, macro-F1, per class",
        description="Load a finished run and evaluate it on every example of a data file in the formats zoo "
        "train --data reads (read with the run's tokenizer, --seq-len, packing and chat template): a language "
        "model's loss, perplexity and next-token accuracy over the tokens its loss counts; a classifier's "
        "loss, accuracy, macro-F1 and per-class precision / recall / F1 / support, the file's labels matched "
        "to the run's by name; a --objective dpo / orpo run's on preference pairs: TRL's eval metrics "
        "(rewards/chosen, rewards/margins, logps/chosen, ...) as its own evaluation computes them.",
        epilog="Examples: zoo eval runs/cls --data test.csv; zoo eval runs/sft --data held_out.jsonl --json",
    )
    evaluate.add_argument("run", metavar="RUN", help=RUN_HELP)
    evaluate.add_argument("--data", required=True, metavar="FILE", help="a .txt, .jsonl, .json or .csv data file")
    evaluate.add_argument("--json", action="store_true", help="print the scores as one JSON object")
    evaluate.set_defaults(func=cmd_eval)

    export = sub.add_parser(
        "export",
        help="a run as one Hugging Face folder, its LoRA adapter merged into the base",
        description="Write a finished run's model as a Hugging Face folder with its tokenizer's files: a "
        "decoder that transformers' AutoModelForCausalLM opens with the same logits; a classifier's encoder "
        "(BertModel) with its head in head.safetensors and its label names as config.json's id2label. A "
        "folder holding files of the names written must be a Hugging Face model folder: nothing else is replaced.",
        epilog="Example: zoo export runs/tuned --merge --output merged/",
    )
    export.add_argument("run", metavar="RUN", help=RUN_HELP)
    export.add_argument("--merge", action="store_true", help="fold the LoRA adapter into the base weights (LoRA runs)")
    export.add_argument("--output", required=True, metavar="DIR", help="the folder to write")
    export.add_argument("--adapter", metavar="NAME", help="of a run of several adapters: the one to merge")
    export.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        help="the weights' dtype (default: the base model's, as its config.json says; float32 without one)",
    )
    export.set_defaults(func=cmd_export)
    for p in (predict, evaluate):
        p.add_argument("--batch-size", type=int, default=64, metavar="N", help="rows per forward pass (default 64)")
    for p in (predict, evaluate, export):
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show full tracebacks")
    return {"predict": predict, "eval": evaluate, "export": export}

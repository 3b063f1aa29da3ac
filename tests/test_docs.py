"""Every code block of README.md and docs/*.md, run as written (docs/claims.md "Doc blocks").

A block is read from its file and run unchanged. HTML comments on the lines just before a
block (invisible on GitHub) say how:

- `<!-- doc-test: continues -->`: runs after the previous python block of the same file, in
  the same process and namespace (the blocks of a chain run in one fresh subprocess).
- `<!-- doc-test: fixtures PATH=KIND ... -->`: before the chain runs, its temporary working
  directory gets what the block names at PATH: `tiny_llama` (a tiny random Llama with a
  word-level tokenizer), `tiny_gpt2`, `tiny_bert`, `sft_jsonl` (prompt/completion records),
  `hub_llama` (the tiny Llama as the model id PATH in a local hub cache, `HF_HUB_CACHE`),
  `one_process` (the `JAX_*` variables of a distributed job of one process; PATH unused).
- `<!-- doc-test: file=PATH -->`: the block is a listing of the repository's file PATH and
  must equal it.
- `<!-- doc-test: not-code (REASON) -->`: output, a diff, a table: not run.
- `<!-- doc-test: slow -->`: the chain runs with `-m slow` only.

Python blocks run with cwd a temporary folder and `HF_HUB_OFFLINE=1`: in the test process
(a fresh namespace, `__name__` "__main__") where the chain changes nothing of its process
(`_in_test_process`), else in a subprocess with the test suite's XLA flags and compilation
cache (tests/conftest.py): a chain that sets jax's devices or configuration, starts a
distributed job, sets a mesh, registers a model, or reads an environment of its own. Shell blocks: every `zoo`
command line is parsed by the CLI's own parser (a wrong flag or choice fails); `--help`,
`zoo info` of a built-in model and `zoo inspect mlp` also run (in the test process).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import short_run_env, zoo_main

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"^<!--\s*doc-test:\s*(.*?)\s*-->\s*$")
FENCE = re.compile(r"^```(\S*)\s*$")
DIRECTIVE = re.compile(r"not-code \(.*?\)|not-code|file=\S+|fixtures(?:\s+[^\s=]+=\w+)+|continues|slow")
PYTHON, SHELL = {"python", "py"}, {"sh", "bash", "shell", "console"}


@dataclasses.dataclass
class Block:
    file: Path
    line: int  # 1-based line of the block's first line of code
    lang: str
    text: str
    markers: list[str]

    @property
    def name(self) -> str:
        return f"{self.file.relative_to(ROOT)}:{self.line}"

    def marker(self, key: str) -> str | None:
        for m in self.markers:
            if m == key or m.startswith(key + " ") or m.startswith(key + "=") or m.startswith(key + " ("):
                return m[len(key) :].lstrip(" =")
        return None


def read_blocks(path: Path) -> list[Block]:
    lines = path.read_text().split("\n")
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while not lines[j].startswith("```"):
            j += 1
        markers, k = [], i - 1
        while k >= 0 and (found := MARKER.match(lines[k])):
            markers[:0] = DIRECTIVE.findall(found.group(1))
            k -= 1
        blocks.append(Block(path, i + 2, m.group(1), "\n".join(lines[i + 1 : j]) + "\n", markers))
        i = j + 1
    return blocks


ALL = [b for path in DOCS for b in read_blocks(path)]


def python_chains() -> list[list[Block]]:
    chains: list[list[Block]] = []
    last: dict[Path, list[Block]] = {}
    for b in ALL:
        if b.lang not in PYTHON or b.marker("not-code") is not None or b.marker("file") is not None:
            continue
        if b.marker("continues") is not None:
            assert b.file in last, f"{b.name}: marked continues, but no python block before it"
            last[b.file].append(b)
        else:
            last[b.file] = [b]
            chains.append(last[b.file])
    return chains


CHAINS = python_chains()


def test_every_block_is_covered():
    """Each block is python (run), shell (parsed), a listing of a file, or marked not-code;
    a block without a language is output (marked not-code too)."""
    for b in ALL:
        if b.lang in PYTHON | SHELL or b.marker("file") is not None:
            continue
        assert b.marker("not-code") is not None, f"{b.name}: a ```{b.lang} block with no doc-test marker"
    assert len(ALL) >= 40


# ------------------------------------------------------------------------------ fixtures

VOCAB_WORDS = "the a of is to and in capital france once upon time hello world model mesh".split()


def _tokenizer(folder: Path) -> None:
    import tokenizers

    vocab = {w: i for i, w in enumerate(["<pad>", "<s>", "</s>", "<unk>", *VOCAB_WORDS])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = tokenizers.normalizers.Lowercase()
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.decoder = tokenizers.decoders.WordPiece()  # joins words with spaces
    tok.add_special_tokens(["<pad>", "<s>", "</s>", "<unk>"])
    tok.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "model_max_length": 512}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def _tiny_llama(folder: Path) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=4 + len(VOCAB_WORDS), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1,
        eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    _tokenizer(folder)


def _tiny_gpt2(folder: Path) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=4 + len(VOCAB_WORDS), n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=1, eos_token_id=2
    )
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    _tokenizer(folder)


def _tiny_bert(folder: Path) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=4 + len(VOCAB_WORDS), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=48, max_position_embeddings=64,
    )  # fmt: skip
    transformers.BertModel(config).save_pretrained(folder)
    _tokenizer(folder)


def _sft_jsonl(path: Path) -> None:
    """Prompt/completion records: 1,700 leave 39 rows of 512 tokens (docs/data.md's
    seq_len) after its 5% validation split, one batch of 32 an epoch (3,200 made two; a
    step at 512 tokens is seconds of the chain's time); 162 rows of README.md's 128."""
    import numpy as np

    rng = np.random.default_rng(0)
    rows = [
        {"prompt": " ".join(rng.choice(VOCAB_WORDS, 6)), "completion": " " + " ".join(rng.choice(VOCAB_WORDS, 4))}
        for _ in range(1700)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


MAKERS = {"tiny_llama": _tiny_llama, "tiny_gpt2": _tiny_gpt2, "tiny_bert": _tiny_bert}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Each kind of fixture built once (a folder or a file), copied where a block names it."""
    cache: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in cache:
            if kind == "sft_jsonl":
                cache[kind] = tmp_path_factory.mktemp("sft") / "sft.jsonl"
                _sft_jsonl(cache[kind])
            else:
                cache[kind] = tmp_path_factory.mktemp(kind)
                MAKERS[kind](cache[kind])
        return cache[kind]

    return get


def _place(cwd: Path, path: str, kind: str, made, env: dict) -> None:
    if kind == "one_process":  # the JAX_* variables of a job of one process
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        env |= {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "1", "JAX_PROCESS_ID": "0"}
        return
    if kind == "hub_llama":  # the model id `path` in a local hub cache
        snapshot = cwd / "hf_cache" / ("models--" + path.replace("/", "--")) / "snapshots" / "abc"
        shutil.copytree(made("tiny_llama"), snapshot)
        env["HF_HUB_CACHE"] = str(cwd / "hf_cache")
        return
    target = cwd / path.rstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    source = made(kind)
    (shutil.copytree if source.is_dir() else shutil.copy)(source, target)


def subprocess_env() -> dict[str, str]:
    """The test suite's settings (tests/conftest.py has set them in os.environ: the compile
    cache, the collective timeout), plus its fast-compile XLA flags (`helpers.short_run_env`:
    a block's subject is its code, not how XLA optimises it); nothing downloaded."""
    env = short_run_env()
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    return env


RUNNER = textwrap.dedent(
    """
    import json, sys
    namespace = {"__name__": "__main__"}
    for file, line, text in json.load(open(sys.argv[1])):
        print(f"=== {file}:{line}", flush=True)
        exec(compile("\\n" * (line - 1) + text, file, "exec"), namespace)
    """
)

# Chains that run for longer than ~20 s on 2 shared cores (see the report in claims.md).
SLOW = {"README.md:105", "docs/data.md:11", "docs/lora.md:8", "docs/checkpoints.md:10"}  # 35-70 s each


def test_every_slow_chain_is_a_chain():
    """A README/docs edit moves a chain's first line: a stale name in SLOW would silently put
    a long chain back into the fast suite (README.md:70 did, 67 s in CI)."""
    assert SLOW <= {chain[0].name for chain in CHAINS}, SLOW - {chain[0].name for chain in CHAINS}


def _is_slow(chain: list[Block]) -> bool:
    return chain[0].name in SLOW or any(b.marker("slow") is not None for b in chain)


def _chain_params():
    for chain in CHAINS:
        yield pytest.param(chain, id=chain[0].name, marks=[pytest.mark.slow] if _is_slow(chain) else [])


# What a chain does to its process that the test process must not share or has already done
# otherwise: jax's device count and configuration, a distributed job, the current mesh, the
# model registry, the environment (a hub cache, a job's variables), signals.
OWN_PROCESS = re.compile(
    r"jax_num_cpu_devices|jax\.config|jax\.distributed|jax\.devices|device_count|make_mesh|set_mesh"
    r"|register_model|os\.environ|signal|\bsys\."
)
ENV_FIXTURES = {"one_process", "hub_llama"}


def _in_test_process(chain: list[Block]) -> bool:
    """Whether the chain runs in the test process: a fast chain that changes nothing of its
    process (above) and needs no environment of its own. Its subject is the code of the
    block, not a process: one that imports zoo and compiles its tiny programs afresh costs a
    few seconds more for nothing (issue 40)."""
    kinds = {pair.split("=")[1] for b in chain for pair in (b.marker("fixtures") or "").split()}
    return not _is_slow(chain) and not kinds & ENV_FIXTURES and not any(OWN_PROCESS.search(b.text) for b in chain)


@pytest.mark.parametrize("chain", list(_chain_params()))
def test_python_block_runs_as_written(chain, tmp_path, made, monkeypatch):
    env = subprocess_env()
    for b in chain:
        spec = b.marker("fixtures")
        for pair in (spec or "").split():
            path, kind = pair.split("=")
            _place(tmp_path, path, kind, made, env)
    if _in_test_process(chain):  # the same blocks, in one namespace, cwd the same folder
        monkeypatch.chdir(tmp_path)
        namespace = {"__name__": "__main__"}
        for b in chain:
            exec(compile("\n" * (b.line - 1) + b.text, str(b.file.relative_to(ROOT)), "exec"), namespace)
        return
    blocks = [[str(b.file.relative_to(ROOT)), b.line, b.text] for b in chain]
    (tmp_path / "_blocks.json").write_text(json.dumps(blocks))
    (tmp_path / "_runner.py").write_text(RUNNER)
    proc = subprocess.run(
        [sys.executable, "_runner.py", "_blocks.json"], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, f"{chain[0].name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


@pytest.mark.parametrize("block", [pytest.param(b, id=b.name) for b in ALL if b.marker("file") is not None])
def test_listing_equals_the_file(block):
    assert block.text == (ROOT / block.marker("file")).read_text(), f"{block.name} differs from {block.marker('file')}"


# ------------------------------------------------------------------------------ shell blocks


def zoo_commands(block: Block) -> list[list[str]]:
    """The `zoo` / `python -m zoo` / `.venv/bin/zoo` commands of a shell block, as argv
    (after `zoo`): continuation lines joined, comments dropped, split at `&&`, `;`, `&`,
    `|` and redirections; shell variables read as 1."""
    text = re.sub(r"\$\(.*\)", "1", block.text.replace("\\\n", " "))
    text = re.sub(r"\$\w+", "1", text)
    commands = []
    for line in text.splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        tokens, current = list(lexer), []
        for token in [*tokens, ";"]:
            if token and set(token) <= set("&;|<>()"):
                if current:
                    commands.append(current)
                current = [] if token not in {">", "<", ">>"} else None
            elif current is not None:
                current.append(token)
    out = []
    for argv in commands:
        if argv[:3] == ["python", "-m", "zoo"] or argv[:3] == [".venv/bin/python", "-m", "zoo"]:
            out.append(argv[3:])
        elif argv[0] in {"zoo", ".venv/bin/zoo"}:
            out.append(argv[1:])
    return out


SHELL_BLOCKS = [b for b in ALL if b.lang in SHELL]


def _cheap(argv: list[str]) -> bool:
    """Commands that take seconds: help, `info` of a built-in model, `inspect mlp`."""
    if "--help" in argv or "-h" in argv:
        return True
    builtin = len(argv) > 1 and not any(c in argv[1] for c in "/.")
    return (argv[:1] == ["info"] and builtin and "--init" not in argv) or argv[:2] == ["inspect", "mlp"]


@pytest.mark.parametrize("block", [pytest.param(b, id=b.name) for b in SHELL_BLOCKS])
def test_shell_block_parses(block, tmp_path, monkeypatch):
    """Every `zoo` command of the block is accepted by the CLI's parser; the cheap ones run."""
    from zoo._cli._main import _parse, build_parsers

    commands = zoo_commands(block)
    for argv in commands:
        if argv in (["--help"], ["-h"]):
            continue
        parser, parsers = build_parsers()
        try:
            _parse(parser, parsers, argv)
        except SystemExit as e:
            pytest.fail(f"{block.name}: `zoo {shlex.join(argv)}` is refused by the parser (exit {e.code})")
    # In this process (the CLI's own entry): what is checked is that the command works, not
    # how a process starts (tests/test_cli.py's fresh-process tests hold that).
    monkeypatch.chdir(tmp_path)
    for argv in filter(_cheap, commands):
        rc, _, err = zoo_main(*argv)
        assert rc == 0, f"{block.name}: `zoo {shlex.join(argv)}` failed:\n{err[-3000:]}"


TEST_REFERENCE = re.compile(r"tests/((?:\w+/)*test_\w+\.py)(?:::(\w+))?")


def test_every_test_the_docs_name_exists():
    """The docs, the package and the tests name tests as `tests/FILE` or `tests/FILE::NAME`
    (docs/claims.md's evidence, docs/testing.md's costs): each such file exists and defines
    that test, so moving or renaming a test cannot leave a claim pointing at nothing."""
    sources = [*DOCS, *sorted((ROOT / "zoo").rglob("*.py")), *sorted((ROOT / "tests").rglob("*.py"))]
    missing = []
    for source in sources:
        for match in TEST_REFERENCE.finditer(source.read_text()):
            path, name = ROOT / "tests" / match.group(1), match.group(2)
            where = f"{source.relative_to(ROOT)}: {match.group(0)}"
            if not path.exists():
                missing.append(f"{where} (no such file)")
            elif name and not re.search(rf"^(?:async )?def {name}\b", path.read_text(), re.M):
                missing.append(f"{where} (no such test)")
    assert not missing, "\n".join(missing)


def test_the_flag_tables_name_every_value_the_help_offers():
    """docs/cli.md's row of each `zoo train` / `zoo finetune` flag with fixed values (argparse's
    choices) names each of them, in its flag cell (`--mode {explicit,shard_map}`) or in
    backticks; `--rules` lists every preset as `--help` does (`zoo.RULE_PRESETS`, in order)."""
    import zoo
    from zoo._cli._main import build_parsers

    offered = {}
    for command in ("train", "finetune"):
        for action in build_parsers()[1][command]._actions:
            if action.choices and action.option_strings:
                offered.setdefault(action.option_strings[0], list(action.choices))
    rows = {}
    for line in (ROOT / "docs" / "cli.md").read_text().splitlines():
        if m := re.match(r"\| `(--[\w-]+)([^`]*)` \|", line):
            rows.setdefault(m.group(1), (set(re.findall(r"[\w+-]+", m.group(2))), line))
    missing = [
        f"{flag}: {v}"
        for flag, values in offered.items()
        if flag in rows
        for v in values
        if v not in rows[flag][0] and f"`{v}`" not in rows[flag][1]
    ]
    assert not missing, missing
    presets = ", ".join(f"`{p}`" for p in zoo.RULE_PRESETS)
    assert presets in rows["--rules"][1], (presets, rows["--rules"][1])

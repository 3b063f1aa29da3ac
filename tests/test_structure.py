"""The package's shape, read from its source (AST): the run stays a short straight line of
stages, no function grows past a screen or two, the modules import each other without a
circle, library modules name their dependencies at the top (no `import zoo` inside a
function, which hides them), and the command line (`zoo/_cli`) uses only the library's
public names (`zoo`, `zoo.train`, `zoo.internal`, ...), never a private module (`zoo._x`,
`zoo.train._x`); its own private modules are its business."""

import ast
from pathlib import Path

ZOO = Path(__file__).resolve().parent.parent / "zoo"
LONGEST_FUNCTION = 100  # lines
LONGEST_FILE = 700  # lines: a module over it mixes concerns (issue 41)
# Files over LONGEST_FILE being split now (the serve engine's programs and the HTTP
# requests' reading move to modules of their own); the split takes them off this list.
LONGEST_RUN = 80  # zoo/train/_run.py's _run: the stages, nothing else


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ZOO.rglob("*.py")):
        parts = path.relative_to(ZOO.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def _functions(tree):
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


def _imported(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The zoo modules (or packages) an import statement in `module` loads."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in MODULES]
    package = module if MODULES[module].name == "__init__.py" else module.rsplit(".", 1)[0]
    if node.level:
        base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    out = []
    for alias in node.names:
        if f"{source}.{alias.name}" in MODULES:
            out.append(f"{source}.{alias.name}")
        elif source in MODULES:
            out.append(source)
    return out


def test_no_function_is_longer_than_the_limit():
    long = [
        f"{MODULES[m].relative_to(ZOO.parent)}:{f.lineno} {f.name} ({f.end_lineno - f.lineno + 1} lines)"
        for m, tree in TREES.items()
        for f in _functions(tree)
        if f.end_lineno - f.lineno + 1 > LONGEST_FUNCTION
    ]
    assert not long, f"functions over {LONGEST_FUNCTION} lines: {long}"


def test_no_file_is_longer_than_the_limit():
    """No module of zoo/ is over `LONGEST_FILE` lines (the last ones over it were split by
    concern: zoo/serve/_engine.py and zoo/serve/_http.py)."""
    lengths = {str(p.relative_to(ZOO.parent)): len(p.read_text().splitlines()) for p in MODULES.values()}
    long = {f: n for f, n in lengths.items() if n > LONGEST_FILE}
    assert not long, f"files over {LONGEST_FILE} lines (split them by concern): {long}"


def test_no_test_file_is_longer_than_the_limit():
    """No file of tests/ is over `LONGEST_FILE` lines either (issue 40): pinned data lives in
    tests/data/, helpers several files share in their own modules (helpers.py, serving.py)."""
    tests = Path(__file__).parent
    lengths = {str(p.relative_to(tests)): len(p.read_text().splitlines()) for p in tests.rglob("*.py")}
    long = {f: n for f, n in lengths.items() if n > LONGEST_FILE}
    assert not long, f"test files over {LONGEST_FILE} lines (split them by capability): {long}"


# `# fmt: skip` keeps a hand-aligned table aligned (the files and how many each holds);
# everywhere else ruff formats.
FMT_SKIP_TABLES = {"zoo/_inspect.py": 1, "zoo/nn/_four_bit.py": 1, "zoo/train/_registry.py": 1}


def test_fmt_skip_only_on_aligned_tables():
    counts = {str(p.relative_to(ZOO.parent)): n for p in MODULES.values() if (n := p.read_text().count("# fmt: skip"))}
    assert counts == FMT_SKIP_TABLES, f"`# fmt: skip` outside the aligned tables: {counts}"


def test_the_run_is_a_short_line_of_stages():
    (run,) = [f for f in _functions(TREES["zoo.train._run"]) if f.name == "_run"]
    assert run.end_lineno - run.lineno + 1 <= LONGEST_RUN


def test_library_modules_import_zoo_at_the_top():
    """`import zoo` inside a function hides a dependency (and usually an import circle);
    the command line (zoo/_cli) is exempt: it imports late to answer --help quickly."""
    found = [
        f"{MODULES[m].relative_to(ZOO.parent)}:{n.lineno} in {f.name}"
        for m, tree in TREES.items()
        if not m.startswith("zoo._cli")
        for f in _functions(tree)
        for n in ast.walk(f)
        if isinstance(n, ast.Import) and any(a.name == "zoo" or a.name.startswith("zoo.") for a in n.names)
    ]
    assert not found, found


def _import_graph() -> dict[str, set[str]]:
    """Module → the zoo modules it imports: at the top, inside functions, for type
    checkers (`if TYPE_CHECKING:`), and through packages (a package's `__init__` is a
    module like any other: importing a name from `zoo.x` loads `zoo/x/__init__.py`)."""
    graph = {m: set() for m in MODULES}
    for m, tree in TREES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                graph[m].update(d for d in _imported(m, node) if d != m)
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of `graph` with more than one module (Tarjan)."""
    index, low, stack, on, circles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return circles


def test_no_import_circle():
    """Modules and the modules they import form no circle, counting every import: inside
    functions, for type checkers and package re-exports alike (a circle hidden from the
    interpreter is still one for whoever reads or moves the code)."""
    circles = _circles(_import_graph())
    assert not circles, circles


def test_the_circle_check_sees_every_kind_of_import():
    """The check itself: a circle closed by a `TYPE_CHECKING` import, by a package's
    re-export or inside a function is found."""
    graph = _import_graph()
    assert "zoo.models._transformer" in graph["zoo.models"]  # an `if TYPE_CHECKING:` re-export
    assert _circles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    assert _circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


# docs/design.md "The layers": each package and the packages it may import.
_CORE = "core"
LAYERS = {
    _CORE: set(),
    "zoo.nn": {_CORE},
    "zoo.models": {"zoo.nn", _CORE},
    "zoo.hf": {"zoo.models", "zoo.nn", _CORE},
    "zoo.lora": {"zoo.hf", "zoo.nn", _CORE},
    "zoo.data": {"zoo.hf", _CORE},
    "generate": {"zoo.lora", "zoo.models", "zoo.nn", _CORE},
    "zoo.serve": {"generate", "zoo.lora", "zoo.models", "zoo.nn", _CORE},
    "zoo.train": {"generate", "zoo.serve", "zoo.data", "zoo.hf", "zoo.lora", "zoo.models", "zoo.nn", _CORE},
    "zoo.internal": {"generate", "zoo.lora", "zoo.nn", _CORE},
    "zoo": {
        "generate",
        "zoo.data",
        "zoo.hf",
        "zoo.internal",
        "zoo.lora",
        "zoo.models",
        "zoo.nn",
        "zoo.serve",
        "zoo.train",
        _CORE,
    },
    "zoo._cli": {"zoo", "zoo.internal", "zoo.serve", "zoo.train"},
}


def _layer(module: str) -> str:
    """The floor of docs/design.md's layers a module stands on."""
    parts = module.split(".")
    if module in ("zoo._generate", "zoo._sampling"):
        return "generate"
    if module == "zoo.__main__":
        return "zoo._cli"
    if len(parts) > 1 and f"zoo.{parts[1]}" in LAYERS:
        return f"zoo.{parts[1]}"
    return "zoo" if module == "zoo" else _CORE


def test_packages_import_only_the_floors_below():
    assert [_layer(m) for m in ("zoo._tree", "zoo._checkpoint._disk", "zoo.presets", "zoo._generate")] == [
        _CORE,
        _CORE,
        _CORE,
        "generate",
    ]
    assert _layer("zoo.models._preference") == "zoo.models" and _layer("zoo.lora._apply") == "zoo.lora"
    graph = _import_graph()
    bad = sorted(
        f"{m} -> {d}"
        for m, deps in graph.items()
        for d in deps
        if _layer(d) != _layer(m) and _layer(d) not in LAYERS[_layer(m)]
    )
    assert not bad, "imports against docs/design.md's layers:\n" + "\n".join(bad)


# The house's targets reached so far (issue 41): a folder by concept stays about the size of
# the largest of Equinox or peft's LoRA tuner. 28 then; 29 with online RL (_grpo.py: its
# task and rollouts, a concept of its own beside the preference objectives' _preference.py).
TRAIN_FILES = 29


def test_zoo_train_is_a_folder_of_concepts_not_of_steps():
    """zoo/train holds at most `TRAIN_FILES` modules: a file under ~100 lines that serves
    one neighbour belongs in it."""
    files = sorted(p.name for p in (ZOO / "train").glob("*.py"))
    assert len(files) <= TRAIN_FILES, f"zoo/train has {len(files)} files (at most {TRAIN_FILES}): {files}"


# `zoo.internal` is low-level again (issue 41): like `equinox.internal`, a short list of the
# step's transforms and what the layers share, at the bottom of the import graph.
INTERNAL_NAMES = 30


def test_zoo_internal_is_short_and_imports_nothing_from_zoo_train():
    """`zoo.internal` holds at most `INTERNAL_NAMES` names and imports nothing from
    zoo/train (its lazy table names the modules of its `TYPE_CHECKING` imports, which the
    graph counts): the command line uses `zoo.train`'s public names instead."""
    import zoo.internal

    names = _public_names(zoo.internal)
    assert len(names) <= INTERNAL_NAMES, f"zoo.internal has {len(names)} names (at most {INTERNAL_NAMES})"
    deps = _import_graph()["zoo.internal"]
    assert "zoo._reduced" in deps, deps  # the graph reads its imports
    train = sorted(d for d in deps if d == "zoo.train" or d.startswith("zoo.train."))
    assert not train, f"zoo.internal imports from zoo/train: {train}"


def test_the_checks_see_the_package():
    """The walks above read the real tree (so an empty pass means something)."""
    assert "zoo.train._run" in MODULES and "zoo.nn._linear" in MODULES and len(MODULES) > 80
    assert any(f.name == "_run" for f in _functions(TREES["zoo.train._run"]))


# --------------------------------------------------------------------------- the command line

ROOT = ZOO.parent
CLI = ZOO / "_cli"


def _imports(path: Path) -> list[tuple[int, str]]:
    """`(line, absolute module)` of every import in `path` (relative ones resolved from
    the module's package, names imported from a package counted as its submodules)."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            out.append((node.lineno, module))
            out += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return out


def _private(module: str) -> bool:
    """A private zoo module outside zoo/_cli: a part after `zoo` starts with `_`."""
    parts = module.split(".")
    if parts[0] != "zoo" or parts[:2] == ["zoo", "_cli"]:
        return False
    return any(p.startswith("_") and not p.startswith("__") for p in parts[1:])


def test_the_cli_imports_no_private_zoo_module():
    bad = [
        f"{path.relative_to(ROOT)}:{line}: {module}"
        for path in sorted(CLI.glob("*.py"))
        for line, module in _imports(path)
        if _private(module)
    ]
    assert not bad, "zoo/_cli imports private modules; export the name from zoo.train / zoo.internal:\n" + "\n".join(
        bad
    )


def test_the_check_sees_private_imports():
    """The check itself: each way of importing a private module is caught."""
    for module in ("zoo._presets", "zoo.train._registry", "zoo.train._task.resolve_init", "zoo._tree.path_str"):
        assert _private(module), module
    for module in ("zoo", "zoo.train", "zoo.internal.path_str", "zoo._cli._common", "zoo.train.RunConfig"):
        assert not _private(module), module
    source = CLI / "_main.py"
    resolved = {m for _, m in _imports(source)}
    assert {"zoo.internal.without_closed_loop_tracebacks", "zoo.train.ConfigError"} <= resolved, resolved


# --- the public surface ---------------------------------------------------------------------------


def _public_names(namespace) -> set[str]:
    """`__all__`, or (a namespace without one) its names that are neither private nor modules."""
    import types

    if hasattr(namespace, "__all__"):
        return set(namespace.__all__)
    return {n for n, v in vars(namespace).items() if not n.startswith("_") and not isinstance(v, types.ModuleType)}


def _surface_table() -> dict[str, int]:
    """docs/design.md's "The public surface" table: namespace → its count of names."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("## 9. The public surface", 1)[1]
    rows = [line.split("|") for line in section.splitlines() if line.startswith("| `zoo")]
    return {row[1].strip().strip("`"): int(row[2]) for row in rows}


def test_every_public_name_is_counted_in_the_design_notes():
    """Each namespace's public names are as many as docs/design.md says and every name
    resolves; the second ways in that were removed stay removed."""
    import importlib

    table = _surface_table()
    counted = {}
    for name in table:
        namespace = importlib.import_module(name)
        names = _public_names(namespace)
        missing = [n for n in names if not hasattr(namespace, n)]
        assert not missing, f"{name}.__all__ names what it does not define: {missing}"
        counted[name] = len(names)
    assert counted == table, (
        f"docs/design.md section 9 says {table}, the package has {counted}: update the table and its reasons"
    )
    import zoo

    namespaces = {n for n in zoo.__all__ if isinstance(getattr(zoo, n), type(zoo))} | {"internal", "presets"}
    assert {f"zoo.{n}" for n in namespaces} | {"zoo"} == set(table), "every public namespace has a row"
    for gone in ("load_bert", "load_gpt2", "encoder_config_from_hf", "transformer_config_to_hf"):
        assert not hasattr(zoo.hf, gone), f"zoo.hf.{gone}: the one way in is zoo.hf.from_pretrained"


# --- lazy namespaces -------------------------------------------------------------------------------


def _lazy_table(tree) -> dict[str, str] | None:
    """A namespace's `lazy_names(__name__, {module: names})` as name → module, or None."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "lazy_names":
            table = ast.literal_eval(node.args[1])
            return {name: module for module, names in table.items() for name in names}
    return None


def _type_checking_names(tree) -> dict[str, str]:
    """The `if TYPE_CHECKING:` block's imports as name → module (`from . import x`: `.x`)."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for imp in node.body:
                for alias in imp.names:
                    name = alias.asname or alias.name
                    out[name] = "." * imp.level + (imp.module or name)
    return out


LAZY = {m: table for m, tree in TREES.items() if (table := _lazy_table(tree)) is not None}


def test_lazy_namespaces_list_each_name_once_for_runtime_and_type_checkers():
    """Each lazy namespace's table (what `zoo.X` imports when first read) names the same
    modules as its `if TYPE_CHECKING:` imports (what editors see) and as its `__all__`,
    and each name reads as the object its module defines."""
    import importlib

    assert {"zoo", "zoo.train", "zoo.internal", "zoo.hf", "zoo.models", "zoo.nn"} <= set(LAZY), sorted(LAZY)
    for name, table in LAZY.items():
        assert table == _type_checking_names(TREES[name]), name
        namespace = importlib.import_module(name)
        if hasattr(namespace, "__all__"):
            assert set(namespace.__all__) == set(table), name
        assert set(table) <= set(dir(namespace)), name
        for attr, module in table.items():
            source = importlib.import_module(module, namespace.__package__)
            want = source if module == f".{attr}" else getattr(source, attr)
            assert getattr(namespace, attr) is want, f"{name}.{attr}"


def test_import_zoo_loads_no_jax_and_every_public_name_reads():
    """`import zoo` in a fresh process imports no jax (the `zoo` command's help needs
    none); then every name of every namespace's `__all__` reads (importing it)."""
    import os
    import subprocess
    import sys

    code = (
        "import sys, zoo\n"
        "assert 'jax' not in sys.modules, 'import zoo imported jax'\n"
        "for ns in [zoo] + [getattr(zoo, n) for n in zoo.__all__ if type(getattr(zoo, n)) is type(zoo)]:\n"
        "    for n in getattr(ns, '__all__', ()):\n"
        "        getattr(ns, n)\n"
        "assert 'jax' in sys.modules\n"
        "print(len(zoo.__all__))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "ZOO_RUNTIME_CHECKS"}  # its import hook loads jax
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["42"], proc.stdout


# --- one forward pass (issue 44) ------------------------------------------------------------------

# The modules of inference: they run the model's own forward pass (`Transformer.extend`,
# `Transformer.head`) with a `KVCache`, and never a copy of its layers.
INFERENCE = ("zoo._generate", "zoo.serve", "zoo.nn._cache")
# A definition named like a layer of the forward pass (`cached_block`, `cached_attention`,
# `blocked_attention`, `_embed`, `_layers`, `_head` were such copies).
FORWARD_NAME = r"(?i)attention|attend|(^|_)(transformer_?)?block$|^_?(embed|layers|head)$"
# The parts of a layer and of the model: calling one of them by hand is running a layer
# outside `TransformerBlock` / `Transformer`.
LAYER_PARTS = {
    "attention",
    "attention_norm",
    "mlp",
    "mlp_norm",
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "token_embedding",
    "position_embedding",
    "final_norm",
    "lm_head",
}
# The attention math and RoPE: only `zoo.nn._attention` (and `zoo.nn._rope`) compute them.
ATTENTION_MATH = {"softmax", "dot_product_attention"}
ROPE = {"apply_rope", "rope_angles", "rope_tables", "rope_frequencies"}
ATTENTION_MODULE = "zoo.nn._attention"
# Modules whose softmax is no attention's, with why.
OTHER_SOFTMAX = {"zoo._sampling": "sampling's probabilities over the vocabulary", "zoo.nn._experts": "the router's"}


def _callee(call: ast.Call) -> str | None:
    """The last name of what `call` calls (`jax.nn.softmax(...)` → `softmax`)."""
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def _second_forward(trees: dict[str, ast.AST]) -> list[str]:
    """Where `trees` (module → AST) hold a second copy of the forward pass: an inference
    module defining a block, attention, embedding or head of its own, or calling a layer's
    parts, the attention math or RoPE; any module but `zoo.nn._attention` defining or
    calling the attention's softmax."""
    import re

    found = []
    for module, tree in trees.items():
        inference = any(module == p or module.startswith(p + ".") for p in INFERENCE)
        for node in ast.walk(tree):
            where = f"{module}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                if inference and re.search(FORWARD_NAME, node.name):
                    found.append(f"{where} defines {node.name}")
                if node.name in ATTENTION_MATH and module != ATTENTION_MODULE:
                    found.append(f"{where} defines {node.name} (the attention's is zoo.nn._attention's)")
            if not isinstance(node, ast.Call):
                continue
            name = _callee(node)
            if inference and isinstance(node.func, ast.Attribute) and name in LAYER_PARTS:
                found.append(f"{where} calls a layer's part .{name}(...)")
            if inference and name in ROPE:
                found.append(f"{where} calls {name}")
            if name in ATTENTION_MATH and module != ATTENTION_MODULE and module not in OTHER_SOFTMAX:
                found.append(f"{where} calls {name}")
    return found


def test_inference_runs_the_training_forward_pass():
    """Generation and the serving engine run training's embedding, blocks, attention and
    head (`Transformer.extend` / `head` with a `KVCache`): no inference module holds a
    block or an attention of its own, and the attention's softmax is written once."""
    found = _second_forward(TREES)
    assert not found, (
        "a second copy of the forward pass; give the model's own layers the feature "
        "(Attention / TransformerBlock take cache=) instead:\n" + "\n".join(found)
    )
    assert sum(isinstance(n, ast.FunctionDef) and n.name == "softmax" for n in ast.walk(TREES[ATTENTION_MODULE])) == 1


def test_the_forward_pass_check_sees_a_copy():
    """The check itself: the cached copies it replaced, put back, are each caught."""
    copies = {
        "zoo.nn._cache": ast.parse(
            "def cached_attention(attention, x, keys, values):\n"
            "    q, k, v = attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)\n"
            "    return jax.nn.softmax(q @ k) @ v\n"
        ),
        "zoo._generate": ast.parse(
            "def run(model, h, keys, values):\n"
            "    for block in model.layers:\n"
            "        h = h + block.attention(block.attention_norm(h))\n"
            "    return h\n"
        ),
        "zoo.serve._programs": ast.parse("def step(q, k):\n    return apply_rope(q, k)\n"),
        "zoo.nn._linear": ast.parse("def softmax(x):\n    return x\n"),
    }
    found = "\n".join(_second_forward(copies))
    for expected in (
        "zoo.nn._cache:1 defines cached_attention",
        "calls a layer's part .q_proj",
        "zoo.nn._cache:3 calls softmax",
        "calls a layer's part .attention(",
        "calls a layer's part .attention_norm",
        "zoo.serve._programs:2 calls apply_rope",
        "zoo.nn._linear:1 defines softmax",
    ):
        assert expected in found, (expected, found)
    assert not _second_forward({"zoo._sampling": ast.parse("p = jax.nn.softmax(logits)")})

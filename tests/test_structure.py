"""The code's shape, read from its syntax tree: the command line (`zoo/_cli`) uses only the
library's public names (`zoo`, `zoo.train`, `zoo.internal`, ...), never a private module
(`zoo._x`, `zoo.train._x`); its own private modules are its business."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLI = ROOT / "zoo" / "_cli"


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
    for module in ("zoo", "zoo.train", "zoo.internal.parse_mesh", "zoo._cli._common", "zoo.train.RunConfig"):
        assert not _private(module), module
    source = CLI / "_common.py"
    resolved = {m for _, m in _imports(source)}
    assert {"zoo.internal.parse_mesh", "zoo.train.ConfigError"} <= resolved, resolved

"""A text-classification task made from real, offline text: which standard-library package
a docstring comes from."""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import sysconfig
from pathlib import Path

import numpy as np

# Packages present in every CPython >= 3.11 (no tkinter: some builds leave it out; no
# distutils or lib2to3: removed in 3.12/3.13), each with about 100 or more docstrings.
DOCSTRING_PACKAGES: tuple[str, ...] = (
    "asyncio",
    "email",
    "importlib",
    "logging",
    "xml",
    "multiprocessing",
    "http",
    "urllib",
)


@dataclasses.dataclass(frozen=True)
class TextClassification:
    """Texts with integer labels, split into train and test.

    **Fields:** `train_texts`, `test_texts` (lists of str), `train_labels`, `test_labels`
    (int32 arrays), `label_names` (label `i` is `label_names[i]`).
    """

    train_texts: list[str]
    train_labels: np.ndarray
    test_texts: list[str]
    test_labels: np.ndarray
    label_names: tuple[str, ...]

    @property
    def num_labels(self) -> int:
        """How many classes."""
        return len(self.label_names)

    def majority_accuracy(self) -> float:
        """Test accuracy of always predicting the most frequent training label."""
        majority = np.bincount(self.train_labels, minlength=self.num_labels).argmax()
        return float(np.mean(self.test_labels == majority))


def _first_paragraph(doc: str, max_chars: int) -> str:
    text = " ".join(doc.split("\n\n")[0].split())
    return text[:max_chars]


# Memoised: one process reads the same sources again for every run of the task.
@functools.cache
def _package_docstrings(folder: Path, min_chars: int, max_chars: int) -> tuple[str, ...]:
    texts = []
    for path in sorted(folder.rglob("*.py")):
        if any(part in ("test", "tests") for part in path.relative_to(folder).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    text = _first_paragraph(doc, max_chars)
                    if len(text) >= min_chars:
                        texts.append(text)
    return tuple(texts)


def stdlib_docstrings(
    packages: tuple[str, ...] = DOCSTRING_PACKAGES,
    *,
    test_fraction: float = 0.2,
    min_chars: int = 40,
    max_chars: int = 400,
) -> TextClassification:
    """Docstrings of the running Python's standard library, labelled by package.

    The first paragraph of every module, class and function docstring (whitespace
    collapsed, at least `min_chars`, cut at `max_chars`) in each package's sources, read
    with `ast` (nothing is imported or downloaded). Texts found in two packages are
    dropped, duplicates kept once. The split is by a hash of the text, so it is the same
    on every run and a text never lands on both sides.

    **Arguments:**

    - `packages`: standard-library package names, one class each.
    - `test_fraction`: share of the texts held out for testing.
    - `min_chars`, `max_chars`: length bounds of a text.

    **Returns:** a `TextClassification`.
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    found: dict[str, set[str]] = {}
    for name in packages:
        folder = stdlib / name
        if not (folder / "__init__.py").exists():
            raise ValueError(
                f"{name!r} is not a standard-library package of this Python ({stdlib}); "
                f"choose among packages with an __init__.py there, e.g. {list(DOCSTRING_PACKAGES)}"
            )
        found[name] = set(_package_docstrings(folder, min_chars, max_chars))
    seen_in: dict[str, int] = {}
    for texts in found.values():
        for text in texts:
            seen_in[text] = seen_in.get(text, 0) + 1
    split = {"train": ([], []), "test": ([], [])}
    for label, name in enumerate(packages):
        for text in sorted(found[name]):
            if seen_in[text] > 1:
                continue
            digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")
            side = "test" if digest / 2**64 < test_fraction else "train"
            split[side][0].append(text)
            split[side][1].append(label)
    # Shuffle deterministically so batches mix the classes.
    out = {}
    for side, (texts, labels) in split.items():
        order = np.random.default_rng(0).permutation(len(texts))
        out[side] = ([texts[i] for i in order], np.asarray(labels, np.int32)[order])
    return TextClassification(out["train"][0], out["train"][1], out["test"][0], out["test"][1], tuple(packages))

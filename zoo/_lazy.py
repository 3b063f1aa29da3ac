"""Package namespaces whose names import their modules when first read (PEP 562), and
classes given by import path (`resolve_class`), which the registries use the same way.

Every package of the zoo lists its public names by module instead of importing them:
`import zoo` loads no jax, so `zoo --help` and the command's usage errors answer at once,
and `zoo.TrainStep` imports its module the first time it is read (from then on it is an
ordinary attribute of the package). Each package's `if TYPE_CHECKING:` block imports the
same names for type checkers and editors; tests/test_structure.py holds the two equal.
The registries hold their built-in classes as import paths (`"zoo.models.Transformer"`)
for the same reason: listing them (the command's help) imports no model.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_names(
    namespace: str, modules: Mapping[str, tuple[str, ...]]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The `(__getattr__, __dir__)` of a package (or module) whose names are imported on
    first read.

    **Arguments:**

    - `namespace`: the package's (module's) `__name__`.
    - `modules`: each module, relative as its own imports would name it (`"._axes"`,
      `".train"`), → the names it gives. A submodule gives itself: `".train": ("train",)`.

    **Returns:** the module-level `__getattr__` (imports the name's module, keeps the value
    on the namespace, returns it; an `AttributeError` for a name not listed) and `__dir__`
    (the namespace's attributes and every listed name).
    """
    where = {name: module for module, names in modules.items() for name in names}

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {namespace!r} has no attribute {name!r}")
        home = sys.modules[namespace]
        module = importlib.import_module(where[name], home.__package__)
        value = module if where[name] == f".{name}" else getattr(module, name)
        setattr(home, name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[namespace])) | set(where))

    return __getattr__, __dir__


def resolve_class(value: type | str) -> type:
    """`value` if a class, else the class its import path names (`"zoo.models.Transformer"`:
    attribute `Transformer` of module `zoo.models`), imported now."""
    if not isinstance(value, str):
        return value
    module, _, name = value.rpartition(".")
    try:
        found = getattr(importlib.import_module(module), name, None) if module else None
    except ModuleNotFoundError as e:
        if not (e.name and (module == e.name or module.startswith(e.name + "."))):
            raise  # the module exists; something it imports is missing
        found = None
    if not isinstance(found, type):
        raise ImportError(f"{value!r} names no class: give a class or its import path (module.Name)")
    return found


def is_subclass(cls: type | str, base: type | str) -> bool:
    """Whether `cls` is `base` or a subclass of it, each a class or its import path. Two
    paths into the zoo itself compare as paths, importing nothing (none of the zoo's
    classes that registries name subclasses another; tests/test_registry.py holds it);
    anything else is compared as classes."""
    if cls == base:
        return True
    if isinstance(cls, str) and isinstance(base, str) and cls.startswith("zoo.") and base.startswith("zoo."):
        return False
    return issubclass(resolve_class(cls), resolve_class(base))

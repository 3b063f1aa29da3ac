"""The registered Hugging Face families, one file each (see `zoo/hf/_family.py` for the
interface). Importing this package imports, and so registers, every module in it, by
name: a new family is its file alone. The registration order (a module's imports first:
`gemma.py` registers Llama before Gemma) is the order `family_of` tries them in for
models without a `family`."""

import importlib
import pkgutil

for _module in sorted(info.name for info in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_module}")

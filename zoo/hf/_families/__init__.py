"""The registered Hugging Face families, one file each (see `zoo/hf/_family.py` for the
interface). Importing this package registers them; the order is the order `family_of`
tries them for models without a `family`."""

from . import bert, gemma, gpt2, llama, mistral, qwen2  # noqa: F401

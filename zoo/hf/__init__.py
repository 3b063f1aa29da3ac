"""Hugging Face interop without torch: load the checkpoints of every registered family
(`zoo.hf.families()`: BERT, GPT-2, Llama, …) into zoo models, placed straight onto a
mesh (a folder, or a Hub id fetched into the local cache: `zoo.hf.download`); write zoo models back as checkpoints transformers loads; fast tokenizers;
sentence-transformers embeddings (all-MiniLM-L6-v2 ships packaged).

```python
encoder = zoo.hf.from_pretrained("path/to/bert", rules=zoo.rules("fsdp"), mesh=mesh)
zoo.hf.save_pretrained(encoder, "out/")            # transformers.BertModel.from_pretrained("out/")
encoder, tokenizer = zoo.hf.load_minilm()
vectors = zoo.hf.sentence_embeddings(encoder, **tokenizer(["a sentence", "another one"]))
```

Every architecture is one `zoo.hf.Family` in its own file under `zoo/hf/_families/`
(the interface: `zoo/hf/_family.py`); `zoo.hf.families()` lists them.

See docs/models.md, "Loading Hugging Face weights" and "Adding a family".
"""

from typing import TYPE_CHECKING

from .._lazy import lazy_names
from . import _families  # noqa: F401 (registers the families: `families()` lists them)

__getattr__, __dir__ = lazy_names(
    __name__,
    {
        "._classifier": ("load_bert_classifier", "save_bert_classifier"),
        "._export": ("hf_tensors", "save_pretrained"),
        "._family": ("Family", "families", "family_of", "get_family", "register"),
        "._files": ("minilm_path",),
        "._hub": ("download", "resolve_model_dir"),
        "._load": ("from_pretrained",),
        "._sentence": ("load_minilm", "sentence_embeddings"),
        "._tokenizer": ("Tokenizer",),
    },
)

if TYPE_CHECKING:
    from ._classifier import load_bert_classifier, save_bert_classifier
    from ._export import hf_tensors, save_pretrained
    from ._family import Family, families, family_of, get_family, register
    from ._files import minilm_path
    from ._hub import download, resolve_model_dir
    from ._load import from_pretrained
    from ._sentence import load_minilm, sentence_embeddings
    from ._tokenizer import Tokenizer

__all__ = [
    "Family",
    "Tokenizer",
    "download",
    "families",
    "family_of",
    "from_pretrained",
    "get_family",
    "hf_tensors",
    "load_bert_classifier",
    "load_minilm",
    "minilm_path",
    "register",
    "resolve_model_dir",
    "save_bert_classifier",
    "save_pretrained",
    "sentence_embeddings",
]

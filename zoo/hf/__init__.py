"""Hugging Face interop without torch: load BERT and GPT-2 checkpoints into zoo models,
placed straight onto a mesh; write zoo models back as checkpoints transformers loads;
fast tokenizers; sentence-transformers embeddings (all-MiniLM-L6-v2 ships packaged).

```python
encoder = zoo.hf.from_pretrained("path/to/bert", rules=zoo.rules("fsdp"), mesh=mesh)
zoo.hf.save_pretrained(encoder, "out/")            # transformers.BertModel.from_pretrained("out/")
encoder, tokenizer = zoo.hf.load_minilm()
vectors = zoo.hf.sentence_embeddings(encoder, **tokenizer(["a sentence", "another one"]))
```

See docs/models.md, "Loading Hugging Face weights".
"""

from ._bert import encoder_config_from_hf, encoder_config_to_hf
from ._export import hf_tensors, save_pretrained
from ._files import minilm_path
from ._gpt2 import transformer_config_from_hf, transformer_config_to_hf
from ._classifier import load_bert_classifier
from ._load import from_pretrained, load_bert, load_gpt2
from ._sentence import load_minilm, sentence_embeddings
from ._tokenizer import Tokenizer

__all__ = [
    "Tokenizer",
    "encoder_config_from_hf",
    "encoder_config_to_hf",
    "from_pretrained",
    "hf_tensors",
    "load_bert",
    "load_bert_classifier",
    "load_gpt2",
    "load_minilm",
    "minilm_path",
    "save_pretrained",
    "sentence_embeddings",
    "transformer_config_from_hf",
    "transformer_config_to_hf",
]

"""Hugging Face RoBERTa and XLM-RoBERTa ↔ `zoo.models.Encoder` (`positions_after_pad`).

Their encoders are BERT's, tensor for tensor (`BERT_NAMES`), with two differences: the
base model of task-model files sits under `roberta.` (`RobertaForSequenceClassification`,
`RobertaForMaskedLM`; `XLMRoberta…` alike), and position ids count from the pad id
(transformers' `create_position_ids_from_input_ids`: real tokens `pad_token_id + 1, …`,
pad tokens `pad_token_id`), so `max_position_embeddings` is the longest sequence plus
`pad_token_id + 1` (514 for 512 tokens, pad id 1). XLM-RoBERTa (`model_type`
`"xlm-roberta"`: bge-m3, multilingual-e5) differs from RoBERTa only in its tokenizer
(Unigram rather than byte-level BPE), which `zoo.hf.Tokenizer` reads from
`tokenizer.json`. `from_pretrained` reads the encoder (an MLM head, `lm_head.*`, and a
classification head are task-head tensors, left out with a warning).

The sequence classifier's head (`RobertaClassificationHead`: the first token's state
through `classifier.dense`, tanh, then `classifier.out_proj`) is zoo's
`EncoderClassifier(pooling="cls")`: `pooler` = `classifier.dense`, `head` =
`classifier.out_proj` (`zoo.hf.load_bert_classifier` / `save_bert_classifier`). Its
dropout differs only in training (RoBERTa's also drops the first token's state before
`classifier.dense`); a `RobertaModel` folder gets a new pooler with the new head, as
`RobertaForSequenceClassification.from_pretrained` starts one.
"""

from __future__ import annotations

from .._family import register
from .bert import Bert


@register
class Roberta(Bert):
    """RoBERTa (`RobertaModel`; the `roberta.` part of task models) ↔ `zoo.models.Encoder`."""

    name = "roberta"
    architecture = "RobertaModel"
    prefix = "roberta."
    # No peft names for the cls-pooled classifier: peft's SEQ_CLS keeps RoBERTa's whole
    # `classifier` (dense and out_proj) as one module to save, which zoo's pooler + head do
    # not match; its adapters keep zoo's names (`zoo/hf/_peft.py`). The encoder's are BERT's.
    lora_task_modules = {}
    lora_absent = {
        "pooler.dense": (
            "RobertaModel's pooler.dense only computes pooler_output (the tanh of the first token's state), "
            "which zoo's Encoder does not compute; its hidden states (last_hidden_state) are unaffected"
        )
    }
    sequence_classifier = "RobertaForSequenceClassification"
    classifier_modules = {"pooler": ("classifier.dense",), "head": ("classifier.out_proj",)}
    new_pooler = True  # part of the task head: RobertaModel has none of it

    def claims(self, config):
        return isinstance(config, self.config_class) and config.positions_after_pad


@register
class XLMRoberta(Roberta):
    """XLM-RoBERTa (`XLMRobertaModel`; the `roberta.` part of task models) ↔ `zoo.models.Encoder`."""

    name = "xlm-roberta"
    architecture = "XLMRobertaModel"
    sequence_classifier = "XLMRobertaForSequenceClassification"

    def claims(self, config):
        return False  # a RoBERTa-shaped config without `family` is written as RoBERTa

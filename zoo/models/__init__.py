"""Zoo models: a decoder-only transformer LM and a BERT-style encoder, built from `zoo.nn`."""

from typing import TYPE_CHECKING

from .._lazy import lazy_names

__getattr__, __dir__ = lazy_names(
    __name__,
    {
        "._config": ("EncoderConfig", "TransformerConfig"),
        "._encoder": ("Encoder", "EncoderClassifier", "EncoderEmbeddings", "mean_pool"),
        "._grpo": ("GRPOLoss", "group_advantages", "reward_table"),
        "._cross_entropy": ("cross_entropy",),
        "._loss": ("classification_loss", "next_token_loss"),
        "._preference": ("PreferenceLoss",),
        "._transformer": ("Transformer",),
    },
)

if TYPE_CHECKING:
    from ._config import EncoderConfig, TransformerConfig
    from ._cross_entropy import cross_entropy
    from ._encoder import Encoder, EncoderClassifier, EncoderEmbeddings, mean_pool
    from ._grpo import GRPOLoss, group_advantages, reward_table
    from ._loss import classification_loss, next_token_loss
    from ._preference import PreferenceLoss
    from ._transformer import Transformer

__all__ = [
    "Encoder",
    "EncoderClassifier",
    "EncoderConfig",
    "EncoderEmbeddings",
    "GRPOLoss",
    "PreferenceLoss",
    "Transformer",
    "TransformerConfig",
    "classification_loss",
    "cross_entropy",
    "group_advantages",
    "mean_pool",
    "next_token_loss",
    "reward_table",
]

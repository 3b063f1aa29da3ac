"""Bounded resources, refused up front: a classifier's scores over sparse label ids cost
what its examples do (labels 0 and 1000000 asked numpy for 7.28 TiB), and an engine whose
cache or queue cannot fit in the memory free is refused before anything is allocated, in
one line naming the limit and a value that fits (`zoo serve --slots 100000` was killed by
the kernel with nothing on stderr)."""

import jax
import numpy as np
import pytest
from helpers import one_line_error, tiny_decoder

import zoo.serve
from zoo.serve._limits import cache_bytes, free_bytes
from zoo.train._scores import ALL_CLASSES_UP_TO, classification_scores


def test_scores_over_sparse_label_ids_are_those_of_the_labels_present():
    from sklearn.metrics import f1_score, precision_recall_fscore_support

    names = tuple(str(i) for i in range(1_000_001))  # integer labels 0 and 1000000: their own ids
    labels = np.array([0, 1_000_000, 1_000_000, 0, 1_000_000])
    predicted = np.array([0, 1_000_000, 0, 0, 17])
    scores = classification_scores(labels, predicted, names)
    present = [0, 17, 1_000_000]
    p, r, f, s = precision_recall_fscore_support(labels, predicted, labels=present, zero_division=0)
    assert list(scores["per_class"]) == ["0", "17", "1000000"]  # beyond ALL_CLASSES_UP_TO: those that occur
    for i, c in enumerate(present):
        got = scores["per_class"][str(c)]
        assert (got["precision"], got["recall"], got["f1"], got["support"]) == pytest.approx((p[i], r[i], f[i], s[i]))
    assert scores["macro_f1"] == pytest.approx(f1_score(labels, predicted, average="macro"))
    assert scores["accuracy"] == pytest.approx(3 / 5)


def test_a_small_label_set_still_lists_every_class():
    names = ("a", "b", "c", "d")
    scores = classification_scores([0, 1, 1], [0, 1, 2], names)
    assert list(scores["per_class"]) == list(names) and len(names) <= ALL_CLASSES_UP_TO
    assert scores["per_class"]["d"] == {"precision": 0.0, "recall": 0.0, "f1": 0.0, "support": 0}
    assert scores["macro_f1"] == pytest.approx((1 + 2 / 3 + 0) / 3)  # d occurs nowhere: not averaged


def _model():
    return tiny_decoder(jax.random.key(0), max_len=64)


def test_an_engine_whose_cache_cannot_fit_is_refused_before_allocating():
    model = _model()
    free = free_bytes(jax.devices()[0])
    assert free is not None
    slots = free // cache_bytes(model.config, 1, 64) + 1  # one slot more than fits
    fits = free // cache_bytes(model.config, 1, 64)
    with pytest.raises(MemoryError, match=rf"slots={slots:,} x max_len=64: the key/value cache needs .* at most"):
        zoo.serve.Engine(model, slots=int(slots), max_len=64)
    # The value it names fits (as computed; not allocated here).
    assert cache_bytes(model.config, int(fits), 64) <= free


def test_a_queue_that_cannot_fit_is_refused():
    with pytest.raises(MemoryError, match=r"max_queue=10,000,000,000,000: a full queue .* at most [\d,]+ fit"):
        zoo.serve.Engine(_model(), slots=1, max_len=64, max_queue=10**13)
    with pytest.raises(ValueError, match="max_queue must be an int >= 0 or None, got -1"):
        zoo.serve.Engine(_model(), slots=1, max_len=64, max_queue=-1)


def test_zoo_serve_refuses_huge_slots_in_one_line(tmp_path):
    import transformers
    from helpers import zoo_main

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    rc, _, err = zoo_main("serve", tmp_path, "--port", "0", "--slots", 10**12)
    one_line_error(rc, err, "slots=1,000,000,000,000 x max_len=64: the key/value cache needs")
    assert "(zoo serve --slots / --max-len)" in err

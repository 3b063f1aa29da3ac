"""The demo's task, `zoo.data.docstring_word_order`: deterministic, balanced, split by
module (no sentence on both sides), and a scrambled text holds exactly the words of a real
sentence in another order (the two halves swapped, or shuffled)."""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

import numpy as np
import pytest

import zoo
from zoo.data._word_order import _module_sentences

_MODULES = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


@pytest.fixture(scope="module")
def swapped():
    return zoo.data.docstring_word_order()


@pytest.fixture(scope="module")
def sentences():
    """Every sentence the task may use -> the sides ("train"/"test") of the modules holding it."""
    sides: dict[str, set[str]] = {}
    for path in _MODULES:
        digest = int.from_bytes(hashlib.sha256(path.name.encode()).digest()[:8], "little")
        for sentence in _module_sentences(path, 6, 20):
            sides.setdefault(sentence, set()).add("test" if digest / 2**64 < 0.2 else "train")
    return sides


def _rows(data):
    return [("train", data.train_texts, data.train_labels), ("test", data.test_texts, data.test_labels)]


def test_same_data_every_time(swapped):
    again = zoo.data.docstring_word_order()
    assert again.train_texts == swapped.train_texts and again.test_texts == swapped.test_texts
    np.testing.assert_array_equal(again.train_labels, swapped.train_labels)
    np.testing.assert_array_equal(again.test_labels, swapped.test_labels)
    other = zoo.data.docstring_word_order(seed=1)
    bags = [sorted(sorted(t.split()) for t in d.test_texts) for d in (other, swapped)]
    assert bags[0] == bags[1]  # the same sentences...
    assert other.test_texts != swapped.test_texts  # ...but the seed picks which are scrambled, and how


def test_labels_are_balanced(swapped):
    assert swapped.label_names == ("original", "swapped") and swapped.num_labels == 2
    assert len(swapped.train_texts) > 1000 and len(swapped.test_texts) > 200
    for _, _, labels in _rows(swapped):
        counts = np.bincount(labels, minlength=2)
        assert abs(counts[0] - counts[1]) <= 1, counts
    assert abs(swapped.majority_accuracy() - 0.5) < 0.01


def test_split_by_module_and_each_sentence_once(swapped, sentences):
    by_words = {tuple(sorted(s.split())): s for s in sentences}
    for side, texts, _ in _rows(swapped):
        # Sentences with the same words as another are left out: a text names one sentence.
        used = [by_words[tuple(sorted(t.split()))] for t in texts]
        assert len(set(used)) == len(texts)  # each sentence once, as written or scrambled
        # ...from a module on this side of the split and from none on the other.
        assert all(sentences[s] == {side} for s in used), side


@pytest.mark.parametrize("corruption", ["swap-halves", "shuffle"])
def test_label_1_texts_are_scrambled_sentences(corruption, swapped, sentences):
    data = swapped if corruption == "swap-halves" else zoo.data.docstring_word_order("shuffle", max_train=300)
    assert data.label_names[1] == {"swap-halves": "swapped", "shuffle": "shuffled"}[corruption]
    by_words = {tuple(sorted(s.split())): s.split() for s in sentences}
    for _, texts, labels in _rows(data):
        for text, label in zip(texts, labels):
            words, original = text.split(), by_words[tuple(sorted(text.split()))]
            assert text == text.lower()
            if label == 0:  # no final full stop or comma gives the sentence's end away
                assert not text.endswith((".", ",", "!", "?")), text
            assert (words == original) == (label == 0), (text, label)
            if corruption == "swap-halves" and label == 1:  # both halves keep two words or more
                assert any(original[k:] + original[:k] == words for k in range(2, len(words) - 1)), text


def test_max_train_and_bad_arguments():
    assert len(zoo.data.docstring_word_order(max_train=100).train_texts) == 100
    with pytest.raises(ValueError, match=r"choose one of \['swap-halves', 'shuffle'\]"):
        zoo.data.docstring_word_order("reverse")
    with pytest.raises(ValueError, match="at least 4 words"):
        zoo.data.docstring_word_order(min_words=3)

"""Runs that would learn nothing are refused where that is knowable: preference pairs whose
chosen and rejected completions train as one (no gradient), `--lora alpha=0` (every
adapter's output times 0), and non-finite LoRA settings, named as such (`alpha=nan` was
blamed on --lr once the loss went NaN)."""

import json

import pytest
from helpers import one_line_error, zoo_main

import zoo

SMALL_LM = ["--model-config", "d_model=32,num_layers=1", "--seq-len", "16", "--steps", "1"]


def _load(path, seq_len=16, **kwargs):
    from zoo.train._user_data import byte_tokenizer

    return zoo.data.load(path, byte_tokenizer(), seq_len=seq_len, **kwargs)[0]


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_identical_pairs_are_refused_with_their_count(tmp_path):
    pairs = [{"prompt": "q", "chosen": "a", "rejected": "b"}, {"prompt": "q", "chosen": "same", "rejected": "same"},
             {"prompt": "r", "chosen": "x", "rejected": "x"}]  # fmt: skip
    with pytest.raises(zoo.data.DataFormatError) as e:
        _load(_write(tmp_path / "p.jsonl", pairs))
    message = str(e.value)
    assert "p.jsonl line 2: chosen and rejected are the same, so the pair teaches nothing; 2 of the 3 pairs" in message
    assert "\n" not in message


def test_pairs_made_identical_by_the_cut_name_the_cut(tmp_path):
    pair = {"prompt": "abcdefghij", "chosen": "0123456789A", "rejected": "0123456789B"}
    with pytest.raises(zoo.data.DataFormatError, match="the same once cut to seq_len 12 \\(raise seq_len\\)"):
        _load(_write(tmp_path / "p.jsonl", [pair]), seq_len=12, max_prompt_len=4)


@pytest.mark.parametrize(
    ("lora", "message"),
    [
        ("alpha=0", "alpha=0 scales every adapter's output by 0, so the run would learn nothing; give alpha > 0"),
        ("alpha=nan", "alpha=nan is not a finite number"),
        ("alpha=inf", "alpha=inf is not a finite number"),
        ("dropout=nan", "dropout=nan is not a finite number"),
    ],
)
def test_lora_settings_that_learn_nothing_are_refused_in_one_line(lora, message):
    rc, _, err = zoo_main("inspect", "transformer", *SMALL_LM[:4], "--lora", lora)
    one_line_error(rc, err, message)
    assert "--lr" not in err


@pytest.mark.parametrize("alpha", [float("nan"), float("inf"), -float("inf")])
def test_lora_config_refuses_an_alpha_that_is_no_finite_number(alpha):
    with pytest.raises(ValueError, match="LoraConfig.lora_alpha must be a finite number"):
        zoo.lora.LoraConfig(lora_alpha=alpha)

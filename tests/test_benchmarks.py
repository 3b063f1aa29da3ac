"""What the benchmark scripts compute besides timing them: `benchmarks/_flops.py`'s model
FLOPs of a decoder against XLA's own count of the same program, and the MFU arithmetic
(`real_size.py --mfu`) against its peak table and `--peak-tflops`, and the weight matmuls
`--mfu` times alone against the FLOPs they stand for."""

import importlib.util
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
import transformers

import zoo

SPEC = importlib.util.spec_from_file_location("_flops", Path(__file__).parent.parent / "benchmarks" / "_flops.py")
flops = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(flops)

# XLA's cost analysis counts every elementwise op too (norms, RoPE, softmax, SiLU, the
# loss), which the model FLOPs leave out, and a LoRA step's first layer gets no input
# gradient (the frozen embedding needs none): 1-2% apart at this shape. Each term the
# formula counts is over 10% of the total here (attention's score and value matmuls and
# the head ~15% each), so a term wrong by 2x misses by more than the tolerance.
TOLERANCE = 0.05
BATCH, SEQ, RANK = 2, 128, 8


def _llama(layers: int = 2) -> dict:
    """A tiny Llama `config.json` (GQA 4/2, untied head) as transformers writes it."""
    return transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    ).to_dict()


def _xla_flops(fn, *args) -> float:
    return float(jax.jit(fn).lower(*args).compile().cost_analysis()["flops"])


@pytest.fixture(scope="module")
def unrolled():
    """The zoo model of `_llama()` (remat off) with its layers unrolled: XLA's cost analysis
    counts a loop's body once on CPU, so a `lax.scan` of the layers would count one layer."""
    config = zoo.hf.get_family("llama").config_from_hf(_llama(), remat=None)
    model = zoo.models.Transformer(config, key=jax.random.key(0))
    return eqx.tree_at(lambda m: m.layers, model, model.layers.unstack())


def _within(measured: float, formula: float) -> None:
    assert abs(measured / formula - 1) < TOLERANCE, f"XLA {measured:.4g} vs formula {formula:.4g}"


def test_forward_and_full_step_flops_agree_with_xla(unrolled):
    tokens = jnp.zeros((BATCH, SEQ), jnp.int32)
    params, static = eqx.partition(unrolled, eqx.is_array)

    def loss(params, tokens):
        return jnp.mean(eqx.combine(params, static)(tokens) ** 2)

    forward = _xla_flops(lambda p, t: eqx.combine(p, static)(t), params, tokens)
    _within(forward, flops.forward_flops(_llama(), BATCH, SEQ))
    _within(_xla_flops(jax.grad(loss), params, tokens), flops.step_flops(_llama(), BATCH, SEQ))


def test_lora_step_flops_agree_with_xla(unrolled):
    """Frozen weights: forward and activation gradients only; the branches trained."""
    config = zoo.lora.LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules="all-linear")
    model = zoo.lora.add_lora(unrolled, config, key=jax.random.key(1))
    trained, frozen = eqx.partition(model, zoo.lora.trainable(model, config))
    trained, static = eqx.partition(trained, eqx.is_array)
    frozen, frozen_static = eqx.partition(frozen, eqx.is_array)
    lora = sum(x.size for x in jax.tree.leaves(trained))
    assert lora == flops.lora_params(_llama(), RANK)

    def loss(trained, frozen, tokens):
        return jnp.mean(eqx.combine(trained, static, frozen, frozen_static)(tokens) ** 2)

    measured = _xla_flops(jax.grad(loss), trained, frozen, jnp.zeros((BATCH, SEQ), jnp.int32))
    _within(measured, flops.step_flops(_llama(), BATCH, SEQ, lora_rank=RANK))


def test_the_step_flops_grow_with_layers_tokens_and_rank_as_documented():
    one, two = _llama(1), _llama(2)
    assert flops.step_flops(two, BATCH, SEQ) - flops.step_flops(one, BATCH, SEQ) == pytest.approx(
        flops.step_flops(one, BATCH, SEQ) - 3 * 2 * flops.matmul_params(one)[1] * BATCH * SEQ
    )  # a layer more adds one layer's share; the head's is counted once
    assert flops.step_flops(two, 2 * BATCH, SEQ) == 2 * flops.step_flops(two, BATCH, SEQ)
    lora, wider = (flops.step_flops(two, BATCH, SEQ, lora_rank=r) for r in (RANK, 2 * RANK))
    assert wider - lora == 6 * flops.lora_params(two, RANK) * BATCH * SEQ  # twice the rank: twice the branches
    assert lora < flops.step_flops(two, BATCH, SEQ)


@pytest.mark.parametrize("lora", [True, False])
def test_the_weight_matmuls_are_the_step_flops_weight_term_in_shapes_that_multiply(lora):
    """`real_size.py --mfu` times these shapes alone: their FLOPs must be the weights'
    share of `step_flops` (4·N·T with LoRA, 6·N·T without), and each entry's operands must
    multiply in its form to `[m, n]`."""
    config = _llama()
    entries = flops.weight_matmuls(config, BATCH, SEQ, lora=lora)
    per_layer, head = flops.matmul_params(config)
    weights = 2 * (config["num_hidden_layers"] * per_layer + head) * BATCH * SEQ
    assert sum(2 * m * k * n * count for m, k, n, _, count in entries) == (2 if lora else 3) * weights
    assert {form for *_, form, _ in entries} == ({"nn", "nt"} if lora else {"nn", "nt", "tn"})
    for m, k, n, form, _ in entries:
        a, b = flops.matmul_operands(m, k, n, form)
        assert flops.multiply(jnp.zeros(a), jnp.zeros(b), form).shape == (m, n)


# device_kind strings as jax reports them.
KINDS = {
    "NVIDIA H100 80GB HBM3": "nvidia h100 (80gb hbm3|sxm.*)",
    "NVIDIA H100 PCIe": "nvidia h100 pcie",
    "NVIDIA H200": "nvidia h200( 141gb hbm3e)?",
    "NVIDIA A100-SXM4-80GB": "nvidia a100.*",
    "NVIDIA A100-PCIE-40GB": "nvidia a100.*",
    "NVIDIA L4": "nvidia l4",
    "TPU v4": "tpu v4",
    "TPU v5 lite": "tpu v5 lite|tpu v5e",
    "TPU v5": "tpu v5|tpu v5p",
    "TPU v6 lite": "tpu v6 lite|tpu v6e",
}


def test_the_peak_is_the_device_kinds_row_in_the_runs_arithmetic():
    for kind, row in KINDS.items():
        assert flops.peak_tflops(kind, "bf16") == flops.PEAKS[row]["bf16"], kind
    assert flops.peak_tflops("NVIDIA H100 PCIe", "fp32") < flops.peak_tflops("NVIDIA H100 80GB HBM3", "fp32")
    assert flops.peak_tflops("NVIDIA A100-SXM4-40GB", "tf32") == flops.PEAKS["nvidia a100.*"]["tf32"]
    # No peak known: a CPU, an unlisted accelerator (L40S is not an L4), float32 on a TPU.
    assert flops.peak_tflops("cpu", "fp32") is None
    assert flops.peak_tflops("NVIDIA L40S", "bf16") is None
    assert flops.peak_tflops("TPU v4", "fp32") is None
    # --peak-tflops wins, known device or not.
    assert flops.peak_tflops("cpu", "fp32", override=1.5) == 1.5
    assert flops.peak_tflops("NVIDIA H100 80GB HBM3", "bf16", override=1.5) == 1.5


def test_the_arithmetic_follows_the_dtype_and_the_frameworks_float32_setting():
    assert flops.matmul_arithmetic("bfloat16", "gpu", None) == "bf16"
    assert flops.matmul_arithmetic("float32", "gpu", None) == "tf32"  # jax's default on GPUs
    assert flops.matmul_arithmetic("float32", "tpu", None) == "bf16"
    assert flops.matmul_arithmetic("float32", "cpu", None) == "fp32"
    assert flops.matmul_arithmetic("float32", "gpu", "highest") == "fp32"  # torch's default
    assert flops.matmul_arithmetic("float32", "gpu", "high") == "tf32"


def test_mfu_is_the_achieved_rate_over_the_peak():
    step = flops.step_flops(_llama(), BATCH, SEQ, lora_rank=RANK)
    peak = flops.peak_tflops("NVIDIA H100 80GB HBM3", "bf16")
    achieved, mfu = flops.utilisation(step, 0.5, peak)
    assert achieved == pytest.approx(step / 0.5 / 1e12)
    assert mfu == pytest.approx(achieved / peak)
    assert flops.utilisation(step, 0.5, None) == (achieved, None)


def _real_size():
    """`benchmarks/real_size.py` as a module (it imports its sibling `_flops`)."""
    import sys

    benchmarks = Path(__file__).parent.parent / "benchmarks"
    sys.path.insert(0, str(benchmarks))
    try:
        spec = importlib.util.spec_from_file_location("real_size", benchmarks / "real_size.py")
        real_size = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(real_size)
    finally:
        sys.path.remove(str(benchmarks))
    return real_size


def test_zoos_time_to_the_first_step_runs_to_its_training_loop(tmp_path, monkeypatch):
    """`real_size.py` times zoo's first step from the process's start to the training
    loop's, as torch's from its start: the run's own stages (load, first evaluation,
    compile, in its summary.json) lie between the two times it reads, and what the CLI
    does before the run's clock starts is counted with the imports, not left out."""
    import json
    import time

    import zoo.train._run as run_module
    from zoo.train import DataConfig, RunConfig, Trainer

    real_size = _real_size()
    monkeypatch.setattr(run_module, "_run", run_module._run)  # put back after the test
    monkeypatch.setattr(Trainer, "run", Trainer.run)
    entered = real_size._entry_times()
    before = time.perf_counter()
    out = tmp_path / "run"
    data = DataConfig(eval_size=8)
    zoo.train.run(RunConfig(model="mlp", steps=2, devices=1, batch_size=8, data=data, quiet=True, output=str(out)))
    seconds = json.loads((out / "summary.json").read_text())["seconds"]
    assert before < entered["run"] < entered["loop"] < time.perf_counter()
    stages = seconds["load"] + seconds["evaluate_before"] + seconds["compile"]
    assert entered["loop"] - entered["run"] >= stages > 0, (entered, seconds)


def test_the_docs_real_size_commands_parse(capsys):
    """Every command `python benchmarks/real_size.py ...` of README.md, docs/*.md and the
    script's own docstring (a line of its own in the shell blocks, or quoted in prose
    between backticks, over a line break or not) is taken by the script's parser, its
    combinations checked (`real_size.parse`), without running it: a flag renamed or
    dropped fails here, not in a reader's terminal."""
    import re
    import shlex

    root = Path(__file__).parent.parent
    real_size = _real_size()
    docs = [root / "README.md", *sorted((root / "docs").glob("*.md")), root / "benchmarks" / "real_size.py"]
    lines = [
        line.split("benchmarks/real_size.py", 1)[1]
        for doc in docs
        for line in doc.read_text().splitlines()
        if line.strip().startswith("python benchmarks/real_size.py")
    ]
    quoted = [rest for doc in docs for rest in re.findall(r"`python benchmarks/real_size\.py([^`]*)`", doc.read_text())]
    assert len(lines) >= 10 and len(quoted) >= 5
    lines += quoted
    for rest in lines:
        argv = shlex.split(rest, comments=True)
        try:
            real_size.parse(argv)
        except SystemExit as e:
            pytest.fail(f"`python benchmarks/real_size.py {shlex.join(argv)}` is refused (exit {e.code})")
    # What it cannot run is one usage line naming the fix.
    for argv, message in (
        (["--repeat", "0"], "give 1 or more runs"),
        (["--repeat", "2", "--load"], "drop one"),
        (["--mfu", "--remat", "none,projections"], "--mfu reads the side by side"),
    ):
        with pytest.raises(SystemExit) as exit_:
            real_size.parse(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and message in err.splitlines()[-1], err


def test_the_side_by_side_prints_each_sides_evaluation_before_the_first_step(capsys):
    """Both sides of `real_size.py` evaluate the held-out windows before their first step
    (zoo's run always does; torch's side as `eval_on_start=True` would): the report prints
    the two held-out losses and each side's time to the first step less that evaluation,
    per run and, with `--repeat`, their ratios."""
    real_size = _real_size()
    args = real_size.parse(["--size", "small", "--steps", "3"])

    def side(first_step, evaluation, loss):
        parts = {"imports": 1.0, "load": 1.0, "evaluate_before": evaluation}
        return {"step_s": [3.0, 2.0, 2.0], "first_loss": 10.5, "held_out_loss": loss, "peak_mb": 100.0,
                "first_step_s": first_step, "parts": parts}  # fmt: skip

    zoo, torch = side(12.0, 5.0, 10.583450), side(9.0, 5.0, 10.583451)
    real_size.report(args, zoo, torch, "2.0")
    out = capsys.readouterr().out
    assert "loss 10.583450 / 10.583451 (|diff| 1.0e-06)" in out
    assert "less each side's evaluation: 7.0 / 4.0 s (1.75x)" in out
    real_size.report_repeats([{"zoo": zoo, "torch": torch}, {"zoo": side(10.0, 4.0, 1.0), "torch": torch}])
    out = capsys.readouterr().out
    assert "first step  1.33, 1.11 (median 1.22)" in out
    assert "less each side's evaluation  1.75, 1.50 (median 1.62)" in out
    # --no-eval-before: neither side evaluated (zoo's summary.json has no eval_before).
    real_size.report(args, side(7.0, 0.0, None), side(4.0, 0.0, None), "2.0")
    assert "neither side evaluated before its first step (--no-eval-before)" in capsys.readouterr().out
    assert real_size.parse(["--no-eval-before"]).no_eval_before


def test_each_side_starts_from_the_folders_files_read_into_the_page_cache(tmp_path, monkeypatch):
    """`real_size.py` reads the model folder's files just before each side's process starts
    (`warm`): zoo reads its weights before its first step, torch maps them and reads them
    during it, so a file the other side pushed out of the cache would make one side's time
    to the first step a disk's."""
    real_size = _real_size()
    (tmp_path / "model.safetensors").write_bytes(b"w" * (3 << 20))
    (tmp_path / "config.json").write_text("{}")
    read = []
    real_open = open

    def recording_open(path, *args, **kwargs):
        f = real_open(path, *args, **kwargs)
        read.append(Path(path).name)
        return f

    monkeypatch.setattr(real_size, "open", recording_open, raising=False)
    calls = []
    monkeypatch.setattr(real_size, "_worker", lambda worker: calls.append(("run", worker, list(read))) or {})
    assert real_size._warm_worker("torch", tmp_path) == {}
    assert calls == [("run", "torch", ["config.json", "model.safetensors"])]

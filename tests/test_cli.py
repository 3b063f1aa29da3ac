"""`python -m zoo`: inspect's table and JSON (mlp, transformer, encoder), errors as one line, and the demo (slow)."""

import json
import subprocess
import sys

import pytest


def run_zoo(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "zoo", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def inspect_json():
    proc = run_zoo("inspect", "mlp", "--devices", "8", "--microbatches", "4", "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_inspect_json_reports_one_all_reduce_outside(inspect_json):
    out = inspect_json
    for key in ("model", "devices", "microbatches", "mesh", "param_bytes", "trainable_bytes", "collectives"):
        assert key in out
    assert out["mesh"] == {"data": 8} and out["devices"] == 8 and out["microbatches"] == 4
    (coll,) = out["collectives"]
    assert set(coll) >= {"kind", "in_loop", "bytes", "mesh_axes", "op_name"}
    assert coll["kind"] == "all-reduce" and coll["in_loop"] is False and coll["mesh_axes"] == ["data"]
    assert coll["bytes"] == out["trainable_bytes"] + 4
    assert out["summary"]["all_reduce_in_loop"] == 0 and out["summary"]["all_reduce_outside"] == 1


def test_inspect_table_shard_map_and_custom_mesh():
    proc = run_zoo("inspect", "mlp", "--devices", "4", "--mesh", "data=2", "--microbatches", "2", "--mode", "shard_map")
    assert proc.returncode == 0, proc.stderr
    assert "mesh {'data': 2}" in proc.stdout
    assert "all-reduces: 0 inside loops, 1 outside" in proc.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["inspect", "mlp", "--devices", "2", "--mesh", "data=4"], "needs 4 devices but only 2"),
        (["inspect", "mlp", "--devices", "2", "--mesh", "data4"], "write it as name=size"),
        (["inspect", "transformerx", "--devices", "2"], "unknown model 'transformerx'"),
        (["inspect", "mlp", "--devices", "2", "--rules", "zz"], "unknown --rules 'zz'"),
        (["inspect", "mlp", "--devices", "2", "--batch-size", "6"], "not divisible by data-parallel size 2 x microbatches 4"),
        (["inspect", "transformer", "--mesh", "data=8", "--rules", "tp"], "lacks 'model'"),
    ],
)
def test_bad_input_is_one_readable_line(args, message):
    proc = run_zoo(*args)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_help_lists_the_flags():
    proc = run_zoo("inspect", "--help")
    for flag in ("--devices", "--microbatches", "--mesh", "--rules", "--mode", "--batch-size", "--lora", "--json"):
        assert flag in proc.stdout
    text = " ".join(proc.stdout.split())  # argparse wraps lines
    for choice in ("mlp", "transformer", "encoder", "dp", "fsdp", "fsdp-once", "tp", "fsdp+tp"):
        assert choice in text


# The transformer models compile in-process: the pytest process already has 8 CPU devices
# (conftest) and the jax caches are shared, which keeps each test to one tiny step's compile.


def inspect_in_process(capsys, *args):
    from zoo._cli import main

    rc = main(["inspect", *args, "--json"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    return json.loads(captured.out)


def test_inspect_transformer_tp_keeps_one_data_all_reduce(capsys):
    """tp's in-loop all-reduces are its own, over `model`; the gradient's is the one over `data`."""
    out = inspect_in_process(capsys, "transformer", "--mesh", "data=4,model=2", "--rules", "tp")
    assert out["model"] == "transformer" and out["mesh"] == {"data": 4, "model": 2} and out["rules"] == "tp"
    outside = [c for c in out["collectives"] if not c["in_loop"]]
    inside = [c for c in out["collectives"] if c["in_loop"]]
    assert [(c["kind"], c["mesh_axes"]) for c in outside] == [("all-reduce", ["data"])]
    assert inside and all(c["mesh_axes"] == ["model"] for c in inside)
    summary = out["summary"]
    assert summary["all_reduce_outside"] == 1 and summary["in_loop_mesh_axes"] == ["model"]
    assert summary["outside_mesh_axes"] == ["data"] and summary["collectives_in_loop"] == len(inside)


def test_inspect_encoder_dp_reduces_trainable_bytes_once(capsys):
    out = inspect_in_process(capsys, "encoder", "--rules", "dp")
    assert out["mesh"] == {"data": 8} and out["param_bytes"] == out["trainable_bytes"] > 0
    (coll,) = out["collectives"]
    assert coll["kind"] == "all-reduce" and coll["in_loop"] is False and coll["mesh_axes"] == ["data"]
    assert 0 < coll["bytes"] - out["trainable_bytes"] <= 8  # + the loss (and weight) scalars
    assert out["summary"]["collectives_in_loop"] == 0 and out["summary"]["in_loop_mesh_axes"] == []


def test_inspect_transformer_fsdp_once_gathers_outside_loops(capsys):
    """`fsdp-once` brings `gather="once"`: every all-gather is hoisted out of the microbatch loop."""
    out = inspect_in_process(capsys, "transformer", "--rules", "fsdp-once")
    summary = out["summary"]
    assert summary["collectives_in_loop"] == 0 and summary["in_loop_mesh_axes"] == []
    assert summary["all_gather_outside"] > 0 and summary["all_gather_in_loop"] == 0
    assert summary["all_reduce_outside"] == 1 and summary["outside_mesh_axes"] == ["data"]


def test_inspect_transformer_lora_reduces_only_the_adapters(capsys):
    """`--lora`: the step's one all-reduce carries the LoRA A/B gradients (+ loss scalars),
    whose bytes the test counts itself on an abstract model built the same way."""
    import equinox as eqx
    import jax
    import jax.random as jr

    import zoo
    from zoo._cli import _TRANSFORMER

    out = inspect_in_process(capsys, "transformer", "--lora", "r=4,alpha=8")
    base = jax.eval_shape(lambda k: zoo.models.Transformer(zoo.models.TransformerConfig(**_TRANSFORMER), key=k), jr.key(0))
    config = zoo.lora.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    lora_model = eqx.filter_eval_shape(zoo.lora.add_lora, base, config, key=jr.key(1))
    leaves = jax.tree_util.tree_leaves_with_path(lora_model)
    lora_bytes = sum(
        x.size * x.dtype.itemsize for path, x in leaves if jax.tree_util.keystr(path).endswith(("lora_A", "lora_B"))
    )
    assert lora_bytes == 2 * 2 * (32 * 4 + 4 * 32) * 4  # 2 layers x (q, v) x (A + B) in float32
    assert out["trainable_bytes"] == out["adapter_bytes"] == lora_bytes
    assert out["param_bytes"] > 10 * lora_bytes
    assert out["lora"]["r"] == 4 and out["lora"]["lora_alpha"] == 8 and out["lora"]["scaling"] == 2.0
    assert [n.split(".")[-1] for n in out["lora"]["adapted_modules"]] == ["q_proj", "v_proj"]
    (coll,) = out["collectives"]
    assert coll["kind"] == "all-reduce" and coll["in_loop"] is False and coll["mesh_axes"] == ["data"]
    assert 0 < coll["bytes"] - out["trainable_bytes"] <= 8  # + the loss (and weight) scalars
    assert out["summary"]["all_reduce_outside"] == 1 and out["summary"]["all_reduce_in_loop"] == 0


def test_bad_lora_is_one_readable_line(capsys):
    """A bad key or value names the accepted keys; a target matching nothing gets zoo's
    error, which lists the model's Linear layers. Exit 2, one line."""
    from zoo._cli import main

    for lora, message in [
        ("r=4,beta=2", "unknown key 'beta'"),
        ("r=four", "r must be a positive integer"),
        ("r=4,targets=qproj", "match no Linear layer"),
    ]:
        assert main(["inspect", "transformer", "--lora", lora]) == 2, lora
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        listed = "layers.layers.attention.q_proj" if "match no" in message else "keys: r, alpha, dropout, targets"
        assert listed in err, err


@pytest.mark.slow
def test_demo_trains_and_shows_one_all_reduce():
    """What `make demo` runs, end to end."""
    proc = run_zoo("demo", timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "loss fell: yes" in proc.stdout
    assert "all-reduces: 0 inside loops, 1 outside" in proc.stdout


@pytest.mark.slow
def test_readme_example_runs():
    """examples/quickstart.py is the README's Python example, verbatim."""
    proc = subprocess.run([sys.executable, "examples/quickstart.py"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "all-reduces: 0 inside loops, 1 outside" in proc.stdout


# `zoo info`: the model's leaf table, in-process (builds and annotates the model, compiles no step).


def info_in_process(capsys, *args):
    from zoo._cli import main

    rc = main(["info", *args, "--json"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    return json.loads(captured.out)


def test_info_transformer_leaves_axes_and_tp_bytes_per_device(capsys):
    import math

    out = info_in_process(capsys, "transformer")
    leaves, totals = out["leaves"], out["totals"]
    assert leaves and totals["leaves"] == len(leaves)
    assert sum(leaf["bytes"] for leaf in leaves) == totals["bytes"] > 0
    assert sum(leaf["parameters"] for leaf in leaves) == totals["parameters"]
    for leaf in leaves:
        assert len(leaf["logical_axes"]) == len(leaf["shape"]) == len(leaf["spec"]), leaf
        assert leaf["bytes"] == math.prod(leaf["shape"]) * 4 and leaf["dtype"] == "float32"
    assert all(leaf["trainable"] for leaf in leaves) and totals["trainable_bytes"] == totals["bytes"]
    assert totals["bytes_per_device"] == totals["bytes"]  # dp: everything replicated

    tp = info_in_process(capsys, "transformer", "--rules", "tp", "--mesh", "data=4,model=2")
    assert tp["mesh"] == {"data": 4, "model": 2} and tp["rules"] == "tp"
    (q,) = [leaf for leaf in tp["leaves"] if leaf["path"] == "model.layers.layers.attention.q_proj.weight"]
    heads = q["logical_axes"].index("heads")
    assert q["spec"][heads] == "model" and all(e is None for i, e in enumerate(q["spec"]) if i != heads)
    assert q["bytes_per_device"] * 2 == q["bytes"]
    assert tp["totals"]["bytes"] == totals["bytes"] > tp["totals"]["bytes_per_device"]
    assert tp["totals"]["bytes_per_device"] == sum(leaf["bytes_per_device"] for leaf in tp["leaves"])


def test_info_transformer_lora_trains_only_the_adapters(capsys):
    import equinox as eqx
    import jax
    import jax.random as jr

    import zoo
    from zoo._cli import _TRANSFORMER

    out = info_in_process(capsys, "transformer", "--lora", "r=4")
    base = jax.eval_shape(lambda k: zoo.models.Transformer(zoo.models.TransformerConfig(**_TRANSFORMER), key=k), jr.key(0))
    config = zoo.lora.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    lora_model = eqx.filter_eval_shape(zoo.lora.add_lora, base, config, key=jr.key(1))
    expected = {
        zoo._axes.path_str(path): x.size * x.dtype.itemsize
        for path, x in jax.tree_util.tree_leaves_with_path(lora_model)
        if jax.tree_util.keystr(path).endswith(("lora_A", "lora_B"))
    }
    assert sum(expected.values()) == 2 * 2 * (32 * 4 + 4 * 32) * 4  # 2 layers x (q, v) x (A + B) in float32
    trainable = {leaf["path"]: leaf["bytes"] for leaf in out["leaves"] if leaf["trainable"]}
    assert trainable == expected
    assert all(p.endswith(("lora_A", "lora_B")) for p in trainable)
    assert out["totals"]["trainable_bytes"] == sum(expected.values())
    assert out["totals"]["trainable_parameters"] == sum(expected.values()) // 4
    assert out["totals"]["bytes"] > 10 * out["totals"]["trainable_bytes"]
    assert out["lora"]["r"] == 4


def test_info_bad_input_is_one_readable_line(capsys):
    from zoo._cli import main

    for args, message in [
        (["transformer", "--rules", "tp", "--mesh", "data=8"], "lacks 'model'"),
        (["transformerx"], "unknown model 'transformerx'"),
        (["mlp", "--mesh", "data4"], "write it as name=size"),
        (["transformer", "--lora", "r=4,beta=2"], "unknown key 'beta'"),
    ]:
        assert main(["info", *args]) == 2, args
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err

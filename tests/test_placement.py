"""Placing a checkpoint's tensors on devices (zoo/hf/_place.py): every stack of layers made
and written by two compiled programs, torch's `[out, in]` weights transposed exactly by one
thread or several (a forked process too), and what is read becoming a CPU device's buffer
without a copy."""

import os
import time

import equinox as eqx
import jax
import numpy as np
import pytest
import safetensors.numpy
from helpers import backend_compiles, data_mesh, preset_mesh
from jax.sharding import NamedSharding

import zoo
from zoo.hf import from_pretrained


def _leaves(model):
    return jax.tree.leaves(eqx.filter(model, eqx.is_array))


@pytest.mark.parametrize("preset", ["dp", "tp"])
def test_every_stack_of_layers_is_placed_by_two_programs(llama_dir, preset):
    """The stacks of layers are made and written layer by layer by two compiled programs
    together, not two per leaf shape (each ~25 ms to compile on a CPU; a 0.4B Llama has
    seven shapes), with the same values and shardings as the file's tensors."""
    zoo.hf._place._zero_stacks.cache_clear()  # compiled afresh, as in a new process
    zoo.hf._place._put_layers.cache_clear()
    mesh = data_mesh(2) if preset == "dp" else preset_mesh("tp", 2)
    with backend_compiles() as names:
        model = from_pretrained(llama_dir, rules=zoo.rules(preset), mesh=mesh)
    stacks = {x.shape for x in jax.tree.leaves(eqx.filter(model.layers.layers, eqx.is_array))}
    assert len(stacks) == 5  # q/o, k/v, gate/up, down, the norms: 10 programs placed leaf by leaf
    # (the skeleton's key and stage programs aside: compiled once a process)
    assert [n for n in names if n not in ("jit(stage)", "jit(_threefry_seed)")] == [
        "jit(zero_stacks)",
        "jit(put_layers)",
    ]
    specs = zoo.partition_specs(model, zoo.rules(preset), mesh)
    for leaf, spec in zip(_leaves(model), jax.tree.leaves(specs), strict=True):
        assert leaf.sharding == NamedSharding(mesh, spec)
    file = safetensors.numpy.load_file(str(llama_dir / "model.safetensors"))
    down = np.asarray(model.layers.layers.mlp.down.weight)  # zoo's [layers, in, out], torch's [out, in] per layer
    for i in range(down.shape[0]):
        np.testing.assert_array_equal(down[i], file[f"model.layers.{i}.mlp.down_proj.weight"].T)


@pytest.mark.parametrize("preset", ["dp", "tp"])
def test_a_stacks_layers_are_read_into_the_same_host_arrays(tmp_path, preset, monkeypatch):
    """Each part of a stack (one per shard a device holds) is read into one of two host
    arrays that the layers take in turn (fresh memory per layer cost ~1 s at 1B: mapped and
    zero-filled by the kernel each time), an array refilled only once the layer read into
    it is placed: every layer's values are the file's, tensor-parallel shards of one shape
    kept apart."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=5,
                                      num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    made = []
    aligned_empty = zoo.hf._place._aligned_empty

    def recording(shape, dtype, alignment=64):
        made.append(tuple(shape))
        return aligned_empty(shape, dtype, alignment)

    monkeypatch.setattr(zoo.hf._place, "_aligned_empty", recording)
    mesh = data_mesh(2) if preset == "dp" else preset_mesh("tp", 2)
    model = from_pretrained(tmp_path, rules=zoo.rules(preset), mesh=mesh)
    stacks = _leaves(model.layers.layers)
    parts = sum(len({str(i) for i in x.sharding.devices_indices_map(x.shape).values()}) for x in stacks)
    assert parts >= len(stacks) + (preset == "tp")
    assert len([shape for shape in made if shape[0] == 1]) == 2 * parts  # two sets, not five
    file = safetensors.numpy.load_file(str(tmp_path / "model.safetensors"))
    layers = model.layers.layers
    for name, leaf in (("mlp.down_proj", layers.mlp.down), ("self_attn.q_proj", layers.attention.q_proj)):
        for i, layer in enumerate(np.asarray(leaf.weight)):
            np.testing.assert_array_equal(layer, file[f"model.layers.{i}.{name}.weight"].T)


@pytest.mark.parametrize("shape", [(3, 5), (1, 300, 700), (2, 1100, 2000)])
def test_a_transposed_weight_is_copied_exactly_by_one_thread_or_several(shape, monkeypatch):
    """The loader's copy of a torch `[out, in]` weight into zoo's `[in, out]` gives every
    value once, whether it is small (the loading thread alone) or large (split by rows into
    whole tiles over threads; rows that are not a whole number of tiles too)."""
    spans = []
    copy_tiles = zoo.hf._place._copy_tiles

    def recording(out, value, start, stop, tile):
        spans.append((start, stop))
        return copy_tiles(out, value, start, stop, tile)

    monkeypatch.setattr(zoo.hf._place, "_copy_tiles", recording)
    monkeypatch.setattr(zoo.hf._place, "_COPY_THREADS", 3)
    file = np.random.default_rng(0).standard_normal((*shape[:-2], shape[-1], shape[-2])).astype(np.float32)
    value = np.swapaxes(file, -1, -2)  # as the loader reads it: a transposed view
    out = zoo.hf._place._copy_into(np.empty(value.shape, np.float32), value)
    np.testing.assert_array_equal(out, value)
    rows = sorted(spans)
    assert rows[0][0] == 0 and rows[-1][1] == shape[-2] and all(a[1] == b[0] for a, b in zip(rows, rows[1:]))
    assert len(spans) == (1 if np.prod(shape) < 1 << 20 else 3), spans


def test_a_forked_process_copies_large_weights_with_threads_of_its_own(monkeypatch):
    """A process forked after the loader's copy threads started has none of them: it
    starts its own instead of queueing work for threads that are not there (and hanging)."""
    monkeypatch.setattr(zoo.hf._place, "_COPY_THREADS", 3)
    value = np.swapaxes(np.random.default_rng(0).standard_normal((2000, 1100)).astype(np.float32), 0, 1)
    zoo.hf._place._copy_into(np.empty(value.shape, np.float32), value)  # the parent's threads
    child = os.fork()
    if child == 0:  # pragma: no cover (the child exits with the comparison's result)
        out = zoo.hf._place._copy_into(np.empty(value.shape, np.float32), value)
        os._exit(0 if np.array_equal(out, value) else 1)
    deadline = time.monotonic() + 60
    while (done := os.waitpid(child, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(child, 9)
        os.waitpid(child, 0)
    assert done[0] == child and os.waitstatus_to_exitcode(done[1]) == 0, "the forked copy hung or differed"


def test_the_loaders_host_arrays_become_cpu_device_buffers_without_a_copy():
    """What the loader reads a layer into is 64-byte aligned, so XLA's CPU client takes it
    as the device's buffer instead of copying it into a new one (at 1B: 40% fewer page
    faults while loading); a jax that stops doing so fails here."""
    out = zoo.hf._place._aligned_empty((3, 100, 7), np.float32)
    out[...] = 1.5
    assert out.ctypes.data % 64 == 0 and out.flags.c_contiguous and out.shape == (3, 100, 7)
    placed = jax.device_put(out, jax.devices("cpu")[0])
    assert placed.unsafe_buffer_pointer() == out.ctypes.data
    np.testing.assert_array_equal(np.asarray(placed), out)

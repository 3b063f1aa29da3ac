"""zoo.Checkpointer: round trips, other meshes, keep-last-k, killed saves, corruption,
mismatched targets, and bit-exact resume in a fresh process."""

import functools
import glob
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import data_mesh, preset_mesh, tiny_decoder
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zoo
from zoo import Checkpointer, CheckpointError

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_checkpoint_worker.py"
TMP_GLOB = "{step}.orbax-checkpoint-tmp*"


def _host(tree):
    """Every leaf of a state on the host (keys as key data), by path."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if hasattr(leaf, "dtype") and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        out[jax.tree_util.keystr(path)] = np.asarray(leaf)
    return out


def _assert_same_bits(expected: dict, state) -> None:
    got = _host(state)
    assert got.keys() == expected.keys()
    for path, value in expected.items():
        assert got[path].dtype == value.dtype and np.array_equal(got[path], value), path


@functools.cache
def _shapes(d_model: int):
    """The tiny decoder with zero-stride NumPy leaves: its structure, shapes, dtypes and
    annotations, no memory and no initialisation to compile."""
    abstract = jax.eval_shape(lambda: tiny_decoder(jax.random.key(0), d_model=d_model))
    return jax.tree.map(lambda a: np.broadcast_to(np.zeros((), a.dtype), a.shape), abstract)


def _make_state(preset: str, mesh, *, seed: int = 0, d_model: int = 16):
    """A training state placed on `mesh` by `preset`'s rules: the tiny decoder and its
    AdamW state (moments laid out like the parameters) filled with random values from
    the host, a typed key, a Python int and a NumPy array."""
    model = _shapes(d_model)
    params = eqx.filter(model, eqx.is_inexact_array)
    specs = zoo.partition_specs(params, zoo.rules(preset), mesh)
    rng = np.random.default_rng(seed)

    def fill(transform=lambda x: x):
        def one(like, spec):
            return jax.device_put(
                transform(rng.standard_normal(like.shape)).astype(like.dtype), NamedSharding(mesh, spec)
            )

        return jax.tree.map(one, params, specs)

    adam, *rest = optax.adamw(1e-3).init(params)
    adam = adam._replace(
        count=jax.device_put(np.int32(7 + seed), NamedSharding(mesh, P())), mu=fill(), nu=fill(np.square)
    )
    return {
        "model": eqx.combine(fill(), model),
        "opt_state": (adam, *rest),
        "key": jax.random.key(seed + 100),
        "epoch": 3 + seed,
        "order": np.arange(5, dtype=np.int64) * (seed + 1),
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint (step 10) of an fsdp state on 8 devices, and that state on the host."""
    directory = tmp_path_factory.mktemp("ckpt")
    mesh = preset_mesh("fsdp", 8)
    with jax.set_mesh(mesh):
        state = _make_state("fsdp", mesh)
    expected = _host(state)
    shardings = {p: x.sharding for p, x in _leaves(state).items() if isinstance(x, jax.Array)}
    with Checkpointer(directory) as ckpt:
        ckpt.save(10, state, metadata={"data_position": 1234, "run": "test"})
        # `save` returns once the arrays are off the devices: deleting them (as a donating
        # step would) must not disturb the write still in flight.
        for leaf in jax.tree.leaves(state):
            if isinstance(leaf, jax.Array):
                leaf.delete()
    return directory, expected, shardings


def _leaves(tree) -> dict:
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_round_trip_on_the_same_mesh(saved):
    directory, expected, shardings = saved
    mesh = preset_mesh("fsdp", 8)
    with jax.set_mesh(mesh), Checkpointer(directory) as ckpt:
        assert ckpt.steps() == [10] and ckpt.latest_step() == 10
        like = _make_state("fsdp", mesh, seed=1)  # other values, same structure
        step, state, metadata = ckpt.restore(like)
    assert step == 10
    assert metadata == {"data_position": 1234, "run": "test"}
    with Checkpointer(directory) as ckpt:  # readable without touching the arrays
        assert ckpt.metadata() == metadata and ckpt.manifest()["step"] == 10
    _assert_same_bits(expected, state)
    assert state["epoch"] == 3 and isinstance(state["epoch"], int)
    assert isinstance(state["order"], np.ndarray)
    assert jax.dtypes.issubdtype(state["key"].dtype, jax.dtypes.prng_key)
    assert state["model"].config == like["model"].config
    for path, leaf in _leaves(state).items():
        if path in shardings:
            assert leaf.sharding == shardings[path], path


@pytest.mark.parametrize("preset,n", [("dp", 2), ("tp", 4)])
def test_restore_onto_another_mesh(saved, preset, n):
    """Saved from data=8 fsdp; restored onto data=2 (dp) or data=2,model=2 (tp)."""
    directory, expected, _ = saved
    mesh = preset_mesh(preset, n)
    with jax.set_mesh(mesh), Checkpointer(directory) as ckpt:
        # An abstract target: shapes and shardings, nothing allocated or computed.
        like = jax.eval_shape(lambda: _make_state(preset, mesh))
        _, state, _ = ckpt.restore(like)
    _assert_same_bits(expected, state)
    model = state["model"]
    specs = zoo.partition_specs(model, zoo.rules(preset), mesh)
    leaves, mus = jax.tree.leaves(model), jax.tree.leaves(state["opt_state"][0].mu)
    assert len(leaves) == len(jax.tree.leaves(specs)) == len(mus)
    for leaf, spec, mu in zip(leaves, jax.tree.leaves(specs), mus):
        assert leaf.sharding == NamedSharding(mesh, spec)
        assert mu.sharding == NamedSharding(mesh, spec)
    if preset == "tp":  # not a vacuous check: some leaves are split over `model`
        assert model.lm_head.weight.sharding.spec == P(None, "model")
    assert set(state["key"].sharding.device_set) <= set(mesh.devices.flat)


def test_abstract_model_from_zoo_shard_is_a_restore_target(saved):
    """The recipe for a new mesh: `zoo.shard` of `eqx.filter_eval_shape(...)` gives
    `ShapeDtypeStruct` leaves with the annotated shardings; restore fills them."""
    directory, expected, _ = saved
    mesh = preset_mesh("tp", 4)
    with jax.set_mesh(mesh), Checkpointer(directory) as ckpt:
        abstract = eqx.filter_eval_shape(lambda: tiny_decoder(jax.random.key(0), d_model=16))
        model = zoo.shard(abstract, zoo.rules("tp"), mesh)
        specs = zoo.partition_specs(abstract, zoo.rules("tp"), mesh)
        for leaf, spec in zip(jax.tree.leaves(model), jax.tree.leaves(specs)):
            assert isinstance(leaf, jax.ShapeDtypeStruct) and leaf.sharding == NamedSharding(mesh, spec)
        like = dict(jax.eval_shape(lambda: _make_state("tp", mesh)), model=model)
        _, state, _ = ckpt.restore(like)
    _assert_same_bits(expected, state)
    assert state["model"].lm_head.weight.sharding == NamedSharding(mesh, P(None, "model"))


@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("shape", [(), (3,)])
def test_keys_round_trip_into_the_placement_of_like(tmp_path, devices, shape):
    """Typed keys made under a `data=N` mesh restore into a like tree made the same way.
    On one device jax gives a scalar key the sharding of its data (`P(None,)`, one entry
    more than the key's rank): a `zoo train --devices 1` run could not resume."""
    mesh = data_mesh(devices)
    with jax.set_mesh(mesh):
        keys = jax.random.key(5) if shape == () else jax.random.split(jax.random.key(5), shape[0])
        with Checkpointer(tmp_path / "ckpt", async_save=False) as ckpt:
            ckpt.save(1, {"key": keys})
            like = {"key": jax.random.key(0) if shape == () else jax.random.split(jax.random.key(0), shape[0])}
            _, state, _ = ckpt.restore(like)
    assert state["key"].shape == shape and state["key"].sharding == like["key"].sharding
    assert np.array_equal(jax.random.key_data(state["key"]), jax.random.key_data(keys))


def test_keep_last_k(tmp_path):
    with Checkpointer(tmp_path, keep=2) as ckpt:
        for step in range(5):
            ckpt.save(step, {"x": jnp.full((4,), step, jnp.int32)})
        ckpt.wait()
        assert ckpt.steps() == [3, 4]
    assert sorted(os.listdir(tmp_path)) == ["3", "4"]  # older steps' files are gone
    with Checkpointer(tmp_path, keep=2, async_save=False) as ckpt:  # a later run sees the same
        assert ckpt.steps() == [3, 4]
        with pytest.raises(CheckpointError, match="step 4 already exists"):
            ckpt.save(4, {"x": jnp.zeros((4,), jnp.int32)})
    with Checkpointer(tmp_path, read_only=True) as ckpt:
        assert ckpt.steps() == [3, 4]
        _, state, _ = ckpt.restore({"x": jnp.zeros((4,), jnp.int32)}, step=3)
        with pytest.raises(CheckpointError, match="read_only"):
            ckpt.save(5, state)
    assert np.array_equal(state["x"], np.full((4,), 3))


def test_delete_leaves_what_is_not_a_checkpoint(tmp_path):
    """`delete` removes one step's folder and nothing else."""
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        for step in (1, 2):
            ckpt.save(step, {"x": jnp.full((2,), step)})
        (tmp_path / "notes.txt").write_text("mine")
        (tmp_path / "data").mkdir()
        (tmp_path / "3.orbax-checkpoint-tmp-99").mkdir()  # another process's save in flight
        ckpt.delete(1)
        assert ckpt.steps() == [2]
        with pytest.raises(CheckpointError, match="no checkpoint for step 7"):
            ckpt.delete(7)
    assert sorted(os.listdir(tmp_path)) == ["2", "3.orbax-checkpoint-tmp-99", "data", "notes.txt"]
    with pytest.raises(CheckpointError, match="read_only=True: it cannot delete"):
        Checkpointer(tmp_path, read_only=True).delete(2)


def _big(seed: int, megabytes: int):
    sys.path.insert(0, str(HERE))
    from _checkpoint_worker import big_state

    return big_state(seed, megabytes)


def test_a_killed_save_leaves_the_previous_checkpoint(tmp_path):
    """SIGKILL a process while it saves step 2 — all of step 2's files on disk, the step not
    yet committed — after step 1 was committed. The worker kills itself exactly at orbax's
    commit point (fault injection, not a race against the writer)."""
    megabytes = 4
    directory, log, out = tmp_path / "run", tmp_path / "run.log", tmp_path / "run.out"
    with open(out, "w") as stdout, open(log, "w") as stderr:  # files: nothing blocks on a pipe
        proc = subprocess.Popen([sys.executable, str(WORKER), "kill", str(directory), str(megabytes)],
                                stdout=stdout, stderr=stderr)  # fmt: skip
    try:
        proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    printed = out.read_text().splitlines()
    assert proc.returncode == -signal.SIGKILL, f"exit {proc.returncode}: {printed}\n{log.read_text()}"
    assert [line.split()[:2] for line in printed] == [["SAVED", "1"], ["COMMITTING", "2"]], printed
    tmp = glob.glob(str(directory / TMP_GLOB.format(step=2)))
    assert tmp and not (directory / "2").exists()
    # The killed step's array data and manifest were written: only the commit was missing.
    written = glob.glob(str(Path(tmp[0]) / "state" / "**" / "d" / "*"), recursive=True)
    assert sum(os.path.getsize(f) for f in written) >= megabytes * 2**20, written
    assert (Path(tmp[0]) / "manifest").is_dir()

    with Checkpointer(directory, read_only=True) as ckpt:
        assert ckpt.steps() == [1]  # the half-written step is not a step
    assert Path(tmp[0]).exists()  # and a reader leaves it alone
    with Checkpointer(directory, keep=None) as ckpt:
        assert ckpt.steps() == [1]
        # A writer removes it, in a background thread started when it opens the directory.
        deadline = time.monotonic() + 60
        while Path(tmp[0]).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not Path(tmp[0]).exists()
    with Checkpointer(directory, keep=None) as ckpt:
        expected = _big(1, megabytes)
        like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), expected)
        step, state, _ = ckpt.restore(like)
        assert step == 1 and np.array_equal(state["w"], expected["w"])
        second = _big(2, megabytes)
        ckpt.save(2, second)  # saving the interrupted step again works
        ckpt.wait()
        assert ckpt.steps() == [1, 2]
        assert np.array_equal(ckpt.restore(like).state["w"], second["w"])
    assert not glob.glob(str(directory / "*.orbax-checkpoint-tmp*"))  # cleaned up


@pytest.fixture
def small_checkpoint(tmp_path):
    """Steps 1 and 2 of `{"w": 256x256 random bits on 8 devices, "b": [16]}`."""
    mesh = data_mesh(8)
    w = jax.random.bits(jax.random.key(0), (256, 256), jnp.uint32)
    state = {"w": jax.device_put(w, NamedSharding(mesh, P("data"))), "b": jnp.arange(16.0)}
    with Checkpointer(tmp_path, keep=None) as ckpt:
        ckpt.save(1, state)
        ckpt.save(2, state)
    return tmp_path, state


def _data_file(step_dir: Path) -> Path:
    """The largest array data file of a checkpoint step (holding bytes of `w`)."""
    files = [Path(f) for f in glob.glob(str(step_dir / "state" / "**" / "d" / "*"), recursive=True)]
    return max(files, key=lambda f: f.stat().st_size)


def test_changed_bytes_are_caught_and_name_the_leaf(small_checkpoint):
    directory, state = small_checkpoint
    data = _data_file(directory / "2")
    assert data.stat().st_size > 64 * 1024  # part of `w`'s 256 KB: the only leaf that large
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # one bit
    data.write_bytes(bytes(raw))
    with Checkpointer(directory, keep=None) as ckpt, pytest.raises(CheckpointError) as info:
        ckpt.restore(state)
    message = str(info.value)
    assert "step 2" in message and "fingerprint mismatch" in message and "['w']" in message
    assert "['b']" not in message  # only the damaged leaf
    assert "the others here are [1]" in message  # what to do instead
    with Checkpointer(directory, keep=None) as ckpt:  # the earlier step is fine
        assert np.array_equal(ckpt.restore(state, step=1).state["w"], state["w"])


# A failed read leaves orbax's other read coroutines un-awaited: noise, not a failure.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("damage", ["delete", "truncate", "manifest"])
def test_missing_or_garbled_files_raise_checkpoint_error(small_checkpoint, damage):
    directory, state = small_checkpoint
    if damage == "manifest":
        (directory / "2" / "manifest" / "metadata").write_text('{"format": "zoo-checkpoint", "leav')
    else:
        data = _data_file(directory / "2")
        if damage == "delete":
            data.unlink()
        else:
            data.write_bytes(data.read_bytes()[:1000])
    with Checkpointer(directory, keep=None) as ckpt, pytest.raises(zoo.DamagedCheckpointError) as info:
        ckpt.restore(state)
    message = str(info.value)
    assert f"{directory / '2'} is damaged" in message and "the others here are [1]" in message, message
    assert info.value.step == 2 and info.value.reason in message  # what restore_intact skips by, not the text
    assert ("manifest" in message) == (damage == "manifest"), message
    assert info.value.__cause__ is not None  # the underlying error stays chained
    if damage == "delete":
        # A `like` that does not match is reported as such, though the data is gone:
        # the manifest is checked before any array is read.
        with Checkpointer(directory, keep=None) as ckpt, pytest.raises(CheckpointError) as info:
            ckpt.restore(state | {"extra": jnp.zeros(2)})
        assert "does not match the `like` tree" in str(info.value) and "['extra']" in str(info.value)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_restore_intact_skips_damaged_steps_and_names_each_when_all_are(small_checkpoint):
    """The newest intact step is restored and the damaged newer one deleted; a damage of
    every step is one `DamagedCheckpointError` (step None) naming each; a mismatched `like`
    is not damage: it is raised as is, nothing deleted."""
    directory, state = small_checkpoint
    _data_file(directory / "2").unlink()
    with Checkpointer(directory, keep=None) as ckpt:
        with pytest.raises(CheckpointError, match="does not match") as info:
            ckpt.restore_intact(state | {"extra": jnp.zeros(3)})
        assert not isinstance(info.value, zoo.DamagedCheckpointError) and ckpt.steps() == [1, 2]
        (restored, skipped) = ckpt.restore_intact(state)
        assert restored.step == 1 and [k for k, _ in skipped] == [2] and ckpt.steps() == [1]
    _data_file(directory / "1").unlink()
    with Checkpointer(directory, keep=None) as ckpt, pytest.raises(zoo.DamagedCheckpointError) as info:
        ckpt.restore_intact(state)
    assert info.value.step is None and "step 1: " in info.value.reason, info.value


def test_mismatched_like_lists_every_difference(saved):
    directory, _, _ = saved
    mesh = preset_mesh("fsdp", 8)
    with jax.set_mesh(mesh):  # another config: shapes differ (abstract: nothing computed)
        other = jax.eval_shape(lambda: _make_state("fsdp", mesh, d_model=32))
    like = {
        "model": other["model"],  # mis-shaped leaves
        # no "opt_state": unexpected leaves
        "key": jax.random.key(0, impl="rbg"),  # another key type
        "epoch": 1.5,  # float where an int was saved
        "order": np.zeros(5, np.int32),  # another dtype
        "extra": jnp.zeros(3),  # missing from the checkpoint
    }
    with Checkpointer(directory) as ckpt, pytest.raises(CheckpointError) as info:
        ckpt.restore(like)
    message = str(info.value)
    assert "missing from the checkpoint (in `like` only) (1):\n    ['extra']" in message
    assert "unexpected (in the checkpoint only) (" in message and "['opt_state'][0].count" in message
    assert "['model'].lm_head.weight: checkpoint [16, 32], `like` [32, 32]" in message
    assert "['key']: checkpoint key<fry>, `like` key<rbg>" in message
    assert "['order']: checkpoint int64, `like` int32" in message
    assert "['epoch']: checkpoint python int, `like` python float" in message
    assert "['model'].config.d_model: checkpoint 16, `like` 32" in message
    with Checkpointer(directory) as ckpt, pytest.raises(CheckpointError, match=r"no checkpoint for step 3 .*\[10\]"):
        ckpt.restore(like, step=3)


def _worker_train(directory: Path, out: Path, *args: str, log: Path) -> subprocess.Popen:
    with open(log, "w") as f:  # a file, not a pipe: nothing can block on a full pipe
        return subprocess.Popen(
            [sys.executable, str(WORKER), "train", str(directory), str(out), *args], stdout=f, stderr=subprocess.STDOUT
        )


def _finished(proc: subprocess.Popen, log: Path) -> None:
    try:
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()  # reaped, whatever happened
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{log.read_text()}"


@pytest.mark.timeout(1320)
def test_a_resumed_run_is_bit_exact(tmp_path):
    """6 steps straight (dropout on, AdamW, FSDP on 8 devices x 2 microbatches) against 3
    steps, save, then a fresh process restoring and running 3 more: the same losses and
    final state, bit for bit. The straight run and the run with the save in the middle (its
    step donating the buffers the asynchronous save was just given) run in this process
    (tests/_checkpoint_worker.py's `train`, the code the fresh process runs; that process
    imports conftest: the same devices and XLA flags, so the same compiled programs); what
    is resumed is the process that restores from the files alone."""
    from _checkpoint_worker import train

    train(str(tmp_path / "ckpt"), str(tmp_path / "first.npz"), 6, 3, False, "fsdp", 8)
    _finished(
        _worker_train(tmp_path / "ckpt", tmp_path / "resumed.npz", "--steps", "6", "--resume",
                      log=tmp_path / "resumed.log"),
        tmp_path / "resumed.log",
    )  # fmt: skip
    first, resumed = np.load(tmp_path / "first.npz"), np.load(tmp_path / "resumed.npz")
    straight = {k[len("straight/") :]: first[k] for k in first.files if k.startswith("straight/")}
    assert len(straight) > 50 and straight["losses"].shape == (6,)
    assert np.all(np.isfinite(straight["losses"]))
    assert len(set(straight["losses"].tolist())) == 6  # it did train: every step differs
    for run, data, rows in (("saving", first, slice(None)), ("resumed", resumed, slice(3, None))):
        for name, value in straight.items():
            got = data[f"{run}/{name}"]
            want = value[rows] if name == "losses" else value
            assert got.dtype == want.dtype and np.array_equal(got, want), (run, name)


def test_a_reader_opening_while_keep_deletes_a_step_lists_the_steps_left(tmp_path, monkeypatch):
    """orbax lists the step folders, then reads each one's metadata and time: a writer
    deleting the oldest in between (its `keep`) must not fail a reader (it did, once,
    in test_readers' loop of readers beside a saving run)."""
    from orbax.checkpoint._src.path import step as orbax_steps

    with Checkpointer(tmp_path, keep=3, async_save=False) as ckpt:
        for step in range(3):
            ckpt.save(step, {"x": jnp.full((2,), step)})
    listed, vanished = orbax_steps._StandardNameFormat.find_all, []

    def find_all_racing_a_writer(self, base_path):
        found = list(listed(self, base_path))
        if not vanished:  # the writer's keep, between orbax's listing and its reads
            shutil.rmtree(os.path.join(tmp_path, "0"))
            vanished.append(0)
        return iter(found)

    monkeypatch.setattr(orbax_steps._StandardNameFormat, "find_all", find_all_racing_a_writer)
    with Checkpointer(tmp_path, read_only=True) as reader:
        assert vanished, "the race was not staged: orbax no longer lists steps this way"
        assert reader.steps() == [1, 2]

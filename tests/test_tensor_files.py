"""zoo.hf's safetensors reader (`zoo.hf._files.Checkpoint`): slices read as they are asked
for, each tensor's rows read once for consecutive column slices, no memory map of the file;
damaged headers, unread dtypes and stale indexes refused naming the file and the fix."""

import json

import numpy as np
import pytest
import safetensors.numpy

from zoo.hf import _files


def test_checkpoint_reads_slices_and_keeps_no_page_of_the_file(tmp_path, monkeypatch):
    import ml_dtypes

    rng = np.random.default_rng(0)
    tensors = {
        "w": rng.normal(size=(6, 5, 4)).astype(np.float32),
        "b": rng.normal(size=(7, 3)).astype(ml_dtypes.bfloat16),
        "i": np.arange(5, dtype=np.int64),
        "s": np.asarray(2.5, np.float16),
    }
    path = tmp_path / "model.safetensors"
    safetensors.numpy.save_file(tensors, str(path))
    with _files.Checkpoint(tmp_path) as checkpoint:
        assert sorted(checkpoint.keys()) == sorted(tensors) and checkpoint.shape("w") == (6, 5, 4)
        for name, index in [("w", ()), ("w", (slice(1, 4),)), ("w", (slice(2, 3), slice(1, 5), slice(0, 2))),
                            ("b", (slice(None), slice(1, 3))), ("i", (slice(3, 5),)), ("s", ())]:  # fmt: skip
            got = checkpoint.read(name, index)
            assert got.dtype == tensors[name].dtype
            np.testing.assert_array_equal(got, tensors[name][index])
            assert got.flags.c_contiguous and got.flags.owndata
        # Column slices of one tensor read one after another: its rows read from the file once.
        calls = []
        real_read_into = _files._read_into

        def recording_read_into(file, out, at):
            calls.append(out.shape)
            real_read_into(file, out, at)

        monkeypatch.setattr(_files, "_read_into", recording_read_into)
        left, right = checkpoint.read("w", (slice(1, 5), slice(0, 2))), checkpoint.read("w", (slice(1, 5), slice(2, 5)))
        again = checkpoint.read("w", (slice(0, 5), slice(0, 2)))  # other rows: read again
        monkeypatch.undo()
        assert calls == [(4, 5, 4), (5, 5, 4)]
        np.testing.assert_array_equal(np.concatenate([left, right], axis=1), tensors["w"][1:5])
        np.testing.assert_array_equal(again, tensors["w"][0:5, 0:2])
        assert not np.shares_memory(left, right) and left.flags.owndata and right.flags.owndata
        # Plain reads: no memory map of the file, so none of its pages counts in the process.
        assert str(path) not in open("/proc/self/maps").read()
    path.write_bytes(path.read_bytes()[:-4])  # truncated: the last tensor's bytes do not fit the file
    with pytest.raises(ValueError, match="cannot read .*do not fit.*save it again"):
        _files.Checkpoint(tmp_path)


def _safetensors_file(path, header: bytes, data: bytes = b"") -> None:
    path.write_bytes(len(header).to_bytes(8, "little") + header + data)


@pytest.mark.parametrize(
    "header, message",
    [
        (b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}}', "do not fit"),  # before the data
        (b'{"w": {"dtype": "F32", "shape": [1]}}', "lacks a dtype, shape or data_offsets"),
        (b"[1, 2]", "not a JSON object"),
        (b"{not json", "not JSON"),
    ],
)
def test_a_damaged_safetensors_header_is_refused_naming_the_file(tmp_path, header, message):
    _safetensors_file(tmp_path / "model.safetensors", header, bytes(8))
    with pytest.raises(ValueError, match=f"cannot read .*model.safetensors: .*{message}.*save it again"):
        _files.Checkpoint(tmp_path)


def test_a_tensor_of_an_unread_dtype_is_refused_when_read_and_the_others_load(tmp_path):
    header = (b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},'
              b' "x": {"dtype": "F8_E8M0", "shape": [2], "data_offsets": [8, 10]}}')  # fmt: skip
    _safetensors_file(tmp_path / "model.safetensors", header, np.asarray([1.5, -2.0], "<f4").tobytes() + bytes(2))
    with _files.Checkpoint(tmp_path) as checkpoint:
        np.testing.assert_array_equal(checkpoint.read("w", ()), [1.5, -2.0])
        with pytest.raises(ValueError, match="cannot read x .*dtype 'F8_E8M0' is not one zoo reads.*convert"):
            checkpoint.read("x", ())


def test_an_index_naming_a_tensor_its_shard_lacks_is_refused(tmp_path):
    safetensors.numpy.save_file({"w": np.zeros(2, np.float32)}, str(tmp_path / "a.safetensors"))
    index = {"weight_map": {"w": "a.safetensors", "v": "a.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="names 1 tensors its shards do not hold .*v in a.safetensors.*again"):
        _files.Checkpoint(tmp_path)

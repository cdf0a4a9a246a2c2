"""The one safetensors reader (``safetensors_io.SafetensorsReader``): the values the ``safetensors`` library
reads for every dtype numpy has, BF16 widened to float32 exactly (the library's numpy side refuses it),
in-place reads, and one error for a file that is not a readable safetensors file."""
import json
import struct

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from mindformers_gptlocal.errors import CheckpointError
from mindformers_gptlocal.safetensors_io import (DTYPES, SafetensorsReader, read_safetensors, tensor_shapes,
                                                 write_safetensors, write_safetensors_streamed)


def _arrays():
    rng = np.random.default_rng(0)
    out = {}
    for code, dtype in DTYPES.items():
        if code == "BF16":
            continue
        values = rng.integers(0, 2, (3, 5)) if dtype is np.bool_ else rng.standard_normal((3, 5)) * 40
        out[f"t.{code}"] = np.asarray(values).astype(dtype)
    out["odd"] = rng.standard_normal((7,)).astype(np.float32)
    out["scalar"] = np.asarray(3, np.int64)
    return out


def _write_bf16(path, floats):
    """A file with one BF16 tensor holding the upper halves of ``floats`` (float32)."""
    raw = (floats.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()
    header = json.dumps({"w": {"dtype": "BF16", "shape": list(floats.shape), "data_offsets": [0, len(raw)]}})
    header = header.encode() + b" " * (-len(header) % 8)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(header)) + header + raw)


def test_reader_gives_the_library_values_for_every_dtype(tmp_path):
    arrays = _arrays()
    path = str(tmp_path / "all.safetensors")
    save_file(arrays, path)
    reference = load_file(path)
    reader = SafetensorsReader(path)
    assert sorted(reader.names()) == sorted(arrays)
    assert tensor_shapes(path) == {name: tuple(a.shape) for name, a in arrays.items()}
    for name, array in reference.items():
        got = reader.get(name)
        assert got.dtype == array.dtype and got.shape == array.shape, name
        np.testing.assert_array_equal(got, array, err_msg=name)
        assert got.flags["WRITEABLE"]
    whole = read_safetensors(path)
    for name, array in reference.items():
        np.testing.assert_array_equal(whole[name], array, err_msg=name)


def test_bf16_is_widened_to_float32_exactly(tmp_path):
    floats = np.array([[1.5, -2.0, 3.140625], [0.0, -0.0078125, 65280.0]], np.float32)  # all exact in bf16
    path = str(tmp_path / "bf16.safetensors")
    _write_bf16(path, floats)
    got = SafetensorsReader(path).get("w")
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, floats)
    rounded = np.array([1.00390625], np.float32)  # not representable: the upper 16 bits give 1.0
    _write_bf16(path, rounded)
    np.testing.assert_array_equal(read_safetensors(path)["w"], np.array([1.0], np.float32))
    assert not SafetensorsReader(path).read_into("w", np.zeros(1, np.float32))  # converted, never raw bits


def test_read_into_fills_the_callers_buffer_or_declines(tmp_path):
    path = str(tmp_path / "m.safetensors")
    save_file({"a": np.arange(12, dtype=np.float32).reshape(3, 4)}, path)
    reader = SafetensorsReader(path)
    target = np.zeros((3, 4), np.float32)
    assert reader.read_into("a", target)
    np.testing.assert_array_equal(target, np.arange(12, dtype=np.float32).reshape(3, 4))
    for other in (np.zeros((3, 4), np.float16), np.zeros((4, 3), np.float32), np.zeros((4, 3), np.float32).T):
        assert not reader.read_into("a", other)
        assert not other.any()


@pytest.mark.parametrize("damage", ["cut", "padded", "garbage", "header_past_end"])
def test_one_error_for_a_damaged_file(tmp_path, damage):
    path = tmp_path / "m.safetensors"
    save_file({"a": np.ones((4, 4), np.float32)}, str(path))
    data = path.read_bytes()
    path.write_bytes({"cut": data[:-5], "padded": data + b"\0" * 8, "garbage": b"\x07" * 40,
                      "header_past_end": struct.pack("<Q", 10 ** 6) + data[8:]}[damage])
    for read in (SafetensorsReader, read_safetensors, tensor_shapes):
        with pytest.raises(CheckpointError, match="is not a readable safetensors file.*truncated or corrupt"):
            read(str(path))


def test_an_unsupported_dtype_names_the_tensor(tmp_path):
    path = str(tmp_path / "f8.safetensors")
    header = json.dumps({"q": {"dtype": "F8_E4M3", "shape": [2], "data_offsets": [0, 2]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(header)) + header + b"\0\0")
    with pytest.raises(CheckpointError, match="'q' has dtype F8_E4M3, which is not supported"):
        SafetensorsReader(path).get("q")


def test_writers_are_read_back_by_the_library(tmp_path):
    """Both writers produce files the ``safetensors`` library reads with the same values and metadata;
    ``write_safetensors`` is byte-identical to the library's own ``save_file``."""
    arrays = {k: v for k, v in _arrays().items() if v.dtype != np.bool_}
    write_safetensors(str(tmp_path / "a.safetensors"), arrays, {"format": "gpt_local"})
    save_file(arrays, str(tmp_path / "b.safetensors"), metadata={"format": "gpt_local"})
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
    plan = [(name, a.shape, a.dtype, lambda a=a: a) for name, a in sorted(arrays.items())]
    write_safetensors_streamed(str(tmp_path / "c.safetensors"), plan, {"format": "pt"})
    back = load_file(str(tmp_path / "c.safetensors"))
    assert sorted(back) == sorted(arrays)
    for name, array in arrays.items():
        assert back[name].dtype == array.dtype
        np.testing.assert_array_equal(back[name], array, err_msg=name)
    from safetensors import safe_open
    with safe_open(str(tmp_path / "c.safetensors"), "np") as handle:
        assert handle.metadata() == {"format": "pt"}

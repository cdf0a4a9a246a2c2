"""load_weights reads each tensor into its Parameter's own buffer (no second copy of the model), with the
values safetensors itself reads; other dtypes are converted one tensor at a time."""
import numpy as np
import pytest
import mindspore as ms
from safetensors.numpy import load_file, save_file

from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM
from mindformers_gptlocal.errors import CheckpointError
from conftest import TINY


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    ms.set_seed(11)
    path = tmp_path_factory.mktemp("weights") / "model"
    GPTLocalForCausalLM(GPTLocalConfig(**TINY)).save_pretrained(str(path))
    return path


def _params(model):
    return {p.name: p for p in model.get_parameters()}


def test_weights_land_in_the_parameters_own_buffers_with_safetensors_values(saved):
    ms.set_seed(12)  # other random weights than the saved ones
    model = GPTLocalForCausalLM(GPTLocalConfig(**TINY))
    before = {name: p.asnumpy().ctypes.data for name, p in _params(model).items()}
    model.load_weights(str(saved))
    reference = load_file(str(saved / "model.safetensors"))
    params = _params(model)
    assert set(reference) <= set(params)
    for name, array in reference.items():
        np.testing.assert_array_equal(params[name].asnumpy(), array, err_msg=name)
        assert params[name].asnumpy().ctypes.data == before[name], f"{name} was copied, not read in place"


def test_another_dtype_in_the_file_is_converted(saved, tmp_path):
    reference = load_file(str(saved / "model.safetensors"))
    half = {name: array.astype(np.float16) for name, array in reference.items()}
    (tmp_path / "m").mkdir()
    save_file(half, str(tmp_path / "m" / "model.safetensors"))
    model = GPTLocalForCausalLM(GPTLocalConfig(**TINY))
    model.load_weights(str(tmp_path / "m"))
    params = _params(model)
    for name, array in half.items():
        assert params[name].dtype == ms.float32
        np.testing.assert_array_equal(params[name].asnumpy(), array.astype(np.float32), err_msg=name)


def test_a_wrong_shape_is_refused_before_anything_is_written(saved, tmp_path):
    tensors = load_file(str(saved / "model.safetensors"))
    name = "model.final_layernorm.weight"
    tensors[name] = np.ones(7, np.float32)
    (tmp_path / "bad").mkdir()
    save_file(tensors, str(tmp_path / "bad" / "model.safetensors"))
    model = GPTLocalForCausalLM(GPTLocalConfig(**TINY))
    first = {n: p.asnumpy().copy() for n, p in _params(model).items()}
    with pytest.raises(CheckpointError, match=name):
        model.load_weights(str(tmp_path / "bad"))
    for n, p in _params(model).items():
        np.testing.assert_array_equal(p.asnumpy(), first[n], err_msg=n)


def test_loading_into_a_model_whose_graph_already_ran(saved):
    """In place after a compiled forward: the graph sees the new weights (same logits as a fresh load)."""
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        ms.set_seed(13)
        model = GPTLocalForCausalLM(GPTLocalConfig(**TINY))
        model.set_train(False)
        ids = ms.Tensor(np.arange(16, dtype=np.int32).reshape(1, 16))
        before = model(ids).asnumpy()
        model.load_weights(str(saved))
        fresh = GPTLocalForCausalLM.from_pretrained(str(saved))
        fresh.set_train(False)
        after, reference = model(ids).asnumpy(), fresh(ids).asnumpy()
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    assert np.abs(before - after).max() > 1e-3
    np.testing.assert_array_equal(after, reference)


def test_a_model_that_built_a_kv_cache_keeps_its_checkpoint_names(saved, tmp_path):
    """KVCache holds the model as a child Cell; MindSpore's default auto_prefix renamed every Parameter to
    ``lm.*`` then, so a model that had generated saved a checkpoint nothing could load, and loaded none (the
    compiled runner's Cells: ``cpu_kernels: {runner: plain}``)."""
    model = GPTLocalForCausalLM(GPTLocalConfig(**TINY, cpu_kernels={"runner": "plain"}))
    names = sorted(_params(model))
    model.kv_cache(1, 16)
    assert sorted(_params(model)) == names
    model.load_weights(str(saved))  # refused with "lacks 28 of 28 tensors" under the lm.* names
    model.save_pretrained(str(tmp_path / "again"))
    assert sorted(load_file(str(tmp_path / "again" / "model.safetensors"))) == sorted(
        load_file(str(saved / "model.safetensors")))


def test_bf16_weights_load_widened_to_float32(saved, tmp_path):
    """A BF16 file (numpy has no bfloat16; ``safetensors.numpy`` refuses it) loads its values exactly."""
    import json
    import struct
    reference = load_file(str(saved / "model.safetensors"))
    header, blobs, offset = {}, [], 0
    for name, array in sorted(reference.items()):
        raw = (array.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()
        header[name] = {"dtype": "BF16", "shape": list(array.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    (tmp_path / "bf").mkdir()
    with open(tmp_path / "bf" / "model.safetensors", "wb") as handle:
        handle.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))
    model = GPTLocalForCausalLM(GPTLocalConfig(**TINY))
    model.load_weights(str(tmp_path / "bf"))
    params = _params(model)
    for name, array in reference.items():
        widened = ((array.astype(np.float32).view(np.uint32) >> 16) << 16).astype(np.uint32).view(np.float32)
        np.testing.assert_array_equal(params[name].asnumpy(), widened, err_msg=name)

"""The folders the converters read and write: Hugging Face directories read lazily, one tensor at a time
(``model.safetensors``, a sharded index, a weights-only ``pytorch_model.bin``), and a gpt_local model
directory (config.json + model.safetensors + tokenizer) written all at once through ``staging.write_folder``.
Safetensors files themselves are read and written by ``safetensors_io`` (the one reader and dtype table).
Knows no weight names (the families in ``family.py`` do).

Pure numpy; torch only to read a ``.bin``, with ``weights_only=True`` unless ``--allow-pickle``.
"""
import json
import os
import shutil

from ..data.tokenizer import EOD_TOKEN, from_gpt2_files
from ..errors import CheckpointError
from ..safetensors_io import TOKENIZER_FILES, SafetensorsReader, write_safetensors_streamed
from ..staging import write_folder
from ..tokenizer_id import write_id

HF_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


# ---------------------------------------------------------------------------------------------
# reading HF checkpoints lazily, one tensor at a time
class TensorSource:
    """name -> lazily loaded numpy array over safetensors (single or sharded) or a weights-only .bin."""

    def __init__(self, directory, allow_pickle=False):
        self.directory = directory
        self.files = {}
        index = os.path.join(directory, "model.safetensors.index.json")
        single = os.path.join(directory, "model.safetensors")
        binary = os.path.join(directory, "pytorch_model.bin")
        if os.path.isfile(single):
            self._add_safetensors(single)
        elif os.path.isfile(index):
            with open(index, encoding="utf-8") as handle:
                weight_map = json.load(handle)["weight_map"]
            for shard in sorted(set(weight_map.values())):
                path = os.path.join(directory, shard)
                if not os.path.isfile(path):
                    raise CheckpointError(f"{index} lists shard {shard}, but {path} does not exist.")
                self._add_safetensors(path)
        elif os.path.isfile(binary):
            self._add_pickle(binary, allow_pickle)
        else:
            raise CheckpointError(f"{directory}: no weights found (looked for {', '.join(HF_WEIGHT_FILES)}).")

    def _add_safetensors(self, path):
        reader = SafetensorsReader(path)
        for name in reader.names():
            self.files[name] = (reader, name)

    def _add_pickle(self, path, allow_pickle):
        try:
            import torch
        except ImportError as err:
            raise CheckpointError(f"{path} is a PyTorch pickle; reading it needs torch (pip install torch), or "
                                  f"convert it to safetensors first.") from err
        try:
            state = torch.load(path, map_location="cpu", weights_only=not allow_pickle)
        except Exception as err:
            raise CheckpointError(f"{path} could not be loaded with weights_only=True ({err}). If you trust this "
                                  f"file, pass --allow-pickle; better, convert it to safetensors.") from err
        for name, tensor in state.items():
            self.files[name] = (None, tensor.detach().to(torch.float32).numpy() if tensor.is_floating_point()
                                else tensor.numpy())

    def names(self):
        return list(self.files)

    def shape(self, name):
        reader, ref = self.files[name]
        return tuple(ref.shape) if reader is None else reader.shape(ref)

    def get(self, name):
        reader, ref = self.files[name]
        return ref if reader is None else reader.get(ref)


# ---------------------------------------------------------------------------------------------
def read_json(path, what):
    """A JSON file ``what`` (a CLI flag) needs, refused with one error when it is absent."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} does not exist; {what} needs it.")
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def write_ms_dir(out, plan, local, hf_dir, **summary):
    """Write a gpt_local model directory all at once: the planned tensors (name-sorted), config.json and the
    Hugging Face directory's tokenizer. Returns the summary (tensor count, config, ``summary``)."""
    plan = sorted(plan, key=lambda item: item[0])

    def build(staging):
        write_safetensors_streamed(os.path.join(staging, "model.safetensors"), plan, {"format": "gpt_local"})
        with open(os.path.join(staging, "config.json"), "w", encoding="utf-8") as handle:
            json.dump(local, handle, indent=2)
        if hf_dir:  # None: no tokenizer to carry (convert mf2ms without --tokenizer)
            copy_tokenizer(hf_dir, staging, local["max_position_embeddings"])
        return {"tensors": len(plan), "config": local, **summary}
    return write_folder(out, build, CheckpointError)


def copy_tokenizer(src, dst, max_length):
    """Copy tokenizer files; build tokenizer.json from vocab.json + merges.txt when it is missing."""
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
    vocab, merges = os.path.join(src, "vocab.json"), os.path.join(src, "merges.txt")
    if not os.path.isfile(os.path.join(dst, "tokenizer.json")) and os.path.isfile(vocab) and os.path.isfile(merges):
        from_gpt2_files(vocab, merges).save(os.path.join(dst, "tokenizer.json"))
    if os.path.isfile(os.path.join(dst, "tokenizer.json")) and not os.path.isfile(
            os.path.join(dst, "tokenizer_config.json")):
        with open(os.path.join(dst, "tokenizer_config.json"), "w", encoding="utf-8") as handle:
            json.dump({"tokenizer_class": "GPT2TokenizerFast", "bos_token": EOD_TOKEN, "eos_token": EOD_TOKEN,
                       "unk_token": EOD_TOKEN, "model_max_length": max_length}, handle, indent=2)
    write_id(dst)  # the id of the tokenizer these weights go with (tokenizer_id.py)


def read_ms_config(ms_dir):
    """The config.json of a gpt_local model directory (--ms-dir), refused with one error if it is not one."""
    if not os.path.isdir(ms_dir):
        raise CheckpointError(f"--ms-dir {ms_dir} does not exist or is not a folder.")
    local = read_json(os.path.join(ms_dir, "config.json"), "--ms-dir")
    if local.get("model_type") != "gpt_local":
        raise CheckpointError(f"{ms_dir}/config.json has model_type {local.get('model_type')!r}, not gpt_local.")
    if local.get("quantization"):  # int8 tensors and their scales: no other format holds them
        raise CheckpointError(f"--ms-dir {ms_dir} is an int8 model directory (`gptlocal quantize`), which only "
                              f"gpt_local loads; convert the float model directory it was quantized from.")
    return local

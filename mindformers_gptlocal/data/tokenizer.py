"""Byte-level BPE tokenizers with the ``tokenizers`` package, and the model directory predict loads.

Three sources: train a new BPE on the corpus, load a ``tokenizer.json``, or
build one from GPT-2's ``vocab.json`` + ``merges.txt``. The end-of-document
token is GPT-2's ``<|endoftext|>`` in every case.
"""
import json
import os
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from ..errors import DataError
from ..tokenizer_id import check_model_dir, id_of_tokenizer, write_id

EOD_TOKEN = "<|endoftext|>"


def train_bpe(documents, vocab_size):
    """A GPT-2-style byte-level BPE trained on ``documents`` (an iterable of strings)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    # the trainer's progress bars on a terminal only: through a pipe they leave empty lines on stdout
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOD_TOKEN],
                                  show_progress=sys.stderr.isatty(),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(documents, trainer=trainer)
    return tokenizer


def from_gpt2_files(vocab, merges):
    """A tokenizer from GPT-2's ``vocab.json`` + ``merges.txt``."""
    for path in (vocab, merges):
        if not os.path.isfile(path):
            raise DataError(f"tokenizer file {path} does not exist; give GPT-2's vocab.json and merges.txt.")
    tokenizer = Tokenizer(models.BPE.from_file(vocab, merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def build_tokenizer(documents_fn, vocab_size, tokenizer_path=None, vocab=None, merges=None):
    """Load or train the tokenizer; make sure it has the end-of-document token."""
    if tokenizer_path:
        if os.path.isdir(tokenizer_path):  # a model directory: its tokenizer.json, checked against its weights
            check_model_dir(tokenizer_path)
            tokenizer_path = os.path.join(tokenizer_path, "tokenizer.json")
        elif os.path.basename(tokenizer_path) == "tokenizer.json":
            check_model_dir(os.path.dirname(os.path.abspath(tokenizer_path)))
        if not os.path.isfile(tokenizer_path):
            raise DataError(f"--tokenizer {tokenizer_path} does not exist; give a tokenizer.json file or a model "
                            f"directory holding one.")
        tokenizer = Tokenizer.from_file(tokenizer_path)
    elif vocab or merges:
        if not (vocab and merges):
            raise DataError("--vocab and --merges go together; give both GPT-2 files.")
        tokenizer = from_gpt2_files(vocab, merges)
    else:
        tokenizer = train_bpe(documents_fn(), vocab_size)
    if tokenizer.token_to_id(EOD_TOKEN) is None:
        tokenizer.add_special_tokens([EOD_TOKEN])
    return tokenizer


def save_model_dir(path, tokenizer, seq_length, model_config=None, chat_template=None):
    """``tokenizer.json``, ``tokenizer_config.json`` (with ``chat_template`` if given) and a gpt_local
    ``config.json``: what predict loads."""
    os.makedirs(path, exist_ok=True)
    tokenizer.save(os.path.join(path, "tokenizer.json"))
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOD_TOKEN, "eos_token": EOD_TOKEN,
                "unk_token": EOD_TOKEN, "pad_token": EOD_TOKEN, "model_max_length": seq_length,
                "clean_up_tokenization_spaces": False}
    if chat_template:
        settings["chat_template"] = chat_template
    with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as handle:
        json.dump(settings, handle, indent=2)
    eod = tokenizer.token_to_id(EOD_TOKEN)
    config = {"model_type": "gpt_local", "architectures": ["GPTLocalForCausalLM"],
              "vocab_size": tokenizer.get_vocab_size(), "seq_length": seq_length,
              "max_position_embeddings": max(seq_length, 256), "bos_token_id": eod, "eos_token_id": eod,
              "pad_token_id": eod}
    config.update(model_config or {})
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as handle:
        json.dump(config, handle, indent=2)
    write_id(path, id_of_tokenizer(tokenizer))

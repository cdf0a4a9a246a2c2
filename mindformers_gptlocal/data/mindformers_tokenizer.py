"""GPTLocalTokenizer: a byte-level BPE ``tokenizer.json`` as a MindFormers tokenizer.

Mcore predict loads ``pretrained_model_dir`` with Hugging Face's AutoTokenizer
(our model directories say ``PreTrainedTokenizerFast``); this registered class
serves YAMLs that name a tokenizer under ``processor.tokenizer.type`` instead.
"""
from mindformers.models.tokenization_utils_fast import PreTrainedTokenizerFast
from mindformers.tools.register import MindFormerRegister, MindFormerModuleType

from .tokenizer import EOD_TOKEN


@MindFormerRegister.register(MindFormerModuleType.TOKENIZER)
class GPTLocalTokenizer(PreTrainedTokenizerFast):
    """GPT-2 style tokenizer from ``tokenizer_file`` (tokenizer.json); ``<|endoftext|>`` is bos/eos/pad."""

    vocab_files_names = {"tokenizer_file": "tokenizer.json"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, tokenizer_file=None, **kwargs):
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            kwargs.setdefault(name, EOD_TOKEN)
        super().__init__(tokenizer_file=tokenizer_file, **kwargs)

"""GPTLocalTokenizer: a byte-level BPE ``tokenizer.json`` as a MindFormers tokenizer.

Mcore predict loads ``pretrained_model_dir`` with Hugging Face's AutoTokenizer
(our model directories say ``PreTrainedTokenizerFast``); this registered class
serves YAMLs that name a tokenizer under ``processor.tokenizer.type`` instead.
"""
from ..data.tokenizer import EOD_TOKEN
from .symbols import MindFormerRegister, MindFormerModuleType, PreTrainedTokenizerFast


@MindFormerRegister.register(MindFormerModuleType.TOKENIZER)
class GPTLocalTokenizer(PreTrainedTokenizerFast):
    """GPT-2 style tokenizer from ``tokenizer_file`` (tokenizer.json); ``<|endoftext|>`` is bos/eos/pad."""

    vocab_files_names = {"tokenizer_file": "tokenizer.json"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, tokenizer_file=None, **kwargs):
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            kwargs.setdefault(name, EOD_TOKEN)
        super().__init__(tokenizer_file=tokenizer_file, **kwargs)

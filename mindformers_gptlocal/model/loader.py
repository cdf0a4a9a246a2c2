"""The one loader of a model directory for ``generate``, ``chat``, ``eval`` and ``serve``.

A gpt_local model directory holds ``config.json``, its weights (``model.safetensors``) and, for text in and out,
``tokenizer.json`` (+ ``tokenizer_config.json``, whose ``chat_template`` chat and serve use). ``check_model_dir``
refuses a folder that lacks one of them with one line naming the folder, what it lacks and the setting that gave
it (``--model``, the eval's ``pretrained=``): before anything is built, so the server fails before it starts.
``load_model`` sets MindSpore's mode and device, builds the model with ``from_pretrained`` (which checks the
tokenizer against the one the weights were trained with), switches it to inference and attaches the compile cache
(``graph_cache.attach``, the ``--compile-cache`` setting).
"""
import json
import os

from ..errors import ConfigError, DataError
from ..safetensors_io import CONFIG_NAME, WEIGHTS_NAME

GIVE = ("give a gpt_local model directory (config.json, model.safetensors, tokenizer.json): a training run's "
        "output/model (e.g. runs/quickstart/train/model), `gptlocal convert hf2ms`, or save_pretrained")


def check_model_dir(model_dir, flag="--model", tokenizer=True):
    """One clear error (naming ``flag`` and the folder) unless ``model_dir`` is a folder with config.json, weights
    and (``tokenizer``) tokenizer.json."""
    named = f"{flag}{'' if flag.endswith('=') else ' '}{model_dir}"
    if os.path.exists(model_dir) and not os.path.isdir(model_dir):
        raise ConfigError(f"{named} is a file, not a model directory (a folder); {GIVE}.")
    if not os.path.isdir(model_dir):
        raise ConfigError(f"{named} does not exist, so it is not a model directory; {GIVE}.")
    if not os.path.isfile(os.path.join(model_dir, CONFIG_NAME)):
        raise ConfigError(f"{named} has no {CONFIG_NAME}, so it is not a model directory; {GIVE}.")
    check_config_json(model_dir, flag)
    if not os.path.isfile(os.path.join(model_dir, WEIGHTS_NAME)):  # the model's own line for it
        from .gpt import missing_weights
        raise ConfigError(f"{flag}{'' if flag.endswith('=') else ' '}{missing_weights(model_dir)}")
    if tokenizer and not os.path.isfile(os.path.join(model_dir, "tokenizer.json")):
        raise DataError(f"{named} has no tokenizer.json, so text cannot be turned into token ids; copy in the "
                        f"tokenizer the model was trained with (prepare-data's <out>/model).")


def check_config_json(model_dir, flag="--model"):
    """One line naming the file, line and column when ``model_dir``'s config.json is there but is not a JSON
    object (a hand edit gone wrong), instead of the JSON parser's traceback deep in the loader."""
    path = os.path.join(model_dir, CONFIG_NAME)
    if not os.path.isfile(path):
        return
    try:
        with open(path, encoding="utf-8") as handle:
            value = json.load(handle)
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
        where = f"line {err.lineno}, column {err.colno}: {err.msg}" if isinstance(err, json.JSONDecodeError) \
            else str(err)
        raise ConfigError(f"{flag}{'' if flag.endswith('=') else ' '}{model_dir}: {path} is not valid JSON ({where});"
                          f" fix it there, or write the folder again (gptlocal convert, save_pretrained).") from err
    if not isinstance(value, dict):
        raise ConfigError(f"{flag}{'' if flag.endswith('=') else ' '}{model_dir}: {path} holds a JSON "
                          f"{type(value).__name__}, not the object of a model's settings; write the folder again "
                          f"(gptlocal convert, save_pretrained).")


def read_tokenizer(model_dir):
    """(tokenizers.Tokenizer or None, chat template or None) of the model directory."""
    tokenizer, template = None, None
    path = os.path.join(model_dir, "tokenizer.json")
    if os.path.isfile(path):
        from tokenizers import Tokenizer
        tokenizer = Tokenizer.from_file(path)
    settings = os.path.join(model_dir, "tokenizer_config.json")
    if os.path.isfile(settings):
        with open(settings, encoding="utf-8") as handle:
            template = json.load(handle).get("chat_template")
    return tokenizer, template


def load_model(model_dir, device_target="CPU", compile_cache="off", cache_flag="--compile-cache", mode="graph",
               cache_days=None, cache_mb=None, **from_pretrained):
    """The model of a checked directory, ready for inference: MindSpore's mode (graph by default: MindSpore's own
    default is PyNative) and device set, ``GPTLocalForCausalLM.from_pretrained(model_dir, inference=True,
    **from_pretrained)`` (``layer_spec``, ``max_batch_size`` ...; built for inference only: a bf16 model's weights
    held as bfloat16 on CPU, ``KernelProvider.bf16_weights``), eval mode, the compile cache attached as
    ``compile_cache`` (the value of ``cache_flag``) says, within ``cache_days`` / ``cache_mb`` (None: its
    defaults)."""
    from ..runtime.graph_cache import attach, bounds
    bounds(cache_days, cache_mb)  # a bad bound: one line before anything is built
    import mindspore as ms
    from .gpt import GPTLocalForCausalLM
    ms.set_context(mode=ms.GRAPH_MODE if mode == "graph" else ms.PYNATIVE_MODE, device_target=str(device_target))
    model = GPTLocalForCausalLM.from_pretrained(model_dir, inference=True, **from_pretrained)
    model.set_train(False)
    attach(model, compile_cache, model_dir, flag=cache_flag, days=cache_days, max_mb=cache_mb)
    return model


def load(model_dir, device_target="CPU", compile_cache="off", flag="--model", cache_days=None, cache_mb=None):
    """(model, tokenizers.Tokenizer, chat template or None) of a model directory (``generate``, ``chat``)."""
    check_model_dir(model_dir, flag)
    model = load_model(model_dir, device_target, compile_cache, cache_days=cache_days, cache_mb=cache_mb)
    tokenizer, template = read_tokenizer(model_dir)
    return model, tokenizer, template

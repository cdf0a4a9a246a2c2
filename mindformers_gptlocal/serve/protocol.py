"""OpenAI request bodies -> what the engine needs, with one 400 per bad field (``RequestError.param`` names it).

Hand-written rather than pydantic models: FastAPI answers pydantic failures with its own 422 body, and the
OpenAI clients expect 400 + ``{"error": {"message", "type", "param", "code"}}``; the checks that matter
(context length, vocabulary, the served name) need the loaded model anyway.

Chat prompts: ``--chat-template FILE`` when given, else the model directory's ``tokenizer_config.json``
``chat_template`` (Hugging Face's Jinja convention, rendered in a sandbox) when present, else (or with
``--chat-template plain``) ``PLAIN_CHAT_TEMPLATE``::

    System: ...\\nUser: ...\\nAssistant: ...\\nAssistant:

with ``"\\nUser:"`` added to the stop strings so a reply ends before the model writes the next user turn.
"""
import numbers
import os

from ..errors import ConfigError
from ..generation.defaults import SERVE as SERVE_DEFAULTS

PLAIN_CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n{% endfor %}"
                       "{% if add_generation_prompt %}Assistant:{% endif %}")
PLAIN_CHAT_STOP = "\nUser:"
COMPLETION_DEFAULT_MAX_TOKENS = SERVE_DEFAULTS["completion_max_tokens"]  # OpenAI's default for /v1/completions
# Bounds beyond the body size (--max-request-bytes): each stop string is matched against the text's tail at
# every token (cost ~ its length), each message and content part goes through the template.
MAX_STOP = 4  # OpenAI's limit
MAX_STOP_CHARS = 256
MAX_MESSAGES = 256
MAX_CONTENT_PARTS = 64
MAX_N = 128  # OpenAI's limit on 'n' (choices per request; each takes a cache slot of its own)
UNSUPPORTED = {"best_of": 1, "echo": False, "logprobs": None, "top_logprobs": None, "suffix": None,
               "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None, "tools": None}


class RequestError(ValueError):
    """A bad request field: ``param`` names it, ``code`` is OpenAI-style (or None)."""

    def __init__(self, message, param=None, code=None):
        super().__init__(message)
        self.param, self.code = param, code


def _is_int(value):
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _number(body, key, default, low, high, low_open=False):
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise RequestError(f"'{key}' must be a number, got {value!r}.", key)
    if value > high or value < low or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise RequestError(f"'{key}' must be in {bracket}{low}, {high}], got {value}.", key)
    return float(value)


BUILTIN_TEMPLATES = {"plain": None}  # None: PLAIN_CHAT_TEMPLATE, with PLAIN_CHAT_STOP added to the stop strings


def chat_template(value, directory_template, flag="--chat-template"):
    """The template chat and serve use: ``value`` (``--chat-template``: a built-in name or a Jinja file; its syntax
    checked here, one ConfigError) when given, else the model directory's own (None: the plain form)."""
    if not value:
        return directory_template
    if value in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[value]
    if not os.path.isfile(value):
        raise ConfigError(f"{flag} {value} is neither a file nor a built-in template ({', '.join(BUILTIN_TEMPLATES)}); "
                          f"give a Jinja template file or one of those names.")
    with open(value, encoding="utf-8") as handle:
        text = handle.read()
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    try:
        ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(text)
    except TemplateSyntaxError as err:
        raise ConfigError(f"{flag} {value}: line {err.lineno}: {err.message} (not a valid Jinja template).") from err
    if not text.strip():
        raise ConfigError(f"{flag} {value} is empty; give a Jinja chat template.")
    return text


def render_chat(messages, template):
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    try:
        return env.from_string(template or PLAIN_CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=True,
                                                                       bos_token="", eos_token="")
    except Exception as err:  # a template error is the request's problem only if the messages caused it
        raise RequestError(f"the chat template failed on these messages: {err}", "messages") from err


def _chat_prompt(body, template):
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list of {role, content} objects.", "messages")
    if len(messages) > MAX_MESSAGES:
        raise RequestError(f"'messages' has {len(messages)} entries; at most {MAX_MESSAGES} are taken.", "messages",
                           "too_many_messages")
    clean = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("system", "user", "assistant", "developer"):
            raise RequestError(f"messages[{i}] needs a 'role' of system, developer, user or assistant.",
                               f"messages[{i}].role")
        content = message.get("content")
        if isinstance(content, list) and len(content) > MAX_CONTENT_PARTS:
            raise RequestError(f"messages[{i}].content has {len(content)} parts; at most {MAX_CONTENT_PARTS} are "
                               f"taken.", f"messages[{i}].content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise RequestError(f"messages[{i}].content: only text parts are supported.", f"messages[{i}].content")
            content = "".join(p.get("text", "") for p in content)
        if not isinstance(content, str):
            raise RequestError(f"messages[{i}].content must be a string.", f"messages[{i}].content")
        clean.append({"role": message["role"], "content": content})
    return render_chat(clean, template)


def _completion_prompt(body):
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        return [int(t) for t in prompt]
    if isinstance(prompt, list):
        raise RequestError("'prompt' must be one string or one list of token ids (one prompt per request).",
                           "prompt")
    raise RequestError(f"'prompt' must be a string or a list of token ids, got {type(prompt).__name__}.", "prompt")


def parse_request(body, chat, model_name, tokenizer, chat_template, vocab_size, max_model_len, eos_token_id):
    """A checked request: prompt ids, max_tokens, sampling options, stop strings, stream flags."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object.")
    model = body.get("model")
    names = (model_name,) if isinstance(model_name, str) else tuple(model_name)  # the base, then --lora names
    if not isinstance(model, str) or model not in names:
        served = repr(names[0]) if len(names) == 1 else ", ".join(map(repr, names))
        raise RequestError(f"model {model!r} is not served here; this server serves {served} "
                           f"(GET /v1/models).", "model", "model_not_found")
    n = body.get("n")
    n = SERVE_DEFAULTS["n"] if n is None else n
    if not _is_int(n) or not 1 <= n <= MAX_N:
        raise RequestError(f"'n' (choices) must be an integer from 1 to {MAX_N}, got {n!r}.", "n")
    for key, default in UNSUPPORTED.items():
        value = body.get(key)
        if value is not None and value != default:
            raise RequestError(f"'{key}' is not supported by gptlocal serve; leave it out.", key)
    field = "messages" if chat else "prompt"
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(isinstance(s, str) for s in stop):
        raise RequestError(f"'stop' must be a string or a list of up to {MAX_STOP} strings.", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise RequestError(f"each 'stop' string may have at most {MAX_STOP_CHARS} characters, got "
                           f"{max(len(s) for s in stop)}.", "stop")
    if chat:
        text = _chat_prompt(body, chat_template)
        if not chat_template:
            stop = stop + [PLAIN_CHAT_STOP]
    else:
        text = _completion_prompt(body)
    if isinstance(text, str):
        if tokenizer is None:
            raise RequestError(f"the model directory has no tokenizer.json, so '{field}' must be token ids.", field)
        ids = tokenizer.encode(text).ids
    else:
        ids = text
    if not ids:
        raise RequestError(f"'{field}' is empty; give at least one token.", field)
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"'{field}' holds token id {bad[0]}, outside the vocabulary (vocab_size {vocab_size}).",
                           field, "invalid_token_id")
    if len(ids) >= max_model_len:
        raise RequestError(f"'{field}' has {len(ids)} tokens; this server's context is {max_model_len} tokens "
                           f"(prompt + max_tokens), so the prompt may have at most {max_model_len - 1}.",
                           field, "context_length_exceeded")
    room = max_model_len - len(ids)
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(key)
    if max_tokens is None:
        max_tokens = room if chat else min(COMPLETION_DEFAULT_MAX_TOKENS, room)
    if not _is_int(max_tokens) or max_tokens < 1:
        raise RequestError(f"'{key}' must be a positive integer, got {max_tokens!r}.", key)
    if max_tokens > room:
        raise RequestError(f"'{key}' is {max_tokens}, but the prompt has {len(ids)} tokens and the context is "
                           f"{max_model_len}: at most {room} new tokens fit.", key, "context_length_exceeded")
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or seed < 0):
        raise RequestError(f"'seed' must be a non-negative integer, got {seed!r}.", "seed")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("'stream' must be true or false.", "stream")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise RequestError("'stream_options' must be an object.", "stream_options")
    top_k = body.get("top_k", SERVE_DEFAULTS["top_k"])
    if top_k is None:
        top_k = SERVE_DEFAULTS["top_k"]
    if not _is_int(top_k) or top_k < -1:
        raise RequestError(f"'top_k' must be a non-negative integer (0 or -1: off), got {top_k!r}.", "top_k")
    penalty = body.get("repetition_penalty")
    penalty = SERVE_DEFAULTS["repetition_penalty"] if penalty is None else penalty
    if not isinstance(penalty, numbers.Real) or isinstance(penalty, bool) or not 0 < penalty < float("inf"):
        raise RequestError(f"'repetition_penalty' must be a number > 0 (1: off), got {penalty!r}.",
                           "repetition_penalty")
    eos = eos_token_id if isinstance(eos_token_id, (list, tuple)) else [] if eos_token_id is None else [eos_token_id]
    if body.get("ignore_eos"):
        eos = []
    return {"prompt": ids, "max_tokens": int(max_tokens),
            "temperature": _number(body, "temperature", SERVE_DEFAULTS["temperature"], 0, 2),
            "top_p": _number(body, "top_p", SERVE_DEFAULTS["top_p"], 0, 1, low_open=True), "top_k": max(int(top_k), 0),
            "seed": seed, "n": int(n), "repetition_penalty": float(penalty),
            "stop": stop, "eos": eos,
            "stream": stream, "include_usage": bool(stream_options.get("include_usage")),
            "return_token_ids": bool(body.get("return_token_ids"))}

"""``gptlocal generate`` and ``gptlocal chat``: a model directory, no YAML (as ``litgpt generate``/``chat``).

Both load with ``GPTLocalForCausalLM.from_pretrained`` (which checks the folder's tokenizer against the one
its weights were trained with) and call the public ``model.generate``; tokens are streamed through its
``stop_when`` hook, which sees every new token. Chat renders the conversation with the model directory's
chat template, or the plain ``User: ... / Assistant:`` form, exactly as ``gptlocal serve`` does
(``serve/protocol.py``), and stops a reply at the next ``User:`` turn in the plain form.
"""
import json
import os
import sys

from ..errors import ConfigError, DataError


def load(model_dir, device_target="CPU", compile_cache="off"):
    """(model, tokenizers.Tokenizer, chat template or None) of a model directory; ``compile_cache``: the
    ``--compile-cache`` value (``model/graph_cache.py attach``)."""
    if not os.path.isdir(model_dir):
        raise ConfigError(f"--model {model_dir} does not exist; give a gpt_local model directory (config.json, "
                          f"model.safetensors, tokenizer.json), e.g. runs/quickstart/train/model.")
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
        raise DataError(f"--model {model_dir} has no tokenizer.json, so text cannot be turned into token ids; "
                        f"copy in the tokenizer the model was trained with (prepare-data's <out>/model).")
    import mindspore as ms
    ms.set_context(mode=ms.GRAPH_MODE, device_target=device_target)  # as serve: MindSpore's default is PyNative
    from tokenizers import Tokenizer
    from ..model.gpt import GPTLocalForCausalLM
    from ..model.graph_cache import attach
    model = GPTLocalForCausalLM.from_pretrained(model_dir)
    attach(model, compile_cache, model_dir)
    template = None
    settings = os.path.join(model_dir, "tokenizer_config.json")
    if os.path.isfile(settings):
        with open(settings, encoding="utf-8") as handle:
            template = json.load(handle).get("chat_template")
    return model, Tokenizer.from_file(path), template


def sampling(options):
    """model.generate keywords of the --temperature/--top-k/--top-p/--max-new-tokens/--seed flags."""
    for flag, value, low in (("--max-new-tokens", options.max_new_tokens, 1), ("--top-k", options.top_k, 0)):
        if value < low:
            raise ConfigError(f"{flag} must be >= {low}, got {value}.")
    if options.temperature < 0:
        raise ConfigError(f"--temperature must be >= 0 (0 = greedy), got {options.temperature}.")
    if not 0 < options.top_p <= 1:
        raise ConfigError(f"--top-p must be in (0, 1], got {options.top_p}.")
    if options.temperature == 0:
        return {"max_new_tokens": options.max_new_tokens, "do_sample": False}
    return {"max_new_tokens": options.max_new_tokens, "do_sample": True, "temperature": options.temperature,
            "top_k": options.top_k, "top_p": options.top_p, "seed": options.seed}


class Streamer:
    """Decodes the generated ids after each token and writes the new text; holds back an incomplete UTF-8
    character and any tail that may begin a stop string; ``stop`` strings end the reply (not printed)."""

    def __init__(self, tokenizer, out, stop=(), eos=None):
        self.tokenizer, self.out, self.stop, self.eos = tokenizer, out, list(stop), eos
        self.shown, self.text, self.stopped = 0, "", False

    def __call__(self, rows, generated):
        ids = [t for t in generated[0] if t != self.eos]
        self.text = self.tokenizer.decode(ids, skip_special_tokens=True)
        for stop in self.stop:
            if stop in self.text:
                self.text, self.stopped = self.text[:self.text.index(stop)], True
        safe = len(self.text)
        if not self.stopped:
            while safe and self.text[safe - 1] == "\ufffd":
                safe -= 1
            for stop in self.stop:
                for keep in range(min(len(stop) - 1, safe), 0, -1):
                    if self.text[:safe].endswith(stop[:keep]):
                        safe -= keep
                        break
        self._write(safe)
        return [self.stopped for _ in rows]

    def _write(self, upto):
        if upto > self.shown and self.out is not None:
            self.out.write(self.text[self.shown:upto])
            self.out.flush()
            self.shown = upto

    def finish(self):
        self._write(len(self.text))
        return self.text


def complete(model, tokenizer, ids, kwargs, out=None, stop=()):
    """Generate after ``ids``; the reply text (cut at a stop string), streamed to ``out`` if given."""
    eos = model.config.eos_token_id
    streamer = Streamer(tokenizer, out, stop, eos) if out is not None or stop else None
    sequences = model.generate([ids], stop_when=streamer, eos_token_id=eos, **kwargs)
    if streamer is None:
        new = [t for t in sequences[0][len(ids):] if t != eos]
        return tokenizer.decode(new, skip_special_tokens=True)
    streamer(range(1), [sequences[0][len(ids):]])  # the last token (and a run of zero new tokens)
    if out is None:
        return streamer.text
    return streamer.finish()


def generate(options):
    """``gptlocal generate``: the prompt, then its continuation, on stdout."""
    kwargs = sampling(options)
    model, tokenizer, _ = load(options.model, options.device_target, options.compile_cache)
    ids = tokenizer.encode(options.prompt).ids
    if not ids:
        raise ConfigError("--prompt is empty; give some text to continue.")
    sys.stdout.write(options.prompt)
    sys.stdout.flush()
    if options.stream:
        complete(model, tokenizer, ids, kwargs, out=sys.stdout)
    else:
        sys.stdout.write(complete(model, tokenizer, ids, kwargs))
    sys.stdout.write("\n")
    return 0


def chat_prompt_ids(tokenizer, messages, template, room):
    """Token ids of the conversation, dropping the oldest turns (never the system message) until it fits
    ``room`` tokens."""
    from ..serve.protocol import render_chat
    while True:
        ids = tokenizer.encode(render_chat(messages, template)).ids
        turns = [i for i, m in enumerate(messages) if m["role"] != "system"]
        if len(ids) <= room or len(turns) <= 1:
            break
        del messages[turns[0]]
    if len(ids) > room:
        raise ConfigError(f"the message is {len(ids)} tokens with its template; the model's context leaves "
                          f"{room} (max_position_embeddings minus --max-new-tokens): shorten it or lower "
                          f"--max-new-tokens.")
    return ids


def chat(options, stdin=None, stdout=None):
    """``gptlocal chat``: one user message per stdin line; each reply streamed, then a newline."""
    from ..serve.protocol import PLAIN_CHAT_STOP
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    kwargs = sampling(options)
    model, tokenizer, template = load(options.model, options.device_target, options.compile_cache)
    stop = () if template else (PLAIN_CHAT_STOP,)
    room = model.token_positions - options.max_new_tokens
    if room < 1:
        raise ConfigError(f"--max-new-tokens {options.max_new_tokens} leaves no room for a message in the model's "
                          f"{model.config.max_position_embeddings} positions; lower it.")
    messages = [{"role": "system", "content": options.system}] if options.system else []
    interactive = stdin.isatty()
    if interactive:
        sys.stderr.write(f"chatting with {options.model} (empty line or Ctrl-D ends)\n")
    while True:
        if interactive:
            sys.stderr.write(">> ")
            sys.stderr.flush()
        line = stdin.readline()
        if not line or (interactive and not line.strip()):
            break
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        ids = chat_prompt_ids(tokenizer, messages, template, room)
        reply = complete(model, tokenizer, ids, kwargs, out=stdout, stop=stop)
        stdout.write("\n")
        stdout.flush()
        messages.append({"role": "assistant", "content": reply.strip()})
    return 0

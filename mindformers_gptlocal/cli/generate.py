"""``gptlocal generate`` and ``gptlocal chat``: a model directory, no YAML (as ``litgpt generate``/``chat``).

Both load through the inference runtime's one loader (``model/loader.py``: the folder checked, then
``GPTLocalForCausalLM.from_pretrained``) and call ``runtime/generate.py``'s ``generate`` (what ``model.generate``
is); tokens are streamed through its ``stop_when`` hook, which sees every new token, into the runtime's
``Detokenizer`` (stop strings, hold-back). Chat renders the conversation with the model directory's chat template,
or the plain ``User: ... / Assistant:`` form, exactly as ``gptlocal serve`` does (``serve/protocol.py``), and
stops a reply at the next ``User:`` turn in the plain form.
"""
import sys
import time

from ..errors import ConfigError
from ..generation.defaults import CLI as CLI_DEFAULTS
from ..generation.sampling import sampling_options


def load(options):
    """(model, tokenizers.Tokenizer, chat template or None) of ``--model`` (``model/loader.py load``)."""
    from ..model.loader import load as load_model_dir
    return load_model_dir(options.model, options.device_target, options.compile_cache,
                          cache_days=getattr(options, "compile_cache_days", None),
                          cache_mb=getattr(options, "compile_cache_mb", None))


def sampling(options):
    """model.generate keywords of the --temperature/--top-k/--top-p/--repetition-penalty/--max-new-tokens/--seed
    flags."""
    for flag, value, low in (("--max-new-tokens", options.max_new_tokens, 1), ("--top-k", options.top_k, 0)):
        if value < low:
            raise ConfigError(f"{flag} must be >= {low}, got {value}.")
    if options.temperature < 0:
        raise ConfigError(f"--temperature must be >= 0 (0 = greedy), got {options.temperature}.")
    if not 0 < options.top_p <= 1:
        raise ConfigError(f"--top-p must be in (0, 1], got {options.top_p}.")
    penalty = getattr(options, "repetition_penalty", CLI_DEFAULTS["repetition_penalty"])
    if not penalty > 0:
        raise ConfigError(f"--repetition-penalty must be > 0 (1 = off), got {penalty}.")
    kwargs = {"max_new_tokens": options.max_new_tokens,
              **sampling_options(options.temperature, options.top_k, options.top_p), "repetition_penalty": penalty}
    if kwargs["do_sample"]:
        kwargs["seed"] = options.seed
    return kwargs


class Streamer:
    """``stop_when`` hook of one prompt: the runtime's ``Detokenizer`` over the generated ids (EOS left out, special
    tokens skipped), its new text written to ``out``; a stop string ends the reply (not printed)."""

    def __init__(self, tokenizer, out, stop=(), eos=None, lead=""):
        from ..runtime.detokenizer import Detokenizer
        self.out, self.eos, self.lead = out, eos, lead  # lead: written before the first text (generate's prompt)
        self.text_of = Detokenizer(lambda ids: tokenizer.decode(ids, skip_special_tokens=True), stop)

    def __call__(self, rows, generated):
        self._write(self.text_of.update([t for t in generated[0] if t != self.eos]))
        return [self.text_of.stopped for _ in rows]

    @property
    def text(self):
        return self.text_of.text

    def _write(self, delta):
        if delta and self.out is not None:
            self.out.write(self.lead + delta)
            self.lead = ""
            self.out.flush()

    def finish(self):
        self._write(self.text_of.rest())
        if self.lead and self.out is not None:  # no text came: the lead still goes out
            self.out.write(self.lead)
            self.lead = ""
        return self.text


def complete(model, tokenizer, ids, kwargs, out=None, stop=(), lead="", stats=None):
    """Generate after ``ids``; the reply text (cut at a stop string), streamed to ``out`` if given, after ``lead``
    (written with the first text, so a prompt the model refuses is never echoed). ``stats``: a dict that gets
    ``seconds`` and ``new_tokens`` of the generate call."""
    from ..runtime.generate import generate
    eos = model.config.eos_token_id
    streamer = Streamer(tokenizer, out, stop, eos, lead) if out is not None or stop else None
    start = time.perf_counter()
    sequences = generate(model, [ids], stop_when=streamer, eos_token_id=eos, **kwargs)
    if stats is not None:
        stats.update(seconds=time.perf_counter() - start, new_tokens=len(sequences[0]) - len(ids))
    if streamer is None:
        new = [t for t in sequences[0][len(ids):] if t != eos]
        return tokenizer.decode(new, skip_special_tokens=True)
    streamer(range(1), [sequences[0][len(ids):]])  # the last token (and a run of zero new tokens)
    if out is None:
        return streamer.text
    return streamer.finish()


def generate(options):
    """``gptlocal generate``: the prompt, then its continuation, on stdout; with ``--num-samples N`` N of them,
    each under a ``--- sample i/N ---`` line, sample i seeded ``--seed + i - 1`` (so sample 1 is the one-sample run)."""
    kwargs = sampling(options)
    samples = getattr(options, "num_samples", CLI_DEFAULTS["num_samples"])
    if samples < 1:
        raise ConfigError(f"--num-samples must be >= 1, got {samples}.")
    stop = [s for s in getattr(options, "stop", None) or [] if s]
    model, tokenizer, _ = load(options)
    ids = tokenizer.encode(options.prompt).ids
    if not ids:
        raise ConfigError("--prompt is empty; give some text to continue.")
    tokens, seconds = 0, 0.0
    for i in range(samples):
        stats, sample = {}, dict(kwargs)
        if "seed" in sample:
            sample["seed"] = kwargs["seed"] + i
        head = f"--- sample {i + 1}/{samples} ---\n" if samples > 1 else ""
        if options.stream:  # the prompt goes out with the first text: a prompt the model refuses is not echoed
            complete(model, tokenizer, ids, sample, out=sys.stdout, stop=stop, lead=head + options.prompt,
                     stats=stats)
        else:
            sys.stdout.write(head + options.prompt + complete(model, tokenizer, ids, sample, stop=stop, stats=stats))
        sys.stdout.write("\n")
        sys.stdout.flush()
        tokens, seconds = tokens + stats["new_tokens"], seconds + stats["seconds"]
    print(f"[gptlocal] {tokens} new tokens in {seconds:.2f} s ({tokens / max(seconds, 1e-9):.1f} tokens/s, "
          f"prompt and compile included)", file=sys.stderr)
    return 0


USER_MARK, ASSISTANT_MARK = "user: ", "assistant: "  # chat's transcript on stdout


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
    """``gptlocal chat``: one user message per stdin line; each reply streamed after ``assistant: ``, then a newline.
    Through a pipe each message is written first as ``user: ...``, so the transcript tells them apart (on a terminal
    the user's line is on the screen already, after the ``>>`` prompt)."""
    from ..serve.protocol import PLAIN_CHAT_STOP, chat_template
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    kwargs = sampling(options)
    chosen = getattr(options, "chat_template", None)
    if chosen:
        chat_template(chosen, None)  # a bad --chat-template: one line before the model loads
    model, tokenizer, template = load(options)
    template = chat_template(chosen, template)
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
        if not interactive:
            stdout.write(f"{USER_MARK}{messages[-1]['content']}\n")
        stdout.write(ASSISTANT_MARK)
        reply = complete(model, tokenizer, ids, kwargs, out=stdout, stop=stop)
        stdout.write("\n")
        stdout.flush()
        messages.append({"role": "assistant", "content": reply.strip()})
    return 0

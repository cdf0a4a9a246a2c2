"""gpt_local as an lm-evaluation-harness model, registered as ``gptlocal``.

    lm_eval --model gptlocal --model_args pretrained=DIR,batch_size=8 --tasks ...
    lm_eval.simple_evaluate(model=GPTLocalLM(pretrained=DIR), tasks=[...])
    gptlocal eval --model DIR --tasks T1,T2

It answers lm-eval's three request types the way lm-eval's own Hugging Face backend (``HFLM``) does,
so results on weights exported with ``gptlocal convert ms2hf`` are the same: the same tokenizer
(``AutoTokenizer`` of the model directory, ``HFLMTokens``: encode/decode as HFLM's), the same request order and
batching (lm-eval's ``Collator``), the same left truncation to ``max_length`` and the same
one-token-continuation sharing. What differs is the model: gpt_local's forward pass (fp32 logits,
log-softmax and the pick of each target token on the device, so only [B, S] numbers come back) and
its KV-cached ``generate`` for ``generate_until``.

Compiles are most of a small evaluation's time (a few seconds a graph shape against tens of milliseconds a
batch), so the shapes are chosen to be few: ``WidthPlan`` picks the scoring widths from all of a call's
batches at once (a new width is compiled only where the padding it saves costs more than the compile, by the
compile and call times it measured), and ``generate_until`` fills a greedy chunk with padding rows to the fixed
batch size, so a task's last, smaller chunk reuses the compiled graphs. After each new shape's first call the
heap the compile freed goes back to the system (``host_memory.release_freed_heap``). With ``compile_cache`` on,
the scoring graphs and ``generate``'s go through ``runtime/graph_cache.py`` (``GraphCache``: loaded, not compiled,
by a second run).
"""
import bisect
import copy
import os
import sys
import time

import numpy as np
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (Collator, _add_special_kwargs, configure_pad_token, handle_stop_sequences,
                                  has_bos_prefix, normalize_gen_kwargs)

from ..errors import ConfigError, DataError
from ..generation.defaults import EVAL as EVAL_DEFAULTS
from ..generation.loop import is_greedy, resolve_options
from ..generation.sampling import sampling_options
from ..host_memory import release_freed_heap
from ..runtime.buckets import bucket_of, length_bucket, width_buckets
from ..runtime.detokenizer import cut_at_stop, find_stop
from ..runtime.generate import generate
from ..model.loader import check_model_dir, load_model

DEVICE_TARGETS = ("CPU", "GPU", "Ascend")
GEN_OPTIONS = {"do_sample", "temperature", "top_k", "top_p", "repetition_penalty"}


def import_transformers_without_torch():
    """Import transformers with ``USE_TORCH=0`` when neither it nor torch is loaded yet: transformers imports torch
    at its import wherever torch is installed (``transformers/utils/generic.py``), ~230 MB and ~2 s an eval over
    MindSpore never uses; a tokenizer needs none of it. Called by ``gptlocal eval`` for its own process (and the
    eval benchmark's worker) before the model is built; the variable is only read at that import and is put back at
    once. Any other process (``lm_eval --model gptlocal``, a test) imports transformers itself, torch included."""
    if "transformers" in sys.modules or "torch" in sys.modules or "USE_TORCH" in os.environ:
        return
    quiet = os.environ.get("TRANSFORMERS_NO_ADVISORY_WARNINGS")
    os.environ.update(USE_TORCH="0", TRANSFORMERS_NO_ADVISORY_WARNINGS="1")  # and no "None of PyTorch..." line
    try:
        from transformers import AutoTokenizer  # noqa: F401  (the import that reads the variable)
    finally:
        del os.environ["USE_TORCH"]
        if quiet is None:
            del os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"]
        else:
            os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = quiet


class HFLMTokens:
    """lm-eval's ``HFLM`` tokenizer methods (tok_encode, tok_batch_encode, tok_decode, eot_token_id,
    prefix_token_id; lm-eval 0.4.x ``models/huggingface.py``), so every request is tokenized exactly as lm-eval's
    hf model does it. Ours, not HFLM's borrowed: ``lm_eval.models.huggingface`` imports torch, accelerate and
    peft (~230-480 MB of RSS and ~4 s of import) for five methods that need a tokenizer only.
    ``tests/evaluation/test_eval_tokens.py`` compares them with HFLM's. Reads ``self.tokenizer``,
    ``self.add_bos_token``, ``self.custom_prefix_token_id`` and ``self.backend``. Batches come back as numpy
    arrays (HFLM's are torch tensors of the same values)."""

    @property
    def eot_token_id(self):
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self):
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        if self.tokenizer.bos_token_id is not None:
            return self.tokenizer.bos_token_id
        return self.tokenizer.eos_token_id

    def tok_encode(self, string, add_special_tokens=None, left_truncate_len=None, **kwargs):
        special = _add_special_kwargs(add_special_tokens, self.add_bos_token)
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            special["add_special_tokens"] = False  # the string starts with the prefix token already
        encoding = self.tokenizer.encode(string, **special)
        if left_truncate_len:
            encoding = encoding[-left_truncate_len:]
        return encoding

    def tok_batch_encode(self, strings, padding_side="left", left_truncate_len=None, truncation=False):
        old_padding_side = self.tokenizer.padding_side
        self.tokenizer.padding_side = padding_side
        special = {}
        if self.backend == "causal":
            if has_bos_prefix(strings[0], getattr(self.tokenizer, "bos_token", None)):
                special = {"add_special_tokens": False}
            elif self.add_bos_token is not None:
                special = {"add_special_tokens": self.add_bos_token}
        encoding = self.tokenizer(strings, truncation=truncation, padding="longest", return_tensors="np", **special)
        input_ids, attention_mask = encoding["input_ids"], encoding["attention_mask"]
        if left_truncate_len:
            input_ids, attention_mask = input_ids[:, -left_truncate_len:], attention_mask[:, -left_truncate_len:]
        self.tokenizer.padding_side = old_padding_side
        return input_ids, attention_mask

    def tok_decode(self, tokens, skip_special_tokens=True):
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)


class _SharedLogits:
    """``Collator.get_cache``'s ``logits`` argument, which it expands and chunks (torch's ``expand``/``chunk``)
    once per request sharing a batch row; ours reads the row's numbers from the batch's numpy results instead, so
    this stands in for the tensor lm-eval would hand around, without importing torch."""

    def expand(self, *shape):
        return self

    def chunk(self, count):
        return [self] * count


class Progress:
    """``[gptlocal eval] loglikelihood 120/400 requests, 3,456 tokens/s`` on stderr, at most every few seconds."""

    def __init__(self, what, total, every=10.0, enabled=True):
        self.what, self.total, self.every, self.enabled = what, total, every, enabled and total > 0
        self.done = self.tokens = 0
        self.start = self.last = time.perf_counter()

    def update(self, requests, tokens):
        self.done += requests
        self.tokens += tokens
        now = time.perf_counter()
        if self.enabled and (now - self.last >= self.every or self.done >= self.total):
            self.last = now
            rate = self.tokens / max(now - self.start, 1e-9)
            print(f"[gptlocal eval] {self.what} {self.done}/{self.total} requests, {rate:,.0f} tokens/s, "
                  f"{now - self.start:.1f} s", file=sys.stderr, flush=True)


def _scorer(lm):
    """A Cell: ids [B, S], targets [B, S], last [B] -> (log p(target) [B, S], greedy ids [B, S],
    log-probs at position ``last`` [B, V]) -- log-softmax in fp32 on the device, as HFLM does in torch."""
    import mindspore as ms
    from mindspore import nn, ops

    class Scorer(nn.Cell):
        def __init__(self):
            super().__init__()
            self.lm = lm
            self.log_softmax = ops.LogSoftmax(axis=-1)
            self.gather_d = ops.GatherD()
            self.argmax = ops.Argmax(axis=-1, output_type=ms.int32)

        def construct(self, input_ids, targets, last_index):
            log_probs = self.log_softmax(self.lm(input_ids))
            batch, _, vocab = log_probs.shape
            picked = ops.squeeze(self.gather_d(log_probs, 2, ops.expand_dims(targets, -1)), -1)
            index = ops.broadcast_to(ops.reshape(last_index, (batch, 1, 1)), (batch, 1, vocab))
            last = ops.reshape(self.gather_d(log_probs, 1, index), (batch, vocab))
            return picked, self.argmax(log_probs), last
    scorer = Scorer()
    scorer.set_train(False)
    return scorer


def plan_widths(needs, compiled, compile_seconds, column_seconds, limit):
    """The widths to compile and run: ``needs`` (columns each batch needs), ``compiled`` (widths with a graph
    already), a compile's cost and one batch call's cost per column, in seconds. Minimises compile_seconds
    per new width + column_seconds x width per batch, each batch at the smallest chosen width that holds it;
    the candidates are ``length_bucket`` of each need and the compiled widths. Returns the chosen widths
    (ascending)."""
    needs = sorted(needs)
    cands = sorted({length_bucket(n, limit) for n in needs} | {w for w in compiled if w >= needs[0]})
    best, back = [], []  # best[i]: least cost of serving every need <= cands[i] with cands[i] the largest chosen
    for i, width in enumerate(cands):
        opened = 0.0 if width in compiled else compile_seconds
        options = [(opened + column_seconds * width * bisect.bisect_right(needs, width), -1)]
        for j in range(i):
            served = bisect.bisect_right(needs, width) - bisect.bisect_right(needs, cands[j])
            options.append((best[j] + opened + column_seconds * width * served, j))
        cost, j = min(options)
        best.append(cost)
        back.append(j)
    last = min((i for i, w in enumerate(cands) if w >= needs[-1]), key=lambda i: (best[i], i))
    chosen = []
    while last >= 0:
        chosen.append(cands[last])
        last = back[last]
    return sorted(chosen)


class WidthPlan:
    """The scorer's widths over one model's run: compiled widths, measured costs, the current plan.

    The first batch (the longest: lm-eval sorts by length) compiles its ``length_bucket``; until a call at a
    compiled width has been timed, batches take the smallest compiled width that holds them (else their
    bucket). From then on ``plan_widths`` chooses over all batches still to come, with the compile cost (first
    call less a timed call, per column) and the call cost per column measured here; it re-plans when a new width
    has compiled. ``adaptive=False`` is the plain path: every batch at its own ``length_bucket``."""

    def __init__(self, limit, adaptive=True):
        self.limit, self.adaptive = limit, adaptive
        self.compiled = {}  # width -> seconds of its first call (compile + run)
        self.column_seconds = None  # median over timed calls of seconds / width
        self._per_column = []
        self.chosen = None

    def compile_seconds(self):
        return float(np.mean([max(t - self.column_seconds * w, 0.0) for w, t in self.compiled.items()]))

    def width(self, need, remaining):
        """The width for a batch of ``need`` columns; ``remaining``: the needs of it and every later batch."""
        if not self.adaptive:
            return length_bucket(need, self.limit)
        if self.column_seconds is None:
            held = [w for w in self.compiled if w >= need]
            return min(held) if held else length_bucket(need, self.limit)
        if self.chosen is None or need > self.chosen[-1]:
            self.chosen = plan_widths(remaining, self.compiled, self.compile_seconds(), self.column_seconds,
                                      self.limit)
        return self.chosen[bisect.bisect_left(self.chosen, need)]

    def record(self, width, seconds):
        """A call at ``width`` took ``seconds``; returns whether it was that width's first (a compile)."""
        if width not in self.compiled:
            self.compiled[width] = seconds
            self.chosen = None  # re-plan with the new compile's cost
            return True
        self._per_column.append(seconds / width)
        first = self.column_seconds is None
        self.column_seconds = float(np.median(self._per_column[-64:]))
        if first:
            self.chosen = None
        return False


@register_model("gptlocal")
class GPTLocalLM(HFLMTokens, TemplateLM):
    """lm-eval model over a gpt_local model directory (config.json + model.safetensors + tokenizer files).

    Model args: ``pretrained`` (the directory), ``batch_size`` (default 8), ``max_length`` (default the
    model's max_position_embeddings, as HFLM reads n_positions), ``device_target`` (CPU/GPU/Ascend),
    ``max_gen_toks`` (default 256, as HFLM), ``seed`` (sampling in generate_until), ``add_bos_token``,
    ``prefix_token_id``, ``progress`` (stderr progress lines, default on), ``width_plan`` (``adaptive``, the
    default: ``WidthPlan``; ``buckets``: every scoring batch at its own length bucket, the plain path),
    ``compile_cache`` (``off``, the default here; ``on``: ``runtime.graph_cache.default_root()``; or a folder: the
    scoring graphs and generate_until's through MindSpore's compile cache, ``runtime/graph_cache.py``
    ``GraphCache``, set on the model as ``model.graph_cache``; ``gptlocal eval`` turns it on),
    ``compile_cache_days`` / ``compile_cache_mb`` (its bounds: default 14 days, 1024 MB).
    """

    backend = "causal"
    think_end_token = None

    def __init__(self, pretrained=None, batch_size=8, max_length=None, device_target="CPU",
                 max_gen_toks=EVAL_DEFAULTS["max_gen_toks"], seed=EVAL_DEFAULTS["seed"], add_bos_token=None,
                 prefix_token_id=None, progress=True, mode="graph",
                 width_plan="adaptive", compile_cache="off", compile_cache_days=None, compile_cache_mb=None,
                 **kwargs):
        super().__init__()
        unknown = sorted(k for k in kwargs if k not in ("device", "dtype", "trust_remote_code", "max_batch_size"))
        if unknown:
            raise ConfigError(f"gptlocal model args: unknown '{unknown[0]}'; known: pretrained, batch_size, "
                              f"max_length, device_target, max_gen_toks, seed, add_bos_token, prefix_token_id, "
                              f"progress, width_plan, compile_cache, compile_cache_days, compile_cache_mb.")
        if str(width_plan) not in ("adaptive", "buckets"):
            raise ConfigError(f"gptlocal model args: width_plan={width_plan!r}; use adaptive (the default: few "
                              f"compiled widths) or buckets (one width per length bucket).")
        if not pretrained:
            raise ConfigError("gptlocal model args: pretrained is not given, so there is no model directory; give "
                              "pretrained=DIR, e.g. output/model or a `gptlocal convert hf2ms` folder.")
        check_model_dir(str(pretrained), "gptlocal model args: pretrained=", tokenizer=False)
        if str(device_target) not in DEVICE_TARGETS:
            raise ConfigError(f"gptlocal model args: device_target={device_target!r}; use one of "
                              f"{', '.join(DEVICE_TARGETS)}.")
        try:
            self.batch_size = int(batch_size)
        except (TypeError, ValueError):
            raise ConfigError(f"gptlocal model args: batch_size={batch_size!r} must be a whole number "
                              f"('auto' is not supported).") from None
        if self.batch_size < 1:
            raise ConfigError(f"gptlocal model args: batch_size={batch_size} must be at least 1.")
        self.pretrained = str(pretrained)
        # the scoring graphs, and generate's, through the compile cache where ``compile_cache`` asks for one
        self.model = load_model(self.pretrained, device_target, compile_cache, mode=mode,
                                cache_flag="gptlocal model args: compile_cache=", cache_days=compile_cache_days,
                                cache_mb=compile_cache_mb,
                                max_batch_size=max(self.batch_size, 8))
        self.config = self.model.config
        positions = int(self.model.token_positions)  # max_position_embeddings less a prefix-tuning prefix
        self._max_length = int(max_length) if max_length else positions
        if self._max_length > positions:
            raise ConfigError(f"gptlocal model args: max_length={max_length} exceeds the model's "
                              f"{positions} positions (max_position_embeddings={self.config.max_position_embeddings}"
                              f" less a prefix-tuning prefix).")
        self._max_gen_toks = int(max_gen_toks)
        self.seed = None if seed is None else int(seed)
        self.add_bos_token = None if add_bos_token is None else bool(add_bos_token)
        # as HFLM._create_tokenizer: the fast tokenizer, add_bos_token passed on when given
        extra = {} if self.add_bos_token is None else {"add_bos_token": self.add_bos_token}
        from transformers import AutoTokenizer
        self.tokenizer = configure_pad_token(AutoTokenizer.from_pretrained(self.pretrained, use_fast=True, **extra))
        self.custom_prefix_token_id = None if prefix_token_id is None else int(prefix_token_id)
        self.progress = str(progress).lower() not in ("0", "false", "no")
        self._scorer = _scorer(self.model)
        self._compile_cache = self.model.graph_cache
        self._widths = WidthPlan(self._max_length, adaptive=str(width_plan) == "adaptive")
        self._kept_compile = None  # the last _score's first-call seconds from the compile cache
        self._generate_calls = 0
        self._generate_shapes = set()  # (batch, prompt width bucket, cache rows) generate has run

    def compiled_shapes(self):
        """The graph shapes this model has compiled: scoring widths (batch ``batch_size``) and generate's
        (batch, prompt width bucket, cache rows)."""
        return {"score_widths": sorted(self._widths.compiled), "generate": sorted(self._generate_shapes)}

    @property
    def max_length(self):
        return self._max_length

    @property
    def max_gen_toks(self):
        return self._max_gen_toks

    @property
    def tokenizer_name(self):
        return self.tokenizer.name_or_path.replace("/", "__")

    def get_model_info(self):
        return {"model_num_parameters": int(sum(p.size for p in self.model.get_parameters())),
                "model_dtype": str(self.config.compute_dtype)}

    # --- loglikelihood -----------------------------------------------------------------------------
    def _score(self, rows, width=None):
        """One compiled call for up to batch_size token rows: per row (target log-probs, greedy ids,
        log-probs at its last position), with row r's target at position t = rows[r][t + 1]. ``width``: the
        padded width (default the rows' ``length_bucket``)."""
        import mindspore as ms
        width = width or length_bucket(max(len(r) for r in rows) - 1, self.max_length)
        ids = np.zeros((self.batch_size, width), np.int32)
        targets = np.zeros((self.batch_size, width), np.int32)
        last = np.zeros(self.batch_size, np.int32)
        for i, row in enumerate(rows):
            ids[i, :len(row) - 1] = row[:-1]
            targets[i, :len(row) - 1] = row[1:]
            last[i] = len(row) - 2
        inputs = ms.Tensor(ids), ms.Tensor(targets), ms.Tensor(last)
        self._kept_compile = None
        if self._compile_cache is not None and width not in self._widths.compiled:  # a new graph: cached
            (picked, greedy, last_probs), self._kept_compile = self._compile_cache.call(self._scorer, inputs)
        else:
            picked, greedy, last_probs = self._scorer(*inputs)
        return picked.asnumpy(), greedy.asnumpy(), last_probs.asnumpy()

    def _loglikelihood_tokens(self, requests, disable_tqdm=False, **kwargs):
        def _collate(req):
            toks = req[1] + req[2]
            return -len(toks), tuple(toks)

        def _lookup_one_token_cont(req):
            return req[-2] + req[-1][:-1]

        re_ord = Collator(requests, sort_fn=_collate, group_by="contexts", group_fn=_lookup_one_token_cont)
        progress = Progress("loglikelihood", len(requests), enabled=self.progress and not disable_tqdm)
        res = []
        placeholder = _SharedLogits()
        chunks = list(re_ord.get_batched(n=self.batch_size))  # all batches first: WidthPlan sees what is to come
        batches = []
        for chunk in chunks:
            rows = []
            for _, context_enc, continuation_enc in chunk:
                if not context_enc or not continuation_enc:
                    raise DataError("gptlocal eval: a loglikelihood request has an empty context or continuation.")
                if len(continuation_enc) > self.max_length:
                    raise DataError(f"gptlocal eval: a continuation of {len(continuation_enc)} tokens exceeds "
                                    f"max_length={self.max_length}.")
                rows.append((context_enc + continuation_enc)[-(self.max_length + 1):])  # left truncation, as HFLM
            batches.append(rows)
        needs = [max(len(r) for r in rows) - 1 for rows in batches]
        self._widths.chosen = None  # plan this call's batches (the compiled widths and measured costs carry over)
        for index, (chunk, rows) in enumerate(zip(chunks, batches)):
            width = self._widths.width(needs[index], needs[index:])
            started = time.perf_counter()
            picked, greedy, last_probs = self._score(rows, width)
            seconds = time.perf_counter() - started
            if self._kept_compile is not None:  # from the compile cache: the plan counts the compile it saved
                seconds = max(seconds, self._kept_compile)
            if self._widths.record(width, seconds):
                release_freed_heap()  # a new width compiled: hand the compile's freed heap back
            for i, ((request_str, ctx_tokens, cont_toks), row) in enumerate(zip(chunk, rows)):
                end = len(row) - 1  # scored positions: [end - contlen, end)
                start = end - len(cont_toks)
                head = float(picked[i, start:end - 1].astype(np.float64).sum())
                head_greedy = bool(np.array_equal(greedy[i, start:end - 1], cont_toks[:-1]))
                for request_str_, cont_, _ in re_ord.get_cache(req_str=request_str, cxt_toks=ctx_tokens,
                                                                cont_toks=cont_toks, logits=placeholder):
                    answer = (head + float(last_probs[i, cont_[-1]]),
                              head_greedy and int(greedy[i, end - 1]) == cont_[-1])
                    res.append(answer)
                    if request_str_ is not None:
                        self.cache_hook.add_partial("loglikelihood", request_str_, answer)
                    progress.update(1, len(row) - 1)
        return re_ord.get_original(res)

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        """HFLM's rolling windows (context_len 1, prefix token first), all requests' windows batched."""
        windows, owners = [], []
        for index, (string,) in enumerate(req.args for req in requests):
            for window in map(lm_utils.make_disjoint_window,
                              lm_utils.get_rolling_token_windows(token_list=self.tok_encode(string),
                                                                 prefix_token=self.prefix_token_id,
                                                                 max_seq_len=self.max_length, context_len=1)):
                windows.append((None,) + window)
                owners.append(index)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm) if windows else []
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, scores):
            totals[owner] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # --- generate_until ------------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm=False):
        from ..runtime.runner import cache_length  # the cache shape generate will use: compiles are counted by it

        def _collate(req):
            toks = self.tok_encode(req[0])
            return -len(toks), req[0]

        re_ords = Collator([req.args for req in requests], sort_fn=_collate, group_by="gen_kwargs",
                           group_fn=lambda x: x[1])
        eos = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        progress = Progress("generate_until", len(requests), enabled=self.progress and not disable_tqdm)
        res = []
        for chunk in re_ords.get_batched(n=self.batch_size):
            contexts, all_gen_kwargs = zip(*chunk)
            gen_kwargs = all_gen_kwargs[0]
            if not isinstance(gen_kwargs, dict):
                raise DataError(f"gptlocal eval: generation kwargs must be a dict, got {gen_kwargs!r}.")
            kwargs = normalize_gen_kwargs(copy.deepcopy(gen_kwargs), self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen_toks = int(kwargs.pop("max_gen_toks"))
            max_ctx_len = self.max_length - max_gen_toks
            if max_ctx_len <= 0:
                raise ConfigError(f"gptlocal eval: max_gen_toks={max_gen_toks} leaves no room for a prompt in "
                                  f"max_length={self.max_length}; lower max_gen_toks.")
            options = self._generation_options(kwargs)
            # HFLM left-pads the batch and cuts it to the last max_ctx_len columns: the same as cutting each
            # row to its last max_ctx_len tokens; gpt_local's generate takes the ragged rows as they are.
            context_enc, attn_masks = self.tok_batch_encode(list(contexts), left_truncate_len=max_ctx_len)
            prompts = [[int(t) for t, keep in zip(ids, mask) if keep]
                       for ids, mask in zip(context_enc.tolist(), attn_masks.tolist())]
            if not all(prompts):
                raise DataError("gptlocal eval: a generate_until context encodes to no tokens.")
            stops = [term for term in until if term]

            def stop_when(rows, generated):  # padding rows (index >= real) stop at once
                return [row >= real or find_stop(self.tok_decode(tokens), stops) >= 0
                        for row, tokens in zip(rows, generated)]
            self._generate_calls += 1
            seed = None if self.seed is None else self.seed + self._generate_calls
            real = len(prompts)
            padded = real < self.batch_size and is_greedy(resolve_options(None, **options))
            if padded:
                # a smaller last chunk: padding rows (copies of its last prompt: no longer; stopped at their first
                # token) keep the batch, hence the compiled cache graphs. Greedy only: a seeded sampler's draws stay
                prompts = prompts + [prompts[-1]] * (self.batch_size - real)
            rows = cache_length(max(map(len, prompts)) + max_gen_toks, self.model.token_positions)
            shape = (len(prompts), bucket_of(max(map(len, prompts)), width_buckets(rows)), rows)
            sequences = generate(self.model, prompts, generation_config={}, max_new_tokens=max_gen_toks,
                                 eos_token_id=self.config.eos_token_id, seed=seed,
                                 stop_when=stop_when if stops or padded else None, **options)[:real]
            if shape not in self._generate_shapes:
                self._generate_shapes.add(shape)
                release_freed_heap()
            prompts = prompts[:real]
            for prompt, sequence, context in zip(prompts, sequences, contexts):
                text = cut_at_stop(self.tok_decode(sequence[len(prompt):]), stops)
                res.append(text)
                self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
                progress.update(1, len(sequence) - len(prompt))
        return re_ords.get_original(res)

    @staticmethod
    def _generation_options(kwargs):
        """lm-eval gen_kwargs -> gpt_local generate options (greedy unless do_sample with a temperature > 0)."""
        unknown = sorted(k for k in kwargs if k not in GEN_OPTIONS)
        if unknown:
            raise ConfigError(f"gptlocal eval: generation option '{unknown[0]}' is not supported; supported: "
                              f"{', '.join(sorted(GEN_OPTIONS))}, until, max_gen_toks.")
        options = dict(kwargs)
        options.update(sampling_options(float(options.pop("temperature", EVAL_DEFAULTS["temperature"]) or 0.0),
                                        options.pop("top_k", None), options.pop("top_p", None),
                                        do_sample=bool(options.pop("do_sample", EVAL_DEFAULTS["do_sample"]))))
        return options

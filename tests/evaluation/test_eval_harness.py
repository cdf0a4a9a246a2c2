"""gpt_local through lm-evaluation-harness equals lm-eval's own `hf` backend on the `gptlocal convert ms2hf`
export: per-request log-likelihoods, acc / acc_norm / exact_match, rolling perplexity, generated text;
contexts longer than max_length; offline local tasks (benchmarks/eval_tasks.py)."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval")
torch = pytest.importorskip("torch")

from conftest import REPO, source_env  # noqa: E402

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
from eval_tasks import write_tasks  # noqa: E402

OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
TASKS = ["gl_choice", "gl_long", "gl_rolling", "gl_until"]


@pytest.fixture(scope="module", autouse=True)
def offline():
    saved = {k: os.environ.get(k) for k in OFFLINE}
    os.environ.update(OFFLINE)
    import mindspore as ms
    mode = ms.get_context("mode")
    yield
    ms.set_context(mode=mode)  # the harness compiles in graph mode; leave the session as it was
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="module")
def task_manager(tmp_path_factory):
    from lm_eval.tasks import TaskManager
    folder = tmp_path_factory.mktemp("tasks")
    write_tasks(str(folder))
    # the local tasks only, as `gptlocal eval` indexes them when it is asked for local tasks only
    # (test_local_tasks_are_indexed_without_lm_evals_own): lm-eval's ~13,000 built-in task YAMLs cost ~10-15 s
    return TaskManager(include_path=str(folder), include_defaults=False), str(folder)


def export_pair(root, tokenizer_dir, seed=0, sharpen=8.0, **shape):
    """A random GPT-2 (sharpened, so choices differ clearly) -> gpt_local dir -> `ms2hf` export (the reference)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from mindformers_gptlocal.checkpoint.hf_gpt2 import hf_to_ms, ms_to_hf
    torch.manual_seed(seed)
    hf = GPT2LMHeadModel(GPT2Config(bos_token_id=0, eos_token_id=0, **shape)).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "wte" in name:
                param.mul_(sharpen)
            elif "ln_" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn_like(param))
    hf.save_pretrained(str(root / "hf0"))
    del hf
    for name in os.listdir(tokenizer_dir):
        if name != "config.json":
            shutil.copyfile(os.path.join(tokenizer_dir, name), str(root / "hf0" / name))
    hf_to_ms(str(root / "hf0"), str(root / "ms"))
    ms_to_hf(str(root / "ms"), str(root / "ref"))
    shutil.rmtree(str(root / "hf0"))
    return str(root / "ms"), str(root / "ref")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, corpus):
    return export_pair(tmp_path_factory.mktemp("tiny"), corpus["model_dir"], vocab_size=512, n_positions=64,
                       n_embd=64, n_layer=2, n_head=4)


def evaluate_both(ms_dir, ref_dir, task_manager, tasks, limit, batch_size=4, max_length=None):
    """Both backends through ``simple_evaluate``. lm-eval's environment report (``add_env_info``: torch's
    ``collect_env``, which runs ``pip list`` and a dozen probes, ~1 s of CPU a call) is left out of these runs: no test
    here reads it (``gptlocal eval``'s own, torch-free one is test_cli_prints_table_and_writes_json's)."""
    import lm_eval.evaluator
    from mindformers_gptlocal.evaluation.harness import GPTLocalLM
    extra = f",max_length={max_length}" if max_length else ""
    report, lm_eval.evaluator.add_env_info = lm_eval.evaluator.add_env_info, lambda storage: None
    try:
        ours = lm_eval.simple_evaluate(model=GPTLocalLM(pretrained=ms_dir, batch_size=batch_size,
                                                        max_length=max_length),
                                       tasks=tasks, task_manager=task_manager, limit=limit, log_samples=True)
        ref = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={ref_dir},batch_size={batch_size},"
                                                             f"device=cpu,dtype=float32{extra}",
                                      tasks=tasks, task_manager=task_manager, limit=limit, log_samples=True)
    finally:
        lm_eval.evaluator.add_env_info = report
    return ours, ref


def assert_same_results(ours, ref, tasks):
    worst = 0.0
    for task in tasks:
        mine, theirs = ours["samples"][task], ref["samples"][task]
        assert [s["doc_id"] for s in mine] == [s["doc_id"] for s in theirs] and mine
        for a, b in zip(mine, theirs):
            if task == "gl_until":
                assert a["resps"] == b["resps"], (a["resps"], b["resps"])
                assert a["exact_match"] == b["exact_match"]
                continue
            for ra, rb in zip(a["resps"], b["resps"]):
                if task == "gl_rolling":
                    worst = max(worst, abs(ra[0] - rb[0]))
                    # a document's summed log-likelihood: 1e-4 absolute, or 1e-6 relative for long sums
                    assert abs(ra[0] - rb[0]) <= max(1e-4, 1e-6 * abs(rb[0])), (ra, rb)
                else:
                    (la, ga), (lb, gb) = ra[0], rb[0]
                    worst = max(worst, abs(la - lb))
                    assert abs(la - lb) <= 1e-4 and ga == gb, (task, a["doc_id"], ra, rb)
            for metric in ("acc", "acc_norm"):
                if metric in b:
                    assert a[metric] == b[metric], (task, a["doc_id"], metric)
        for key, value in ref["results"][task].items():
            if "stderr" in key or not isinstance(value, float):
                continue
            if "perplexity" in key or "bits_per_byte" in key:
                assert abs(ours["results"][task][key] - value) <= 1e-5 * abs(value), (task, key)
            elif key.split(",")[0] in ("acc", "acc_norm", "exact_match"):
                assert ours["results"][task][key] == value, (task, key)
    return worst


@pytest.fixture(scope="module")
def tiny_runs(tiny, task_manager):
    return evaluate_both(tiny[0], tiny[1], task_manager[0], TASKS, limit=8)


def test_tiny_model_equals_hf_backend(tiny, tiny_runs):
    ours, ref = tiny_runs
    worst = assert_same_results(ours, ref, TASKS)
    print(f"max |loglikelihood diff| {worst:.2e}")
    texts = [s["resps"][0][0] for s in ours["samples"]["gl_until"]]
    assert any(texts) and not any("\n" in t for t in texts)  # generated something, cut at the stop string
    # the gl_long contexts are longer than the model's 64 positions: the left-truncation path ran
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny[0])
    assert min(len(tok.encode(s["arguments"][0][0])) for s in ours["samples"]["gl_long"]) > 64


def test_short_max_length_truncates_like_hf(tiny, task_manager):
    """max_length=24: rolling windows, left-truncated loglikelihood and generate_until prompts (24 - 8 tokens)."""
    ms_dir, ref_dir = tiny
    tasks = ["gl_choice", "gl_rolling", "gl_until"]
    ours, ref = evaluate_both(ms_dir, ref_dir, task_manager[0], tasks, limit=6, batch_size=3, max_length=24)
    assert ours["samples"]["gl_until"] and ref["results"]["gl_rolling"]
    assert_same_results(ours, ref, tasks)


def test_gpt2_small_width_and_vocab_equals_hf_backend(tmp_path, corpus, task_manager):
    """GPT-2 small's vocabulary (50257), width (768), heads (12) and 1024 positions, at 2 of its 12 layers: the
    harness sees only the logits, whose parity with transformers at the full 12-layer shape is
    tests/checkpoint/test_hf_interop.py's gpt2-small-shape case; the ten more layers cost ~2.4x the time here."""
    ms_dir, ref_dir = export_pair(tmp_path, corpus["model_dir"], sharpen=2.0, vocab_size=50257, n_positions=1024,
                                  n_embd=768, n_layer=2, n_head=12)
    tasks = ["gl_choice", "gl_rolling", "gl_until"]  # a handful of requests: 4 choices, 1 document, 1 generation
    ours, ref = evaluate_both(ms_dir, ref_dir, task_manager[0], tasks, limit=1, batch_size=4)
    worst = assert_same_results(ours, ref, tasks)
    print(f"GPT-2 small width and vocabulary: max |loglikelihood diff| {worst:.2e}")


def test_sampling_is_seeded_and_stops(tiny):
    from lm_eval.api.instance import Instance
    from mindformers_gptlocal.evaluation.harness import GPTLocalLM
    kwargs = {"until": ["("], "do_sample": True, "temperature": 1.5, "top_k": 50, "max_gen_toks": 12}
    requests = [Instance("generate_until", {}, (f"def f{i}(x):\n    return", dict(kwargs)), i) for i in range(5)]
    lm = GPTLocalLM(pretrained=tiny[0], batch_size=4, progress=False)

    def run(seed):
        lm.seed, lm._generate_calls = seed, 0
        return lm.generate_until(requests)
    first, again, other = run(3), run(3), run(4)
    assert first == again and first != other
    assert not any("(" in text for text in first + other)
    from mindformers_gptlocal import GPTLocalForCausalLM  # the model MindFormers builds (mf/model.py)
    with pytest.raises(Exception, match="gptlocal eval"):  # MindFormers' eval_with_harness.py route is refused
        GPTLocalForCausalLM.from_pretrained(tiny[0]).set_dynamic_inputs()


def test_cli_prints_table_and_writes_json(tiny, tiny_runs, task_manager, tmp_path, capsys):
    """`gptlocal eval` in a process of its own (a script calling main(), which reads sys.argv, as the console
    script does) prints the table, writes the JSON, and never imports torch nor HFLM's module (nor MindFormers);
    its scoring graph is stored in a compile-cache folder of its own. (A second run over the cache, loading the graph:
    one more process, ~20 s, is over the suite's budget; `python benchmarks/run.py eval` runs one, "cached".)"""
    from mindformers_gptlocal.cli.main import main
    cache = tmp_path / "compile-cache"
    heavy = ("torch", "lm_eval.models.huggingface", "accelerate", "peft", "mindformers")
    script = tmp_path / "run_eval.py"
    script.write_text(f"import sys\nfrom mindformers_gptlocal.cli.main import main\ncode = main()\n"
                      f"print('LOADED', [m for m in {heavy!r} if m in sys.modules], code)\n")
    runs = []
    for run in ("first",):
        out = tmp_path / f"results-{run}.json"
        argv = ["eval", "--model", tiny[0], "--tasks", "gl_choice", "--include_path", task_manager[1], "--limit", "8",
                "--batch_size", "4", "--output_path", str(out), "--log_samples", "--compile_cache", str(cache)]
        proc = subprocess.run([sys.executable, str(script), *argv], env=source_env(**OFFLINE), capture_output=True,
                              text=True, timeout=600)
        printed = proc.stdout
        assert printed.strip().splitlines()[-1] == "LOADED [] 0", printed + proc.stderr
        assert "|gl_choice|" in printed and "acc_norm" in printed
        runs.append(json.loads(out.read_text()))
        graphs = sorted(str(p.relative_to(cache)) for p in cache.rglob("*.mindir"))
        kinds = [g.split("-")[0] for g in graphs]  # one width, stored in a folder of its own (runtime/graph_cache.py)
        assert kinds == ["anchor", "scorer"] and all(g.endswith("/graph.mindir") for g in graphs), graphs
        assert (cache / graphs[1].split("/")[0] / "first_call_seconds").is_file()
    first = [s["resps"] for s in runs[0]["samples"]["gl_choice"]]
    for mine, sample in zip(first, tiny_runs[1]["samples"]["gl_choice"]):  # hf, same 8 documents
        for ((a, ga),), ((b, gb),) in zip(mine, sample["resps"]):
            assert abs(a - b) <= 1e-4 and ga == gb
    saved = runs[0]
    assert "torch not imported" in saved["pretty_env_info"]
    results, ref = saved["results"], tiny_runs[1]["results"]  # hf, same 8 documents
    assert results["gl_choice"]["acc,none"] == ref["gl_choice"]["acc,none"]
    assert results["gl_choice"]["acc_norm,none"] == ref["gl_choice"]["acc_norm,none"]
    assert main(["eval", "--model", tiny[0], "--tasks", "no_such_task", "--include_path", task_manager[1]]) == 2
    assert "unknown task 'no_such_task'" in capsys.readouterr().err
    assert main(["eval", "--model", str(tmp_path / "missing"), "--tasks", "gl_choice",
                 "--include_path", task_manager[1]]) == 2
    assert "not a model directory" in capsys.readouterr().err


def test_local_tasks_are_indexed_without_lm_evals_own(task_manager):
    """``gptlocal eval --include_path DIR`` whose tasks are all DIR's tasks indexes DIR alone (lm-eval's ~13,000
    built-in task YAMLs cost ~10-15 s of CPU to index). Any other name (a built-in task, or a group or tag of DIR's,
    which may list built-in tasks) takes the built-in index with DIR's: test_command_errors' offline eval of a
    built-in task with --include-path."""
    from lm_eval.tasks import TaskManager
    from mindformers_gptlocal.evaluation.run import task_manager as index_for
    local = index_for(TaskManager, task_manager[1], ["gl_choice", "gl_rolling"])
    assert sorted(local.all_tasks) == sorted(task_manager[0].all_tasks)  # DIR's, no built-in one
    assert {"gl_choice", "gl_rolling"} <= set(local.all_subtasks) and "hellaswag" not in local.all_tasks


def test_lm_eval_finds_gptlocal_by_name_and_import_stays_light():
    """A fresh interpreter: importing the package loads neither torch nor MindSpore; lm-eval then finds ``gptlocal``
    by name, and its own models are registered too (``hf`` still lm-eval's lazy entry: the plugin registered after
    lm-eval filled its registry, which lm-eval does only when it is empty). The entry is compared, not imported:
    HFLM's module would import torch and transformers (~9 s of CPU) for a name lm-eval wrote there itself."""
    code = ("import sys, mindformers_gptlocal; heavy = [m for m in ('torch', 'mindspore') if m in sys.modules]; "
            "import lm_eval; from lm_eval.api.registry import get_model, model_registry; "
            "name = get_model('gptlocal').__name__; hf = dict(model_registry.items()).get('hf'); "
            "from lm_eval.models import MODEL_MAPPING; "  # lm-eval's own table, read after the lookups
            "print(heavy, name, 'HFLM' if hf == MODEL_MAPPING['hf'] == 'lm_eval.models.huggingface:HFLM' else hf)")
    out = subprocess.run([sys.executable, "-c", code], env=source_env(), capture_output=True, text=True, timeout=300)
    assert out.stdout.strip().splitlines()[-1] == "[] GPTLocalLM HFLM", out.stdout + out.stderr


def test_plan_widths_is_the_least_cost_choice():
    """plan_widths (a DP over candidate widths) against every subset of the candidates, on random batches."""
    import itertools
    import random
    from mindformers_gptlocal.evaluation.harness import plan_widths
    from mindformers_gptlocal.runtime.buckets import length_bucket
    rng = random.Random(0)

    def cost(chosen, needs, compiled, compile_s, column_s):
        total = sum(compile_s for w in chosen if w not in compiled)
        for need in needs:
            fits = [w for w in chosen if w >= need]
            if not fits:
                return float("inf")
            total += column_s * min(fits)
        return total
    for _ in range(40):
        limit = rng.choice([64, 100, 256])
        needs = [rng.randint(1, limit) for _ in range(rng.randint(1, 7))]
        compiled = set(rng.sample([16, 24, 32, 48, 64, 96, limit], rng.randint(0, 2)))
        compile_s, column_s = rng.choice([0.0, 0.5, 5.0, 50.0]), rng.choice([1e-4, 1e-2, 1.0])
        chosen = plan_widths(needs, compiled, compile_s, column_s, limit)
        cands = sorted({length_bucket(n, limit) for n in needs} | {w for w in compiled if w >= min(needs)})
        best = min(cost(c, needs, compiled, compile_s, column_s)
                   for k in range(1, len(cands) + 1) for c in itertools.combinations(cands, k))
        assert cost(chosen, needs, compiled, compile_s, column_s) == pytest.approx(best, rel=1e-12, abs=1e-12)
        assert chosen[-1] >= max(needs)
    # no compile cost: every need its own bucket; a huge one: the one width that holds the longest
    assert plan_widths([17, 40, 5], set(), 0.0, 1.0, 256) == [16, 24, 48]
    assert plan_widths([17, 40, 5], set(), 1e9, 1.0, 256) == [48]


def test_planned_widths_score_as_the_plain_buckets(tiny):
    """The scorer at the widths WidthPlan picks (here: everything at the widest compiled one) gives the same
    per-request numbers as the plain path, every batch at its own length bucket; odd lengths, a partial batch."""
    from mindformers_gptlocal.evaluation.harness import GPTLocalLM, WidthPlan
    lm = GPTLocalLM(pretrained=tiny[0], batch_size=4, progress=False, width_plan="buckets")
    rng = np.random.default_rng(1)
    requests = [(None, rng.integers(1, 500, n).tolist(), rng.integers(1, 500, m).tolist())
                for n, m in [(3, 1), (9, 2), (20, 3), (5, 4), (1, 1), (26, 5), (13, 1)]]
    plain = lm._loglikelihood_tokens(requests)
    widths = sorted(lm._widths.compiled)
    assert len(widths) >= 2  # the plain path compiled a width per bucket
    lm._widths = WidthPlan(lm.max_length)
    lm._widths.compiled, lm._widths.column_seconds = {widths[-1]: 1.0}, 1e-9  # a compile costs more than padding
    planned = lm._loglikelihood_tokens(requests)
    assert sorted(lm._widths.compiled) == [widths[-1]]  # every batch ran at the widest width, nothing new compiled
    for (a, ga), (b, gb) in zip(planned, plain):
        assert abs(a - b) <= 1e-5 and ga == gb


def test_tokenizer_methods_equal_hflm(tiny, tmp_path):
    """HFLMTokens (ours, so the eval process needs no torch) against HFLM's own methods on the requests of every
    type: loglikelihood pairs (trailing spaces, a BOS-prefixed context), rolling documents, generate_until batches
    (left truncation, both padding sides, truncation on either side), decode with and without special tokens;
    add_bos_token None / True / False and a custom prefix_token_id, on the plain tokenizer and on one whose
    post-processor adds a BOS (so add_special_tokens changes the ids)."""
    from lm_eval.models.huggingface import HFLM
    from mindformers_gptlocal.evaluation.harness import GPTLocalLM
    from tokenizers import Tokenizer, processors
    with_bos = {}
    for side, folder in zip(("ms", "ref"), tiny):
        with_bos[side] = str(tmp_path / side)
        shutil.copytree(folder, with_bos[side])
        tok = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
        bos = "<|endoftext|>"
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
        tok.save(os.path.join(with_bos[side], "tokenizer.json"))
    long_text = "def add(a, b):\n    return a + b  # " * 12
    contexts = ["Question: what is 2 + 2?\nAnswer:", "x = 1 ", "<|endoftext|>import os\n", "  print(", long_text]
    continuations = [" 4", "\n", "os.path", " 'hi')", " done"]
    batches = [contexts, contexts[2:] + contexts[:2], ["ü ñ 日本", "a"]]
    checked = 0
    for ms_dir, ref_dir in ((tiny[0], tiny[1]), (with_bos["ms"], with_bos["ref"])):
        for add_bos, prefix in ((None, None), (True, None), (False, 7)):
            ours = GPTLocalLM(pretrained=ms_dir, batch_size=2, progress=False, add_bos_token=add_bos,
                              prefix_token_id=prefix)
            ref = HFLM(pretrained=ref_dir, batch_size=2, device="cpu", dtype="float32", add_bos_token=add_bos,
                       prefix_token_id=prefix)
            assert (ours.eot_token_id, ours.prefix_token_id) == (ref.eot_token_id, ref.prefix_token_id)
            for context, continuation in zip(contexts, continuations):
                assert ours._encode_pair(context, continuation) == ref._encode_pair(context, continuation)
                for special in (None, True, False):
                    assert ours.tok_encode(context, add_special_tokens=special) == \
                        ref.tok_encode(context, add_special_tokens=special)
                assert ours.tok_encode(context, left_truncate_len=5) == ref.tok_encode(context, left_truncate_len=5)
                ids = ref.tok_encode(context, add_special_tokens=True)
                for skip in (True, False):
                    assert ours.tok_decode(ids, skip_special_tokens=skip) == ref.tok_decode(ids, skip_special_tokens=skip)
                checked += 1
            assert ours.tok_decode(ours.eot_token_id, skip_special_tokens=False) == \
                ref.tok_decode(ref.eot_token_id, skip_special_tokens=False)
            for strings in batches:
                for kwargs in (dict(left_truncate_len=6), dict(padding_side="right"), dict(truncation=True), {}):
                    for side in ("left", "right"):
                        ours.tokenizer.truncation_side = ref.tokenizer.truncation_side = side
                        mine, theirs = ours.tok_batch_encode(strings, **kwargs), ref.tok_batch_encode(strings, **kwargs)
                        assert isinstance(mine[0], np.ndarray)
                        for a, b in zip(mine, theirs):
                            np.testing.assert_array_equal(a, b.numpy())
                        assert ours.tokenizer.padding_side == ref.tokenizer.padding_side
    assert checked == 30
    assert len(ref.tok_encode(long_text)) > 64  # the truncation=True batches did truncate (model_max_length 64)
    assert ref.tok_encode("x", add_special_tokens=True) != ref.tok_encode("x", add_special_tokens=False)  # a BOS

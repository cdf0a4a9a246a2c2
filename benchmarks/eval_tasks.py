"""Small offline lm-eval tasks over local JSONL files, for `gptlocal eval` tests, the README table and
`benchmarks/eval_throughput.py`.

    python benchmarks/eval_tasks.py OUT_DIR     # writes OUT_DIR/*.yaml + *.jsonl; then
    gptlocal eval --model DIR --tasks gl_choice,gl_rolling,gl_until --include_path OUT_DIR

Tasks (Python-source text, which the tokenizer of `gptlocal prepare-data` knows):
  gl_choice   multiple_choice: which expression ends a line (acc, acc_norm)
  gl_rolling  loglikelihood_rolling over code snippets (word/byte perplexity, bits per byte)
  gl_until    generate_until with the stop string "\\n" and max_gen_toks 8 (exact_match)
  gl_long     multiple_choice whose contexts exceed 64 tokens (left truncation at a small max_length)
"""
import json
import os
import sys

NAMES = ["x", "y", "value", "total", "count", "item", "key", "result", "data", "index", "name", "path"]
OPS = [" + ", " - ", " * ", " // ", " % ", " == "]


def MEAN(metrics):
    return [{"metric": m, "aggregation": "mean", "higher_is_better": True} for m in metrics]


def _docs(n):
    for i in range(n):
        a, b = NAMES[i % len(NAMES)], NAMES[(3 * i + 1) % len(NAMES)]
        op = OPS[i % len(OPS)]
        yield i, a, b, op


def write_tasks(out, docs=24):
    """The four tasks' YAML + JSONL in ``out``, ``docs`` documents each (24 for the tests and the docs' table)."""
    os.makedirs(out, exist_ok=True)
    choice, rolling, until, long_ = [], [], [], []
    for i, a, b, op in _docs(docs):
        tag = "" if i < 24 else str(i)  # the first 24 as always (tests, the docs' table); later ones all distinct
        choices = [f" {a}{o}{b}" for o in OPS[:4]]
        choice.append({"question": f"def f{tag}({a}, {b}):\n    return", "choices": choices, "label": i % 4})
        rolling.append({"text": f"def f{i}({a}, {b}):\n    {a} = {a}{op}{b}\n    return {a}\n\n"
                                f"for {a} in range({i + 2}):\n    print({a}{op}{b})\n"})
        until.append({"prompt": f"def g{tag}({a}):\n    if {a} is None:\n        return", "answer": " None"})
        body = "".join(f"    {n} = {a}{op}{j}\n" for j, n in enumerate(NAMES))
        long_.append({"question": f"def h{tag}({a}, {b}):\n{body}    return", "choices": choices, "label": (i + 1) % 4})
    tasks = {
        "gl_choice": (choice, {"output_type": "multiple_choice", "doc_to_text": "{{question}}",
                               "doc_to_choice": "{{choices}}", "doc_to_target": "label",
                               "metric_list": MEAN(["acc", "acc_norm"])}),
        "gl_long": (long_, {"output_type": "multiple_choice", "doc_to_text": "{{question}}",
                            "doc_to_choice": "{{choices}}", "doc_to_target": "label",
                            "metric_list": MEAN(["acc", "acc_norm"])}),
        "gl_rolling": (rolling, {"output_type": "loglikelihood_rolling", "doc_to_text": "",
                                 "doc_to_target": "{{text}}",
                                 "metric_list": [{"metric": "word_perplexity"}, {"metric": "byte_perplexity"},
                                                 {"metric": "bits_per_byte"}]}),
        "gl_until": (until, {"output_type": "generate_until", "doc_to_text": "{{prompt}}",
                             "doc_to_target": "{{answer}}",
                             "generation_kwargs": {"until": ["\n"], "max_gen_toks": 8, "do_sample": False,
                                                   "temperature": 0.0},
                             "metric_list": MEAN(["exact_match"])}),
    }
    for name, (docs, spec) in tasks.items():
        data = os.path.abspath(os.path.join(out, f"{name}.jsonl"))
        with open(data, "w", encoding="utf-8") as handle:
            handle.writelines(json.dumps(d) + "\n" for d in docs)
        config = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": data}},
                  "test_split": "test", **spec, "metadata": {"version": 1.0}}
        with open(os.path.join(out, f"{name}.yaml"), "w", encoding="utf-8") as handle:
            json.dump(config, handle, indent=2)  # JSON is YAML
    return sorted(tasks)


if __name__ == "__main__":
    print(" ".join(write_tasks(sys.argv[1] if len(sys.argv) > 1 else "eval_tasks")))

"""Helpers of run_scripts/sft_example.sh: an instruction data set from this machine's Python standard
library, the held-out response-only loss of a model, and its answers to held-out prompts.

    python run_scripts/sft_example.py data --out DIR                 # DIR/train.jsonl, DIR/heldout.jsonl
    python run_scripts/sft_example.py yaml --base MODEL_DIR --data TRAIN.mindrecord --out-dir OUT --path RUN.yaml
    python run_scripts/sft_example.py loss --model MODEL_DIR --data ROWS.mindrecord
    python run_scripts/sft_example.py answer --model MODEL_DIR --records DIR/heldout.jsonl --count 3

The records are Alpaca JSONL: the instruction asks what a standard-library function does, given its
signature (``textwrap.dedent(text)``); the response is the first line of its docstring. No download:
everything comes from the modules this Python has.
"""
import argparse
import importlib
import inspect
import json
import os
import random
import sys
import warnings

MODULES = (
    "abc argparse ast base64 bisect calendar cmd codecs collections colorsys configparser contextlib copy csv "
    "dataclasses datetime decimal difflib dis email.utils enum filecmp fileinput fnmatch fractions ftplib "
    "functools genericpath getopt gettext glob gzip hashlib heapq hmac html html.parser http.client "
    "http.cookies imaplib inspect ipaddress json json.decoder json.encoder keyword linecache locale logging "
    "lzma mailbox mimetypes netrc ntpath numbers operator optparse os os.path pathlib pickle pickletools "
    "pkgutil platform plistlib poplib posixpath pprint py_compile queue quopri random re reprlib sched "
    "secrets selectors shelve shlex shutil smtplib socket socketserver sqlite3 ssl stat statistics string "
    "stringprep struct subprocess symtable sysconfig tabnanny tarfile tempfile textwrap threading timeit "
    "token tokenize trace traceback tracemalloc types typing unittest.case unittest.mock urllib.parse "
    "urllib.request uu uuid warnings wave weakref webbrowser xml.dom.minidom xml.etree.ElementTree zipfile "
    "zipimport").split()


def first_line(doc):
    line = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
    return " ".join(line.split())


def records():
    """(module.function(signature), first docstring line) for the public pure-Python functions."""
    seen = set()
    for name in MODULES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                module = importlib.import_module(name)
            except Exception:  # pylint: disable=broad-except
                continue  # not in this Python build
        functions = []
        for attr, obj in sorted(vars(module).items()):
            if attr.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            if inspect.isfunction(obj):
                functions.append((attr, obj))
            elif inspect.isclass(obj):  # and the methods of its classes
                functions += [(f"{attr}.{m}", f) for m, f in sorted(vars(obj).items())
                              if not m.startswith("_") and inspect.isfunction(f)]
        for attr, fn in functions:
            doc = inspect.getdoc(fn)
            try:
                signature = str(inspect.signature(fn))
            except (TypeError, ValueError):
                continue
            answer = first_line(doc or "")
            if not 4 <= len(answer.split()) <= 40 or len(signature) > 120 or answer in seen:
                continue
            seen.add(answer)
            yield {"instruction": f"What does {name}.{attr}{signature} do in Python?", "input": "",
                   "output": answer}


def make_data(out, heldout, seed=0):
    os.makedirs(out, exist_ok=True)
    rows = list(records())
    random.Random(seed).shuffle(rows)
    parts = {"heldout.jsonl": rows[:heldout], "train.jsonl": rows[heldout:]}
    for name, part in parts.items():
        with open(os.path.join(out, name), "w", encoding="utf-8") as handle:
            for row in part:
                handle.write(json.dumps(row) + "\n")
    print(f"{len(rows)} instruction records from {len(MODULES)} standard-library modules: "
          f"{len(parts['train.jsonl'])} train, {len(parts['heldout.jsonl'])} held out -> {out}")


def write_yaml(base, data, out_dir, epochs, path):
    """model_configs/finetune_gpt_local_tiny_sft_lora_cpu.yaml pointed at the base model, the data and out_dir,
    its model sizes taken from the base model's config.json (the quickstart's tiny model or a converted GPT-2)."""
    from mindformers_gptlocal import yaml_io
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    config = yaml_io.load_yaml(os.path.join(repo, "model_configs", "finetune_gpt_local_tiny_sft_lora_cpu.yaml"))
    with open(os.path.join(base, "config.json"), encoding="utf-8") as handle:
        sizes = json.load(handle)
    model_config = config["model"]["model_config"]
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"):
        if key in sizes:
            model_config[key] = sizes[key]
    model_config["seq_length"] = int(os.environ.get("SEQ", 256))
    if os.environ.get("PET_CONFIG"):  # another method, e.g. '{"pet_type": "ptuning2", "pre_seq_len": 16}'
        model_config["pet_config"] = json.loads(os.environ["PET_CONFIG"])
    if os.environ.get("LR"):
        config["lr_schedule"]["learning_rate"] = float(os.environ["LR"])
    config["load_checkpoint"] = os.path.abspath(base)
    config["output_dir"] = os.path.abspath(out_dir)
    config["overwrite_output_dir"] = True  # the example run again redoes it (its data is replaced too)
    config["runner_config"]["epochs"] = epochs
    config["train_dataset"]["data_loader"]["dataset_dir"] = os.path.abspath(data)
    config["train_dataset_task"]["dataset_config"] = config["train_dataset"]
    for callback in config["callbacks"]:
        if callback["type"] == "GPTLocalSaveModelDir":
            callback["tokenizer_dir"] = os.path.abspath(base)
        if callback["type"] in ("GPTLocalThroughputMonitor", "MFLossMonitor"):
            callback["per_print_times"] = 20
    yaml_io.dump_yaml(config, path)
    print(f"{path}: pet_config {json.dumps(model_config['pet_config'])}")


def load(model_dir):
    import mindspore as ms
    from mindformers_gptlocal import GPTLocalForCausalLM
    ms.set_context(mode=ms.PYNATIVE_MODE)
    model = GPTLocalForCausalLM.from_pretrained(model_dir, hidden_dropout=0.0, attention_dropout=0.0,
                                                embedding_dropout=0.0)
    model.set_train(False)
    return model


def response_loss(model_dir, data, batch=8):
    """Mean cross-entropy over the response tokens (labels != -100, loss_mask 1) of prepare-data rows."""
    import numpy as np
    from mindspore import Tensor
    from mindspore.mindrecord import FileReader
    model = load(model_dir)
    reader = FileReader(data)
    rows = list(reader.get_next())
    reader.close()
    total, count = 0.0, 0
    for start in range(0, len(rows), batch):
        chunk = rows[start:start + batch]
        ids = np.stack([r["input_ids"] for r in chunk]).astype(np.int32)
        labels = np.stack([r["labels"] for r in chunk]).astype(np.int64)
        mask = np.stack([r["loss_mask"] for r in chunk]).astype(bool) & (labels != -100)
        logits = model(Tensor(ids)).asnumpy().astype(np.float64)
        logits -= logits.max(-1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        picked = np.take_along_axis(logp, np.maximum(labels, 0)[..., None], -1)[..., 0]
        total -= picked[mask].sum()
        count += int(mask.sum())
    return total / max(count, 1), count


def answers(model_dir, records_path, count, max_new_tokens=40):
    from mindformers_gptlocal.data.instruct import ALPACA_PROMPT_WITHOUT_INPUT
    from tokenizers import Tokenizer
    model = load(model_dir)
    tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    eos = model.config.eos_token_id
    with open(records_path, encoding="utf-8") as handle:
        rows = [json.loads(line) for line in handle][:count]
    for row in rows:
        prompt = ALPACA_PROMPT_WITHOUT_INPUT.format(instruction=row["instruction"]) + "\n"
        ids = tokenizer.encode(prompt).ids
        out = model.generate([ids], max_new_tokens=max_new_tokens, do_sample=False, repetition_penalty=1.3,
                             eos_token_id=eos, pad_token_id=eos)
        new = [t for t in list(out[0])[len(ids):] if t != eos]
        print(f"Q: {row['instruction']}\n   model (greedy, repetition penalty 1.3): {tokenizer.decode(new).strip()}\n"
              f"   reference: {row['output']}\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    data = sub.add_parser("data")
    data.add_argument("--out", required=True)
    data.add_argument("--heldout", type=int, default=64)
    loss = sub.add_parser("loss")
    loss.add_argument("--model", required=True)
    loss.add_argument("--data", required=True)
    loss.add_argument("--label", default="")
    yaml = sub.add_parser("yaml")
    yaml.add_argument("--base", required=True)
    yaml.add_argument("--data", required=True)
    yaml.add_argument("--out-dir", required=True)
    yaml.add_argument("--epochs", type=int, default=2)
    yaml.add_argument("--path", required=True)
    answer = sub.add_parser("answer")
    answer.add_argument("--model", required=True)
    answer.add_argument("--records", required=True)
    answer.add_argument("--count", type=int, default=3)
    args = parser.parse_args()
    if args.command == "data":
        make_data(args.out, args.heldout)
    elif args.command == "yaml":
        write_yaml(args.base, args.data, args.out_dir, args.epochs, args.path)
    elif args.command == "loss":
        value, tokens = response_loss(args.model, args.data)
        print(f"held-out response-only loss {args.label}: {value:.4f} over {tokens} response tokens")
        print(json.dumps({"loss": value, "tokens": tokens}), file=sys.stderr)
    else:
        answers(args.model, args.records, args.count)


if __name__ == "__main__":
    main()

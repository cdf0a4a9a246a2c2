"""``gptlocal``: prepare-data, convert (HF GPT-2 <-> gpt_local), ckpt (split/merge per-rank shards),
run (the run_mindformer.py drop-in), quickstart, plan (layout check and per-device memory, before any compile)."""
import argparse
import json
import sys


def _prepare_data(argv):
    parser = argparse.ArgumentParser(prog="gptlocal prepare-data",
                                     description="Text files, a folder or JSONL -> tokenizer, MindRecord and "
                                                 "Megatron .bin/.idx. With no --input: the Python standard library.")
    parser.add_argument("--input", nargs="*", help="text files, folders or .jsonl (default: Python's stdlib sources)")
    parser.add_argument("--out", default="data/gptlocal", help="output folder (default: data/gptlocal)")
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--vocab-size", type=int, default=8192, help="size of a newly trained BPE")
    parser.add_argument("--tokenizer", help="an existing tokenizer.json to use instead of training one")
    parser.add_argument("--vocab", help="GPT-2 vocab.json (with --merges)")
    parser.add_argument("--merges", help="GPT-2 merges.txt (with --vocab)")
    parser.add_argument("--jsonl-key", default="text", help="JSONL field holding the text (default: text)")
    parser.add_argument("--eval-fraction", type=float, default=0.05, help="share of documents held out for eval")
    parser.add_argument("--max-bytes", type=int, help="stop adding files past this many bytes")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out folder")
    args = parser.parse_args(argv)
    from .data.prepare import prepare
    summary = prepare(inputs=args.input, out=args.out, seq_length=args.seq_length, vocab_size=args.vocab_size,
                      tokenizer_path=args.tokenizer, vocab=args.vocab, merges=args.merges, jsonl_key=args.jsonl_key,
                      eval_fraction=args.eval_fraction, max_bytes=args.max_bytes, overwrite=args.overwrite)
    print(json.dumps(summary, indent=2))
    return 0


def _convert(argv):
    parser = argparse.ArgumentParser(prog="gptlocal convert",
                                     description="Hugging Face GPT-2 <-> gpt_local model directories, exact.")
    sub = parser.add_subparsers(dest="direction", required=True)
    hf2ms = sub.add_parser("hf2ms", help="HF GPT-2 directory -> gpt_local directory")
    hf2ms.add_argument("--hf-dir", required=True, help="config.json + model.safetensors (or shards, or .bin)")
    hf2ms.add_argument("--out", required=True, help="new folder for config.json, model.safetensors, tokenizer")
    hf2ms.add_argument("--allow-pickle", action="store_true",
                       help="load pytorch_model.bin with full pickle (only for files you trust)")
    ms2hf = sub.add_parser("ms2hf", help="gpt_local directory -> HF GPT-2 directory")
    ms2hf.add_argument("--ms-dir", required=True, help="gpt_local model directory (e.g. output/model)")
    ms2hf.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    from . import convert
    if args.direction == "hf2ms":
        summary = convert.hf_to_ms(args.hf_dir, args.out, allow_pickle=args.allow_pickle)
    else:
        summary = convert.ms_to_hf(args.ms_dir, args.out)
    print(f"wrote {summary['tensors']} tensors to {args.out}")
    return 0


def _ckpt(argv):
    parser = argparse.ArgumentParser(prog="gptlocal ckpt",
                                     description="Split a full gpt_local checkpoint into per-rank shards for a "
                                                 "(data, model, pipeline) parallel strategy, or merge them back.")
    sub = parser.add_subparsers(dest="action", required=True)
    split = sub.add_parser("split", help="full .safetensors -> DIR/rank_*/ + DIR/strategy.json")
    split.add_argument("--ckpt", required=True, help="full gpt_local .safetensors (e.g. output/model/model.safetensors)")
    split.add_argument("--config", required=True, help="run YAML: model.model_config + parallel_config")
    split.add_argument("--out", required=True, help="new folder for the rank shards")
    split.add_argument("--overwrite", action="store_true", help="replace an existing --out folder")
    merge = sub.add_parser("merge", help="DIR/rank_*/ -> one full .safetensors")
    merge.add_argument("--dir", required=True, help="a folder written by `gptlocal ckpt split`")
    merge.add_argument("--out", required=True, help="the full .safetensors file to write")
    args = parser.parse_args(argv)
    from . import dist_checkpoint
    if args.action == "split":
        config = dist_checkpoint.config_from_yaml(args.config)
        summary = dist_checkpoint.split_checkpoint(args.ckpt, config, args.out, overwrite=args.overwrite)
        print(f"wrote {summary['tensors']} tensors as {summary['ranks']} rank shards to {summary['out']}")
    else:
        summary = dist_checkpoint.merge_checkpoint(args.dir, args.out)
        print(f"merged {summary['ranks']} rank shards into {summary['tensors']} tensors: {summary['out']}")
    return 0


def _run(argv):
    from .launcher import main as launch
    return launch(argv)


def _plan(argv):
    from .planner import main as plan
    return plan(argv)


def _quickstart(argv):
    from .quickstart import main as quickstart
    return quickstart(argv)


COMMANDS = {"prepare-data": _prepare_data, "convert": _convert, "ckpt": _ckpt, "run": _run, "quickstart": _quickstart,
            "plan": _plan}


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print("usage: gptlocal {" + ",".join(COMMANDS) + "} [options]  (gptlocal COMMAND --help for each)",
              file=sys.stderr)
        return 2
    from .errors import GPTLocalError
    try:
        return COMMANDS[argv[0]](argv[1:])
    except GPTLocalError as err:
        print(f"gptlocal {argv[0]}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

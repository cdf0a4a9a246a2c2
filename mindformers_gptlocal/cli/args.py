"""Every ``gptlocal`` subcommand's arguments, in one place. Building a parser imports nothing heavy
(``run``'s value converters load MindFormers' own only when a value is converted)."""
import argparse

COMMANDS = {
    "prepare-data": "text files, a folder or JSONL -> tokenizer, MindRecord and Megatron .bin/.idx",
    "convert": "Hugging Face GPT-2 <-> gpt_local model directories, exact (mf2ms/ms2mf: MindFormers 1.x GPT-2)",
    "ckpt": "split a full checkpoint into per-rank shards for a (dp, mp, pp) layout, or merge them back",
    "run": "run a MindFormers YAML (train/finetune/eval/predict): the flags of run_mindformer.py",
    "plan": "check a YAML's parallel layout, estimate per-device memory and communication (no devices)",
    "quickstart": "the whole product on one CPU with no download: data, train, eval, generate",
    "serve": "an OpenAI-compatible HTTP server (completions, chat, streaming) with continuous batching",
    "eval": "benchmark a model directory with lm-evaluation-harness tasks (needs the [eval] extra)",
    "lora": "merge a pet_config run's LoRA adapters into the base weights",
    "migrate-yaml": "a MindFormers 1.x GPT-2 YAML -> a gpt_local YAML (keys mapped or dropped, each said)",
}


def main_parser():
    """``gptlocal --help``: the subcommands (each one parses its own arguments)."""
    parser = argparse.ArgumentParser(prog="gptlocal", description="GPT-2-family models on MindFormers "
                                                                  "(model_type: gpt_local).",
                                     epilog="gptlocal COMMAND --help shows a command's options.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, text in COMMANDS.items():
        sub.add_parser(name, help=text, add_help=False)
    return parser


def prepare_data_parser():
    parser = argparse.ArgumentParser(prog="gptlocal prepare-data",
                                     description="Text files, a folder or JSONL -> tokenizer, MindRecord and "
                                                 "Megatron .bin/.idx. With no --input: the Python standard library.")
    parser.add_argument("--input", nargs="*", help="text files, folders or .jsonl (default: Python's stdlib sources)")
    parser.add_argument("--out", default="data/gptlocal", help="output folder (default: data/gptlocal)")
    parser.add_argument("--seq-length", type=int, help="tokens a row (default 256; with --from-mf-mindrecord: "
                                                       "checked against the rows, default their width - 1)")
    parser.add_argument("--vocab-size", type=int, default=8192, help="size of a newly trained BPE")
    parser.add_argument("--tokenizer", help="an existing tokenizer.json to use instead of training one")
    parser.add_argument("--vocab", help="GPT-2 vocab.json (with --merges)")
    parser.add_argument("--merges", help="GPT-2 merges.txt (with --vocab)")
    parser.add_argument("--jsonl-key", default="text", help="JSONL field holding the text (default: text)")
    parser.add_argument("--eval-fraction", type=float, default=0.05, help="share of documents held out for eval")
    parser.add_argument("--max-bytes", type=int, help="stop adding files past this many bytes")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out folder")
    parser.add_argument("--format", default="text", choices=("text", "alpaca", "chat"),
                        help="text (default); alpaca: .json/.jsonl records {instruction, input, output}; chat: "
                             "records {messages: [{role, content}]}. Instruction formats write MindRecord with "
                             "the prompt masked out of the loss")
    parser.add_argument("--too-long", default="truncate", choices=("truncate", "error"),
                        help="an instruction record longer than --seq-length: drop tokens from the start of its "
                             "prompt (default) or stop with its file and line")
    parser.add_argument("--no-pack", dest="pack", action="store_false",
                        help="one instruction record a row (default: pack several a row, with actual_seq_len)")
    parser.add_argument("--from-mf-mindrecord", metavar="FILE",
                        help="rewrite a MindFormers 1.x GPT-2 MindRecord (input_ids + input_mask/attention_mask, "
                             "seq_length + 1 a row) once into gpt_local's columns; --out default: <FILE stem>_gptlocal")
    return parser


def migrate_yaml_parser():
    parser = argparse.ArgumentParser(prog="gptlocal migrate-yaml",
                                     description="A MindFormers 1.x GPT-2 YAML (configs/gpt2/run_gpt2*.yaml) -> a "
                                                 "gpt_local YAML; every key mapped or dropped with a line saying so.")
    parser.add_argument("old", metavar="OLD.yaml", help="the MindFormers GPT-2 YAML")
    parser.add_argument("--out", required=True, help="the gpt_local YAML to write")
    parser.add_argument("--device-target", choices=("CPU", "GPU", "Ascend"),
                        help="run on this device instead of the old context.device_target")
    parser.add_argument("--model-dir", help="a `gptlocal convert mf2ms` output: load_checkpoint and tokenizer")
    return parser


def convert_parser():
    parser = argparse.ArgumentParser(prog="gptlocal convert",
                                     description="Hugging Face <-> gpt_local model directories, exact: GPT-2, "
                                                 "Llama-family (Llama, Qwen2, TinyLlama, SmolLM) and GPT-NeoX "
                                                 "(Pythia); the family is read from config.json.")
    sub = parser.add_subparsers(dest="direction", required=True)
    hf2ms = sub.add_parser("hf2ms", help="HF directory (GPT-2, Llama, Qwen2, GPT-NeoX) -> gpt_local directory")
    hf2ms.add_argument("--hf-dir", required=True, help="config.json + model.safetensors (or shards, or .bin)")
    hf2ms.add_argument("--out", required=True, help="new folder for config.json, model.safetensors, tokenizer")
    hf2ms.add_argument("--allow-pickle", action="store_true",
                       help="load pytorch_model.bin with full pickle (only for files you trust)")
    ms2hf = sub.add_parser("ms2hf", help="gpt_local directory -> HF directory of its family")
    ms2hf.add_argument("--ms-dir", required=True, help="gpt_local model directory (e.g. output/model)")
    ms2hf.add_argument("--out", required=True)
    ms2hf.add_argument("--lora-only", action="store_true",
                       help="write only the LoRA adapters of a pet_config run, as a Hugging Face PEFT adapter "
                            "(adapter_config.json + adapter_model.safetensors)")
    mf2ms = sub.add_parser("mf2ms", help="MindFormers 1.x GPT-2 .ckpt -> gpt_local directory")
    mf2ms.add_argument("--mf-ckpt", required=True, help="MindSpore .ckpt with MindFormers' GPT-2 names")
    mf2ms.add_argument("--mf-yaml", help="the MindFormers YAML it was trained with (default: sizes from the shapes)")
    mf2ms.add_argument("--num-heads", type=int, help="attention heads, without --mf-yaml (default hidden_size / 64)")
    mf2ms.add_argument("--tokenizer", help="folder with tokenizer.json or vocab.json + merges.txt to carry along")
    mf2ms.add_argument("--out", required=True, help="new folder for config.json, model.safetensors, tokenizer")
    ms2mf = sub.add_parser("ms2mf", help="gpt_local GPT-2 directory -> MindFormers 1.x GPT-2 .ckpt")
    ms2mf.add_argument("--ms-dir", required=True, help="gpt_local model directory (e.g. output/model)")
    ms2mf.add_argument("--out", required=True, help="the .ckpt file to write")
    return parser


def lora_parser():
    parser = argparse.ArgumentParser(prog="gptlocal lora", description="LoRA adapters of a pet_config run.")
    sub = parser.add_subparsers(dest="action", required=True)
    merge = sub.add_parser("merge", help="fold adapters into the base weights: a plain model directory")
    merge.add_argument("--base", required=True, help="the base model directory the run finetuned")
    merge.add_argument("--adapter", required=True,
                       help="the run's model directory (output/model), checkpoint folder or .safetensors file")
    merge.add_argument("--out", required=True, help="new folder for the merged model directory")
    merge.add_argument("--lora-alpha", type=float,
                       help="LoRA alpha (default: the run's pet_config, found beside --adapter)")
    merge.add_argument("--overwrite", action="store_true", help="replace an existing --out folder")
    return parser


def ckpt_parser():
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
    return parser


def plan_parser():
    parser = argparse.ArgumentParser(prog="gptlocal plan",
                                     description="Check a YAML's parallel layout and estimate per-device memory and "
                                                 "communication, without devices or compiling.")
    parser.add_argument("--config", required=True, help="run YAML (base_config is merged)")
    parser.add_argument("--devices", type=int, help="cards the run will have (default: 1 when use_parallel is "
                                                    "False, else dp*mp*pp)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def quickstart_parser():
    parser = argparse.ArgumentParser(prog="gptlocal quickstart",
                                     description="The whole product on one CPU, with no download.")
    parser.add_argument("--workdir", default="runs/quickstart", help="where data, YAMLs and outputs go")
    parser.add_argument("--steps", type=int, default=240, help="training steps (batch 4 x 256 tokens)")
    parser.add_argument("--max-bytes", type=int, default=3_000_000, help="corpus size from the stdlib")
    parser.add_argument("--prompt", default="def main(", help="prompt for the generated sample")
    return parser


def _str2bool(value):
    from mindformers.tools.utils import str2bool
    return str2bool(value)


def _str2bool_or_str(value):
    from mindformers.tools.utils import str2bool_or_str
    return str2bool_or_str(value)


class _Options(argparse.Action):
    """``--options KEY=VALUE ...`` with MindFormers' own parsing (ActionDict), loaded when used."""

    def __call__(self, parser, namespace, values, option_string=None):
        from mindformers.tools.register import ActionDict
        ActionDict(self.option_strings, self.dest, nargs=self.nargs)(parser, namespace, values, option_string)


def run_parser():
    """The flags of MindFormers r1.8.0 ``run_mindformer.py`` (plus ``--key value`` config overrides)."""
    parser = argparse.ArgumentParser(prog="gptlocal run",
                                     description="Run a MindFormers YAML (train/finetune/eval/predict).")
    add = parser.add_argument
    add("--config", required=True, help="YAML config file")
    add("--mode", type=int, help="0 graph, 1 pynative")
    add("--device_id", type=int)
    add("--device_target", type=str, help="CPU, GPU or Ascend")
    add("--run_mode", type=str, help="train, finetune, eval or predict")
    add("--do_eval", type=_str2bool)
    add("--train_dataset_dir", type=str)
    add("--eval_dataset_dir", type=str)
    add("--predict_data", type=str, nargs="+")
    add("--modal_type", type=str, nargs="+")
    add("--predict_batch_size", type=int)
    add("--adapter_id", type=str, nargs="+")
    add("--load_checkpoint", type=str)
    add("--src_strategy_path_or_dir", type=str)
    add("--auto_trans_ckpt", type=_str2bool)
    add("--transform_process_num", type=int)
    add("--only_save_strategy", type=_str2bool)
    add("--resume_training", type=_str2bool_or_str)
    add("--strategy_load_checkpoint", type=str)
    add("--remote_save_url", type=str)
    add("--seed", type=int)
    add("--use_parallel", type=_str2bool)
    add("--profile", type=_str2bool)
    add("--options", nargs="+", action=_Options, help="key=value overrides merged into the config")
    add("--epochs", type=int)
    add("--batch_size", type=int)
    add("--gradient_accumulation_steps", type=int)
    add("--sink_mode", type=_str2bool)
    add("--num_samples", type=int)
    add("--output_dir", type=str)
    add("--register_path", type=str)
    add("--do_sample", type=_str2bool)
    add("--trust_remote_code", type=_str2bool)
    return parser


def serve_parser():
    parser = argparse.ArgumentParser(prog="gptlocal serve",
                                     description="Serve a gpt_local model directory over an OpenAI-compatible HTTP "
                                                 "API (needs the [serve] extra: pip install "
                                                 "'mindformers-gptlocal[serve]').")
    parser.add_argument("--model", required=True, help="model directory (config.json, model.safetensors, "
                                                       "tokenizer.json)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-batch-size", type=int, default=8, help="sequences decoded together (cache slots)")
    parser.add_argument("--max-queue", type=int, default=64, help="requests that may wait for a slot; more get 429")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="context (prompt + new tokens) per request; default max_position_embeddings")
    parser.add_argument("--prompt-buckets", default=None,
                        help="comma-separated prompt widths to compile (default: 16, 32, 64, ... up to the context)")
    parser.add_argument("--batch-buckets", default=None,
                        help="comma-separated batch sizes to compile (default: 1, 4, 16, ... up to --max-batch-size)")
    parser.add_argument("--served-model-name", default=None, help="the model id clients send (default: folder name)")
    parser.add_argument("--device_target", "--device-target", default="CPU", choices=["CPU", "GPU", "Ascend"])
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    ops = parser.add_argument_group("running it exposed (docs/serving.md)")
    ops.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' on every route but /health (default: the "
                          "GPTLOCAL_API_KEY environment variable, which unlike a flag does not show in ps)")
    ops.add_argument("--max-request-bytes", type=int, default=1 << 20,
                     help="larger request bodies get 413 before they are read (default: 1048576 = 1 MiB)")
    ops.add_argument("--request-timeout", type=float, default=600.0,
                     help="seconds from arrival: a request still generating ends with finish_reason 'length', one "
                          "still waiting for a slot gets 504 (default: 600; 0: no limit)")
    ops.add_argument("--send-timeout", type=float, default=30.0,
                     help="seconds a response may wait on a client that stopped reading before it is dropped and "
                          "its generation cancelled (default: 30)")
    ops.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="after SIGTERM: seconds running requests get to finish (new ones get 503) before they are "
                          "ended; then the process exits 0 (default: 30)")
    return parser


def eval_parser():
    parser = argparse.ArgumentParser(prog="gptlocal eval",
                                     description="Benchmark a gpt_local model directory with lm-evaluation-harness "
                                                 "tasks (pip install 'mindformers-gptlocal[eval]').")
    parser.add_argument("--model", required=True, help="gpt_local model directory (config.json, model.safetensors, "
                                                        "tokenizer files)")
    parser.add_argument("--tasks", required=True, help="comma-separated lm-eval task names, e.g. gl_choice,gl_until")
    parser.add_argument("--num_fewshot", type=int, help="few-shot examples per request (default: each task's own)")
    parser.add_argument("--limit", type=float, help="documents per task (a fraction if < 1)")
    parser.add_argument("--include_path", help="folder of extra task YAMLs (local tasks)")
    parser.add_argument("--output_path", help="write lm-eval's results JSON to this file")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--max_length", type=int, help="context length (default: max_position_embeddings)")
    parser.add_argument("--device_target", default="CPU", choices=("CPU", "GPU", "Ascend"))
    parser.add_argument("--seed", type=int, default=1234, help="seed of lm-eval and of sampled generation")
    parser.add_argument("--log_samples", action="store_true", help="also keep every request's responses in the JSON")
    return parser


PARSERS = {"prepare-data": prepare_data_parser, "convert": convert_parser, "ckpt": ckpt_parser, "run": run_parser,
           "plan": plan_parser, "quickstart": quickstart_parser, "serve": serve_parser, "eval": eval_parser,
           "lora": lora_parser, "migrate-yaml": migrate_yaml_parser}

"""Every ``gptlocal`` subcommand's arguments, in one place. Building a parser imports nothing heavy
(``run``'s value converters load MindFormers' own only when a value is converted), so every ``--help``
answers without loading MindSpore.

One spelling rule for flags: ours are written with dashes (``--hf-dir``, ``--max-new-tokens``); MindFormers'
launcher flags keep their own underscores (``--device_target``, ``--load_checkpoint``). Every parser here is a
``Parser``, which accepts the other spelling of any of its flags (``--hf_dir``, ``--device-target``) as an
alias, and names the closest flags when one is unknown.
"""
import argparse
import difflib
import sys


COMMANDS = {  # in a user's order (README's command table): data, train, use, serve, evaluate, then the tools
    "prepare-data": "text files, a folder or JSONL -> tokenizer, MindRecord and Megatron .bin/.idx",
    "run": "run a MindFormers YAML (train/finetune/eval/predict): the flags of run_mindformer.py",
    "generate": "continue a prompt with a model directory (no YAML), streamed",
    "chat": "chat with a model directory on stdin (its chat template), replies streamed",
    "serve": "an OpenAI-compatible HTTP server (completions, chat, streaming) with continuous batching (needs the "
             "[serve] extra)",
    "eval": "benchmark a model directory with lm-evaluation-harness tasks (needs the [eval] extra)",
    "convert": "Hugging Face GPT-2, Llama/Qwen2 and GPT-NeoX <-> gpt_local model directories, exact (mf2ms/ms2mf: "
               "MindFormers 1.x GPT-2)",
    "migrate-yaml": "a MindFormers 1.x GPT-2 YAML -> a gpt_local YAML (keys mapped or dropped, each said)",
    "lora": "merge a pet_config run's LoRA adapters into the base weights",
    "quantize": "a model directory -> an int8 (default) or bfloat16 inference model directory (generate, chat, "
                "serve, eval)",
    "ckpt": "split a full checkpoint into per-rank shards for a (dp, mp, pp) layout, or merge them back",
    "plan": "check a YAML's parallel layout, estimate per-device memory and communication (no devices)",
    "quickstart": "the whole product on one CPU with no download: data, train, eval, generate",
}


# flags users bring from other tools: (a flag the parser must have, what to say instead of a near spelling)
FLAG_HINTS = {
    "--do-sample": ("--temperature", "sampling is already the default; --temperature 0 is greedy"),
    "--greedy": ("--temperature", "use --temperature 0 for greedy decoding; sampling is the default"),
}


class Parser(argparse.ArgumentParser):
    """ArgumentParser with the spelling rule above: ``--a_b`` and ``--a-b`` name the same flag (done once, on
    the arguments, before argparse sees them), and an unknown flag gets the closest known ones suggested."""

    def canonical(self, token):
        """``token`` with its flag respelled to the one this parser defines, if it defines the other spelling."""
        if not token.startswith("--") or token == "--":
            return token
        name, eq, value = token.partition("=")
        if name in self._option_string_actions:
            return token
        for other in ("--" + name[2:].replace("_", "-"), "--" + name[2:].replace("-", "_")):
            if other in self._option_string_actions:
                return other + eq + value
        return token

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        if "--" in args:
            cut = args.index("--")
            args = [self.canonical(a) for a in args[:cut]] + args[cut:]
        else:
            args = [self.canonical(a) for a in args]
        return super().parse_known_args(args, namespace)

    def error(self, message):
        """One line, as every other bad input (argparse prints its whole usage first)."""
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help lists the flags)\n")

    def parse_args(self, args=None, namespace=None):
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            flags = [e.split("=", 1)[0] for e in extras if e.startswith("-")]
            known = sorted(self._all_flags())
            hint = "; ".join(h for h in (self._hint(f, known) for f in flags) if h)
            self.error(f"unrecognized arguments: {' '.join(extras)}" + (f" ({hint})" if hint else ""))
        return namespace

    def _hint(self, flag, known):
        """What to say about the unknown ``flag``: its FLAG_HINTS line, else the closest known flags."""
        needs, said = FLAG_HINTS.get(flag.replace("_", "-"), (None, None))
        if needs in known:
            return f"{flag}: {said}"
        close = difflib.get_close_matches(flag.replace("_", "-"), known, n=2, cutoff=0.6)
        return f"{flag}: did you mean {' or '.join(close)}?" if close else ""

    def _all_flags(self):
        flags = set()
        for action in self._actions:
            flags.update(o for o in action.option_strings if o.startswith("--"))
            if isinstance(action, argparse._SubParsersAction):  # pylint: disable=protected-access
                for sub in action.choices.values():
                    flags.update(sub._all_flags() if isinstance(sub, Parser) else ())
        return flags


def main_parser():
    """``gptlocal --help``: the subcommands (each one parses its own arguments)."""
    parser = Parser(prog="gptlocal", description="GPT-2-family models on MindFormers (model_type: gpt_local).",
                    epilog="gptlocal COMMAND --help shows a command's options. Flags: ours use dashes "
                           "(--hf-dir), MindFormers' launcher flags underscores (--device_target); the other "
                           "spelling of any flag works too.")
    parser.add_argument("--version", action="version", version=version_line())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, text in COMMANDS.items():
        sub.add_parser(name, help=text, add_help=False)
    return parser


def version_line():
    """``mindformers-gptlocal X (MindSpore Y, MindFormers Z)``, from package metadata: nothing imported."""
    from importlib import metadata
    from .. import __version__

    def installed(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"
    return (f"mindformers-gptlocal {__version__} (mindspore {installed('mindspore')}, mindformers "
            f"{installed('mindformers')}, Python {sys.version.split()[0]})")


def _cli_defaults():
    """generation/defaults.py's CLI column, read when a parser is built: importing ``generation`` loads numpy, whose
    BLAS starts threads, and ``gptlocal run`` must block SIGINT/SIGTERM before any thread starts
    (``training/stop.py hold``)."""
    from ..generation.defaults import CLI
    return CLI


def _sampling_flags(parser, max_new_tokens):
    CLI_DEFAULTS = _cli_defaults()  # pylint: disable=invalid-name
    parser.add_argument("--model", required=True, help="model directory (config.json, model.safetensors, "
                                                       "tokenizer.json), e.g. runs/quickstart/train/model,"
                                                       " or a Hugging Face model id in the local Hugging Face cache (e.g. gpt2; converted once, never downloaded)")
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens,
                        help=f"tokens to generate at most (default {max_new_tokens})")
    parser.add_argument("--temperature", type=float, default=CLI_DEFAULTS["temperature"],
                        help=f"sampling temperature (default {CLI_DEFAULTS['temperature']}); 0 = greedy (the most "
                             f"likely token each step)")
    parser.add_argument("--top-k", type=int, default=CLI_DEFAULTS["top_k"],
                        help=f"sample among the k most likely tokens (default {CLI_DEFAULTS['top_k']}; 0 = all)")
    parser.add_argument("--top-p", type=float, default=CLI_DEFAULTS["top_p"],
                        help=f"nucleus sampling mass (default {CLI_DEFAULTS['top_p']} = off)")
    parser.add_argument("--seed", type=int, default=CLI_DEFAULTS["seed"],
                        help=f"sampling seed (default {CLI_DEFAULTS['seed']}): same seed, same text")
    parser.add_argument("--repetition-penalty", type=float, default=CLI_DEFAULTS["repetition_penalty"],
                        help=f"Hugging Face's repetition penalty: the logit of a token already in the prompt or "
                             f"the reply is divided by it (multiplied if negative); default "
                             f"{CLI_DEFAULTS['repetition_penalty']} = off, 1.1-1.3 discourages loops")
    device_target_flag(parser)
    compile_cache_flag(parser, "generation's graphs")


def device_target_flag(parser):
    """``--device-target`` of generate, chat, serve and eval."""
    parser.add_argument("--device-target", default="CPU", choices=("CPU", "GPU", "Ascend"),
                        help="where the model runs (default CPU); GPU and Ascend need a MindSpore built for them")


def compile_cache_flag(parser, what):
    """``--compile-cache on|off|DIR`` and its bounds (``runtime/graph_cache.py attach`` reads them)."""
    parser.add_argument("--compile-cache", default="on",
                        help=f"{what} through MindSpore's compile cache, loaded instead of compiled in a later run "
                             f"(less time and memory): on (default; $XDG_CACHE_HOME/mindformers_gptlocal/compile), "
                             f"off, or a folder")
    parser.add_argument("--compile-cache-days", type=float, default=None,
                        help="drop stored graphs unused for this many days (default 14)")
    parser.add_argument("--compile-cache-mb", type=float, default=None,
                        help="then the least recently used until the store holds at most this many MB (default 1024)")


def generate_parser():
    CLI_DEFAULTS = _cli_defaults()  # pylint: disable=invalid-name
    parser = Parser(prog="gptlocal generate",
                    description="Continue a prompt with a gpt_local model directory (no YAML): "
                                "GPTLocalForCausalLM.from_pretrained + model.generate.")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    _sampling_flags(parser, CLI_DEFAULTS["max_new_tokens"])
    parser.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    parser.add_argument("--num-samples", type=int, default=CLI_DEFAULTS["num_samples"],
                        help=f"continuations of the prompt (default {CLI_DEFAULTS['num_samples']}), each printed under "
                             f"a '--- sample i/N ---' line; sample i is seeded --seed + i - 1")
    parser.add_argument("--stop", action="append", default=[], metavar="STR",
                        help="end the continuation before this text (repeatable; the stop text is not printed)")
    return parser


def chat_parser():
    CLI_DEFAULTS = _cli_defaults()  # pylint: disable=invalid-name
    parser = Parser(prog="gptlocal chat",
                    description="Chat with a gpt_local model directory: each line on stdin is a user message, "
                                "rendered with the directory's chat template (tokenizer_config.json; else a plain "
                                "'User: ... / Assistant:' form, as gptlocal serve does); replies are streamed. "
                                "Works through a pipe: printf 'hi\\n' | gptlocal chat --model DIR.")
    _sampling_flags(parser, CLI_DEFAULTS["chat_max_new_tokens"])
    parser.add_argument("--system", help="a system message put first")
    chat_template_flag(parser)
    return parser


def chat_template_flag(parser):
    """``--chat-template FILE|plain`` (chat, serve): ``serve/protocol.py chat_template`` reads it."""
    parser.add_argument("--chat-template", default=None, metavar="FILE|plain",
                        help="the chat template: a Jinja file (Hugging Face's convention: messages, "
                             "add_generation_prompt) or 'plain' (System:/User:/Assistant: lines, replies stop at the "
                             "next 'User:'); default: the model directory's (tokenizer_config.json chat_template), "
                             "else plain. Given, it replaces the directory's")


def prepare_data_parser():
    parser = Parser(prog="gptlocal prepare-data",
                                     description="Text files, a folder or JSONL -> tokenizer, MindRecord and "
                                                 "Megatron .bin/.idx. With no --input: the Python standard library.")
    parser.add_argument("--input", nargs="*", help="text files, folders or .jsonl (default: Python's stdlib sources)")
    parser.add_argument("--out", default="data/gptlocal", help="output folder (default: data/gptlocal)")
    parser.add_argument("--seq-length", type=int, help="tokens a row (default 256; with --from-mf-mindrecord: "
                                                       "checked against the rows, default their width - 1)")
    parser.add_argument("--vocab-size", type=int, default=8192, help="size of a newly trained BPE")
    parser.add_argument("--tokenizer", help="an existing tokenizer.json, or a model directory (its tokenizer.json, "
                                            "checked against its weights' tokenizer_id), instead of training one")
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
    parser = Parser(prog="gptlocal migrate-yaml",
                    description="A MindFormers 1.x GPT-2 YAML (configs/gpt2/run_gpt2*.yaml) -> a "
                                "gpt_local YAML; every key mapped or dropped with a line saying so.")
    parser.add_argument("old", metavar="OLD.yaml", help="the MindFormers GPT-2 YAML")
    parser.add_argument("--out", required=True, help="the gpt_local YAML to write")
    parser.add_argument("--device-target", choices=("CPU", "GPU", "Ascend"),
                        help="run on this device instead of the old context.device_target")
    parser.add_argument("--model-dir", help="a `gptlocal convert mf2ms` output: load_checkpoint and tokenizer")
    return parser


def convert_parser():
    parser = Parser(prog="gptlocal convert",
                                     description="Hugging Face <-> gpt_local model directories, exact: GPT-2, "
                                                 "Llama-family (Llama, Qwen2, TinyLlama, SmolLM) and GPT-NeoX "
                                                 "(Pythia); the family is read from config.json.")
    sub = parser.add_subparsers(dest="direction", required=True)
    hf2ms = sub.add_parser("hf2ms", help="HF directory (GPT-2, Llama, Qwen2, GPT-NeoX) -> gpt_local directory")
    hf2ms.add_argument("--hf-dir", required=True, help="config.json + model.safetensors (or shards, or .bin), or a "
                                                         "model id in the local Hugging Face cache (e.g. gpt2)")
    hf2ms.add_argument("--out", required=True, help="new folder for config.json, model.safetensors, tokenizer")
    hf2ms.add_argument("--overwrite", action="store_true", help="replace an existing --out folder")
    hf2ms.add_argument("--allow-pickle", action="store_true",
                       help="load pytorch_model.bin with full pickle (only for files you trust)")
    ms2hf = sub.add_parser("ms2hf", help="gpt_local directory -> HF directory of its family")
    ms2hf.add_argument("--ms-dir", required=True, help="gpt_local model directory (e.g. output/model)")
    ms2hf.add_argument("--out", required=True, help="new folder for the Hugging Face files")
    ms2hf.add_argument("--overwrite", action="store_true", help="replace an existing --out folder")
    ms2hf.add_argument("--lora-only", action="store_true",
                       help="write only the LoRA adapters of a pet_config run, as a Hugging Face PEFT adapter "
                            "(adapter_config.json + adapter_model.safetensors)")
    ms2hf.add_argument("--peft", action="store_true",
                       help="write the adapter of a pet_config run as a Hugging Face PEFT adapter: LoRA as "
                            "--lora-only, prefixtuning / ptuning2 as a PrefixTuningConfig adapter")
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
    parser = Parser(prog="gptlocal lora", description="LoRA adapters of a pet_config run.")
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
    parser = Parser(prog="gptlocal ckpt",
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
    parser = Parser(prog="gptlocal plan",
                                     description="Check a YAML's parallel layout and estimate per-device memory and "
                                                 "communication, without devices or compiling.")
    parser.add_argument("--config", required=True, help="run YAML (base_config is merged)")
    parser.add_argument("--devices", type=int, help="cards the run will have (default: 1 when use_parallel is "
                                                    "False, else dp*mp*pp)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def quickstart_parser():
    parser = Parser(prog="gptlocal quickstart",
                                     description="The whole product on one CPU, with no download.")
    parser.add_argument("--out", "--workdir", dest="workdir", default="runs/quickstart",
                        help="where data, YAMLs and outputs go (default runs/quickstart)")
    parser.add_argument("--steps", type=int, default=240, help="training steps (batch 4 x 256 tokens)")
    parser.add_argument("--max-bytes", type=int, default=3_000_000, help="corpus size from the stdlib")
    parser.add_argument("--prompt", default="def main(", help="prompt for the generated sample")
    return parser


def _str2bool(value):
    from ..mf.symbols import str2bool
    return str2bool(value)


def _str2bool_or_str(value):
    from ..mf.symbols import str2bool_or_str
    return str2bool_or_str(value)


class _Options(argparse.Action):
    """``--options KEY=VALUE ...`` with MindFormers' own parsing (ActionDict), loaded when used."""

    def __call__(self, parser, namespace, values, option_string=None):
        from ..mf.symbols import ActionDict
        ActionDict(self.option_strings, self.dest, nargs=self.nargs)(parser, namespace, values, option_string)


RUN_EPILOG = """config overrides: any other --dotted.key VALUE (or --dotted.key=VALUE) sets that key of the
YAML after the flags above, its VALUE parsed as YAML, e.g.
  gptlocal run --config model_configs/pretrain_gpt_local_tiny_cpu.yaml \\
      --runner_config.stop_step 10 --model.model_config.seq_length 128 --pretrained_model_dir output/model
The flags are those of MindFormers' own run_mindformer.py (the same in 1.8 and 1.9, the versions gpt_local
supports), spelled as there (--device_target); the dashed spelling (--device-target) is accepted too. Ctrl-C or
SIGTERM during training saves a checkpoint and stops; a training run into an output_dir that holds a run is
refused unless --resume_training True continues it or --overwrite_output_dir True starts over
(docs/reliability.md)."""


def run_parser():
    """The flags of MindFormers' ``run_mindformer.py`` (1.8 and 1.9 take the same), plus ``--key value`` config
    overrides."""
    parser = Parser(prog="gptlocal run", formatter_class=argparse.RawDescriptionHelpFormatter,
                    description="Run a MindFormers YAML (train/finetune/eval/predict) with the flags of "
                                "MindFormers' run_mindformer.py; the pre-flight checks run first.",
                    epilog=RUN_EPILOG)
    add = parser.add_argument
    add("--config", help="YAML config file (base_config is merged); required")
    add("--mode", type=int, help="context.mode: 0 graph, 1 pynative")
    add("--device_id", type=int, help="context.device_id")
    add("--device_target", type=str, help="context.device_target: CPU, GPU or Ascend")
    add("--run_mode", type=str, help="train, finetune, eval, predict or predict_with_train_model")
    add("--do_eval", type=_str2bool, help="evaluate during training (eval_dataset)")
    add("--train_dataset_dir", type=str, help="train_dataset.data_loader.dataset_dir")
    add("--eval_dataset_dir", type=str, help="eval_dataset.data_loader.dataset_dir")
    add("--predict_data", type=str, nargs="+", help="predict: the input text(s)")
    add("--modal_type", type=str, nargs="+", help="predict: modal types of multimodal inputs")
    add("--predict_batch_size", type=int, help="predict: batch size")
    add("--adapter_id", type=str, nargs="+", help="predict: adapter ids")
    add("--load_checkpoint", type=str, help="weights to load: a model directory, a .safetensors file or a "
                                            "checkpoint folder")
    add("--src_strategy_path_or_dir", type=str, help="strategy of a distributed checkpoint to transform")
    add("--auto_trans_ckpt", type=_str2bool, help="transform a distributed checkpoint to this layout")
    add("--transform_process_num", type=int, help="processes for the checkpoint transform")
    add("--only_save_strategy", type=_str2bool, help="write the parallel strategy and stop")
    add("--resume_training", type=_str2bool_or_str, help="True: continue from the newest complete checkpoint "
                                                         "(load_checkpoint or output_dir/checkpoint); or a file name")
    add("--strategy_load_checkpoint", type=str, help="parallel.strategy_ckpt_load_file")
    add("--remote_save_url", type=str, help="remote_save_url (ModelArts)")
    add("--seed", type=int, help="seed")
    add("--use_parallel", type=_str2bool, help="use_parallel (msrun launches)")
    add("--profile", type=_str2bool, help="profile")
    add("--options", nargs="+", action=_Options, help="key=value overrides merged into the config")
    add("--epochs", type=int, help="runner_config.epochs")
    add("--batch_size", type=int, help="runner_config.batch_size")
    add("--gradient_accumulation_steps", type=int, help="runner_config.gradient_accumulation_steps")
    add("--sink_mode", type=_str2bool, help="runner_config.sink_mode")
    add("--num_samples", type=int, help="data_loader.num_samples of the datasets")
    add("--output_dir", type=str, help="output_dir (checkpoints, model directory, logs)")
    add("--overwrite_output_dir", type=_str2bool, help="gpt_local's overwrite_output_dir: True starts over on an "
                                                       "earlier run in output_dir, deleting its checkpoints and model "
                                                       "directory (without it, or --resume_training, it is refused)")
    add("--register_path", type=str, help="a folder to put on sys.path (MindFormers' external-model route)")
    add("--do_sample", type=_str2bool, help="model.model_config.do_sample")
    add("--trust_remote_code", type=_str2bool, help="trust_remote_code")
    parser.add_argument("--verbose", action="store_true",
                        help="also print MindFormers' own log on the terminal (the config dump, its loss lines and "
                             "warnings); without it they go to <output_dir>/log only")
    return parser


def serve_parser():
    parser = Parser(prog="gptlocal serve",
                                     description="Serve a gpt_local model directory over an OpenAI-compatible HTTP "
                                                 "API (needs the [serve] extra: pip install "
                                                 "'mindformers-gptlocal[serve]').")
    parser.add_argument("--model", required=True, help="model directory (config.json, model.safetensors, "
                                                       "tokenizer.json), or a Hugging Face model id in the local Hugging "
                                                       "Face cache (e.g. gpt2; converted once, never downloaded)")
    chat_template_flag(parser)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-batch-size", type=int, default=8, help="sequences decoded together (cache slots)")
    parser.add_argument("--max-queue", type=int, default=64, help="requests that may wait for a slot; more get 429")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="context (prompt + new tokens) per request; default max_position_embeddings")
    parser.add_argument("--prompt-buckets", default=None,
                        help="comma-separated prompt widths to compile (default: 16, 32, 64, ... up to the context)")
    parser.add_argument("--batch-buckets", default=None,
                        help="comma-separated batch sizes to compile (default: 1, 16, 256, ... up to --max-batch-size)")
    parser.add_argument("--warmup-tokens", type=int, default=512,
                        help="compile at start-up only the shapes of up to this many tokens (batch x width); larger "
                             "refill shapes compile when first needed, pausing the running requests for it "
                             "(default 512; a large value compiles everything at start)")
    parser.add_argument("--max-prefill-tokens", type=int, default=32,
                        help="tokens per prefill call (batch x width): arriving prompts are prefilled apart from "
                             "the decoding rows, in chunks of at most this many tokens, so no prompt shape of the "
                             "full batch is compiled (default 32; 0: prompts join the decode call of every busy "
                             "slot, one refill shape per batch bucket, as before; docs/serving.md)")
    parser.add_argument("--served-model-name", default=None, help="the model id clients send (default: folder name)")
    parser.add_argument("--lora", action="append", default=None, metavar="NAME=DIR",
                        help="also serve the LoRA adapter of a finetune's model directory DIR as model NAME "
                             "(repeatable; requests of different adapters share decode steps; docs/serving.md)")
    device_target_flag(parser)
    compile_cache_flag(parser, "the server's graphs")
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
    parser = Parser(prog="gptlocal eval",
                                     description="Benchmark a gpt_local model directory with lm-evaluation-harness "
                                                 "tasks (pip install 'mindformers-gptlocal[eval]').")
    parser.add_argument("--model", required=True, help="gpt_local model directory (config.json, model.safetensors, "
                                                        "tokenizer files), or a Hugging Face model id in the local Hugging Face cache (e.g. gpt2; converted once, never downloaded)")
    parser.add_argument("--tasks", required=True, help="comma-separated lm-eval task names, e.g. gl_choice,gl_until")
    parser.add_argument("--num-fewshot", type=int, help="few-shot examples per request (default: each task's own)")
    parser.add_argument("--limit", type=float, help="documents per task (a fraction if < 1)")
    parser.add_argument("--include-path", help="folder of extra task YAMLs (local tasks)")
    parser.add_argument("--out", "--output-path", dest="output_path", help="write lm-eval's results JSON to this file")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-length", type=int, help="context length (default: max_position_embeddings)")
    device_target_flag(parser)
    from ..generation.defaults import EVAL  # pylint: disable=import-outside-toplevel  (numpy: see _cli_defaults)
    parser.add_argument("--seed", type=int, default=EVAL["seed"], help="seed of lm-eval and of sampled generation")
    parser.add_argument("--log-samples", action="store_true", help="also keep every request's responses in the JSON")
    compile_cache_flag(parser, "the scoring and generate_until graphs")
    return parser


def quantize_parser():
    parser = Parser(prog="gptlocal quantize",
                    description="A gpt_local model directory -> an inference model directory in int8 (weights per "
                                "output channel, activations per row at run time) or bfloat16; generate, chat, "
                                "serve and eval load it like any other (docs/model-directory.md).")
    parser.add_argument("--model", required=True, help="the float gpt_local model directory")
    parser.add_argument("--out", required=True, help="new folder for the quantized model directory")
    parser.add_argument("--dtype", default="int8", help="int8 (the default) or bfloat16")
    return parser


PARSERS = {"prepare-data": prepare_data_parser, "convert": convert_parser, "ckpt": ckpt_parser, "run": run_parser,
           "plan": plan_parser, "quickstart": quickstart_parser, "serve": serve_parser, "eval": eval_parser,
           "lora": lora_parser, "migrate-yaml": migrate_yaml_parser, "generate": generate_parser, "chat": chat_parser,
           "quantize": quantize_parser}

"""The command line a newcomer meets (issue 26, item 4): every --help without MindSpore, --version, one flag
spelling with the other as an alias, suggestions, `convert --overwrite`, and `generate`/`chat` equal to
``model.generate`` (greedy) through the public API."""
import io
import json
import os
import shutil
import subprocess
import sys

import pytest

from mindformers_gptlocal.cli import args as cli_args
from mindformers_gptlocal.cli.main import main
from mindformers_gptlocal.errors import ConfigError, GPTLocalError
from conftest import TINY, save_tiny_base, source_env

HEAVY = ("mindspore", "mindformers", "torch", "transformers", "lm_eval", "fastapi", "tokenizers")

HELP_PROBE = r"""
import json, sys, time
from mindformers_gptlocal.cli import args
from mindformers_gptlocal.cli.main import main
heavy = %r
result = {}
def probe(argv):
    start = time.perf_counter()
    try:
        main(argv + ["--help"])
    except SystemExit as exit_:
        code = exit_.code
    else:
        code = "returned"
    loaded = sorted({m.split(".")[0] for m in sys.modules} & set(heavy))
    result[" ".join(argv) or "gptlocal"] = {"code": code, "heavy": loaded, "seconds": time.perf_counter() - start}
probe([])
for name in args.COMMANDS:
    probe([name])
    parser = args.PARSERS[name]()
    for action in parser._actions:
        if action.__class__.__name__ == "_SubParsersAction":
            for sub in action.choices:
                probe([name, sub])
sys.stderr.write(json.dumps(result))
""" % (HEAVY,)


@pytest.fixture(scope="module")
def helps():
    """Every command's and sub-command's --help, in one fresh interpreter: exit code and heavy modules loaded."""
    proc = subprocess.run([sys.executable, "-c", HELP_PROBE], env=source_env(), capture_output=True, text=True,
                          timeout=120)
    return json.loads(proc.stderr.strip().splitlines()[-1]), proc.stdout


def test_every_help_loads_no_heavy_module(helps):
    result, _ = helps
    assert set(cli_args.COMMANDS) <= set(result), result  # every subcommand, those added later included
    assert set(cli_args.COMMANDS) == set(cli_args.PARSERS)
    for command, probe in result.items():
        assert probe["code"] == 0, (command, probe)
        assert probe["heavy"] == [], (command, probe)  # checked after each: the first that loads one is named


def test_run_help_lists_the_launcher_flags_and_the_override_form(helps):
    _, text = helps
    run_help = text[text.index("usage: gptlocal run"):]
    launcher = ("--config --mode --device_id --device_target --run_mode --do_eval --train_dataset_dir "
                "--eval_dataset_dir --predict_data --predict_batch_size --modal_type --load_checkpoint "
                "--src_strategy_path_or_dir --auto_trans_ckpt --transform_process_num --only_save_strategy "
                "--strategy_load_checkpoint --resume_training --profile --options --seed --use_parallel "
                "--do_sample --adapter_id --remote_save_url --register_path").split()
    missing = [flag for flag in launcher if flag not in run_help]
    assert not missing, missing
    assert "--dotted.key VALUE" in run_help and "--runner_config.stop_step 10" in run_help


def test_version(capsys):
    from mindformers_gptlocal import __version__
    with pytest.raises(SystemExit) as caught:
        main(["--version"])
    assert caught.value.code == 0
    assert capsys.readouterr().out.startswith(f"mindformers-gptlocal {__version__} (mindspore ")


def test_one_spelling_rule_other_spelling_is_an_alias_everywhere():
    """Our flags are dashed; MindFormers' launcher flags keep underscores; each parser takes the other too."""
    launcher = {a.option_strings[0] for a in cli_args.run_parser()._actions if a.option_strings}
    parsers = [cli_args.PARSERS[name]() for name in cli_args.PARSERS]
    for parser in list(parsers):
        for action in parser._actions:
            if isinstance(action, cli_args.argparse._SubParsersAction):
                parsers += list(action.choices.values())
    checked = 0
    for parser in parsers:
        assert isinstance(parser, cli_args.Parser), parser.prog
        for action in parser._actions:
            for flag in action.option_strings:
                name = flag[2:]
                if not flag.startswith("--") or not ("-" in name or "_" in name):
                    continue
                if parser.prog != "gptlocal run":
                    assert "_" not in name, f"{parser.prog} {flag}: our flags use dashes"
                else:
                    assert flag in launcher
                other = "--" + (name.replace("_", "-") if "_" in name else name.replace("-", "_"))
                assert parser.canonical(other + "=1") == flag + "=1", (parser.prog, flag)
                checked += 1
    assert checked > 30
    options = cli_args.convert_parser().parse_args(["hf2ms", "--hf_dir", "a", "--out", "b"])
    assert options.hf_dir == "a"
    options, rest = cli_args.run_parser().parse_known_args(["--config", "c.yaml", "--device-target", "CPU",
                                                            "--model.model_config.seq_length", "8"])
    assert options.device_target == "CPU" and rest == ["--model.model_config.seq_length", "8"]
    options = cli_args.eval_parser().parse_args(["--model", "m", "--tasks", "t", "--num_fewshot", "2",
                                                 "--output_path", "r.json"])
    assert (options.num_fewshot, options.output_path) == (2, "r.json")


def test_suggestions_for_a_mistyped_command_and_flag(capsys):
    assert main(["genrate"]) == 2
    assert "Did you mean generate" in capsys.readouterr().err
    assert main(["prepar-data"]) == 2
    assert "Did you mean prepare-data?" in capsys.readouterr().err
    with pytest.raises(SystemExit) as caught:  # the spelling rule holds for command names too
        main(["prepare_data", "--help"])
    assert caught.value.code == 0 and "usage: gptlocal prepare-data" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli_args.generate_parser().parse_args(["--model", "m", "--prompt", "p", "--max-tokens", "3"])
    assert "did you mean --max-new-tokens" in capsys.readouterr().err


def test_optimizer_and_handler_errors_are_gptlocal_errors():
    import mindformers  # noqa: F401  (first: registering gpt_local imports the handler module)
    from mindspore import nn
    from mindformers_gptlocal.mf.data_handler import GPTLocalInstructHandler
    from mindformers_gptlocal.training.optim import GPTLocalAdamW
    with pytest.raises(ConfigError, match=r"optimizer.betas .*\(0.9, 1.5\); set e.g. betas"):
        GPTLocalAdamW(nn.Dense(2, 2).trainable_params(), betas=(0.9, 1.5))
    with pytest.raises(ConfigError, match="optimizer.eps must be > 0, got 0"):
        GPTLocalAdamW(nn.Dense(2, 2).trainable_params(), eps=0)
    with pytest.raises(ConfigError, match="GPTLocalInstructHandler.format is 'sharegpt'; set it to alpaca or chat"):
        GPTLocalInstructHandler(seq_length=64, format="sharegpt")
    with pytest.raises(ConfigError, match="GPTLocalInstructHandler has no tokenizer .*set pretrained_model_dir"):
        GPTLocalInstructHandler(seq_length=64)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, corpus):
    """The tiny model's directory, its weights from a fixed seed: the same model whatever ran before in this worker
    (test_generate_num_samples_stop_and_repetition_penalty needs one whose greedy text the penalty changes; unseeded,
    one worker order under -n 3 gave a model where it did not)."""
    return save_tiny_base(tmp_path_factory.mktemp("cli_model") / "model", corpus, seed=0)


def _reference(model_dir, ids, max_new, stop=None, **options):
    """What model.generate gives, greedy, decoded (cut at ``stop``): in PyNative mode, uncached (the CLI runs in
    GRAPH mode, through its compile cache)."""
    import mindspore as ms
    from tokenizers import Tokenizer
    from mindformers_gptlocal import GPTLocalForCausalLM
    before = ms.get_context("mode")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    try:
        model = GPTLocalForCausalLM.from_pretrained(model_dir)
        eos = model.config.eos_token_id
        options.setdefault("do_sample", False)
        out = model.generate([ids], max_new_tokens=max_new, eos_token_id=eos, **options)[0][len(ids):]
    finally:
        ms.set_context(mode=before)
    text = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json")).decode([t for t in out if t != eos])
    return text[:text.index(stop)] if stop and stop in text else text


def test_generate_greedy_equals_model_generate(model_dir, capsys, tmp_path, graph_mode):
    """Streamed and not, both through a compile-cache folder (on by default): the first run stores its graphs,
    the second loads them; both print what an uncached model.generate gives. (``gptlocal generate`` sets GRAPH
    mode, as serve does; ``graph_mode`` gives the suite its mode back after.) The graphs are the compiled runner's
    (the model's ``cpu_kernels: {runner: plain}``); on CPU the default native runner compiles none and stores
    nothing, with the same output."""
    from tokenizers import Tokenizer
    prompt = "def main(args):\n    "
    ids = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json")).encode(prompt).ids
    expected = prompt + _reference(model_dir, ids, 6) + "\n"
    cache = tmp_path / "compile"
    native = ["--model", model_dir, "--prompt", prompt, "--temperature", "0", "--max_new_tokens", "6",
              "--compile-cache", str(tmp_path / "native-compile")]
    assert main(["generate", *native]) == 0 and capsys.readouterr().out == expected
    assert not list((tmp_path / "native-compile").glob("*/graph.mindir"))
    compiled = tmp_path / "compiled"  # the same model directory on the compiled runner
    shutil.copytree(model_dir, compiled)
    config = json.loads((compiled / "config.json").read_text())
    config["cpu_kernels"] = {"runner": "plain"}
    (compiled / "config.json").write_text(json.dumps(config))
    flags = ["--model", str(compiled), "--prompt", prompt, "--temperature", "0", "--max_new_tokens", "6",
             "--compile-cache", str(cache)]
    assert main(["generate", *flags, "--stream"]) == 0  # streamed through stop_when
    assert capsys.readouterr().out == expected
    stored = sorted(p.parent.name.split("-")[0] for p in cache.glob("*/graph.mindir"))
    assert "anchor" in stored and "cachedforward" in stored, stored  # the prefill's graph at least
    assert main(["generate", *flags]) == 0  # model.generate itself, its graphs loaded where stored
    assert capsys.readouterr().out == expected
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    flags[flags.index(str(cache))] = str(blocked / "compile")  # a store that cannot be made: used, not kept
    assert main(["generate", *flags]) == 0
    out = capsys.readouterr()
    assert out.out == expected and "could not store" in out.err and out.err.count("could not store") == 1


def test_chat_through_a_pipe_greedy_equals_model_generate(model_dir, monkeypatch, capsys, graph_mode):
    """Two lines on stdin: two replies, the second with the first turn in its prompt (plain template); stdout marks
    the user's lines and the replies."""
    from tokenizers import Tokenizer
    from mindformers_gptlocal.serve.protocol import PLAIN_CHAT_STOP, render_chat
    tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    monkeypatch.setattr(sys, "stdin", io.StringIO("print hello\nand again\n"))
    assert main(["chat", "--model", model_dir, "--temperature", "0", "--max-new-tokens", "5",
                 "--compile-cache", "off"]) == 0
    out = capsys.readouterr().out
    messages = [{"role": "user", "content": "print hello"}]
    first = _reference(model_dir, tokenizer.encode(render_chat(messages, None)).ids, 5, PLAIN_CHAT_STOP)
    messages += [{"role": "assistant", "content": first.strip()}, {"role": "user", "content": "and again"}]
    second = _reference(model_dir, tokenizer.encode(render_chat(messages, None)).ids, 5, PLAIN_CHAT_STOP)
    # through a pipe the transcript marks each message and each reply
    transcript = f"user: print hello\nassistant: {first}\nuser: and again\nassistant: {second}\n"
    assert out == transcript, (out, first, second)


def test_generate_num_samples_stop_and_repetition_penalty(model_dir, capsys, graph_mode):
    """--repetition-penalty is model.generate's (HF's); --stop cuts the text before the stop string (streamed or
    not); --num-samples N prints N numbered samples, sample i seeded --seed + i (so it equals a one-sample run
    with that seed)."""
    from tokenizers import Tokenizer
    prompt = "def main(args):\n    "
    ids = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json")).encode(prompt).ids
    plain = _reference(model_dir, ids, 12)
    penalised = _reference(model_dir, ids, 12, repetition_penalty=1.8)
    assert penalised != plain  # the penalty changes this model's greedy text (else the check below proves nothing)
    base = ["--model", model_dir, "--prompt", prompt, "--max-new-tokens", "12", "--compile-cache", "off"]
    assert main(["generate", *base, "--temperature", "0", "--repetition-penalty", "1.8"]) == 0
    assert capsys.readouterr().out == prompt + penalised + "\n"
    stop = plain[4:7]
    for stream in ([], ["--stream"]):
        assert main(["generate", *base, "--temperature", "0", "--stop", "@@@", "--stop", stop, *stream]) == 0
        assert capsys.readouterr().out == prompt + plain[:plain.index(stop)] + "\n", stream
    assert main(["generate", *base, "--temperature", "0", "--num-samples", "2"]) == 0
    assert capsys.readouterr().out == "".join(f"--- sample {i}/2 ---\n{prompt}{plain}\n" for i in (1, 2))
    sampled = ["--temperature", "1.0", "--top-k", "0"]
    assert main(["generate", *base, *sampled, "--seed", "7", "--num-samples", "2", "--stream"]) == 0
    two = capsys.readouterr().out
    texts = [part.split("\n", 1)[1][:-1] for part in two.split("--- sample ")[1:]]
    assert len(texts) == 2 and texts[0] != texts[1], two
    for seed, text in zip((7, 8), texts):
        assert main(["generate", *base, *sampled, "--seed", str(seed)]) == 0
        assert capsys.readouterr().out == text + "\n"
    want = _reference(model_dir, ids, 12, do_sample=True, temperature=1.0, top_k=0, seed=8)
    assert texts[1] == prompt + want
    for flags, message in ((["--repetition-penalty", "0"], "--repetition-penalty must be > 0"),
                           (["--num-samples", "0"], "--num-samples must be >= 1")):
        assert main(["generate", *base, *flags]) == 2
        assert message in capsys.readouterr().err


def test_chat_template_file_and_plain(model_dir, monkeypatch, capsys, graph_mode, tmp_path):
    """--chat-template FILE renders the prompt with that Jinja file (no plain-form stop); 'plain' is the built-in
    form; a missing or broken file is one line, exit 2, before the model loads."""
    from tokenizers import Tokenizer
    from mindformers_gptlocal.serve.protocol import PLAIN_CHAT_STOP, render_chat
    tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>")
    messages = [{"role": "user", "content": "print hello"}]
    flags = ["chat", "--model", model_dir, "--temperature", "0", "--max-new-tokens", "5", "--compile-cache", "off"]
    monkeypatch.setattr(sys, "stdin", io.StringIO("print hello\n"))
    assert main([*flags, "--chat-template", str(template)]) == 0
    rendered = render_chat(messages, template.read_text())
    assert rendered == "<user>print hello\n<assistant>"
    reply = _reference(model_dir, tokenizer.encode(rendered).ids, 5)
    assert capsys.readouterr().out == f"user: print hello\nassistant: {reply}\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO("print hello\n"))
    assert main([*flags, "--chat-template", "plain"]) == 0
    plain = _reference(model_dir, tokenizer.encode(render_chat(messages, None)).ids, 5, PLAIN_CHAT_STOP)
    assert capsys.readouterr().out == f"user: print hello\nassistant: {plain}\n"
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    for value, message in ((str(tmp_path / "none.jinja"), "is neither a file nor a built-in template (plain)"),
                           (str(broken), "line 1:")):
        assert main([*flags, "--chat-template", value]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err


def test_generate_refuses_bad_flags_with_the_flag_named(model_dir, capsys):
    assert main(["generate", "--model", model_dir, "--prompt", "x", "--top-p", "0"]) == 2
    assert "--top-p must be in (0, 1], got 0.0" in capsys.readouterr().err
    assert main(["generate", "--model", model_dir + "_nowhere", "--prompt", "x"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_convert_overwrite(model_dir, tmp_path, capsys):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "old.txt").write_text("stale")
    assert main(["convert", "ms2hf", "--ms-dir", model_dir, "--out", str(out)]) == 2
    assert "already holds files; pass --overwrite" in capsys.readouterr().err
    assert (out / "old.txt").exists()
    assert main(["convert", "ms2hf", "--ms-dir", model_dir, "--out", str(out), "--overwrite"]) == 0
    assert not (out / "old.txt").exists() and (out / "config.json").exists()
    assert main(["convert", "hf2ms", "--hf-dir", str(out), "--out", str(tmp_path / "back")]) == 0
    with open(tmp_path / "back" / "config.json", encoding="utf-8") as handle:
        assert json.load(handle)["hidden_size"] == TINY["hidden_size"]
    with pytest.raises(GPTLocalError):  # the converter's own refusal still reaches the caller as one error
        from mindformers_gptlocal.checkpoint.hf_models import hf_to_ms
        hf_to_ms(str(tmp_path / "nowhere"), str(tmp_path / "x"))

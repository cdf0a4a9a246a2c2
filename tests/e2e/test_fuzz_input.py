"""Fuzz: seeded random mutations of a valid YAML and its data files. Each run either works or stops with
one of our clear errors (a GPTLocalError; exit code 2 and one ``gptlocal run: error:`` line from the
launcher), never a raw traceback from deep inside MindSpore.

The launcher's config loading and pre-flight run in this process for every mutation (fast); only
mutations the pre-flight accepts are trained for real, in a subprocess (2 steps; two such runs at a time).
"""
import os
import random
import shutil
import traceback

import numpy as np
import yaml

from mindformers_gptlocal import yaml_io
from mindformers_gptlocal.errors import GPTLocalError
from conftest import Launch, tiny_yaml

MUTATIONS = 25
MAX_REAL_RUNS = int(os.environ.get("GPTLOCAL_FUZZ_REAL_RUNS", "5"))
BAD_VALUES = ["four", 64.5, -3, 0, None, [1, 2], {"a": 1}, True, "", "1e-5", 7]


def _typo(key, rng):
    i = rng.randrange(len(key))
    return key[:i] + key[i + 1:] if rng.random() < 0.5 else key[:i] + key[i] + key[i:]


def _corrupt_file(path, rng):
    """Truncate, zero a region, or empty a file, in place; says which."""
    size = os.path.getsize(path)
    choice = rng.choice(["truncate", "zero", "empty"])
    with open(path, "r+b") as handle:
        if choice == "truncate":
            handle.truncate(rng.randrange(1, max(2, size)))
        elif choice == "zero":
            start = rng.randrange(0, max(1, size - 64))
            handle.seek(start)
            handle.write(b"\0" * min(4096, size - start))
        else:
            handle.truncate(0)
    return choice


def mutate(base, files, tmp, rng):
    """One random change to a copy of the config dict or the data it points to; returns (config, what)."""
    config = yaml.safe_load(yaml.safe_dump(base))
    model = config["model"]["model_config"]
    kind = rng.choice(["value", "typo", "delete", "runner", "yaml_text", "mindrecord", "megatron", "checkpoint"])
    if kind == "value":
        key, value = rng.choice(sorted(model)), rng.choice(BAD_VALUES)
        model[key] = value
        return config, f"model_config.{key} = {value!r}"
    if kind == "typo":
        key = rng.choice(sorted(model))
        model[_typo(key, rng)] = model.pop(key)
        return config, f"model_config key {key} misspelt"
    if kind == "delete":
        key = rng.choice(sorted(model))
        del model[key]
        return config, f"model_config.{key} deleted"
    if kind == "runner":
        section, key = rng.choice([("runner_config", "batch_size"), ("runner_config", "epochs"),
                                   ("train_dataset", "batch_size"), ("runner_config", "gradient_accumulation_steps")])
        value = rng.choice(BAD_VALUES)
        config[section][key] = value
        return config, f"{section}.{key} = {value!r}"
    if kind == "yaml_text":
        return None, rng.choice(["drop_line", "garbage", "cut"])
    if kind == "mindrecord":
        path = str(tmp / "train.mindrecord")
        shutil.copyfile(files["mindrecord"], path)
        shutil.copyfile(files["mindrecord"] + ".db", path + ".db")
        config["train_dataset"]["data_loader"]["dataset_dir"] = path
        return config, f"train.mindrecord {_corrupt_file(path, rng)}"
    if kind == "megatron":
        prefix = str(tmp / "doc")
        for suffix in (".bin", ".idx"):
            shutil.copyfile(files["megatron"] + suffix, prefix + suffix)
        suffix = rng.choice([".bin", ".idx"])
        config["train_dataset"] = yaml.safe_load(yaml.safe_dump(files["megatron_section"]))
        config["train_dataset"]["data_loader"]["config"]["data_path"] = ["1", prefix]
        return config, f"megatron {suffix} {_corrupt_file(prefix + suffix, rng)}"
    path = str(tmp / "weights.safetensors")
    shutil.copyfile(files["checkpoint"], path)
    config["load_checkpoint"], config["run_mode"] = path, "finetune"
    return config, f"checkpoint {_corrupt_file(path, rng)}"


def _mutate_text(text, how, rng):
    lines = text.splitlines()
    if how == "drop_line":
        del lines[rng.randrange(len(lines))]
        return "\n".join(lines)
    if how == "garbage":
        i = rng.randrange(len(text))
        return text[:i] + rng.choice([":", "[", "{", "\t", "- ", "'", "&x "]) + text[i:]
    return text[:rng.randrange(len(text))]


def _preflight(yaml_path):
    """What the launcher runs before set_output_path / build_context."""
    from mindformers_gptlocal.cli.launcher import load_config, check_model_section
    from mindformers_gptlocal.mf.run_yaml import preflight
    config = load_config(["--config", yaml_path])
    check_model_section(config)
    preflight(config, log=lambda _: None)


def test_fuzzed_inputs_work_or_fail_clearly(tmp_path, corpus):
    base_path = tiny_yaml(tmp_path, corpus=corpus, train_dataset__data_loader__num_samples=8)
    base = yaml_io.load_yaml(base_path)
    (tmp_path / "megatron").mkdir()
    megatron = yaml_io.load_yaml(tiny_yaml(tmp_path / "megatron", "pretrain_gpt_local_tiny_cpu_megatron.yaml",
                                           corpus=corpus,
                                           train_dataset__data_loader__sizes=[8, 0, 0],
                                           train_dataset__data_loader__config__seq_length=64))
    from safetensors.numpy import save_file
    checkpoint = str(tmp_path / "valid.safetensors")
    save_file({"model.embedding.word_embeddings": np.zeros((512, 64), np.float32),
               "model.embedding.position_embeddings": np.zeros((64, 64), np.float32)}, checkpoint)
    files = {"mindrecord": corpus["train_mindrecord"], "checkpoint": checkpoint,
             "megatron": os.path.join(os.path.dirname(corpus["train_mindrecord"]), "megatron", "train_text_document"),
             "megatron_section": megatron["train_dataset"]}
    rng = random.Random(int(os.environ.get("GPTLOCAL_FUZZ_SEED", "1234")))  # other seeds explore more
    outcomes, failures, real_runs = [], [], 0
    running = []  # (what, Launch): real runs under way, two at a time (independent: they overlap)

    def finish(what, launch):
        code, out = launch.result()
        errors = [line for line in out.splitlines() if line.startswith("gptlocal run: error:")]
        if code == 0 or (code == 2 and len(errors) == 1 and "Traceback" not in out):
            outcomes.append((what, "trained" if code == 0 else "clear error at run", (errors or [""])[0][:100]))
        else:
            failures.append((what, out[-1500:]))
    for number in range(MUTATIONS):
        case = tmp_path / f"case{number}"
        case.mkdir()
        config, what = mutate(base, files, case, rng)
        yaml_path = str(case / "run.yaml")
        if config is None:
            with open(base_path) as handle:
                text = _mutate_text(handle.read().replace(str(tmp_path / "output"), str(case / "output")), what, rng)
            with open(yaml_path, "w") as handle:
                handle.write(text)
            what = f"yaml text {what}"
        else:
            config["output_dir"] = str(case / "output")
            yaml_io.dump_yaml(config, yaml_path)
        try:
            _preflight(yaml_path)
        except GPTLocalError as err:
            outcomes.append((what, "clear error", str(err)[:100]))
            continue
        except Exception:  # noqa: BLE001 - the point of the test
            failures.append((what, traceback.format_exc()[-1500:]))
            continue
        if real_runs >= MAX_REAL_RUNS:
            outcomes.append((what, "accepted by pre-flight (not trained: run cap)", ""))
            continue
        real_runs += 1
        if len(running) == 2:
            finish(*running.pop(0))
        running.append((what, Launch(["--config", yaml_path], cwd=str(case))))
    for what, launch in running:
        finish(what, launch)
    print("\n[fuzz] outcomes:")
    for item in outcomes + [(w, "FAILED", "") for w, _ in failures]:
        print("  ", item)
    assert not failures, "\n\n".join(f"{what}:\n{detail}" for what, detail in failures)
    assert sum(1 for _, outcome, _ in outcomes if outcome == "clear error") >= MUTATIONS // 2

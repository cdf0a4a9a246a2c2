"""Real 2-process data parallel with msrun on CPU, through run_scripts/run_msrun.sh.

Unshuffled MindRecord shards interleave (rank r reads samples r, r + 2, ...), so two workers with
batch 2 see, at every step, exactly the 4 samples a single process with batch 4 sees. With
``gradients_mean`` the averaged gradient equals the single process's, so the mean of the two
workers' losses must follow the single-process loss curve step by step.
"""
import os
import socket
import subprocess

import numpy as np

from conftest import REPO, run_launcher, source_env, step_losses, tiny_yaml
from mindformers_gptlocal import yaml_io

STEPS = 8
GLOBAL_BATCH = 4


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _yaml(tmp_path, name, corpus, per_card_batch, samples):
    path = tiny_yaml(tmp_path, name, corpus=corpus, train_dataset__data_loader__num_samples=samples,
                     train_dataset__data_loader__shuffle=False, train_dataset__batch_size=per_card_batch,
                     runner_config__batch_size=per_card_batch, lr_schedule__learning_rate=3e-3)
    config = yaml_io.load_yaml(path)
    for callback in config["callbacks"]:
        if callback["type"] == "GPTLocalThroughputMonitor":
            callback["per_print_times"] = 1
    return yaml_io.dump_yaml(config, path)


def test_two_process_data_parallel_matches_single_process_and_exports(corpus, tmp_path):
    dp_dir, single_dir = tmp_path / "dp2", tmp_path / "single"
    dp_dir.mkdir()
    single_dir.mkdir()
    dp_yaml = _yaml(dp_dir, "pretrain_gpt_local_tiny_cpu_dp2.yaml", corpus, GLOBAL_BATCH // 2,
                    STEPS * GLOBAL_BATCH // 2)
    env = source_env(MASTER_PORT=str(_free_port()), LOG_DIR=str(dp_dir / "msrun_log"), GLOG_v="3")
    proc = subprocess.run(["bash", os.path.join(REPO, "run_scripts", "run_msrun.sh"), "2", dp_yaml],
                          cwd=str(dp_dir), env=env, capture_output=True, text=True, timeout=600)
    logs = {name: (dp_dir / "msrun_log" / name).read_text() for name in os.listdir(dp_dir / "msrun_log")
            if name.startswith("worker_")}
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:] + str(list(logs))
    assert len(logs) == 2
    worker_losses = [step_losses(logs[name]) for name in sorted(logs)]
    assert all(len(losses) == STEPS for losses in worker_losses), worker_losses
    assert worker_losses[0] != worker_losses[1]  # each worker really saw its own shard

    single_yaml = _yaml(single_dir, "pretrain_gpt_local_tiny_cpu.yaml", corpus, GLOBAL_BATCH,
                        STEPS * GLOBAL_BATCH)
    code, out = run_launcher(["--config", single_yaml], cwd=str(single_dir))
    assert code == 0, out[-3000:]
    single = np.array(step_losses(out))
    data_parallel = np.mean(worker_losses, axis=0)
    assert len(single) == STEPS
    assert single[-1] < single[0] - 0.3  # the curve moves, so matching it means something
    print("dp2 mean", data_parallel.tolist(), "single", single.tolist(),
          "max rel diff", float(np.max(np.abs(data_parallel / single - 1))))
    np.testing.assert_allclose(data_parallel, single, rtol=1e-4, atol=0)

    from mindformers_gptlocal import GPTLocalForCausalLM
    model = GPTLocalForCausalLM.from_pretrained(str(dp_dir / "output" / "model"))  # loads on a single card
    assert model.config.hidden_size == 64

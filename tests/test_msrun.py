"""Real 2-process data parallel with msrun on CPU, through run_scripts/run_msrun.sh."""
import os
import re
import socket
import subprocess

import numpy as np

from conftest import REPO, source_env, tiny_yaml


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_process_data_parallel_trains_and_exports(corpus, tmp_path):
    yaml_path = tiny_yaml(tmp_path, "pretrain_gpt_local_tiny_cpu_dp2.yaml", corpus=corpus,
                          train_dataset__data_loader__num_samples=32)
    env = source_env(MASTER_PORT=str(_free_port()), LOG_DIR=str(tmp_path / "msrun_log"), GLOG_v="3")
    proc = subprocess.run(["bash", os.path.join(REPO, "run_scripts", "run_msrun.sh"), "2", yaml_path],
                          cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=600)
    logs = {name: (tmp_path / "msrun_log" / name).read_text() for name in os.listdir(tmp_path / "msrun_log")
            if name.startswith("worker_")}
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:] + str(list(logs))
    assert len(logs) == 2
    for text in logs.values():
        losses = [float(x) for x in re.findall(r"\[gpt_local\] step \d+/\d+\s+loss ([0-9.]+)", text)]
        assert losses and all(np.isfinite(losses))
    from mindformers_gptlocal import GPTLocalForCausalLM
    model = GPTLocalForCausalLM.from_pretrained(str(tmp_path / "output" / "model"))  # loads on a single card
    assert model.config.hidden_size == 64

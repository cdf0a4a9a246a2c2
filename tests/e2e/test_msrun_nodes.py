"""run_scripts/run_msrun.sh turns MASTER_ADDR / NODE_RANK / LOCAL_WORKERS into msrun's multi-node flags.

A real two-node launch cannot be staged on one machine: msrun starts the scheduler on every node
whose own address is MASTER_ADDR, so two launches here would both try to be the master. So this
test puts a stand-in `msrun` first on PATH that prints its arguments; tests/e2e/test_msrun.py runs the
real msrun on one node.
"""
import os
import subprocess

from conftest import REPO

SCRIPT = os.path.join(REPO, "run_scripts", "run_msrun.sh")


def _flags(tmp_path, workers, env):
    fake = tmp_path / "bin" / "msrun"
    fake.parent.mkdir(exist_ok=True)
    fake.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@"\n')
    fake.chmod(0o755)
    full = dict(os.environ, PATH=f"{fake.parent}{os.pathsep}{os.environ['PATH']}", **env)
    for key in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_WORKERS", "LOG_DIR", "JOIN"):
        if key not in env:
            full.pop(key, None)
    proc = subprocess.run(["bash", SCRIPT, str(workers), "c.yaml", "--run_mode", "train"], env=full, cwd=str(tmp_path),
                          capture_output=True, text=True, timeout=60)
    report = tmp_path / env.get("LOG_DIR", "output/msrun_log") / "msrun.log"  # msrun's own output goes there
    args = report.read_text().split("\n") if report.exists() else []
    return proc.returncode, args, proc.stdout + proc.stderr


def test_single_node_defaults(tmp_path):
    code, args, _ = _flags(tmp_path, 8, {})
    assert code == 0
    for flag in ("--worker_num=8", "--local_worker_num=8", "--master_addr=127.0.0.1", "--node_rank=0",
                 "--master_port=8118", "--join=True"):
        assert flag in args
    assert args[-7:-1] == ["--config", "c.yaml", "--use_parallel", "True", "--run_mode", "train"]
    assert "--tail_worker_log=-2" in args  # the script shows rank 0 itself, without MindSpore's warnings


def test_node_of_a_64_card_job(tmp_path):
    code, args, out = _flags(tmp_path, 64, dict(MASTER_ADDR="10.0.0.1", NODE_RANK="3", LOCAL_WORKERS="8",
                                                MASTER_PORT="9000", LOG_DIR="logs/node3"))
    assert code == 0
    assert "8 of 64 workers here, showing rank 24" in out, out
    for flag in ("--worker_num=64", "--local_worker_num=8", "--master_addr=10.0.0.1", "--node_rank=3",
                 "--master_port=9000", "--log_dir=logs/node3"):
        assert flag in args


def test_workers_must_split_evenly_over_nodes(tmp_path):
    code, _, err = _flags(tmp_path, 64, dict(LOCAL_WORKERS="6"))
    assert code == 2 and "multiple of LOCAL_WORKERS" in err

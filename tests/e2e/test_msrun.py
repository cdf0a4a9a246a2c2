"""Real 2-process data parallel with msrun on CPU, through run_scripts/run_msrun.sh.

Unshuffled MindRecord shards interleave (rank r reads samples r, r + 2, ...), so two workers with
batch 2 see, at every step, exactly the 4 samples a single process with batch 4 sees. With
``gradients_mean`` the averaged gradient equals the single process's, so the mean of the two
workers' losses must follow the single-process loss curve step by step.

Stopping, resume and crash safety with two processes, in one chain of launches: a run stopped by Ctrl-C
is resumed, that resumed run has its worker 1 SIGKILLed (during a save, which is slowed down), and the run
resumed after the kill finishes; every stretch has each worker's losses equal to the uninterrupted
two-process run's, bit for bit. Each rank's step graph is compiled once, by the uninterrupted run, and stored
(``runner_wrapper.compile_cache`` set to a folder of this module's); the chain's launches load it.
"""
import glob
import os
import re
import signal
import socket
import subprocess
import time

import numpy as np
import pytest

from conftest import REPO, run_launcher, source_env, step_losses, tiny_yaml
from mindformers_gptlocal import yaml_io

STEPS = 10  # room after a Ctrl-C (at step 3 or 4 here; later on a loaded machine) for the kill two steps on
GLOBAL_BATCH = 4


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _yaml(tmp_path, name, corpus, per_card_batch, samples, **changes):
    path = tiny_yaml(tmp_path, name, corpus=corpus, train_dataset__data_loader__num_samples=samples,
                     train_dataset__data_loader__shuffle=False, train_dataset__batch_size=per_card_batch,
                     runner_config__batch_size=per_card_batch, lr_schedule__learning_rate=3e-3, **changes)
    config = yaml_io.load_yaml(path)
    for callback in config["callbacks"]:
        if callback["type"] == "GPTLocalThroughputMonitor":
            callback["per_print_times"] = 1
        if callback["type"] == "GPTLocalCheckpointMonitor":
            callback.update(save_checkpoint_steps=1, keep_checkpoint_max=3)
    return yaml_io.dump_yaml(config, path)


def _dp_yaml(folder, corpus, store):
    """The two-process YAML, its step graphs kept in ``store`` (each rank its own)."""
    folder.mkdir(exist_ok=True)
    return _yaml(folder, "pretrain_gpt_local_tiny_cpu_dp2.yaml", corpus, GLOBAL_BATCH // 2, STEPS * GLOBAL_BATCH // 2,
                 runner_wrapper__compile_cache=str(store))


def _step_graphs(store):
    """{stored step graph folder: (inode, mtime) of its graph} in ``store`` (a store rewrites the file)."""
    return {name: (os.stat(path).st_ino, os.stat(path).st_mtime_ns)
            for name in sorted(os.listdir(store)) if name.startswith("gptlocaltrainonestepcell-")
            for path in [os.path.join(store, name, "graph.mindir")] if os.path.isfile(path)}


def _msrun_env(folder, run, **extra):
    return source_env(MASTER_PORT=str(_free_port()), LOG_DIR=str(folder / f"msrun_log_{run}"), GLOG_v="3", **extra)


def _worker_losses(folder, run):
    """Each worker's step losses (worker 0, worker 1) from msrun's logs of one launch."""
    logs = sorted(glob.glob(str(folder / f"msrun_log_{run}" / "worker_*.log")))
    return [step_losses(open(log).read()) for log in logs]


def _msrun(folder, yaml_path, run, *flags, **env):
    proc = subprocess.run(["bash", os.path.join(REPO, "run_scripts", "run_msrun.sh"), "2", yaml_path, *flags],
                          cwd=str(folder), env=_msrun_env(folder, run, **env), capture_output=True, text=True,
                          timeout=600)
    logs = "".join(open(p).read()[-1500:] for p in glob.glob(str(folder / f"msrun_log_{run}" / "*.log")))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:] + logs
    for log in glob.glob(str(folder / f"msrun_log_{run}" / "worker_*.log")):
        assert "compile cache off" not in open(log).read(), log  # each rank's step graph through its store
    return _worker_losses(folder, run)


@pytest.fixture(scope="module")
def dp_reference(corpus, tmp_path_factory):
    """The uninterrupted two-process run: (folder, each worker's STEPS losses, the store of its step graphs: one
    per rank, compiled here)."""
    folder, store = tmp_path_factory.mktemp("dp2"), tmp_path_factory.mktemp("dp2_step_graphs")
    worker_losses = _msrun(folder, _dp_yaml(folder, corpus, store), "full")
    assert len(worker_losses) == 2 and all(len(losses) == STEPS for losses in worker_losses), worker_losses
    assert len(_step_graphs(store)) == 2, os.listdir(store)  # each rank stored its own
    return folder, worker_losses, store


def test_two_process_data_parallel_matches_single_process_and_exports(corpus, tmp_path, dp_reference):
    dp_dir, worker_losses, _ = dp_reference
    single_dir = tmp_path / "single"
    single_dir.mkdir()
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


def _worker_pids(yaml_path):
    """{rank: pid} of the msrun workers running ``yaml_path`` (rank and role from the environment msrun gives them)."""
    pids = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
            environ = dict(item.split(b"=", 1) for item in open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
                           if b"=" in item)
        except OSError:
            continue
        if (yaml_path.encode() in cmdline and any(arg.endswith(b"run_mindformer.py") for arg in cmdline)
                and environ.get(b"MS_ROLE") == b"MS_WORKER"):  # (msrun's scheduler runs the same command)
            rank = environ.get(b"RANK_ID") or environ.get(b"MS_NODE_ID")
            if rank is not None and rank.isdigit():
                pids[int(rank)] = int(pid)
    return pids


def _sigint_after_step_2(tmp_path, yaml_path):
    """run_msrun.sh on ``yaml_path``, Ctrl-C'd (SIGINT to the script) once worker 0 logs step 2: (its exit code, the
    terminal's text, the seconds from the signal to its end)."""
    out_path = tmp_path / "terminal.txt"
    with open(out_path, "w") as terminal:
        proc = subprocess.Popen(["bash", os.path.join(REPO, "run_scripts", "run_msrun.sh"), "2", yaml_path],
                                cwd=str(tmp_path), env=_msrun_env(tmp_path, "stopped"), stdout=terminal,
                                stderr=subprocess.STDOUT)
        try:
            deadline, log = time.time() + 300, tmp_path / "msrun_log_stopped" / "worker_0.log"
            while proc.poll() is None and time.time() < deadline and not (log.exists() and "step 2/" in
                                                                           log.read_text()):
                time.sleep(0.05)
            assert proc.poll() is None, out_path.read_text()[-3000:]
            proc.send_signal(signal.SIGINT)
            sent = time.time()
            code = proc.wait(120)
            took = time.time() - sent
            print(f"\n[msrun stop test] run_msrun.sh ended {took:.1f} s after the SIGINT")
        finally:
            if proc.poll() is None:
                proc.kill()
    return code, out_path.read_text(), took


def test_ctrl_c_resume_kill_during_a_save_resume_continues_both_ranks_exactly(corpus, tmp_path, dp_reference):
    """One chain of three launches, each rank's losses the uninterrupted run's bit for bit in every stretch:
    Ctrl-C to run_msrun.sh (it passes SIGINT to both workers, which agree on the step by an all-reduce at each step
    end, save it and end; the script exits 130, its terminal showing rank 0 only and no MindSpore warning); the resume
    (announced on each rank at that step) has worker 1 SIGKILLed during a slowed-down save; the run resumed after the
    kill (from the newest step both ranks share) finishes like the reference. Every launch of the chain loads each
    rank's step graph the reference stored (none compiled and stored again)."""
    from mindformers_gptlocal.checkpoint import manifest
    from mindformers_gptlocal.checkpoint.resume import common_rank_checkpoint
    _, reference, store = dp_reference
    stored = _step_graphs(store)
    yaml_path = _dp_yaml(tmp_path, corpus, store)
    code, shown, took = _sigint_after_step_2(tmp_path, yaml_path)
    assert code == 130, shown[-3000:]
    assert took < 20, took  # the workers saved and ended; msrun's scheduler (~30 s heartbeat timeout) not waited for
    found = re.findall(r"\[gptlocal\] stopped after step (\d+) \(SIGINT\): checkpoint \S+rank_0\S+ \(every rank saved",
                       shown)
    assert len(found) == 1, shown[-3000:]  # rank 0's line; rank 1's is in its own log
    stop = int(found[0])
    assert 2 <= stop <= STEPS - 4, shown[-3000:]  # room for the kill below
    assert "[WARNING]" not in shown and "rank_1" not in shown, shown[-3000:]
    assert _worker_losses(tmp_path, "stopped") == [losses[:stop] for losses in reference], stop
    for rank in (0, 1):
        entries = manifest.read_manifest(str(tmp_path / "output" / "checkpoint" / f"rank_{rank}"))
        assert entries and entries[-1]["step"] == stop, (rank, entries)
        assert f"stopped after step {stop} (SIGINT)" in open(tmp_path / "msrun_log_stopped" /
                                                             f"worker_{rank}.log").read()

    log_dir = tmp_path / "msrun_log_killed"
    config = yaml_io.load_yaml(yaml_path)  # the same run, each save slowed down (the monitor's test_save_delay)
    for callback in config["callbacks"]:
        if callback["type"] == "GPTLocalCheckpointMonitor":
            callback["test_save_delay"] = 0.5
    slowed = yaml_io.dump_yaml(config, str(tmp_path / "pretrain_gpt_local_tiny_cpu_dp2_slowed.yaml"))
    proc = subprocess.Popen(["bash", os.path.join(REPO, "run_scripts", "run_msrun.sh"), "2", slowed,
                             "--resume_training", "True"],
                            cwd=str(tmp_path), env=_msrun_env(tmp_path, "killed"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:  # until worker 1 has saved once since the resume
            log = log_dir / "worker_1.log"
            if log.exists() and len(step_losses(log.read_text())) >= 2:
                break
            time.sleep(0.2)
        time.sleep(0.25)  # inside the next slowed-down save
        pids = _worker_pids(slowed)
        assert 1 in pids, pids
        os.kill(pids[1], signal.SIGKILL)
        killed_at = time.time()
        while _worker_pids(slowed) and time.time() < killed_at + 120:  # msrun notices and kills the other worker
            time.sleep(0.2)
        assert not _worker_pids(slowed), "msrun did not stop worker 0 within 120 s after worker 1 was killed"
        print(f"\n[msrun kill test] Ctrl-C after step {stop}; both workers gone {time.time() - killed_at:.1f} s after "
              "worker 1 was killed")
        # (msrun itself then waits ~30 s for its scheduler's heartbeat timeout: not waited for here)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    resumed_first = _worker_losses(tmp_path, "killed")
    assert len(resumed_first[1]) >= 2, resumed_first
    for rank in (0, 1):  # the resumed run, up to the kill: announced at the stopped step, the reference's losses
        assert f"rank {rank} resumes from step {stop}" in open(log_dir / f"worker_{rank}.log").read()
        assert resumed_first[rank] == reference[rank][stop:stop + len(resumed_first[rank])], (rank, resumed_first)
    name, step, _ = common_rank_checkpoint(str(tmp_path / "output" / "checkpoint"), 0, log=print)
    assert stop < step < STEPS, step
    resumed = _msrun(tmp_path, yaml_path, "resumed", "--resume_training", "True")
    assert resumed == [losses[step:] for losses in reference], (step, resumed, reference)
    assert _step_graphs(store) == stored  # loaded by every launch, not compiled and stored again
    for run in ("stopped", "killed"):
        for log in glob.glob(str(tmp_path / f"msrun_log_{run}" / "worker_*.log")):
            assert "compile cache off" not in open(log).read(), log

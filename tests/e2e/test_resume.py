"""Exact resume: N steps, stop, ``--resume_training True``; the steps after N equal an uninterrupted run bit for bit,
with dropout on (hidden and attention 0.1: counter-based masks, model/dropout.py).

Covers shuffled MindRecord with a fixed loss scale (saved by MindFormers' stock CheckpointMonitor), and
Megatron .bin/.idx with a dynamic loss scale that rises during the run (its scale and step counter must
resume too; saved by GPTLocalCheckpointMonitor). Single card, fp32 on CPU.
"""
import os

from conftest import SHARED_CHANGES, SHARED_STEPS, Launch, launch_in_process, run_launcher, step_losses
from conftest import megatron_changes, uninterrupted_run, write_yaml

N = 4


def assert_exact_resume(tmp_path, tmp_path_factory, corpus, name, steps, monitor="GPTLocalCheckpointMonitor",
                        **changes):
    """A run of ``steps`` steps stopped after N (``runner_config.stop_step``), resumed: the uninterrupted losses bit
    for bit (those from conftest's uninterrupted_run, shared by every test of the same YAML)."""
    assert changes["model__model_config__hidden_dropout"] == changes["model__model_config__attention_dropout"] == 0.1
    part = write_yaml(tmp_path / "part", corpus, name, monitor, **changes)
    stopped = Launch(["--config", part, "--runner_config.stop_step", str(N)], cwd=str(tmp_path / "part"))
    if "megatron" in name:  # both would write the same GPTDataset index cache next to the corpus: one at a time
        stopped.result()
    code, out = uninterrupted_run(tmp_path_factory, corpus, part)  # (its checkpoint monitor left out)
    assert code == 0, out[-3000:]
    reference = step_losses(out)
    assert len(reference) == steps, out[-3000:]

    code, first = stopped.result()
    assert code == 0, first[-3000:]
    assert step_losses(first) == reference[:N]
    from mindformers_gptlocal.checkpoint.resume import find_resume_checkpoint
    from safetensors import safe_open
    saved, _ = find_resume_checkpoint(str(tmp_path / "part" / "output" / "checkpoint"), log=lambda _: None)
    with safe_open(saved, framework="numpy") as handle:  # dropout was on: its counter is saved, one per step
        assert int(handle.get_tensor("dropout_step")) == N
    code, second = run_launcher(["--config", part, "--resume_training", "True"], cwd=str(tmp_path / "part"))
    assert code == 0, second[-3000:]
    assert f"(step {N})" in second, second[-3000:]
    assert step_losses(second) == reference[N:], (step_losses(second), reference)
    return out, second


def test_resume_mindrecord_shuffled_is_exact_from_stock_rank0_layout(tmp_path, tmp_path_factory, corpus):
    """The interrupted run saves with MindFormers' own CheckpointMonitor (checkpoint/rank_0/, which single-card
    MindFormers refuses to resume from): the pre-flight resolves it to the newest whole file. conftest's shared
    YAML (SHARED_STEPS steps, dropout on), whose uninterrupted losses test_stop_signals and test_crash_safe use too."""
    assert_exact_resume(tmp_path, tmp_path_factory, corpus, "pretrain_gpt_local_tiny_cpu.yaml", SHARED_STEPS,
                        monitor="CheckpointMonitor", **SHARED_CHANGES)
    assert os.path.isdir(tmp_path / "part" / "output" / "checkpoint" / "rank_0")


def test_resume_megatron_dynamic_loss_scale_is_exact(tmp_path, tmp_path_factory, corpus):
    full, resumed = assert_exact_resume(tmp_path, tmp_path_factory, corpus, "pretrain_gpt_local_tiny_cpu_megatron.yaml",
                                        2 * N, **megatron_changes(corpus, 2 * N))
    assert "loss scale raised 4096 -> 8192" in full
    assert "step 6: loss scale raised 8192 -> 16384" in full
    assert "step 6: loss scale raised 8192 -> 16384" in resumed  # scale and window count carried over the stop


def test_resume_without_checkpoint_is_one_clear_error(tmp_path, corpus, capsys, monkeypatch):
    yaml_path = write_yaml(tmp_path, corpus)
    (tmp_path / "cwd").mkdir()  # MindFormers' config parser opens its log under ./output/log of the cwd
    code, out = launch_in_process(["--config", yaml_path, "--resume_training", "True"], str(tmp_path / "cwd"),
                                  capsys, monkeypatch)  # refused by the pre-flight: no subprocess needed
    assert code == 2, out[-3000:]
    assert "resume_training: no complete checkpoint" in out and "Traceback" not in out
    assert not os.path.exists(tmp_path / "output")  # nothing written to output_dir

"""A batch whose loss or gradients are NaN/Inf is skipped (weights unchanged) and counted in the log.

The faults come from real data: a MindRecord with a float32 loss_mask column (the model casts the
mask to float32 anyway) built from the prepared corpus, where one sample of step NAN_STEP has a NaN
mask entry (NaN loss and gradients) and one sample of step HUGE_STEP has a +1e35/-1e35 pair (the
pair cancels in the loss normaliser, so the loss stays finite but the gradients are ~1e32 and
larger: their squared norm overflows fp32, or the scaled gradients overflow outright).
"""
import numpy as np
from safetensors.numpy import load_file

from mindformers_gptlocal import yaml_io
from conftest import run_launcher, step_losses, tiny_yaml

BATCH, STEPS, NAN_STEP, HUGE_STEP = 4, 10, 3, 6


def faulty_mindrecord(corpus, path):
    from mindspore.mindrecord import FileReader, FileWriter
    reader = FileReader(corpus["train_mindrecord"])
    rows = [row for _, row in zip(range(BATCH * STEPS), reader.get_next())]
    reader.close()
    for row in rows:
        row["loss_mask"] = np.asarray(row["loss_mask"], np.float32)
    rows[BATCH * (NAN_STEP - 1) + 1]["loss_mask"][5] = np.nan
    rows[BATCH * (HUGE_STEP - 1) + 2]["loss_mask"][3:5] = [1e35, -1e35]
    writer = FileWriter(path, shard_num=1, overwrite=True)
    schema = {name: {"type": "int32", "shape": [-1]} for name in ("input_ids", "labels", "position_ids")}
    schema["loss_mask"] = {"type": "float32", "shape": [-1]}
    writer.add_schema(schema, "gpt_local_faults")
    writer.write_raw_data(rows)
    writer.commit()
    return path


def run_with_faults(tmp_path, corpus, scale_sense):
    data = faulty_mindrecord(corpus, str(tmp_path / "faults.mindrecord"))
    yaml_path = tiny_yaml(tmp_path, corpus=corpus, train_dataset__data_loader__dataset_dir=data,
                          train_dataset__data_loader__shuffle=False, runner_wrapper__scale_sense=scale_sense,
                          lr_schedule__learning_rate=3e-3)
    config = yaml_io.load_yaml(yaml_path)
    for callback in config["callbacks"]:
        if callback["type"] == "GPTLocalThroughputMonitor":
            callback["per_print_times"] = 1
        if callback["type"] == "GPTLocalCheckpointMonitor":
            callback.update(save_checkpoint_steps=1, keep_checkpoint_max=STEPS)
    yaml_io.dump_yaml(config, yaml_path)
    code, out = run_launcher(["--config", yaml_path], cwd=str(tmp_path))
    assert code == 0, out[-3000:]
    return out


def weights(tmp_path, step):
    tensors = load_file(str(tmp_path / "output" / "checkpoint" / f"gpt_local_rank_0-1_{step}.safetensors"))
    return {k: v for k, v in tensors.items() if k.startswith("model.")}


def assert_skipped_and_unchanged(tmp_path, out):
    losses = step_losses(out)
    assert len(losses) == STEPS, out[-3000:]
    assert np.isnan(losses[NAN_STEP - 1])
    assert all(np.isfinite(x) for i, x in enumerate(losses) if i != NAN_STEP - 1), losses
    for step in (NAN_STEP, HUGE_STEP):
        assert f"step {step}: loss or gradients not finite" in out, out[-3000:]
        before, after = weights(tmp_path, step - 1), weights(tmp_path, step)
        assert before.keys() == after.keys()
        for name in before:
            np.testing.assert_array_equal(before[name], after[name], err_msg=f"step {step} changed {name}")
    changed = weights(tmp_path, HUGE_STEP + 1)
    assert any(not np.array_equal(changed[k], weights(tmp_path, HUGE_STEP)[k]) for k in changed)  # trains on
    assert f"step {STEPS}/{STEPS}" in out and "skipped 2" in out.split(f"step {STEPS}/{STEPS}")[1].splitlines()[0]
    assert losses[-1] < losses[0], losses


def test_fp32_fixed_scale_skips_nan_and_huge_gradient_steps(tmp_path, corpus):
    out = run_with_faults(tmp_path, corpus, 1.0)
    assert_skipped_and_unchanged(tmp_path, out)
    assert "loss scale" not in out  # a fixed scale never moves


def test_dynamic_scale_backs_off_and_recovers(tmp_path, corpus):
    scale = {"type": "DynamicLossScaleUpdateCell", "loss_scale_value": 4096, "scale_factor": 2, "scale_window": 2}
    out = run_with_faults(tmp_path, corpus, scale)
    assert_skipped_and_unchanged(tmp_path, out)
    assert f"step {NAN_STEP}: loss scale backed off" in out
    assert f"step {HUGE_STEP}: loss scale backed off" in out
    assert f"step {HUGE_STEP + 2}: loss scale raised" in out  # two clean steps (scale_window) later

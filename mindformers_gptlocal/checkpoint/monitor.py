"""``GPTLocalCheckpointMonitor``: MindFormers' CheckpointMonitor made crash-safe.

The stock monitor writes straight to the final ``*.safetensors`` name, so a crash mid-save
leaves a truncated file that resume may pick. Here each checkpoint is written to a
``partial-<pid>-`` name, fsynced, renamed into place, and only then recorded (size and
SHA-256) in ``manifest.json`` (see ``manifest.py``); resume (``resume.py``) takes the
newest recorded file that still verifies. Contents and names are the stock ones
(``checkpoint/rank_<id>/<prefix>_rank_<id>-<epoch>_<step>.safetensors`` with optimizer
state, step and loss scale), except that a single-card run writes ``checkpoint/`` without the
``rank_0`` level, because single-card MindFormers refuses to resume from a file inside ``rank_*``.

On a resumed run the trainer hands the resume step only to callbacks typed exactly
``CheckpointMonitor``; the pre-flight check passes it to this one as ``append_info``.
"""
import glob
import os
import time

from mindformers.core.callback.callback import CheckpointMonitor
from mindformers.tools.register import MindFormerRegister, MindFormerModuleType
from mindformers.tools.utils import get_real_group_size

from . import manifest as ckpt_manifest

# Test hook: seconds to wait between writing a checkpoint's temp file and renaming it, so a
# kill test can land inside a save. Unset in normal use.
SAVE_DELAY_ENV = "GPTLOCAL_TEST_SAVE_DELAY"


@MindFormerRegister.register(MindFormerModuleType.CALLBACK)
class GPTLocalCheckpointMonitor(CheckpointMonitor):
    """CheckpointMonitor with temp-name + fsync + rename writes and a manifest of complete files."""

    def __init__(self, *args, checkpoint_format="safetensors", async_save=False, **kwargs):
        if async_save:
            print("[gpt_local] GPTLocalCheckpointMonitor: async_save is off (a file must be whole before it is "
                  "recorded).", flush=True)
        super().__init__(*args, checkpoint_format=checkpoint_format, async_save=False, **kwargs)
        if get_real_group_size() == 1 and os.path.basename(self._directory).startswith("rank_"):
            # single-card MindFormers refuses to resume from a file inside a rank_* folder
            self._directory = os.path.dirname(self._directory)
            self.meta_json = os.path.join(self._directory, "meta.json")
        self._remove_stale_partials()

    def _remove_stale_partials(self):
        for path in glob.glob(os.path.join(self._directory, ckpt_manifest.PARTIAL_PREFIX + "*")):
            print(f"[gpt_local] removing unfinished checkpoint file from an earlier run: {path}", flush=True)
            os.remove(path)

    def remove_redundancy(self, network, cur_file, append_dict, train_network):
        """Called by ``save_checkpoint`` to write ``cur_file``: write elsewhere, then rename atomically.

        The stock name counts steps of this run only, so a resumed run would overwrite the first run's
        files; the name here carries the global step (``step_num``) instead."""
        directory = os.path.dirname(cur_file)
        step = int(append_dict.get("step_num", 0))
        if step:
            cur_file = os.path.join(directory, f"{self._prefix}-{append_dict.get('epoch_num', 1)}_{step}."
                                               f"{self._config.format}")
        self._written = cur_file
        name = os.path.basename(cur_file)
        partial = os.path.join(directory, f"{ckpt_manifest.PARTIAL_PREFIX}{os.getpid()}-{name}")
        super().remove_redundancy(network, partial, append_dict, train_network)
        delay = float(os.environ.get(SAVE_DELAY_ENV) or 0)
        if delay:
            time.sleep(delay)
        ckpt_manifest.fsync_path(partial)
        os.replace(partial, cur_file)
        ckpt_manifest.fsync_path(directory)
        ckpt_manifest.record(directory, cur_file, append_dict.get("step_num", 0))

    def record_last_ckpt_to_json(self, epoch, step, ckpt_file):
        """meta.json names the file actually written (global step in its name)."""
        super().record_last_ckpt_to_json(epoch, step, os.path.basename(getattr(self, "_written", ckpt_file)))

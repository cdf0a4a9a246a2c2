"""``GPTLocalCheckpointMonitor``: MindFormers' CheckpointMonitor made crash-safe.

The stock monitor writes straight to the final ``*.safetensors`` name, so a crash mid-save
leaves a truncated file that resume may pick. Here each checkpoint is written to a
``partial-<pid>-`` name, given the mode the umask gives a new file (MindSpore's is read-only to its owner),
fsynced, renamed into place, and only then recorded (size and
SHA-256) in ``manifest.json`` (see ``checkpoint/manifest.py``); resume (``checkpoint/resume.py``) takes the
newest recorded file that still verifies. Contents and names are the stock ones
(``checkpoint/rank_<id>/<prefix>_rank_<id>-<epoch>_<step>.safetensors`` with optimizer
state, step and loss scale), except that a single-card run writes ``checkpoint/`` without the
``rank_0`` level, because single-card MindFormers refuses to resume from a file inside ``rank_*``.

On a resumed run the trainer hands the resume step only to callbacks typed exactly
``CheckpointMonitor``; the pre-flight check passes it to this one as ``append_info``, and what the
run is (``run_record``), stored with each manifest entry so a changed YAML cannot resume silently.

``keep_checkpoint_max`` counts and removes only this run's checkpoints: each manifest entry carries the ``run_id`` of
the run that wrote it (a fresh one per run; a resumed run keeps its checkpoint's, handed in by the pre-flight), and
the oldest entries of this run beyond the limit are removed once the new file is recorded. A file of another run, or
one no manifest lists, is never removed (the stock rotation removed the folder's oldest file, whoever wrote it).

A save that fails for lack of space (ENOSPC, or EFBIG under a file-size limit) removes its temp
file, leaves the earlier checkpoints and the manifest as they were, and stops the run with one
error naming the folder and the space needed; ``on_save_error: continue`` keeps training instead
and tries again at the next save.

``stop_on_signal`` (on by default): SIGINT or SIGTERM during training finishes the step, saves a checkpoint here
the way the periodic saves do, prints it and the command that resumes, and ends the run with 130 / 143
(``training/stop.py`` sees the signals). Under many ranks the ranks agree on the step first: a one-element
all-reduce (MAX) of "a signal arrived" at every step end, so a rank that got the signal and one that did not stop
after the same step (a data-parallel step is synchronous: a rank stopping alone would leave the others waiting in
their gradient all-reduce); a second all-reduce after the save keeps every rank running until all have saved.
``test_save_delay`` (tests only) waits that many seconds between writing a checkpoint's temp file and renaming it,
so a test's kill lands inside a save.
"""
import errno
import glob
import os
import re
import shlex
import shutil
import sys
import time
import uuid

from ..checkpoint import manifest as ckpt_manifest
from ..errors import CheckpointError
from ..staging import publish_file, set_new_mode
from ..training import stop
from .compat import defer_checkpoint_rotation
from .symbols import CheckpointMonitor, MindFormerRegister, MindFormerModuleType, get_real_group_size

SPACE_ERRORS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
ON_SAVE_ERROR = ("stop", "continue")


def _errno_of(err):
    """The OS error number of a failed write: an OSError's, or the one in the safetensors writer's
    SafetensorError text ("... (os error 28)"); None when there is none."""
    if isinstance(err, OSError) and err.errno:
        return err.errno
    found = re.search(r"os error (\d+)", str(err))
    return int(found.group(1)) if found else None


@MindFormerRegister.register(MindFormerModuleType.CALLBACK)
class GPTLocalCheckpointMonitor(CheckpointMonitor):
    """CheckpointMonitor with temp-name + fsync + rename writes and a manifest of complete files."""

    def __init__(self, *args, checkpoint_format="safetensors", async_save=False, run_record=None,
                 checksum="sha256", on_save_error="stop", stop_on_signal=True, test_save_delay=0.0, run_id=None,
                 **kwargs):
        if checksum not in ckpt_manifest.CHECKSUMS:
            raise CheckpointError(f"GPTLocalCheckpointMonitor.checksum is {checksum!r}; use one of "
                                  f"{', '.join(ckpt_manifest.CHECKSUMS)}.")
        if on_save_error not in ON_SAVE_ERROR:
            raise CheckpointError(f"GPTLocalCheckpointMonitor.on_save_error is {on_save_error!r}; use one of "
                                  f"{', '.join(ON_SAVE_ERROR)}.")
        if not isinstance(stop_on_signal, bool):
            raise CheckpointError(f"GPTLocalCheckpointMonitor.stop_on_signal is {stop_on_signal!r}; use True or "
                                  f"False.")
        self._run_record, self._checksum, self._on_save_error = run_record, checksum, on_save_error
        self._run_id = str(run_id) if run_id else uuid.uuid4().hex[:16]  # a resumed run: its checkpoint's
        self._stop_on_signal, self._armed = stop_on_signal, False
        # tests only: seconds between writing a checkpoint's temp file and renaming it, so a kill lands in a save
        self._test_save_delay = float(test_save_delay or 0)
        if async_save:
            print("[gptlocal] GPTLocalCheckpointMonitor: async_save is off (a file must be whole before it is "
                  "recorded).", flush=True)
        super().__init__(*args, checkpoint_format=checkpoint_format, async_save=False, **kwargs)
        if get_real_group_size() == 1 and os.path.basename(self._directory).startswith("rank_"):
            # single-card MindFormers refuses to resume from a file inside a rank_* folder
            self._directory = os.path.dirname(self._directory)
            self.meta_json = os.path.join(self._directory, "meta.json")
        self._remove_stale_partials()
        # keep_checkpoint_max: the stock monitor deletes the folder's oldest file (any run's) before writing the
        # next one; here this run's oldest are removed once the new file is recorded, so a failed save never costs
        # a good checkpoint and another run's files are never touched (mf/compat.py "deferred checkpoint
        # rotation": a manager without the methods is a CompatError)
        defer_checkpoint_rotation(self._manager, self._defer_rotation)
        defer_checkpoint_rotation(self._manager, self._remove_if_own, "remove_ckpoint_file")

    def on_train_begin(self, run_context):
        super().on_train_begin(run_context)
        if self._stop_on_signal:
            self._armed = stop.arm()

    def on_train_step_end(self, run_context):
        super().on_train_step_end(run_context)  # the periodic save, if this step has one
        if not self._armed:
            return
        signum = _agreed_signal(stop.requested())
        if signum:
            self._stop_for(signum, run_context)

    def on_train_end(self, run_context):
        super().on_train_end(run_context)  # its save of the last step: already done when a signal stopped the run
        if self._armed:
            self._armed = False
            stop.disarm()
            if stop.stopped():
                self._say_stopped(stop.stopped())
            if stop.stopped() and not stop.STATE.launcher:  # MindFormers' own launcher: nothing of ours runs after
                raise SystemExit(stop.exit_status(stop.stopped()))

    def _stop_for(self, signum, run_context):
        """Save this step (unless its periodic save just did), wait until every rank has, then stop; the line
        naming the checkpoint comes at the end of training (``on_train_end``)."""
        cb_params = run_context.original_args()
        self._stopped_at = int(self._append_step_num + cb_params.cur_step_num)
        if getattr(self, "use_legacy_format", True):
            self._save_ckpt(cb_params, True)
        else:
            self._save_megatron_ckpt_file_format(cb_params)
        _agreed_signal(signum)  # a barrier: no rank ends (msrun then kills the others) before every rank saved
        stop.mark_stopped(signum)
        run_context.request_stop()

    def _say_stopped(self, signum):
        saved = getattr(self, "_written", None)
        if saved:
            where = f"checkpoint {saved}" + (" (every rank saved this step)" if get_real_group_size() > 1 else "")
        else:
            where = f"no checkpoint written (the save failed; the newest complete one in {self._directory} stays)"
        print(f"{stop.PREFIX} stopped after step {self._stopped_at} ({stop.name(signum)}): {where}; resume: "
              f"{resume_command()}", flush=True)

    def _defer_rotation(self):
        """The stock rotation's turn: nothing now (``_rotate_own`` runs after the new file is recorded)."""

    def _own_entries(self, directory):
        return sorted((e for e in ckpt_manifest.read_manifest(directory) if e.get("run_id") == self._run_id),
                      key=lambda e: e["step"])

    def _rotate_own(self, directory):
        """Remove this run's oldest checkpoints beyond ``keep_checkpoint_max`` (manifest entries first)."""
        keep = self._config.keep_checkpoint_max
        if not keep or keep <= 0:
            return
        old = [e["file"] for e in self._own_entries(directory)[:-keep]]
        if not old:
            return
        ckpt_manifest.forget(directory, old)
        for name in old:
            path = os.path.join(directory, name)
            if os.path.exists(path):
                os.remove(path)

    def _remove_if_own(self, file_name):
        """CheckpointManager.remove_ckpoint_file (keep_checkpoint_per_n_minutes) for this run's files only."""
        directory = os.path.dirname(file_name)
        if os.path.basename(file_name) not in {e["file"] for e in self._own_entries(directory)}:
            return
        ckpt_manifest.forget(directory, [os.path.basename(file_name)])
        if os.path.exists(file_name):
            os.remove(file_name)
        if file_name in self._manager.ckpoint_filelist:
            self._manager.ckpoint_filelist.remove(file_name)

    def _remove_stale_partials(self):
        for path in glob.glob(os.path.join(self._directory, ckpt_manifest.PARTIAL_PREFIX + "*")):
            print(f"[gptlocal] removing unfinished checkpoint file from an earlier run: {path}", flush=True)
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
        try:
            super().remove_redundancy(network, partial, append_dict, train_network)
            if self._test_save_delay:
                time.sleep(self._test_save_delay)
            ckpt_manifest.fsync_path(partial)
        except Exception as err:  # pylint: disable=broad-except  (safetensors raises its own SafetensorError)
            if not self._out_of_space(err, partial):
                raise
            self._written = None
            message = self._space_message(directory, name, step, err)
            # ours, and MindSpore's own temp name for it (<partial stem>.tmp)
            for path in glob.glob(os.path.splitext(partial)[0] + ".*"):
                os.remove(path)
            if self._on_save_error == "continue":
                print(f"[gptlocal] {message}; on_save_error: continue, so training goes on and the next save "
                      f"tries again.", flush=True)
                return
            raise CheckpointError(f"{message}. Free space there (or point output_dir at a larger disk) and resume "
                                  f"with --resume_training True; or set the callback's on_save_error: continue "
                                  f"to keep training and retry at the next save.") from err
        for folder in (directory, os.path.dirname(directory)) if os.path.basename(directory).startswith("rank_") \
                else (directory,):
            set_new_mode(folder)  # MindSpore / MindFormers make the checkpoint folders 0700 / 0750
        publish_file(partial, cur_file)  # MindSpore's file is 0400: the umask's mode (0644 under 0022), renamed
        ckpt_manifest.record(directory, cur_file, append_dict.get("step_num", 0), run=self._run_record,
                             checksum=self._checksum, run_id=self._run_id)
        self._rotate_own(directory)

    @staticmethod
    def _out_of_space(err, partial):
        """ENOSPC/EFBIG from Python, or from the safetensors writer (SafetensorError "... (os error 28)"); for
        any other failure a probe write in the same folder tells whether the disk is full."""
        code = _errno_of(err)
        if code:
            return code in SPACE_ERRORS
        probe = partial + ".probe"
        try:
            with open(probe, "wb") as handle:
                handle.write(b"\0" * (1 << 20))
                handle.flush()
                os.fsync(handle.fileno())
            return False
        except OSError as probe_err:
            return probe_err.errno in SPACE_ERRORS
        finally:
            if os.path.exists(probe):
                os.remove(probe)

    def _space_message(self, directory, name, step, err):
        """The folder, what the write needed (the last complete checkpoint's size) and what is free."""
        entries = ckpt_manifest.read_manifest(directory)
        needed = entries[-1]["bytes"] if entries else None
        free = shutil.disk_usage(directory).free
        need = f"about {needed / 1e6:,.1f} MB" if needed else "the size of one checkpoint"
        kept = f"; the previous checkpoint ({entries[-1]['file']}) and the manifest are intact" if entries else ""
        code = _errno_of(err)
        reason = os.strerror(code) if code else str(err).splitlines()[0]
        return (f"checkpoint {name} (step {step}) could not be written to {directory}: {reason}. It needs {need}, "
                f"{free / 1e6:,.1f} MB are free{kept}; the partial file was removed")

    def record_last_ckpt_to_json(self, epoch, step, ckpt_file):
        """meta.json names the file actually written (global step in its name); nothing when the save failed."""
        if getattr(self, "_written", "") is None:
            return
        super().record_last_ckpt_to_json(epoch, step, os.path.basename(getattr(self, "_written", ckpt_file)))


def _agreed_signal(mine):
    """The largest signal number any rank asks to stop for (0: none), through a one-element all-reduce when the
    run has several ranks; ``mine`` on one."""
    if get_real_group_size() <= 1:
        return int(mine)
    import numpy as np
    import mindspore as ms
    from mindspore import mint
    flag = ms.Tensor(np.array([int(mine)], np.int32))
    mint.distributed.all_reduce(flag, op="max")
    return int(flag.asnumpy()[0])


def resume_command():
    """The command line that continues this run: this process's own with ``--resume_training True`` (an msrun rank
    names the launch line instead, which it cannot see)."""
    if os.environ.get("MS_ROLE") == "MS_WORKER":
        return "the same launch line (e.g. bash run_scripts/run_msrun.sh ...) with --resume_training True"
    argv = list(sys.argv)
    script = os.path.basename(argv[0]) if argv else ""
    if script in ("gptlocal", "__main__.py") and "run" in argv[1:2]:
        words, args = ["gptlocal", "run"], argv[2:]
    elif script.endswith(".py"):
        words, args = ["python", argv[0]], argv[1:]
    else:
        return "the same command with --resume_training True"
    kept, skip = [], False
    for arg in args:
        if skip:
            skip = False
            continue
        if arg.replace("-", "_") == "__resume_training":
            skip = True
            continue
        if arg.replace("-", "_").startswith("__resume_training="):
            continue
        kept.append(arg)
    return shlex.join(words + kept + ["--resume_training", "True"])

"""Training callbacks: tokens/s progress and eval progress.

MindSpore ``Callback``s, registered with MindFormers by ``mf/registry.py``; a YAML ``callbacks:`` list names them by
``type``. The model directory at the end (``GPTLocalSaveModelDir``, which reads MindFormers' output folder and rank)
is in ``mf/registry.py``.
"""
import sys
import time

import numpy as np
from mindspore.train.callback import Callback

from . import stop


def _loss_value(outputs):
    loss = outputs[0] if isinstance(outputs, (tuple, list)) else outputs
    return float(np.mean(loss.asnumpy()))


def peak_rss_mb():
    """This process's own peak RSS: VmHWM from /proc, which exec resets. ``ru_maxrss`` is no good for a
    launched process: Linux carries the parent's peak RSS at fork into the child's ru_maxrss."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _overflow_and_scale(outputs):
    """(overflow flag, loss scale) from the wrapper's (loss, overflow, scale, ...) outputs."""
    if not isinstance(outputs, (tuple, list)) or len(outputs) < 3:
        return False, None
    return bool(np.asarray(outputs[1].asnumpy()).any()), float(np.asarray(outputs[2].asnumpy()).ravel()[0])


class GPTLocalThroughputMonitor(Callback):
    """Prints step, loss, tokens/s and step time every ``per_print_times`` steps (first step includes compile: its
    line says how long the step graph took to compile or to load from the compile cache, as the step wrapper timed
    it, ``mf/wrapper.py`` ``first_compile``).

    Tokens per step are read from the train dataset's batch shape unless given. Steps the wrapper
    skipped because the loss or gradients were not finite are counted (``skipped N``), and loss-scale
    changes are logged, from the wrapper's (loss, overflow, scale) outputs. Losses are printed with
    ``loss_digits`` significant digits (default 4; 17 prints each float exactly, for comparing runs bit for bit).
    """

    def __init__(self, per_print_times=10, tokens_per_step=None, stream=None, initial_step=0, loss_digits=4):
        super().__init__()
        if isinstance(loss_digits, bool) or not isinstance(loss_digits, int) or not 1 <= loss_digits <= 17:
            raise ValueError(f"GPTLocalThroughputMonitor.loss_digits must be an integer from 1 to 17, got "
                             f"{loss_digits!r}.")
        self.loss_digits = loss_digits
        self.tokens_per_step = tokens_per_step
        self.per_print_times = int(per_print_times)
        self.stream = stream or sys.stdout
        self.initial_step = int(initial_step)  # set by the pre-flight check on a resumed run
        self.window_start = None
        self.window_steps = 0
        self.skipped = 0
        self.last_scale = None
        self.history = []
        self.started = None
        self.tokens = 0
        self.step_seconds = None  # the latest window's seconds a step, without the first (compile) step
        self.last_step = self.run_steps = None  # the newest step; the run's steps (the dataset's)
        self.compile_told = False  # this launch's first line says what the step graph's compile took

    def on_train_begin(self, run_context):
        if self.tokens_per_step is None:
            dataset = run_context.original_args().train_dataset
            self.tokens_per_step = int(np.prod(dataset.output_shapes()[0])) if dataset is not None else 0

    def on_train_step_begin(self, run_context):
        if self.window_start is None:
            self.window_start = time.time()
        if self.started is None:
            self.started = time.time()

    def on_train_step_end(self, run_context):
        params = run_context.original_args()
        step = params.cur_step_num + self.initial_step
        self.window_steps += 1
        loss = _loss_value(params.net_outputs)
        self.history.append(loss)
        overflow, scale = _overflow_and_scale(params.net_outputs)
        if overflow:
            self.skipped += 1
            self.stream.write(f"[gptlocal] step {step}: loss or gradients not finite (loss {loss!r}); update "
                              f"skipped, weights unchanged ({self.skipped} skipped so far)\n")
        if scale is not None and self.last_scale is not None and scale != self.last_scale:
            change = "backed off" if scale < self.last_scale else "raised"
            self.stream.write(f"[gptlocal] step {step}: loss scale {change} {self.last_scale:g} -> {scale:g}\n")
        self.last_scale = scale
        self.tokens += self.tokens_per_step
        self.last_step = step
        total = max(params.batch_num * params.epoch_num, step)  # the run's steps, whether or not it stops sooner
        end = max(self.stop_at(params), step)  # where this launch stops (runner_config.stop_step may cut it)
        self.run_steps = total
        if step == 1 or step % self.per_print_times == 0 or step == end:
            seconds = time.time() - self.window_start
            rate = self.tokens_per_step * self.window_steps / max(seconds, 1e-9)
            if step > 1 + self.initial_step:  # the first step's time is mostly the compile
                self.step_seconds = seconds / self.window_steps
            eta = "" if self.step_seconds is None or step >= end else \
                f"  ETA {format_seconds(self.step_seconds * (end - step))}"
            self.stream.write(f"[gptlocal] step {step}/{total}  loss {format_loss(loss, self.loss_digits)}  "
                              f"{rate:,.0f} tokens/s  "
                              f"{1000 * seconds / self.window_steps:.0f} ms/step  skipped {self.skipped}"
                              f"{'' if scale is None else f'  scale {scale:g}'}{eta}{self._compile_note(params)}\n")
            self.stream.flush()
            self.window_start = time.time()
            self.window_steps = 0

    def _compile_note(self, params):
        """On this launch's first line: how long the step graph's compile (or its load from the compile cache) took,
        where the training wrapper timed it; else nothing."""
        timed = getattr(getattr(params, "train_network", None), "first_compile", None)
        if self.compile_told or timed is None:
            return ""
        self.compile_told = True
        seconds, loaded = timed
        return f"  (step graph {'loaded from the compile cache' if loaded else 'compiled'} in {seconds:.1f} s)"

    def stop_at(self, params):
        """The step this launch ends at: the dataset's steps, or runner_config.stop_step's (TrainCallBack, which
        counts this launch's steps) if it comes first. The progress lines count toward the dataset's steps
        (``step 10/23``), and the summary says where stop_step stopped."""
        total = params.batch_num * params.epoch_num
        for callback in getattr(params, "list_callback", None) or []:
            stop = getattr(callback, "stop_step", None)
            if type(callback).__name__ == "TrainCallBack" and isinstance(stop, int) and stop > 0:
                total = min(total, stop + self.initial_step)
        return total

    def on_train_end(self, run_context):
        peak_mb = peak_rss_mb()
        steps = len(self.history)
        seconds = time.time() - self.started if self.started else 0.0
        last = f", last loss {format_loss(self.history[-1], self.loss_digits)}" if self.history else ""
        rate = f", {self.tokens / seconds:,.0f} tokens/s overall" if seconds > 0 and self.tokens else ""
        done = f"training stopped ({stop.name(stop.stopped())})" if stop.stopped() else "training done"
        cut = "" if stop.stopped() or not self.last_step or self.last_step >= self.run_steps else \
            f"; stopped at step {self.last_step} of {self.run_steps} by runner_config.stop_step (--resume_training " \
            f"True continues)"
        self.stream.write(f"[gptlocal] {done}: {steps} steps in {format_seconds(seconds)}{last}{rate}; "
                          f"peak RSS {peak_mb:,.0f} MB{cut}\n")
        self.stream.flush()


def format_loss(loss, digits):
    """``loss`` to ``digits`` significant digits, trailing zeros kept (``5.980``, not ``5.98``)."""
    return f"{loss:#.{digits}g}"


def format_seconds(seconds):
    """``1h02m``, ``3m05s`` or ``12s``."""
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


class GPTLocalEvalProgress(Callback):
    """Eval progress on stdout: the batches scored of the dataset's, tokens/s and the time left, every
    ``per_print_times`` batches and at the end (the first batch includes the graph compile)."""

    def __init__(self, per_print_times=10, stream=None):
        super().__init__()
        self.per_print_times = max(int(per_print_times), 1)
        self.stream = stream or sys.stdout
        self.started = self.first_done = None
        self.tokens_per_step = 0

    def on_eval_begin(self, run_context):
        params = run_context.original_args()
        dataset = getattr(params, "valid_dataset", None)
        if dataset is not None:
            self.tokens_per_step = int(np.prod(dataset.output_shapes()[0]))
        self.started = time.time()

    def on_eval_step_end(self, run_context):
        params = run_context.original_args()
        step, total = params.cur_step_num, params.batch_num
        now = time.time()
        if self.first_done is None:
            self.first_done = (now, step)
        if step == 1 or step % self.per_print_times == 0 or step == total:
            since, at = self.first_done
            rate = (step - at) / max(now - since, 1e-9) if step > at else 0
            tokens = f"  {rate * self.tokens_per_step:,.0f} tokens/s" if rate and self.tokens_per_step else ""
            eta = f"  ETA {format_seconds((total - step) / rate)}" if rate and step < total else ""
            self.stream.write(f"[gptlocal] eval batch {step}/{total}{tokens}{eta}\n")
            self.stream.flush()

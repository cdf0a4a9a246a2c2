"""GPTLocalThroughputMonitor's lines: the step counts toward the run's steps when runner_config.stop_step ends the
launch sooner (`step 10/23`, as README's tour says), the summary says where stop_step stopped, and every loss has
exactly loss_digits significant digits (trailing zeros kept: 5.980, not 5.98)."""
import io
import re
from types import SimpleNamespace

import mindspore as ms
import numpy as np
import pytest

from mindformers_gptlocal.training.callbacks import GPTLocalThroughputMonitor, format_loss


class _Context:
    def __init__(self, params):
        self.params = params

    def original_args(self):
        return self.params


def _train(losses, run_steps, stop_step=None, initial_step=0, loss_digits=4):
    """Feed the monitor one step per loss, as MindSpore's loop does; returns what it printed."""
    from mindformers.core.callback.callback import TrainCallBack
    stream = io.StringIO()
    monitor = GPTLocalThroughputMonitor(per_print_times=5, tokens_per_step=64, stream=stream,
                                        initial_step=initial_step, loss_digits=loss_digits)
    callbacks = [monitor] + ([TrainCallBack(stop_step=stop_step)] if stop_step else [])
    params = SimpleNamespace(batch_num=run_steps, epoch_num=1, list_callback=callbacks, cur_step_num=0,
                             net_outputs=None)
    context = _Context(params)
    monitor.on_train_begin(context)
    for index, loss in enumerate(losses):
        params.cur_step_num = index + 1
        params.net_outputs = (ms.Tensor(np.float32(loss)), ms.Tensor(False), ms.Tensor(np.float32(1.0)))
        monitor.on_train_step_begin(context)
        monitor.on_train_step_end(context)
    monitor.on_train_end(context)
    return stream.getvalue()


def test_a_run_cut_by_stop_step_counts_toward_its_own_steps_and_says_where_it_stopped():
    out = _train([6.0 - 0.1 * i for i in range(10)], run_steps=23, stop_step=10)
    steps = re.findall(r"\[gptlocal\] step (\d+)/(\d+)", out)
    assert steps == [("1", "23"), ("5", "23"), ("10", "23")], out
    assert "ETA" not in out.splitlines()[2], out  # its last line: nothing left in this launch
    assert "training done: 10 steps" in out and \
        "stopped at step 10 of 23 by runner_config.stop_step (--resume_training True continues)" in out, out


def test_a_resumed_run_counts_on_from_its_checkpoint():
    out = _train([5.0, 4.9, 4.8], run_steps=13, initial_step=10)
    assert re.findall(r"\[gptlocal\] step (\d+)/(\d+)", out) == [("13", "13")], out
    assert "stopped at step" not in out, out  # it ran to the end


def test_a_whole_run_says_no_stop():
    out = _train([6.0] * 5, run_steps=5)
    assert re.findall(r"\[gptlocal\] step (\d+)/(\d+)", out) == [("1", "5"), ("5", "5")], out
    assert "stopped at step" not in out, out


@pytest.mark.parametrize("value,digits,text", [(5.98, 4, "5.980"), (6.0, 4, "6.000"), (10.0, 4, "10.00"),
                                               (0.5, 4, "0.5000"), (6.2351336, 4, "6.235"), (5.98, 3, "5.98"),
                                               (float("nan"), 4, "nan")])
def test_losses_keep_their_significant_digits(value, digits, text):
    assert format_loss(value, digits) == text


def test_every_progress_line_and_the_summary_print_four_significant_digits():
    out = _train([5.98, 6.0, 4.5, 10.0, 3.25], run_steps=5)
    losses = re.findall(r"loss (\S+?),?\s", out)
    assert losses == ["5.980", "3.250", "3.250"], out  # steps 1 and 5, then the summary's last loss

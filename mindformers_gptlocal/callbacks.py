"""Training callbacks registered with MindFormers: tokens/s progress, and a model directory at the end.

Use them from a YAML ``callbacks:`` list by ``type``.
"""
import os
import sys
import time

import numpy as np
from mindspore.train.callback import Callback

from mindformers.tools.register import MindFormerRegister, MindFormerModuleType
from mindformers.tools.utils import get_output_root_path


def _loss_value(outputs):
    loss = outputs[0] if isinstance(outputs, (tuple, list)) else outputs
    return float(np.mean(loss.asnumpy()))


@MindFormerRegister.register(MindFormerModuleType.CALLBACK)
class GPTLocalThroughputMonitor(Callback):
    """Prints step, loss, tokens/s and step time every ``per_print_times`` steps (first step includes compile).

    Tokens per step are read from the train dataset's batch shape unless given.
    """

    def __init__(self, per_print_times=10, tokens_per_step=None, stream=None):
        super().__init__()
        self.tokens_per_step = tokens_per_step
        self.per_print_times = int(per_print_times)
        self.stream = stream or sys.stdout
        self.window_start = None
        self.window_steps = 0
        self.history = []

    def on_train_begin(self, run_context):
        if self.tokens_per_step is None:
            dataset = run_context.original_args().train_dataset
            self.tokens_per_step = int(np.prod(dataset.output_shapes()[0])) if dataset is not None else 0

    def on_train_step_begin(self, run_context):
        if self.window_start is None:
            self.window_start = time.time()

    def on_train_step_end(self, run_context):
        params = run_context.original_args()
        step = params.cur_step_num
        self.window_steps += 1
        loss = _loss_value(params.net_outputs)
        self.history.append(loss)
        if step == 1 or step % self.per_print_times == 0 or step == params.batch_num * params.epoch_num:
            seconds = time.time() - self.window_start
            rate = self.tokens_per_step * self.window_steps / max(seconds, 1e-9)
            total = params.batch_num * params.epoch_num
            self.stream.write(f"[gpt_local] step {step}/{total}  loss {loss:.4f}  {rate:,.0f} tokens/s  "
                              f"{1000 * seconds / self.window_steps:.0f} ms/step\n")
            self.stream.flush()
            self.window_start = time.time()
            self.window_steps = 0

    def on_train_end(self, run_context):
        import resource
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        self.stream.write(f"[gpt_local] training done, peak RSS {peak_mb:,.0f} MB\n")
        self.stream.flush()


@MindFormerRegister.register(MindFormerModuleType.CALLBACK)
class GPTLocalSaveModelDir(Callback):
    """At the end of training, rank 0 writes ``<output_dir>/<subdir>``: config.json, model.safetensors and
    the tokenizer files of ``tokenizer_dir``: a directory ``from_pretrained``, eval and predict load directly.

    Single-card and data-parallel runs only: under pipeline or tensor parallel a rank holds a slice.
    """

    def __init__(self, subdir="model", tokenizer_dir=None):
        super().__init__()
        self.subdir = subdir
        self.tokenizer_dir = tokenizer_dir

    def on_train_end(self, run_context):
        from mindformers.tools.utils import get_real_rank
        from .checkpoint import save_model_dir
        if get_real_rank() != 0:
            return  # data-parallel ranks hold the same weights; one writer avoids a race
        import mindspore as ms
        if ms.get_auto_parallel_context("parallel_mode") in ("semi_auto_parallel", "auto_parallel"):
            print("[gpt_local] GPTLocalSaveModelDir skipped: under tensor/pipeline parallel each rank holds a "
                  "slice; use the CheckpointMonitor output and MindFormers' checkpoint merge.", flush=True)
            return
        network = run_context.original_args().train_network
        model = _find_causal_lm(network)
        out = os.path.join(get_output_root_path(), self.subdir)
        save_model_dir(model, out, self.tokenizer_dir)
        print(f"[gpt_local] model directory written: {out}", flush=True)


def _find_causal_lm(network):
    from .model import GPTLocalForCausalLM
    for _, cell in network.cells_and_names():
        if isinstance(cell, GPTLocalForCausalLM):
            return cell
    raise RuntimeError("no GPTLocalForCausalLM inside the train network")

"""The gpt_local classes MindFormers builds by name that are not MindFormers subclasses: the optimizer (``optimizer:
type: GPTLocalAdamW``), the eval metric (``metric: type: GPTLocalPerplexityMetric``) and the training callbacks
(``callbacks: - type: GPTLocalThroughputMonitor`` ...). They are plain MindSpore classes in ``training/``, but
``GPTLocalSaveModelDir`` (defined here: it reads MindFormers' output folder and rank); this module is where MindFormers'
registry learns their names (``registration.register`` imports it). The MindFormers subclasses in this package
(train-step wrappers, checkpoint monitor, tokenizer, instruction handler) carry the register decorator where they are
defined.
"""
import os

from mindspore.train.callback import Callback

from ..model.weights import save_model_dir
from ..training import stop
from ..training.callbacks import GPTLocalEvalProgress, GPTLocalThroughputMonitor
from ..training.metrics import GPTLocalPerplexityMetric
from ..training.optim import GPTLocalAdamW
from .symbols import MindFormerModuleType, MindFormerRegister, get_output_root_path, get_real_rank


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
        if stop.stopped():
            return  # stopped by a signal: the checkpoint resumes it; the model directory comes at the real end
        if get_real_rank() != 0:
            return  # data-parallel ranks hold the same weights; one writer avoids a race
        import mindspore as ms
        if ms.get_auto_parallel_context("parallel_mode") in ("semi_auto_parallel", "auto_parallel"):
            print("[gptlocal] GPTLocalSaveModelDir skipped: under tensor/pipeline parallel each rank holds a "
                  "slice; use the CheckpointMonitor output and MindFormers' checkpoint merge.", flush=True)
            return
        network = run_context.original_args().train_network
        model = _find_causal_lm(network)
        out = os.path.join(get_output_root_path(), self.subdir)
        save_model_dir(model, out, self.tokenizer_dir)
        print(f"[gptlocal] model directory written: {out}", flush=True)


def _find_causal_lm(network):
    # imported here, not at the top: mf/registration.py imports this module before model.gpt
    from ..model.gpt import GPTLocalForCausalLM  # pylint: disable=import-outside-toplevel
    for _, cell in network.cells_and_names():
        if isinstance(cell, GPTLocalForCausalLM):
            return cell
    raise RuntimeError("no GPTLocalForCausalLM inside the train network")


REGISTERED = ((GPTLocalAdamW, "OPTIMIZER"), (GPTLocalPerplexityMetric, "METRIC"),
              (GPTLocalThroughputMonitor, "CALLBACK"), (GPTLocalEvalProgress, "CALLBACK"),
              (GPTLocalSaveModelDir, "CALLBACK"))

for _cls, _kind in REGISTERED:
    MindFormerRegister.register_cls(_cls, module_type=getattr(MindFormerModuleType, _kind))

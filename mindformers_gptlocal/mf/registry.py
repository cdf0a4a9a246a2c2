"""The gpt_local classes MindFormers builds by name that are not MindFormers subclasses: the optimizer
(``optimizer: type: GPTLocalAdamW``), the eval metric (``metric: type: GPTLocalPerplexityMetric``) and the
training callbacks (``callbacks: - type: GPTLocalThroughputMonitor`` ...). They are plain MindSpore classes in
``training/``; this module is where MindFormers' registry learns their names (``registration.register`` imports
it). The MindFormers subclasses in this package (train-step wrappers, checkpoint monitor, tokenizer, instruction
handler) carry the register decorator where they are defined.
"""
from ..training.callbacks import GPTLocalEvalProgress, GPTLocalSaveModelDir, GPTLocalThroughputMonitor
from ..training.metrics import GPTLocalPerplexityMetric
from ..training.optim import GPTLocalAdamW
from .symbols import MindFormerModuleType, MindFormerRegister

REGISTERED = ((GPTLocalAdamW, "OPTIMIZER"), (GPTLocalPerplexityMetric, "METRIC"),
              (GPTLocalThroughputMonitor, "CALLBACK"), (GPTLocalEvalProgress, "CALLBACK"),
              (GPTLocalSaveModelDir, "CALLBACK"))

for _cls, _kind in REGISTERED:
    MindFormerRegister.register_cls(_cls, module_type=getattr(MindFormerModuleType, _kind))

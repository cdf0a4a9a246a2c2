"""What makes MindFormers know gpt_local: ``register()``, run once per process.

It is called by the ``.pth`` hook right after ``import mindformers`` (``mindformers_gptlocal_autoregister``),
by ``import mindformers_gptlocal`` when MindFormers is already loaded, and before the first MindFormers-facing
name (``mindformers_gptlocal.GPTLocalForCausalLM`` ...) is handed out. It

1. imports the modules whose classes carry MindFormers' register decorators (``mf/model.py``: the config and the
   model, which also register themselves with AutoConfig / AutoModelForCausalLM; train wrappers, optimizer,
   callbacks, metric, checkpoint monitor, tokenizer, instruction data handler); the handler is also set on
   ``mindformers.dataset.handler``, where HFDataLoader looks;
2. wraps MindFormers' ``build_context`` so a gpt_local YAML gets our pre-flight checks (and the
   switch to the mcore path) inside MindFormers' own ``run_mindformer.py`` too;
3. keeps a gpt_local runner_wrapper when MindFormers' trainer swaps wrappers for pipeline
   parallel or gradient accumulation;
4. gives MindFormers a barrier on CPU (MindSpore has no Barrier kernel there; MindFormers calls it
   when many ranks load or save a checkpoint, so a data-parallel CPU resume failed);
5. wraps the trainer's ``check_runner_config`` so resuming a run that has no step left is one
   clear error instead of MindSpore's "epoch must bigger than initial_epoch";
6. lets MindFormers 1.9's checkpoint check take the checkpoint file gpt_local's resume names, and keeps a gpt_local
   model with prefix tuning as it is (MindFormers' own prefix models would wrap it).

Items 2-6 (and the handler's name in 1) are patches of MindFormers/MindSpore: they live in ``compat.py`` with
every other patch, each checked against the installed MindFormers before it is applied (``compat.apply``, handed
what the patches call of the layers above it: the pre-flight, the resume check, the handler, the prefix pet_types).
No MindFormers file is edited; other models pass through untouched.
"""
import importlib

from . import compat
from ..checkpoint.resume import check_steps_left
from ..peft.prefix import PREFIX_TYPES
from .run_yaml import preflight

# modules whose classes MindFormers finds by name (YAML ``type:`` / ``model_type``), under mindformers_gptlocal
REGISTERED_MODULES = ("mf.wrapper", "mf.registry", "mf.checkpoint_monitor", "mf.tokenizer", "mf.data_handler",
                      "mf.model")
PACKAGE = __package__.rsplit(".", 1)[0]  # mindformers_gptlocal
_STATE = {"done": False}


def register():
    """Register gpt_local with MindFormers (idempotent). Imports MindFormers if it is not loaded yet."""
    if _STATE["done"]:
        return
    _STATE["done"] = True
    import mindformers  # noqa: F401  (with the .pth hook installed, this may re-enter register(): it returns)
    for name in REGISTERED_MODULES:
        # a module of ours may be importing right now (it imported mindformers first, which fired the hook):
        # import_module then returns it half-built, and its decorators run when it finishes
        importlib.import_module(f"{PACKAGE}.{name}")
    handler = importlib.import_module(f"{PACKAGE}.mf.data_handler").GPTLocalInstructHandler
    compat.apply(compat.Hooks(preflight=preflight, steps_left=check_steps_left, instruct_handler=handler,
                              prefix_types=PREFIX_TYPES))

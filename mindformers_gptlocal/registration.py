"""What makes MindFormers know gpt_local: ``register()``, run once per process.

It is called by the ``.pth`` hook right after ``import mindformers`` (``mindformers_gptlocal_autoregister``),
by ``import mindformers_gptlocal`` when MindFormers is already loaded, and before the first heavy
name (``GPTLocalForCausalLM`` ...) is handed out. It

1. imports the modules whose classes carry MindFormers' register decorators (config, model,
   train wrappers, optimizer, callbacks, metric, checkpoint monitor, tokenizer, instruction data handler);
   the config and the model also register themselves with AutoConfig / AutoModelForCausalLM where they
   are defined; the handler is also set on ``mindformers.dataset.handler``, where HFDataLoader looks;
2. wraps MindFormers' ``build_context`` so a gpt_local YAML gets our pre-flight checks (and the
   switch to the mcore path) inside MindFormers' own ``run_mindformer.py`` too;
3. keeps a gpt_local runner_wrapper when MindFormers' trainer swaps wrappers for pipeline
   parallel or gradient accumulation;
4. gives MindFormers a barrier on CPU (MindSpore has no Barrier kernel there; MindFormers calls it
   when many ranks load or save a checkpoint, so a data-parallel CPU resume failed);
5. wraps the trainer's ``check_runner_config`` so resuming a run that has no step left is one
   clear error instead of MindSpore's "epoch must bigger than initial_epoch".

Items 2-5 (and the handler's name in 1) are patches of MindFormers/MindSpore: they live in
``mindformers_compat.py`` with every other patch, each checked against the installed MindFormers before
it is applied (``mindformers_compat.apply()``). No MindFormers file is edited; other models pass through
untouched.
"""
import importlib
import sys

from . import mindformers_compat
from .mindformers_compat import (BARRIER_USERS, GPTLOCAL_WRAPPERS, mark_checked,  # noqa: F401  (their old home)
                                 _barrier_on_cpu, _keeping_gptlocal_wrapper, _refusing_finished_runs, _with_preflight)
from .preflight.checks import is_gpt_local, preflight  # noqa: F401  (imported before model.config, as before)

# modules whose classes MindFormers finds by name (YAML ``type:`` / ``model_type``)
REGISTERED_MODULES = ("mf.wrapper", "mf.registry", "mf.checkpoint_monitor", "mf.tokenizer", "mf.data_handler",
                      "model.config", "model.gpt")
_STATE = {"done": False}


def register():
    """Register gpt_local with MindFormers (idempotent). Imports MindFormers if it is not loaded yet."""
    if _STATE["done"]:
        return
    _STATE["done"] = True
    import mindformers  # noqa: F401  (with the .pth hook installed, this may re-enter register(): it returns)
    bases = sys.modules.get(f"{__package__}.model.bases")
    if bases is not None:  # the model was imported before MindFormers: lean classes are replaced by registered ones
        bases.reimport_with_mindformers(__package__)
    for name in REGISTERED_MODULES:
        # a module of ours may be importing right now (it imported mindformers first, which fired the hook):
        # import_module then returns it half-built, and its decorators run when it finishes
        importlib.import_module(f"{__package__}.{name}")
    mindformers_compat.apply()

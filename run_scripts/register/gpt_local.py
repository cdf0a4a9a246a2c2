"""For MindFormers' documented external-model route, with no installed auto-registration:

    python run_mindformer.py --register_path <repo>/run_scripts/register --config my.yaml
    # my.yaml:  model: {model_config: {auto_register: gpt_local.GPTLocalConfig, model_type: gpt_local, ...}}

MindFormers imports this file from REGISTER_PATH; importing these names runs
mindformers_gptlocal.mf.registration.register(): config, model, wrappers, callbacks, tokenizer.
"""
from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM  # noqa: F401  (registers everything)

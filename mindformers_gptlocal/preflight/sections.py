"""The YAML sections around the model a user sets: top-level keys, runner_config, optimizer, lr_schedule,
callbacks, context, parallel and parallel_config, checked for known keys (the closest one suggested, from
MindFormers' own registries and config templates), types and ranges. Each mistake is one ConfigError naming
the key; nothing here writes or builds anything.

A key is refused outright where MindFormers itself would refuse it (runner_config, a class whose constructor
takes no ``**kwargs``) and where it is a near miss of a known key (``per_print_time`` for ``per_print_times``);
an unknown key far from every known one passes where MindFormers passes extra keys on (``context``,
``parallel``, classes that take ``**kwargs``).

MindFormers' tables come in as ``names`` (``mf/symbols.py``, handed down by the caller: ``preflight/`` sits below
``mf/``, which calls it, and imports nothing of it).
"""
import difflib
import inspect
import numbers

from ..errors import ConfigError

# top-level keys MindFormers reads outside its config template (trainer, context, callbacks), and ours
EXTRA_TOP_LEVEL = (
    "base_config", "use_legacy", "tensorboard", "generation_config", "trust_remote_code", "auto_tune",
    "autotune_per_step", "filepath_prefix", "check_for_nan_in_loss_and_grad", "use_checkpoint_health_monitor",
    "affinity_config", "affinity_cpu_list", "mindio_pool_capacity", "device_num", "local_rank", "rank_id",
    "calculate_per_token_loss", "data_size", "push_to_hub", "hub_model_id", "hub_private_repo", "hub_token",
    "resume_by_last_timestamp_ckpt", "transform_by_rank", "use_graceful_exit", "profile_output", "profile_cb",
    "profiler_level", "with_stack", "set_numa_enable", "npu_num_per_node", "pet_config", "grouped_lr_schedule",
    "stable_rank_config", "processor", "tokenizer", "eval_step_interval", "eval_epoch_interval",
    "input_data", "adapter_id", "predict_batch_size", "use_past", "max_device_memory", "register_path",
    "moe_config", "src_strategy_path_or_dir", "load_ckpt_async", "remove_redundancy", "use_legacy_format",
    "data_simplification", "jit_level", "infer_boost", "print_separate_loss",
    "gptlocal_compat",  # ours: strict (default) or warn, mf/compat.py require
    "overwrite_output_dir",  # ours: start over on an earlier run in output_dir (preflight/inputs.py check_earlier_run)
)
CONTEXT_KEYS = (
    "mode", "device_target", "device_id", "max_device_memory", "max_call_depth", "save_graphs", "save_graphs_path",
    "enable_graph_kernel", "graph_kernel_flags", "runtime_num_threads", "jit_config", "jit_level", "ascend_config",
    "gpu_config", "memory_optimize_level", "mempool_block_size", "op_timeout", "deterministic", "debug_level",
    "precompile_only", "enable_compile_cache", "compile_cache_path", "save_compile_cache", "load_compile_cache",
    "pynative_synchronize", "variable_memory_max_size", "enable_reduce_precision", "inter_op_parallel_num",
    "print_file_path", "env_config_path", "jit_syntax_level", "affinity_cpu_list", "train_precision_sync",
    "infer_precision_sync", "exclude_cann_cpu", "postprocess_use_numpy",
)


def _suggest(key, known):
    close = difflib.get_close_matches(str(key), [str(k) for k in known], n=1, cutoff=0.75)
    return close[0] if close else None


def _unknown(where, key, known, strict, listing=True):
    """Refuse ``key`` (of ``where``) if it is a near miss of a known key, or if ``strict``."""
    close = _suggest(key, known)
    if close:
        raise ConfigError(f"{where}: unknown key {key!r}; did you mean {close!r}?")
    if strict:
        names = f" (known: {', '.join(sorted(known))})" if listing else ""
        raise ConfigError(f"{where}: unknown key {key!r}{names}; remove it or fix its spelling.")


def known_top_level(names):
    """The top-level keys MindFormers (its config template, ``names``: ``mf/symbols.py``) or gpt_local reads."""
    templates = names.CONFIG_NAME_TO_CLASS
    keys = set(templates) - {"general_config"}
    return keys | set(templates["general_config"].keys()) | set(EXTRA_TOP_LEVEL)


def check_top_level(config, names):
    """Every top-level key is one MindFormers or gpt_local reads (``runer_config:`` would train on defaults)."""
    known = known_top_level(names)
    for key in config:
        if key not in known:
            close = _suggest(key, known)
            hint = f"did you mean {close!r}?" if close else "remove it or fix its spelling (MindFormers ignores it)."
            raise ConfigError(f"the YAML's top-level key {key!r} is not one MindFormers reads; {hint}")


def _number(where, value, low=None, high=None, low_open=False, integer=False, allow_none=False):
    if value is None and allow_none:
        return
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ConfigError(f"{where} must be {'an integer' if integer else 'a number'}, got {value!r}.")
    if low is not None and (value < low or (low_open and value == low)):
        raise ConfigError(f"{where} must be {'>' if low_open else '>='} {low}, got {value!r}.")
    if high is not None and value > high:
        raise ConfigError(f"{where} must be <= {high}, got {value!r}.")


def _flag(where, value):
    if not isinstance(value, bool):
        raise ConfigError(f"{where} must be True or False, got {value!r}.")


def check_runner(config, names):
    RunnerConfig = names.RunnerConfig  # pylint: disable=invalid-name
    runner = config.get("runner_config") or {}
    for key in runner:
        if key not in RunnerConfig.keys():
            _unknown("runner_config", key, RunnerConfig.keys(), strict=True)
    if "sink_mode" in runner:
        _flag("runner_config.sink_mode", runner["sink_mode"])
    if runner.get("sink_size") not in (None, -1):
        _number("runner_config.sink_size", runner["sink_size"], 1, integer=True)
    if "stop_step" in runner:
        _number("runner_config.stop_step", runner["stop_step"], 0, integer=True, allow_none=True)


def _registered(kind, names):
    return names.MindFormerRegister.registry.get(getattr(names.MindFormerModuleType, kind), {})


def _parameters(cls):
    """(named constructor parameters over the class's MRO, whether its own constructor takes **kwargs)."""
    named, open_ended = set(), False
    for index, klass in enumerate(inspect.getmro(cls)):
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        try:
            params = inspect.signature(init).parameters.values()
        except (TypeError, ValueError):
            return named, True
        if index == 0 or not named:
            open_ended = any(p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) for p in params)
        named |= {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)} - {"self"}
        if not any(p.kind == p.VAR_POSITIONAL or p.kind == p.VAR_KEYWORD for p in params):
            break  # a constructor without *args/**kwargs passes nothing further up
    return named, open_ended


def _check_typed(where, section, kind, what, names, skip=()):
    """``section`` has a registered ``type`` (closest suggested) and keys its constructor takes."""
    registry = _registered(kind, names)
    kind_name = section.get("type")
    if not isinstance(kind_name, str) or not kind_name:
        raise ConfigError(f"{where}.type must name a MindFormers {what}, got {kind_name!r}.")
    if kind_name not in registry:
        names = [n for n in registry if n[:1].isupper()]
        close = _suggest(kind_name, names)
        hint = f"did you mean {close!r}?" if close else f"known: {', '.join(sorted(names))}."
        raise ConfigError(f"{where}.type {kind_name!r} is not a registered MindFormers {what}; {hint}")
    named, open_ended = _parameters(registry[kind_name])
    for key in section:
        if key == "type" or key in skip or key in named:
            continue
        _unknown(f"{where} ({kind_name})", key, named, strict=not open_ended)
    return kind_name


def _check_learning_rate(where, value):
    if isinstance(value, dict):
        return
    _number(where, value, 0, low_open=True)


def check_optimizer(config, names):
    optimizer = config.get("optimizer")
    if not optimizer:
        return
    _check_typed("optimizer", optimizer, "OPTIMIZER", "optimizer", names, skip=("params",))
    if "learning_rate" in optimizer:
        _check_learning_rate("optimizer.learning_rate", optimizer["learning_rate"])
    if "weight_decay" in optimizer:
        _number("optimizer.weight_decay", optimizer["weight_decay"], 0)
    if "eps" in optimizer:
        _number("optimizer.eps", optimizer["eps"], 0, low_open=True)
    if "betas" in optimizer:
        betas = optimizer["betas"]
        if not isinstance(betas, (list, tuple)) or len(betas) != 2:
            raise ConfigError(f"optimizer.betas must be a list of two numbers in [0, 1), got {betas!r}.")
        for beta in betas:
            _number("optimizer.betas", beta, 0)
            if beta >= 1:
                raise ConfigError(f"optimizer.betas must be a list of two numbers in [0, 1), got {betas!r}.")


def check_lr_schedule(config, names):
    schedule = config.get("lr_schedule")
    if not schedule:
        return
    _check_typed("lr_schedule", schedule, "LR", "learning-rate schedule", names)
    if "learning_rate" in schedule:
        _check_learning_rate("lr_schedule.learning_rate", schedule["learning_rate"])
    for key in ("lr_end", "warmup_lr_init"):
        if schedule.get(key) is not None:
            _number(f"lr_schedule.{key}", schedule[key], 0)
    for key in ("warmup_ratio", "decay_ratio"):
        if schedule.get(key) is not None:
            _number(f"lr_schedule.{key}", schedule[key], 0, 1)
    for key in ("warmup_steps", "decay_steps"):
        if schedule.get(key) is not None:
            _number(f"lr_schedule.{key}", schedule[key], 0, integer=True)
    if schedule.get("total_steps") not in (None, -1):
        _number("lr_schedule.total_steps", schedule["total_steps"], 1, integer=True)


def check_callbacks(config, names):
    for index, callback in enumerate(config.get("callbacks") or []):
        name = _check_typed(f"callbacks[{index}]", callback, "CALLBACK", "callback", names)
        where = f"callbacks[{index}] ({name})"
        if "per_print_times" in callback:
            _number(f"{where}.per_print_times", callback["per_print_times"], 1, integer=True)
        if "loss_digits" in callback:
            _number(f"{where}.loss_digits", callback["loss_digits"], 1, 17, integer=True)
        if "stop_on_signal" in callback:  # GPTLocalCheckpointMonitor: save and stop on SIGINT/SIGTERM
            _flag(f"{where}.stop_on_signal", callback["stop_on_signal"])


def check_context(config):
    context = config.get("context") or {}
    for key in context:
        if key not in CONTEXT_KEYS:
            _unknown("context", key, CONTEXT_KEYS, strict=False)
    mode = context.get("mode")
    if "mode" in context and (isinstance(mode, bool) or mode not in (0, 1)):
        raise ConfigError(f"context.mode must be 0 (graph) or 1 (pynative), got {context['mode']!r}.")
    if "device_id" in context:
        _number("context.device_id", context["device_id"], 0, integer=True)
    if "max_call_depth" in context:
        _number("context.max_call_depth", context["max_call_depth"], 1, integer=True)
    memory = context.get("max_device_memory")
    if memory is not None and not (isinstance(memory, str) and memory.upper().endswith("GB")):
        raise ConfigError(f"context.max_device_memory must be a size like \"58GB\", got {memory!r}.")


def check_parallel(config, names):
    parallel = config.get("parallel") or {}
    try:
        from mindspore.parallel._auto_parallel_context import _set_auto_parallel_context_func_map as known
        known = set(known) | {"pipeline_config", "strategy_ckpt_config", "optimizer_weight_shard_size"}
    except ImportError:  # a MindSpore that moved it: only the types below
        known = None
    for key in parallel if known else ():
        if key not in known:
            _unknown("parallel", key, known, strict=False)
    if "parallel_mode" in parallel and not (isinstance(parallel["parallel_mode"], str) or (
            isinstance(parallel["parallel_mode"], int) and not isinstance(parallel["parallel_mode"], bool)
            and 0 <= parallel["parallel_mode"] <= 3)):
        raise ConfigError(f"parallel.parallel_mode must be 0-3 or a mode name (e.g. semi_auto_parallel), got "
                          f"{parallel['parallel_mode']!r}.")
    for key in ("full_batch", "enable_parallel_optimizer", "gradients_mean", "enable_alltoall"):
        if key in parallel:
            _flag(f"parallel.{key}", parallel[key])
    layout = config.get("parallel_config") or {}
    named, _ = _parameters(names.TransformerOpParallelConfig)
    for key in layout:
        if key not in named:
            _unknown("parallel_config", key, named, strict=False)
    for key in ("use_seq_parallel", "vocab_emb_dp"):
        if key in layout:
            _flag(f"parallel_config.{key}", layout[key])


def check_sections(config, names):
    """Every check above, in the order a reader meets the sections; ``names``: MindFormers' (``mf/symbols.py``)."""
    check_top_level(config, names)
    check_runner(config, names)
    check_context(config)
    check_parallel(config, names)
    check_optimizer(config, names)
    check_lr_schedule(config, names)
    check_callbacks(config, names)

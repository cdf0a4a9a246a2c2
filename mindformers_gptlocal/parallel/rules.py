"""The layout rules a parallel gpt_local run must satisfy, in one function.

``check_parallel_layout`` is called by ``gptlocal plan`` (on the YAML, before anything
is built), by pre-flight (``gptlocal run``) and when the model config is built inside
MindFormers (``run_mindformer.py``), so every entry point stops with the same lines.
It returns ALL problems, one line each naming the YAML key and a fix; callers raise
``ConfigError`` with them (``raise_if_bad``). The rules are arithmetic on the config values; only
``build_device_count`` (used at model build) asks MindSpore for the running job's size.

Batch semantics are MindFormers 1.8's (``BaseTrainer._check_global_batch_size_for_auto_parallel``):
``runner_config.batch_size`` is the batch of one data-parallel replica for one micro-batch, and
with ``full_batch`` the global batch is ``batch_size * data_parallel * micro_batch_num`` (pipeline)
or ``batch_size * data_parallel * gradient_accumulation_steps``. A global batch built that way is
divisible by data_parallel by construction, so the batch rule that can fail in practice is a
non-positive or non-integer ``batch_size`` (and micro_batch_num < pipeline_stage); there is no
separate divisibility check. MindFormers resets micro_batch_num to 1 without pipeline, so that
is not an error.
"""
import os

from ..errors import ConfigError
from .layout import Layout, config_value

# the parallel modes in which MindSpore sets shard strategies (by name; the YAML may give their numbers 1, 2)
PARALLEL_MODES = ("semi_auto_parallel", "auto_parallel")
SHARDING_MODES = PARALLEL_MODES + (1, 2, "1", "2")


def seq_length_problem(seq, max_pos, rope=False):
    """The seq_length rule (``model/arch.py`` and ``check_parallel_layout`` both state it with this text), or None."""
    if not (isinstance(seq, int) and isinstance(max_pos, int)) or seq <= max_pos:
        return None
    why = ("rotary positions are built for max_position_embeddings rows (the causal mask and the position index)"
           if rope else "the learned position table has max_position_embeddings rows")
    return (f"model_config.seq_length ({seq}) is larger than model_config.max_position_embeddings ({max_pos}): "
            f"{why}. Lower seq_length or raise max_position_embeddings.")


def _positive_ints(layout, problems):
    names = {"dp": "data_parallel", "mp": "model_parallel", "pp": "pipeline_stage", "micro": "micro_batch_num"}
    good = True
    for short, key in names.items():
        value = getattr(layout, short)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.append(f"parallel_config.{key} must be a positive integer, got {value!r}; set it to 1 or more.")
            good = False
    return good


def _divisible(problems, key, value, mp, why):
    if isinstance(value, int) and value % mp:
        problems.append(f"model_config.{key} ({value}) is not divisible by parallel_config.model_parallel ({mp}): "
                        f"{why}. Choose model_parallel among {_divisors(value, limit=mp * 4)} or change {key}.")


def _divisors(number, limit):
    return [d for d in range(1, min(number, limit) + 1) if number % d == 0]


def _adapter_width(pet, hidden):
    """The bottleneck width of pet_type: adapter (``peft/adapter.py`` checks the values), or None."""
    get = (lambda key: pet.get(key)) if hasattr(pet, "get") else (lambda key: getattr(pet, key, None))
    if not pet or get("pet_type") != "adapter":
        return None
    factor = get("reduction_factor")
    if isinstance(factor, int) and factor > 0 and isinstance(hidden, int):
        return hidden // factor
    size = get("bottleneck_size")
    return 64 if size is None else size if isinstance(size, int) else None


def check_parallel_layout(model_config, layout, devices=None, batch_size=None):
    """Every layout problem of ``model_config`` (dict or config object) under ``layout``.

    ``layout``: a ``Layout`` (or a parallel_config section, read with ``Layout.read``, offset from
    ``model_config``). ``devices``: the card count the run will have (None: not known, the product
    is not checked). ``batch_size``: runner_config.batch_size.
    Returns a list of strings, empty when the layout is sound.
    """
    if not isinstance(layout, Layout):
        layout = Layout.read(layout, offset=config_value(model_config, "offset", None))
    problems = []
    if not _positive_ints(layout, problems):
        return problems
    dp, mp, pp, micro = layout.dp, layout.mp, layout.pp, layout.micro
    heads = config_value(model_config, "num_attention_heads")
    hidden = config_value(model_config, "hidden_size")
    inter = config_value(model_config, "intermediate_size") or (4 * hidden if isinstance(hidden, int) else None)
    vocab = config_value(model_config, "vocab_size")
    layers = config_value(model_config, "num_hidden_layers")
    seq = config_value(model_config, "seq_length")
    max_pos = config_value(model_config, "max_position_embeddings")

    if mp > 1:
        _divisible(problems, "num_attention_heads", heads, mp, "tensor parallel gives every rank whole heads")
        groups = config_value(model_config, "num_query_groups", None)
        if groups is not None and groups != heads:
            _divisible(problems, "num_query_groups", groups, mp,
                       "tensor parallel gives every rank whole key/value groups (grouped-query attention)")
        _divisible(problems, "hidden_size", hidden, mp, "the row-parallel projections split hidden_size")
        _divisible(problems, "intermediate_size", inter, mp, "the MLP's fc1/fc2 split intermediate_size")
        width = _adapter_width(config_value(model_config, "pet_config", None), hidden)
        if width:
            _divisible(problems, "pet_config.bottleneck_size", width, mp,
                       "the bottleneck adapters (pet_type: adapter) split their bottleneck like the MLP")
        if not layout.vocab_emb_dp:
            _divisible(problems, "vocab_size", vocab, mp,
                       "parallel_config.vocab_emb_dp is False, so the embedding and tied head split the vocabulary "
                       "(pad vocab_size up to a multiple, or set vocab_emb_dp: True)")
        if layout.seq_parallel and isinstance(seq, int) and seq % mp:
            problems.append(f"model_config.seq_length ({seq}) is not divisible by parallel_config.model_parallel "
                            f"({mp}) but parallel_config.use_seq_parallel is True: sequence parallel splits the "
                            f"sequence over the tensor-parallel ranks. Use a seq_length that is a multiple of "
                            f"{mp} or set use_seq_parallel: False.")
    if isinstance(layers, int):
        try:
            layout.layers_per_stage(layers)
        except ConfigError as err:
            problems.append(str(err))
    problem = seq_length_problem(seq, max_pos, config_value(model_config, "position_embedding_type", None) == "rope")
    if problem:
        problems.append(problem)
    if pp > 1 and micro < pp:
        problems.append(f"parallel_config.micro_batch_num ({micro}) is smaller than parallel_config.pipeline_stage "
                        f"({pp}): the pipeline needs at least one micro-batch per stage in flight. Set "
                        f"micro_batch_num to {pp} or more (4 * pipeline_stage keeps the bubble small).")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)
                                   or batch_size < 1):
        problems.append(f"runner_config.batch_size must be a positive integer, got {batch_size!r}; it is the "
                        f"batch of one data-parallel replica and one micro-batch.")
    if devices is not None and dp * mp * pp != devices:
        problems.append(f"parallel_config.data_parallel * model_parallel * pipeline_stage = {dp} * {mp} * {pp} = "
                        f"{dp * mp * pp}, but the run has {devices} device(s). Make the product equal the device "
                        f"count (e.g. data_parallel: {max(devices // (mp * pp), 1)}), or launch {dp * mp * pp} "
                        f"workers.")
    return problems


def global_batch_size(batch_size, dp, micro_batch_num=1, accumulation=1):
    """Samples per optimizer step across the cluster, MindFormers 1.8's formula."""
    return batch_size * dp * micro_batch_num * accumulation


def build_device_count():
    """Cards of a running job when its layout must multiply to them (semi-auto/auto parallel with
    communication initialised), else None. In MindFormers' plain data-parallel mode the trainer
    resets data_parallel/model_parallel to 1 and replicates over all ranks, so there is no product
    to check."""
    import mindspore as ms
    if ms.get_auto_parallel_context("parallel_mode") not in PARALLEL_MODES:
        return None
    try:
        from mindspore.communication import get_group_size
        return get_group_size()
    except (RuntimeError, ValueError):
        return None


def launch_device_count(config):
    """Cards of a job about to start (pre-flight): 1 without use_parallel; msrun's MS_WORKER_NUM for
    semi-auto/auto parallel; otherwise None (not checked, see ``build_device_count``)."""
    if not config_value(config, "use_parallel", False):
        return 1
    mode = config_value(config_value(config, "parallel", {}) or {}, "parallel_mode", 0)
    workers = os.environ.get("MS_WORKER_NUM")
    if mode in SHARDING_MODES and workers and workers.isdigit():
        return int(workers)
    return None


def raise_if_bad(problems, where="the parallel layout"):
    """ConfigError listing every problem, one per line; nothing when the list is empty."""
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise ConfigError(f"{where} has {len(problems)} problem(s):\n{lines}")


def check_yaml_layout(config, devices=None):
    """``check_parallel_layout`` on a whole run YAML (a dict or MindFormerConfig).

    ``devices``: explicit card count; else 1 when ``use_parallel`` is False, else unknown.
    """
    model_config = dict(config_value(config_value(config, "model", {}), "model_config", {}) or {})
    runner = config_value(config, "runner_config", {}) or {}
    if devices is None and not config_value(config, "use_parallel", False):
        devices = 1
    problems = check_parallel_layout(model_config, Layout.of_run_yaml(config), devices=devices,
                                     batch_size=config_value(runner, "batch_size"))
    mode = config_value(config_value(config, "parallel", {}) or {}, "parallel_mode", 0)
    layerdrop = model_config.get("layerdrop") or 0
    if config_value(config, "use_parallel", False) and mode in SHARDING_MODES and layerdrop:
        problems.append(f"model_config.layerdrop ({layerdrop}) needs counter-based dropout, which gpt_local uses "
                        f"only with parallel.parallel_mode 0 (stand-alone or data parallel), but parallel_mode is "
                        f"{mode!r}; set layerdrop: 0 or parallel_mode: 0.")
    return problems

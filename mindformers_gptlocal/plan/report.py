"""``gptlocal plan``: check a run YAML's parallel layout and size each pipeline stage, before any compile.

Pure arithmetic on the YAML (``yaml_io.load_yaml``, ``base_config`` merged): no MindSpore, no
devices. The layout is the run's ``Layout`` (``parallel/layout.py``, the object the model is built
from), its rules ``parallel/rules.check_parallel_layout`` (the same function the model build and
pre-flight call), and the byte counts come from ``memory.py`` over the parameter table.
``format_plan`` prints a table; ``gptlocal plan --json`` prints ``plan()`` as one JSON object.
"""
from ..parallel.layout import Layout, config_value
from ..parallel.rules import check_yaml_layout, global_batch_size
from . import memory as mem

GIB = 2 ** 30
CARD_MEMORY = {"Ascend": 64 * GIB}   # Ascend 910B: 64 GB HBM a card
CARD_NAME = {"Ascend": "Ascend 910B, 64 GB"}


def plan(config, devices=None):
    """The plan of a loaded YAML dict: {'problems': [...], 'layout': ..., 'stages': [...], ...}."""
    problems = check_yaml_layout(config, devices)
    model_config = dict(config_value(config_value(config, "model", {}), "model_config", {}) or {})
    layout = Layout.of_run_yaml(config)
    result = {"problems": problems, "layout": layout.summary()}
    if problems:
        return result
    s = mem.shape_of(model_config)
    dp, t, pp, micro = layout.dp, layout.mp, layout.pp, layout.micro
    vocab_parallel = not layout.vocab_emb_dp and t > 1
    parallel = config_value(config, "parallel", {}) or {}
    parallel_optimizer = bool(config_value(parallel, "enable_parallel_optimizer", False)) and dp > 1
    batch = int(config_value(config_value(config, "runner_config", {}), "batch_size", 1) or 1)
    counts = layout.layers_per_stage(s["layers"])
    recompute = layout.recompute_modes(s["layers"])
    target = str(config_value(config_value(config, "context", {}), "device_target", "Ascend"))
    pbytes = mem.BYTES[s["params_dtype"]]
    flash = s["flash"] and target == "Ascend"   # the model uses the fused kernel only on Ascend
    stages = []
    pet = mem.stage_pet_params(s, counts, t, vocab_parallel)  # pet_config: only the trainable get grads/moments
    for index, parts in enumerate(mem.stage_params(s, counts, t, vocab_parallel)):
        params = sum(parts.values())
        trainable = params if pet is None else pet[index][1]
        weights = params * pbytes
        grads = trainable * pbytes
        optimizer = trainable * mem.ADAM_MOMENT_BYTES / (dp if parallel_optimizer else 1)
        first, last = index == 0, index == pp - 1
        flight = mem.in_flight_micro_batches(index, pp, micro) if pp > 1 else 1
        act = {mode: mem.stage_activation_bytes(s, batch, counts[index], first, last, t, layout.seq_parallel,
                                                mode, vocab_parallel, flash) * flight
               for mode in ("none", "full", recompute[index])}
        configured = act[recompute[index]]
        total = weights + grads + optimizer + configured
        stages.append({"stage": index, "layers": counts[index], "recompute": recompute[index],
                       "params": params, "trainable_params": trainable, "param_parts": parts,
                       "weights_bytes": weights, "grads_bytes": grads,
                       "optimizer_bytes": optimizer, "in_flight_micro_batches": flight,
                       "activation_bytes": configured, "activation_bytes_no_recompute": act["none"],
                       "activation_bytes_full_recompute": act["full"], "total_bytes": total})
    result.update(shape=s, batch_size=batch, devices=dp * t * pp, device_target=target,
                  global_batch_size=global_batch_size(batch, dp, micro if pp > 1 else 1),
                  parallel_optimizer=parallel_optimizer, vocab_parallel=vocab_parallel, stages=stages,
                  communication=communication(s, layout, batch, stages, recompute, vocab_parallel),
                  notes=_notes(s, pp, config_value(config, "run_mode", "train")))
    peak = max(st["total_bytes"] for st in stages)
    result["peak_device_bytes"] = peak
    if target in CARD_MEMORY:
        result["card"] = CARD_NAME[target]
        result["card_bytes"] = CARD_MEMORY[target]
        result["fits"] = peak <= CARD_MEMORY[target]
    if target == "CPU" and dp * t * pp == 1:
        st = stages[0]
        optimizer = config_value(config_value(config, "optimizer", {}) or {}, "type", None)
        factor, measured_as = mem.cpu_state_factor(optimizer)
        result["cpu_optimizer"] = {"type": optimizer, "state_factor": factor, "factor_of": measured_as,
                                   "measured": measured_as == optimizer}
        if measured_as != optimizer:
            result["notes"].append(f"optimizer.type {optimizer!r} has no measured CPU memory factor: the CPU peak RSS "
                                   f"estimate uses {measured_as}'s ({factor}x the weights, grads and moments), the "
                                   f"conservative one")
        result["cpu_peak_rss_bytes"] = mem.cpu_peak_rss(
            st["weights_bytes"] + st["grads_bytes"] + st["optimizer_bytes"], st["activation_bytes"],
            mem.head_activation_bytes(s, batch), optimizer)
    return result


def communication(s, layout, batch, stages, recompute, vocab_parallel=False):
    """Bytes each device sends per optimizer step, by kind (ring algorithms).

    Tensor parallel (the same with grouped-query attention, SwiGLU or a parallel residual, each of which
    still ends in two row-parallel projections): per layer and micro-batch, 2 all-reduces in the forward (after the attention
    projection and after fc2) and 2 in the backward (the input gradients of QKV and fc1), each of
    batch*seq*hidden elements in the compute dtype; full recompute repeats the 2 forward ones.
    Sequence parallel turns each all-reduce into an all-gather plus a reduce-scatter of the same
    total volume, with activations between them split over the ranks. A vocab-parallel embedding
    and head add one all-reduce each way. Pipeline: each boundary carries batch*seq*hidden elements
    per micro-batch forward and the same back. Data parallel: a ring all-reduce of the gradients
    sends 2*(dp-1)/dp of their bytes (a parallel optimizer's reduce-scatter + all-gather sends the same).
    """
    dp, t, pp, micro = layout.dp, layout.mp, layout.pp, layout.micro
    c = mem.BYTES[s["compute_dtype"]]
    micro_batches = micro if pp > 1 else 1
    message = batch * s["seq"] * s["hidden"] * c
    per_stage = []
    for st, mode in zip(stages, recompute):
        tp_ops = 0
        if t > 1:
            full = st["layers"] if mode == "full" else (mode if isinstance(mode, int) else 0)
            tp_ops = 4 * st["layers"] + 2 * full
            if vocab_parallel:
                tp_ops += 2 * ((st["stage"] == 0) + (st["stage"] == pp - 1))
        tp_bytes = tp_ops * micro_batches * 2 * (t - 1) / t * message
        pp_bytes = micro_batches * message * ((st["stage"] < pp - 1) + (st["stage"] > 0))
        dp_bytes = 2 * (dp - 1) / dp * st["grads_bytes"] if dp > 1 else 0
        per_stage.append({"stage": st["stage"],
                          "tp": {"collectives": tp_ops * micro_batches,
                                 "kind": ("all-gather + reduce-scatter pairs" if layout.seq_parallel
                                          else "all-reduce"),
                                 "message_bytes": message, "bytes_sent": tp_bytes},
                          "pp": {"bytes_sent": pp_bytes}, "dp": {"bytes_sent": dp_bytes},
                          "total_bytes_sent": tp_bytes + pp_bytes + dp_bytes})
    return per_stage


def plan_json(result):
    """``plan()``'s result as the one JSON object of ``gptlocal plan --json`` (the Arch as its layer choices)."""
    import json
    shape = result.get("shape")
    if shape is not None:
        result = dict(result, shape=dict(shape, arch=shape["arch"].choices()))
    return json.dumps(result)


def _notes(s, pp, run_mode):
    notes = []
    if run_mode not in ("train", "finetune"):
        notes.append(f"run_mode is {run_mode}: the figures are those of a training step with this layout "
                     f"(an {run_mode} run keeps no gradients, optimizer state or saved activations).")
    if s["tied"] and pp > 1:
        notes.append("tied head: the last stage holds a copy of the token embedding (MindSpore keeps a copy of "
                     "a parameter shared across stages on each stage using it; their gradients are all-reduced); "
                     "counted in that stage's params as head_copy.")
    notes.append("activations: per micro-batch times the micro-batches in flight under 1F1B "
                 "(pipeline_stage - stage index).")
    return notes


def _gib(value):
    return f"{value / GIB:8.2f}"


def format_plan(result, path=""):
    """The plan as a readable table."""
    lines = []
    if result["problems"]:
        lines.append(f"{path}: {len(result['problems'])} problem(s):")
        lines += [f"  - {p}" for p in result["problems"]]
        return "\n".join(lines)
    lay, s = result["layout"], result["shape"]
    lines.append(f"{path}")
    lines.append(f"model: {s['layers']} layers, hidden {s['hidden']}, {s['heads']} heads, vocab {s['vocab']}, "
                 f"seq {s['seq']}; params {s['params_dtype']}, compute {s['compute_dtype']}")
    groups = s["arch"].groups
    kv = mem.kv_cache_bytes(s, 1, s["seq"])
    lines.append(f"decode KV cache: {kv / 2 ** 20:,.1f} MiB per sequence of {s['seq']} tokens ({groups} key/value "
                 f"heads of {s['heads']}" + (f"; {s['heads'] // groups}x smaller than multi-head)" if groups != s["heads"]
                                             else ")"))
    lines.append(f"layout: dp {lay['dp']} x mp {lay['mp']} x pp {lay['pp']} = {result['devices']} devices; "
                 f"micro_batch_num {lay['micro']}; batch_size {result['batch_size']} per replica and micro-batch; "
                 f"global batch {result['global_batch_size']}; seq parallel {lay['seq_parallel']}; "
                 f"vocab-parallel embedding {result['vocab_parallel']}; parallel optimizer "
                 f"{result['parallel_optimizer']}")
    lines.append("per device, GiB:")
    lines.append(f"{'stage':>5} {'layers':>6} {'params':>12} {'weights':>8} {'grads':>8} {'optim':>8} "
                 f"{'act':>8} {'act(none)':>9} {'act(full)':>9} {'total':>8}  recompute")
    for st in result["stages"]:
        lines.append(f"{st['stage']:>5} {st['layers']:>6} {st['params']:>12,} {_gib(st['weights_bytes'])} "
                     f"{_gib(st['grads_bytes'])} {_gib(st['optimizer_bytes'])} {_gib(st['activation_bytes'])} "
                     f"{_gib(st['activation_bytes_no_recompute']):>9} {_gib(st['activation_bytes_full_recompute']):>9} "
                     f"{_gib(st['total_bytes'])}  {st['recompute']}")
    if any(st["trainable_params"] != st["params"] for st in result["stages"]):
        lines.append("pet_config: grads and optim for the trainable parameters only: " + ", ".join(
            f"stage {st['stage']} {st['trainable_params']:,} ("
            + (f"{st['param_parts']['prefix']:,} in the prefix)" if "prefix" in st["param_parts"]
               else f"{st['param_parts'].get('adapters', 0):,} in adapters)")
            for st in result["stages"]))
    lines.append("communication per step, per device, GiB sent (tp / pp / dp):")
    for com in result["communication"]:
        lines.append(f"  stage {com['stage']}: tp {com['tp']['bytes_sent'] / GIB:.2f} "
                     f"({com['tp']['collectives']} {com['tp']['kind']}) / pp {com['pp']['bytes_sent'] / GIB:.3f} / "
                     f"dp {com['dp']['bytes_sent'] / GIB:.2f}")
    if "card" in result:
        verdict = "fits" if result["fits"] else "DOES NOT FIT"
        lines.append(f"peak per device {result['peak_device_bytes'] / GIB:.2f} GiB of {result['card']} "
                     f"({result['card_bytes'] / GIB:.0f} GiB): {verdict} (model state and activations; the "
                     f"runtime's workspace comes on top)")
    if "cpu_peak_rss_bytes" in result:
        opt = result["cpu_optimizer"]
        lines.append(f"CPU single process: expected peak RSS {result['cpu_peak_rss_bytes'] / 2 ** 20:,.0f} MB "
                     f"(runtime + measured CPU factors for optimizer {opt['type']}, see plan/memory.py; measured "
                     f"runs land up to ~20% above it)")
    lines += [f"note: {n}" for n in result["notes"]]
    return "\n".join(lines)

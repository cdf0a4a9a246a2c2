"""``gptlocal eval``: lm-eval's ``simple_evaluate`` over a gpt_local model directory, its results table on
stdout and its results JSON written atomically (lm-eval's own CLI route is ``lm_eval --model gptlocal``)."""
import contextlib
import json
import os
import platform
import sys
import time

from ..errors import ConfigError
from ..model.loader import check_model_dir
from ..safetensors_io import atomic_write


def hub_unreachable(timeout=3.0):
    """The Hugging Face Hub's host (``HF_ENDPOINT``, default huggingface.co), if it cannot be reached within
    ``timeout`` seconds: the reason, else None."""
    import socket
    from urllib.parse import urlparse
    endpoint = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = endpoint.hostname or "huggingface.co", endpoint.port or (80 if endpoint.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as err:
        return f"{host}:{port} cannot be reached ({err.strerror or err.__class__.__name__})"
    return None


def user_offline():
    """The reason the Hugging Face libraries are offline by the user's choice (HF_HUB_OFFLINE or
    HF_DATASETS_OFFLINE set), else None."""
    if os.environ.get("HF_HUB_OFFLINE") or os.environ.get("HF_DATASETS_OFFLINE"):
        return "HF_HUB_OFFLINE is set"
    return None


def set_offline(offline):
    """The Hugging Face libraries' offline switch in this process: HF_HUB_OFFLINE in the environment (read by
    huggingface_hub and datasets when they are imported) and, where they are imported already, the module
    constants they read at each call."""
    if offline:
        os.environ["HF_HUB_OFFLINE"] = "1"
    else:
        os.environ.pop("HF_HUB_OFFLINE", None)
    for module, names in (("huggingface_hub.constants", ("HF_HUB_OFFLINE",)),
                          ("datasets.config", ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))):
        for name in names:
            if module in sys.modules:
                setattr(sys.modules[module], name, bool(offline))


def load_tasks_cache_first(manager, tasks, flag, offline):
    """The tasks' data sets from the local Hugging Face cache first, with no network call (the process is
    offline, ``set_offline``, from the start of ``run_eval``): where every one is there, the run stays offline and
    never asks the Hub. Only where one is not (and the user did not set ``offline``) is the Hub asked: unreachable
    within 3 s, one ConfigError naming the tasks and the reason; reachable, the process goes online and lm-eval
    downloads it. Returns the reason the run is offline, or None (online)."""
    try:
        manager.load(tasks)
        return offline or "the run reads the local cache only (it held every task's data set)"
    except (ConnectionError, OSError) as err:
        if not _is_network_error(err):
            raise
        missing = err
    unreachable = offline or hub_unreachable()
    if unreachable:
        raise _missing_data_set(flag, f"the Hub is offline here: {unreachable}", missing)
    set_offline(False)
    return None


def _lm_eval():
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
        from lm_eval.utils import handle_non_serializable, make_table
    except ImportError as err:
        raise ConfigError(f"gptlocal eval needs lm-evaluation-harness ({err}); install it with "
                          f"pip install 'mindformers-gptlocal[eval]'.") from None
    return lm_eval, TaskManager, handle_non_serializable, make_table


@contextlib.contextmanager
def env_info_without_torch():
    """While it lasts, ``simple_evaluate``'s ``add_env_info`` in a process without torch records the platform and
    MindSpore's version as ``pretty_env_info`` instead of importing torch for ``torch.utils.collect_env`` (~230 MB
    of RSS and ~3 s at the end of every run, for an eval that never touches torch). With torch loaded, lm-eval's
    own. The other keys (lm_eval/transformers versions, git hash) are lm-eval's either way."""
    import lm_eval.evaluator
    import lm_eval.utils
    original = lm_eval.evaluator.add_env_info

    def add_env_info(storage):
        if "torch" in sys.modules:
            return original(storage)
        saved, lm_eval.utils.is_torch_available = lm_eval.utils.is_torch_available, lambda: False
        try:
            original(storage)
        finally:
            lm_eval.utils.is_torch_available = saved
        import mindspore
        storage["pretty_env_info"] = (f"gpt_local on MindSpore {mindspore.__version__} (torch not imported)\n"
                                      f"OS: {platform.platform()}\nPython version: {sys.version}\n"
                                      f"CPU: {platform.processor() or platform.machine()}")
    lm_eval.evaluator.add_env_info = add_env_info
    try:
        yield
    finally:
        lm_eval.evaluator.add_env_info = original


@contextlib.contextmanager
def _network_errors_named(tasks, offline):
    """A task's data set that neither the local cache nor the network gives: one ConfigError."""
    try:
        yield
    except (ConnectionError, OSError) as err:  # datasets' ConnectionError, huggingface_hub's offline errors
        if not _is_network_error(err):
            raise
        where = f"the Hub is offline here: {offline}" if offline else "the Hub could not be reached"
        raise _missing_data_set(tasks, where, err) from None


def _missing_data_set(tasks, where, err):
    return ConfigError(f"--tasks {tasks}: a task's data set is not in the local Hugging Face cache and {where} "
                       f"({str(err).splitlines()[0]}); run it once where huggingface.co is reachable (the cache is "
                       f"reused), or use local tasks (--include-path DIR).")


def _is_network_error(err):
    names = {cls.__name__ for cls in type(err).__mro__}
    return bool(names & {"ConnectionError", "LocalEntryNotFoundError", "OfflineModeIsEnabled", "HfHubHTTPError",
                         "Timeout", "ConnectTimeout"})


def task_manager(TaskManager, include_path, tasks):  # pylint: disable=invalid-name  (lm-eval's class)
    """lm-eval's task index for ``tasks``: the ``include_path`` folder's alone where it holds each of them as a task
    (a YAML or Python task, which names no other entry of the index), else lm-eval's built-in index (~13,000 tasks,
    ~10-15 s of CPU to build) with the folder's. A local group or tag may list built-in tasks: the built-in index."""
    if include_path and tasks:
        local = TaskManager(include_path=include_path, include_defaults=False)
        if set(tasks) <= set(local.all_subtasks):
            return local
    return TaskManager(include_path=include_path)


def run_eval(options, own_process=False):
    """Evaluate ``options.model`` on ``options.tasks``; print the table, write ``options.output_path``.
    ``own_process``: the `gptlocal eval` command's own process (the console script), which imports the tokenizer's
    transformers without torch (``harness.import_transformers_without_torch``)."""
    offline = user_offline()
    set_offline(True)  # the local cache first: no network call unless a task's data set is not there
    lm_eval, TaskManager, handle_non_serializable, make_table = _lm_eval()
    if options.include_path and not os.path.isdir(options.include_path):
        raise ConfigError(f"--include-path {options.include_path} is not a folder of task YAMLs.")
    if options.output_path and os.path.isdir(options.output_path):
        raise ConfigError(f"--out {options.output_path} is a folder; give a file name, e.g. --out results.json.")
    check_model_dir(str(options.model), "--model", tokenizer=False)  # before lm-eval's task index (~15 s)
    tasks = [t.strip() for t in options.tasks.split(",") if t.strip()]
    manager = task_manager(TaskManager, options.include_path, tasks)
    unknown = [t for t in tasks if not manager.match_tasks([t])]
    if not tasks or unknown:
        raise ConfigError(f"--tasks: unknown task '{(unknown or [''])[0]}'; name lm-eval tasks (lm_eval ls tasks) "
                          f"or add --include-path DIR holding the task YAML.")
    # the tasks' data from the local cache, before the model loads (a missing one and no Hub: one line at once)
    offline = load_tasks_cache_first(manager, tasks, options.tasks, offline)
    from .harness import GPTLocalLM, import_transformers_without_torch
    if own_process:
        import_transformers_without_torch()
    model = GPTLocalLM(pretrained=options.model, batch_size=options.batch_size, max_length=options.max_length,
                       device_target=options.device_target, seed=options.seed,
                       compile_cache=getattr(options, "compile_cache", "on"),
                       compile_cache_days=getattr(options, "compile_cache_days", None),
                       compile_cache_mb=getattr(options, "compile_cache_mb", None))
    limit = None if options.limit is None else (int(options.limit) if options.limit >= 1 else options.limit)
    start = time.perf_counter()
    with _network_errors_named(options.tasks, offline), env_info_without_torch():
        # gpt_local draws no torch numbers: no torch seed (setting one imports torch)
        results = lm_eval.simple_evaluate(model=model, tasks=tasks, num_fewshot=options.num_fewshot,
                                          limit=limit, task_manager=manager, log_samples=options.log_samples,
                                          random_seed=options.seed, numpy_random_seed=options.seed,
                                          torch_random_seed=None, fewshot_random_seed=options.seed)
    results["config"]["model"] = "gptlocal"
    results["config"]["model_args"] = f"pretrained={options.model},batch_size={options.batch_size}"
    print(f"gptlocal ({options.model}), limit: {limit}, num_fewshot: {options.num_fewshot}, "
          f"batch_size: {options.batch_size}, {time.perf_counter() - start:.1f} s")
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    if options.output_path:
        text = json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False)
        folder = os.path.dirname(os.path.abspath(options.output_path))
        os.makedirs(folder, exist_ok=True)

        def write(tmp):
            with open(tmp, "w", encoding="utf-8") as handle:
                handle.write(text)
        atomic_write(options.output_path, write)
        print(f"wrote {options.output_path}")
    return 0

"""mf/logs.py: MindFormers' log held from inside ``import mindformers`` until the checks pass, and the trainer's config
dump sent to the log; both are patches checked against the installed MindFormers like the others."""
import importlib
import os
import subprocess
import sys
import textwrap
import types

from mindformers_gptlocal.mf import logs
from mindformers_gptlocal.mf.compat import check_patch

from conftest import source_env


class LoggerWithoutLookup:
    """A MindFormers logger class that logs through a logger it keeps: replacing get_logger would hold nothing."""
    kept = None

    @classmethod
    def info(cls, msg, *args):
        cls.kept.info(msg, *args)


def test_the_log_patches_check_out_here_and_a_moved_target_fails_by_name():
    for patch in logs.PATCHES:
        assert check_patch(patch) == [], patch.name
    real = importlib.import_module(logs.LOGGER)
    stand_in = types.ModuleType(logs.LOGGER)
    stand_in.__dict__.update({k: v for k, v in vars(real).items() if k != "get_logger"})
    problems = check_patch(logs.BY_NAME["MindFormers' log held until the checks pass"],
                           lambda name: stand_in if name == logs.LOGGER else importlib.import_module(name))
    assert problems and "get_logger" in problems[0], problems
    stand_in.get_logger = real.get_logger
    stand_in.logger = LoggerWithoutLookup
    problems = check_patch(logs.BY_NAME["MindFormers' log held until the checks pass"],
                           lambda name: stand_in if name == logs.LOGGER else importlib.import_module(name))
    assert problems and "get_logger()" in problems[-1], problems


def test_held_from_inside_import_mindformers_and_nothing_written_when_dropped(tmp_path):
    """A fresh process: everything MindFormers logs, from its import on, is held (./output/log is not created); after
    ``drop`` its logger is its own again; after ``release`` the held records reach it."""
    script = textwrap.dedent("""
        import os, sys
        assert "mindformers" not in sys.modules
        from mindformers_gptlocal.mf.logs import HeldLog
        held = HeldLog()
        import mindformers
        from mindformers.tools.logger import logger
        module = sys.modules["mindformers.tools.logger"]  # the package exports a class of that name
        logger.warning("held warning")
        assert [r.getMessage() for r in held.records][-1] == "held warning"
        assert not os.path.exists("output"), os.listdir(".")  # 1.9 logs two warnings during import mindformers
        held.drop()
        assert held.records == [] and module.get_logger is not None
        assert module.get_logger().name.startswith("mindformers")
        again = HeldLog()  # MindFormers loaded now: held from here
        logger.info("second")
        assert [r.getMessage() for r in again.records] == ["second"]
        again.drop()
        print("OK", sorted(os.listdir(".")))
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=str(tmp_path), env=source_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "OK" in done.stdout, done.stdout[-2000:] + done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "OK ['output']"  # only the real logger's call after drop wrote


def test_config_dump_goes_to_the_log_for_the_call_only():
    modules = [importlib.import_module(name) for name in logs.CONFIG_DUMPERS]
    originals = [module.pprint for module in modules]
    with logs.config_dump_to_log(verbose=True):
        assert [module.pprint for module in modules] == originals
    with logs.config_dump_to_log():
        assert all(module.pprint is not original for module, original in zip(modules, originals))
    assert [module.pprint for module in modules] == originals


def test_the_launcher_keeps_no_copy_of_the_log_patches():
    import mindformers_gptlocal.cli.launcher as launcher
    assert launcher.HeldLog is logs.HeldLog and launcher.config_dump_to_log is logs.config_dump_to_log
    assert not hasattr(launcher, "_drop_import_log") and not hasattr(launcher, "quiet_mindformers")
    assert os.path.basename(logs.__file__) == "logs.py"


def test_importing_the_model_class_or_preparing_data_prints_nothing_of_mindformers_and_writes_no_log(tmp_path):
    """`from mindformers_gptlocal import GPTLocalForCausalLM` (it imports MindFormers) and `gptlocal prepare-data`
    (its Megatron writer is MindFormers'): nothing of MindFormers' import-time log on stdout or stderr (1.9 logs two
    warnings there, on stdout), no ./output/log in the caller's folder; a script's stdout is its own."""
    script = "from mindformers_gptlocal import GPTLocalForCausalLM\nprint('mine', GPTLocalForCausalLM.__name__)\n"
    done = subprocess.run([sys.executable, "-c", script], cwd=str(tmp_path), env=source_env(), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == "mine GPTLocalForCausalLM\n", done.stdout
    assert "WARNING" not in done.stderr and "hyper_parallel" not in done.stderr, done.stderr[-2000:]
    assert os.listdir(tmp_path) == []
    data = subprocess.run([sys.executable, "-m", "mindformers_gptlocal.cli", "prepare-data", "--max-bytes", "20000",
                           "--vocab-size", "300", "--seq-length", "32", "--out", "data/small"], cwd=str(tmp_path),
                          env=source_env(), capture_output=True, text=True, timeout=300)
    assert data.returncode == 0, data.stderr[-3000:]
    assert data.stdout.startswith("{") and "WARNING" not in data.stdout + data.stderr, data.stdout + data.stderr
    assert os.listdir(tmp_path) == ["data"]

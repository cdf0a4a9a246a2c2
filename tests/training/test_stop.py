"""training/stop.py and the stop line's resume command, without training (tests/e2e/test_stop_signals.py trains)."""
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import source_env


@pytest.mark.parametrize("argv, env, expected", [
    (["/venv/bin/gptlocal", "run", "--config", "a b.yaml", "--resume_training", "False", "--seed", "1"], {},
     "gptlocal run --config 'a b.yaml' --seed 1 --resume_training True"),
    (["/x/mindformers_gptlocal/cli/__main__.py", "run", "--config", "r.yaml", "--resume-training=x.safetensors"], {},
     "gptlocal run --config r.yaml --resume_training True"),
    (["run_scripts/run_mindformer.py", "--config", "r.yaml"], {},
     "python run_scripts/run_mindformer.py --config r.yaml --resume_training True"),
    (["run_scripts/run_mindformer.py", "--config", "r.yaml", "--use_parallel", "True"], {"MS_ROLE": "MS_WORKER"},
     "the same launch line (e.g. bash run_scripts/run_msrun.sh ...) with --resume_training True"),
    (["ipython"], {}, "the same command with --resume_training True"),
])
def test_the_resume_command_is_this_command_with_resume_training(monkeypatch, argv, env, expected):
    from mindformers_gptlocal.mf.checkpoint_monitor import resume_command
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.delenv("MS_ROLE", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert resume_command() == expected


def _python(script):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=source_env(), capture_output=True,
                          text=True, timeout=120)


def test_held_signals_outside_training_end_the_process_at_once_with_their_status():
    """Before training (loading, compiling) a held SIGINT ends the process as it would without gpt_local: at once,
    130, one line."""
    done = _python("""
        import os, signal, time
        from mindformers_gptlocal.training import stop
        stop.hold()
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(10)
        print("not reached")
    """)
    assert done.returncode == 130, done.stdout + done.stderr
    assert done.stderr.strip() == "[gptlocal] SIGINT: stopped" and "not reached" not in done.stdout


def test_armed_the_first_signal_asks_and_the_second_ends_at_once():
    done = _python("""
        import os, signal, time
        from mindformers_gptlocal.training import stop
        stop.hold()
        assert stop.arm()
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.time() + 10
        while not stop.requested() and time.time() < deadline:
            time.sleep(0.01)
        print("asked", stop.requested(), flush=True)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(10)
        print("not reached")
    """)
    assert done.returncode == 130, done.stdout + done.stderr
    assert done.stdout == "asked 15\n", done.stdout
    assert "SIGTERM: finishing the current step" in done.stderr and "SIGINT again: stopping now" in done.stderr


def test_a_forked_child_gets_the_signals_back():
    """A data worker forked while the signals are held is a normal process: SIGTERM ends it."""
    done = _python("""
        import os, signal, time
        from mindformers_gptlocal.training import stop
        stop.hold()
        pid = os.fork()
        if pid == 0:
            time.sleep(30)
            os._exit(0)
        time.sleep(0.3)
        os.kill(pid, signal.SIGTERM)
        _, status = os.waitpid(pid, 0)
        print("child", os.WTERMSIG(status) if os.WIFSIGNALED(status) else "exited")
        stop.release()
        assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    """)
    assert done.returncode == 0 and done.stdout == "child 15\n", done.stdout + done.stderr


def test_release_undoes_hold_in_this_process():
    import signal
    from mindformers_gptlocal.training import stop
    before = signal.getsignal(signal.SIGTERM)
    stop.hold()
    try:
        assert signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    finally:
        stop.release()
    assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    assert signal.getsignal(signal.SIGTERM) == before and stop.STATE.watcher is None


def test_the_watcher_takes_only_sigint_and_sigterm():
    """A wait that returns a number that is neither SIGINT nor SIGTERM (a random value was seen once under MindSpore
    2.7.2, no signal sent) does not end the process; a real SIGTERM after it still does."""
    done = _python("""
        import os, signal, time, types
        from mindformers_gptlocal.training import stop
        real = signal.sigtimedwait
        answers = [types.SimpleNamespace(si_signo=1601370272)]
        signal.sigtimedwait = lambda signals, timeout: answers.pop() if answers else real(signals, timeout)
        stop.hold()
        time.sleep(1.5)
        print("alive", flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)
        print("not reached")
    """)
    assert done.returncode == 143 and done.stdout == "alive\n", done.stdout + done.stderr
    assert done.stderr.strip() == "[gptlocal] SIGTERM: stopped"

"""``gptlocal quickstart``'s two runs at once (cli/quickstart.py ``together``): the console shows them in the order
given, each one's lines after the one before it ended, and a run that fails stops the other and is the one named.
(The whole quickstart runs, and is checked, in tests/e2e/test_readme_tour.py.)"""
import time

import pytest

from conftest import source_env, tiny_yaml


def test_two_runs_shown_in_order_and_a_failing_run_stops_the_other(corpus, tmp_path, capsys, monkeypatch):
    from mindformers_gptlocal.cli.quickstart import together
    monkeypatch.setenv("PYTHONPATH", source_env()["PYTHONPATH"])  # the runs import this working tree
    monkeypatch.setenv("GLOG_v", "3")
    # a training run that would take minutes (many steps), then one that fails at its YAML, after the first
    long = tiny_yaml(tmp_path, corpus=corpus, runner_config__epochs=200)
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {bad: 1}\n", encoding="utf-8")
    started = time.monotonic()
    with pytest.raises(SystemExit) as failed:
        together(("== 1 train", long, str(tmp_path / "train.log"), ()),
                 ("== 2 broken", str(bad), str(tmp_path / "bad.log"), ()))
    assert time.monotonic() - started < 120  # the training run was stopped, not waited for
    assert str(bad) in str(failed.value) and "failed (exit 2)" in str(failed.value), failed.value
    out = capsys.readouterr().out
    first, second = out.index("== 1 train\n"), out.index("== 2 broken\n")
    error = out.index("gptlocal run: error: --config " + str(bad))
    assert first < second < error, out  # the failing run's lines held until the first run ended
    assert "[gptlocal] SIGTERM" in out[first:second], out  # the training run stopped on the quickstart's SIGTERM
    with open(tmp_path / "train.log", encoding="utf-8") as handle:
        assert "SIGTERM" in handle.read()  # everything the run printed is in its log
    with open(tmp_path / "bad.log", encoding="utf-8") as handle:
        assert "gptlocal run: error:" in handle.read()

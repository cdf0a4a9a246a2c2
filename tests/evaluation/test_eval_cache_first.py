"""``gptlocal eval`` reads the local Hugging Face cache first (``evaluation/run.py`` ``load_tasks_cache_first``):
where every task's data set is cached the run stays offline and never asks the Hub; only a missing one makes it
ask (unreachable: one line naming the reason; reachable: the process goes online for lm-eval's download). lm-eval's
TaskManager is stood in for by ``Manager``, whose ``load`` reads the offline switch as the data-set loader does."""
import pytest

from mindformers_gptlocal.errors import ConfigError
from mindformers_gptlocal.evaluation import run


class Manager:
    """``load`` succeeds where the data sets are cached or the process is online, else raises what ``datasets``
    raises offline; records the offline switch at each call."""

    def __init__(self, cached):
        self.cached = cached
        self.calls = []

    def load(self, tasks):
        from huggingface_hub import constants
        self.calls.append(constants.HF_HUB_OFFLINE)
        if constants.HF_HUB_OFFLINE and not self.cached:
            raise ConnectionError("Couldn't reach the Hugging Face Hub for dataset 'org/data': offline mode")
        return {"tasks": tasks}


@pytest.fixture
def probes(monkeypatch):
    """The process online as a user leaves it (restored afterwards); returns the list of Hub probes made, each
    answering what ``answer[0]`` says (None: reachable)."""
    import sys
    from huggingface_hub import constants
    if "datasets.config" in sys.modules:  # set_offline sets its switches too: restored afterwards
        for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
            monkeypatch.setattr(sys.modules["datasets.config"], name, getattr(sys.modules["datasets.config"], name))
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(name, "")  # recorded, so that set_offline's writes are undone afterwards
        monkeypatch.delenv(name)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    made, answer = [], [None]
    monkeypatch.setattr(run, "hub_unreachable", lambda: made.append(1) or answer[0])
    return made, answer


def test_cached_data_sets_never_ask_the_hub(probes):
    from huggingface_hub import constants
    made, _ = probes
    offline = run.user_offline()
    run.set_offline(True)  # as run_eval starts
    manager = Manager(cached=True)
    reason = run.load_tasks_cache_first(manager, ["t"], "t", offline)
    assert manager.calls == [True] and made == []  # read offline, no probe
    assert reason and constants.HF_HUB_OFFLINE  # and the run stays offline


def test_a_missing_data_set_asks_the_hub_then_goes_online(probes):
    import os
    from huggingface_hub import constants
    made, _ = probes
    run.set_offline(True)
    manager = Manager(cached=False)
    assert run.load_tasks_cache_first(manager, ["t"], "t", None) is None
    assert manager.calls == [True] and made == [1]
    assert not constants.HF_HUB_OFFLINE and "HF_HUB_OFFLINE" not in os.environ  # lm-eval may download


def test_a_missing_data_set_and_no_hub_is_one_line(probes):
    made, answer = probes
    answer[0] = "127.0.0.1:9 cannot be reached (Connection refused)"
    run.set_offline(True)
    with pytest.raises(ConfigError) as caught:
        run.load_tasks_cache_first(Manager(cached=False), ["t"], "t", None)
    message = str(caught.value)
    assert "--tasks t: a task's data set is not in the local Hugging Face cache" in message
    assert "127.0.0.1:9 cannot be reached" in message and "\n" not in message and made == [1]


def test_offline_by_the_user_never_asks_the_hub(probes, monkeypatch):
    made, _ = probes
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    offline = run.user_offline()
    run.set_offline(True)
    with pytest.raises(ConfigError, match="the Hub is offline here: HF_HUB_OFFLINE is set"):
        run.load_tasks_cache_first(Manager(cached=False), ["t"], "t", offline)
    assert made == []

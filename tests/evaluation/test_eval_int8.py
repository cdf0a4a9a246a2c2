"""lm-eval's ``gptlocal`` model on an int8 model directory (``gptlocal quantize``): log-likelihoods near the float
model's (int8 tolerance) and equal to the int8 model's own forward."""
import numpy as np
import pytest

pytest.importorskip("lm_eval")

from conftest import save_tiny_base  # noqa: E402


def test_int8_directory_scores_near_the_float_model(tmp_path, corpus):
    import mindspore as ms
    from lm_eval.api.instance import Instance
    from mindformers_gptlocal.evaluation.harness import GPTLocalLM
    from mindformers_gptlocal.quantize import quantize_model
    base = save_tiny_base(tmp_path / "fp32", corpus, 6)
    quantize_model(base, str(tmp_path / "int8"), "int8", log=lambda line: None)
    requests = [Instance("loglikelihood", {}, (f"def f{i}(x):\n    return", " x + 1"), i) for i in range(3)]
    mode = ms.get_context("mode")
    try:
        scores = {}
        for name in ("fp32", "int8"):
            lm = GPTLocalLM(pretrained=str(tmp_path / name), batch_size=4, progress=False)
            scores[name] = np.array([value for value, _ in lm.loglikelihood(requests)])
        assert lm.model.head_int8 is not None
    finally:
        ms.set_context(mode=mode)
    assert np.all(np.isfinite(scores["int8"]))
    assert np.abs(scores["int8"] - scores["fp32"]).max() <= 0.02 * np.abs(scores["fp32"]).max() + 0.05
    assert np.abs(scores["int8"] - scores["fp32"]).max() > 0

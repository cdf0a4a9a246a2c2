"""A model directory with compute_dtype bfloat16 evaluated on CPU: lm-eval's ``gptlocal`` model loads it and its
compiled scoring graph gives the bf16 model's own log-probabilities (the bf16 GEMM kernel), close to the float32
model's and not equal to them."""
import numpy as np
import pytest

pytest.importorskip("lm_eval")

from conftest import save_tiny_base  # noqa: E402


def _log_probs(model, row):
    import mindspore as ms
    logits = model(ms.Tensor(np.array([row[:-1]], np.int32))).asnumpy()[0].astype(np.float64)
    logits -= logits.max(-1, keepdims=True)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return log_probs[np.arange(len(row) - 1), row[1:]]


def test_bf16_directory_scores(tmp_path, corpus):
    import mindspore as ms
    from mindformers_gptlocal import GPTLocalForCausalLM
    from mindformers_gptlocal.evaluation.harness import GPTLocalLM
    folder = save_tiny_base(tmp_path / "bf16", corpus, 0, compute_dtype="bfloat16")
    mode = ms.get_context("mode")
    try:
        lm = GPTLocalLM(pretrained=folder, batch_size=2, progress=False)
        assert lm.config.compute_dtype == "bfloat16" and lm.model.head_gemm.precision == "bfloat16"
        for param in lm.model.get_parameters():  # sharpen: differences show at bf16's size
            if "norm" not in param.name:
                param.set_data(ms.Tensor(param.asnumpy() * 8.0))
        rows = [[3, 40, 7, 99, 12, 5], [8, 2, 77]]
        picked = lm._score(rows)[0]  # pylint: disable=protected-access
        fp32 = GPTLocalForCausalLM.from_pretrained(folder, compute_dtype="float32")
        fp32.set_train(False)
        # by name (the harness's scoring Cell prefixes them "lm."; an inference build has head_table too); its
        # Linears are bf16 Parameters: widened exactly
        sources = {param.name.removeprefix("lm."): param for param in lm.model.get_parameters()}
        for param in fp32.get_parameters():
            param.set_data(ms.Tensor(sources[param.name].asnumpy().astype(np.float32)))
        for index, row in enumerate(rows):
            got = picked[index, :len(row) - 1]
            np.testing.assert_allclose(got, _log_probs(lm.model, row), atol=1e-4, rtol=0)
            full = _log_probs(fp32, row)
            assert 0 < np.abs(got - full).max() < 0.05 * max(1.0, np.abs(full).max()), (got, full)
    finally:
        ms.set_context(mode=mode)

"""Under pipeline parallel MindFormers' trainer swaps the runner_wrapper for MFPipelineWithLossScaleCell;
a YAML that chose a gpt_local wrapper keeps the CPU/GPU-safe GPTLocalPipelineWithLossScaleCell."""
from types import SimpleNamespace

import mindformers_gptlocal  # noqa: F401  (installs the hook)
from mindformers.trainer.base_trainer import BaseTrainer
from mindformers.tools.register import MindFormerRegister, MindFormerModuleType
from mindformers.wrapper.wrapper import MFPipelineWithLossScaleCell

from mindformers_gptlocal.mf.wrapper import GPTLocalPipelineWithLossScaleCell


def trainer_with(wrapper_type):
    wrapper = SimpleNamespace(type=wrapper_type)
    config = SimpleNamespace(runner_wrapper=wrapper, parallel_config=SimpleNamespace(micro_batch_num=4),
                             calculate_per_token_loss=False)
    return SimpleNamespace(config=config)


def test_gptlocal_wrapper_survives_the_pipeline_reset_and_gets_micro_batches():
    for chosen in ("GPTLocalTrainOneStepCell", "GPTLocalPipelineWithLossScaleCell"):
        trainer = trainer_with(chosen)
        BaseTrainer._reset_wrapper_for_pipeline_parallel(trainer)
        assert trainer.config.runner_wrapper.type == "GPTLocalPipelineWithLossScaleCell"
        assert trainer.config.runner_wrapper.micro_batch_num == 4
    trainer = trainer_with("GPTLocalTrainOneStepCell")
    BaseTrainer._reset_wrapper_for_grad_accu(trainer, 3)
    assert trainer.config.runner_wrapper.type == "GPTLocalPipelineWithLossScaleCell"
    assert trainer.config.runner_wrapper.micro_batch_num == 3
    trainer = trainer_with("MFTrainOneStepCell")  # other wrappers: MindFormers' own behaviour
    BaseTrainer._reset_wrapper_for_pipeline_parallel(trainer)
    assert trainer.config.runner_wrapper.type == "MFPipelineWithLossScaleCell"
    registered = MindFormerRegister.get_cls(MindFormerModuleType.WRAPPER, "GPTLocalPipelineWithLossScaleCell")
    assert registered is GPTLocalPipelineWithLossScaleCell and issubclass(registered, MFPipelineWithLossScaleCell)

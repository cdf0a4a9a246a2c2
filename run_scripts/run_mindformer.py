"""MindFormers' run_mindformer.py flags for pip users (the mindformers wheel ships no launcher).

    python run_scripts/run_mindformer.py --config model_configs/pretrain_gpt_local_tiny_cpu.yaml --run_mode train
"""
import sys

from mindformers_gptlocal.training import stop

if __name__ == "__main__":
    stop.hold()  # SIGINT/SIGTERM stop training safely; taken before MindSpore starts (training/stop.py)
    from mindformers_gptlocal.cli.launcher import main
    sys.exit(main())

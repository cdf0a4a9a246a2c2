"""gpt_local's own CPU kernels: C++ sources shipped as package data, built at first use (``build.py``) and
called through MindSpore's AOT ``ops.Custom`` (``attention.py``: the fused causal attention; ``kv_write.py``: the
KV cache's in-place write; ``norm_gelu.py``: LayerNorm and bias + GeLU; ``rms_swiglu.py``: RMSNorm and SwiGLU;
``linear.py``: Linear's GEMM; ``lora_dropout.py``: LoRA's input dropout). Which op runs which of them is decided in
one place, ``provider.py``, from the model's ``model_config.cpu_kernels``."""

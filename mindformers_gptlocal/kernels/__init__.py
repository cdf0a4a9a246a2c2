"""gpt_local's own CPU kernels: C++ sources shipped as package data, built at first use (``build.py``) and
called through MindSpore's AOT ``ops.Custom`` (``attention.py``: the fused causal attention; ``model/kv_write.py``: the KV cache's in-place write;
``norm_gelu.py``, ``head_loss.py``; ``rms_swiglu.py``: RMSNorm and SwiGLU; ``linear.py``: Linear's GEMM)."""

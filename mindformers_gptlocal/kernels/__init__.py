"""gpt_local's own CPU kernels: C++ sources shipped as package data, built at first use (``build.py``) and called
through MindSpore's AOT ``ops.Custom``.

Each kernel is one entry of the kernel table (``table.py``: its tensors' dtypes and dims, its options struct, its
symbol, its source); its computation is a typed C++ core (``int gptlocal_core_<name>(const float *x, ...,
int64_t sizes..., const Options &)``) in one ``.cc`` file per op or small family (``cpu_attention.cc``,
``cpu_layernorm.cc``, ``cpu_linear.cc``...), sharing ``common.h`` (the worker pool, exp, GeLU, bf16 rounding, the
counter dropout's mask). The build generates from the table (``codegen.py``) the cores' declarations and options
structs (``cores.h``) and each MindSpore entry point, a thin adapter (``aot.h`` ``bind``); Python reads the same
table for the options' values, the primitives' shapes, dtypes and bprops (``aot.py``) and the build's sources and
symbols. Composite kernels (``cpu_decode_layer.cc``) call the other cores as C++ functions. The Cells
(``attention.py``, ``norm_gelu.py``, ``rms_swiglu.py``, ``linear.py``, ``linear_int8.py``, ``lora_dropout.py``,
``decode_layer.py``, ``train_step.py``, ``kv_write.py``) are what the model holds; which op runs which of them is
decided in one place, ``provider.py``, from the model's ``model_config.cpu_kernels``."""

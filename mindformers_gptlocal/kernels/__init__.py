"""gpt_local's own CPU kernels, laid out by kind (imports point down the list):

- ``provider.py``: ``KernelProvider``, the one place each op's implementation is chosen, from the model's
  ``model_config.cpu_kernels``;
- ``cells/``: the MindSpore Cells and primitives the model holds, each wrapping a core (``attention.py``,
  ``norm_gelu.py``, ``rms_swiglu.py``, ``linear.py``, ``linear_int8.py``, ``decode_layer.py``, ``train_layer.py``...);
- ``abi/``: the ABI and build machinery: the kernel table (``spec.py``, ``table.py``: each kernel's tensors, dtypes,
  dims, options struct, symbol and source; ``layer_table.py``: a decoder layer's parameters), the codes C++ shares
  (``codes.py``), the generated ``cores.h`` and adapters (``codegen.py``), the build at first use (``build.py``), an
  entry as a MindSpore AOT ``ops.Custom`` primitive (``aot.py``);
- ``csrc/``: the typed C++ cores (``int gptlocal_core_<name>(const float *x, ..., int64_t sizes..., const Options
  &)``), one ``.cc`` per op or small family, sharing ``common.h``; shipped as package data. Composite kernels
  (``cpu_decode_layer.cc``) call the other cores as C++ functions."""

"""Each kernel op's arguments beyond its tensors, one small typed struct per op (llm.c's typed kernel signatures).

MindSpore's AOT ``ops.Custom`` hands a kernel only tensors, so an op's scalars travel as its last input, a float32
vector, which the C++ side reads as the struct of the same name in ``common.h`` (``args_at``: a vector of another
length fails the call). The fields here and there are the same, in the same order (tests/kernels/test_args.py reads
common.h and compares). ``AttentionArgs(scale=..., ...).tensor()`` is that input.
"""
import collections

import numpy as np
from mindspore import Tensor


def _struct(name, fields, doc):
    base = collections.namedtuple(name, fields)

    def tensor(self):
        """The op's argument input: its fields as a float32 vector, in order."""
        return Tensor(np.array([float(value) for value in self], np.float32))

    return type(name, (base,), {"__slots__": (), "__doc__": doc, "tensor": tensor})


AttentionArgs = _struct("AttentionArgs", "scale dropout_scale dropout_mode threads query_block key_block",
                        "The fused attention's (cpu_attention.cc): dropout_mode 0 none, 1 keep where the counter "
                        "dropout's bits agree, 2 where they differ.")
LayerNormArgs = _struct("LayerNormArgs", "epsilon threads", "LayerNorm's (cpu_norm_gelu.cc).")
BiasGeluArgs = _struct("BiasGeluArgs", "form threads", "Bias + GeLU's (cpu_norm_gelu.cc): form 0 tanh, 1 quick.")
RMSNormArgs = _struct("RMSNormArgs", "epsilon threads", "RMSNorm's (cpu_rms_swiglu.cc).")
SwiGLUArgs = _struct("SwiGLUArgs", "threads", "SwiGLU's silu(gate) * up (cpu_rms_swiglu.cc).")
LinearArgs = _struct("LinearArgs", "threads precision",
                     "Linear's GEMM (cpu_linear.cc): precision 0 float32, 1 bfloat16 x bfloat16 -> float32 (oneDNN's "
                     "dnnl_gemm_bf16bf16f32), 2 the same numbers emulated (inputs rounded to bfloat16, float32 sgemm).")
LinearGeluArgs = _struct("LinearGeluArgs", "threads precision form",
                         "Linear's GEMM with the bias + GeLU epilogue (cpu_linear.cc): LinearArgs' fields, then "
                         "BiasGeluArgs' form (0 tanh, 1 quick).")
LoRADropoutArgs = _struct("LoRADropoutArgs", "scale mode threads",
                          "LoRA's input dropout (lora_dropout.cc): scale 1 / (1 - p); mode 1 keep where the bits "
                          "agree, 2 where they differ.")
Int8LinearArgs = _struct("Int8LinearArgs", "threads", "An int8 model's Linear (cpu_linear_int8.cc).")
STRUCTS = (AttentionArgs, LayerNormArgs, BiasGeluArgs, RMSNormArgs, SwiGLUArgs, LinearArgs, LoRADropoutArgs)
DecodeLayerArgs = _struct("DecodeLayerArgs", "epsilon scale form threads precision",
                          "The decode step's layer (cpu_decode_layer.cc): the LayerNorms' epsilon, attention's "
                          "scale, form 0 tanh GeLU, 1 quick, and its GEMMs' precision (LinearArgs').")
AdamWArgs = _struct("AdamWArgs", "threads", "AdamW's in-place update (cpu_train_step.cc).")
SquareSumArgs = _struct("SquareSumArgs", "threads", "A gradient's sum of squares (cpu_train_step.cc).")
STRUCTS += (DecodeLayerArgs, Int8LinearArgs, LinearGeluArgs, AdamWArgs, SquareSumArgs)

"""``CPURowsBF16``: the token lookup of a bf16 model built for inference (``cpu_decoder.cc``'s
``gptlocal_rows_bf16_fwd``): the rows of a bfloat16 table widened to float32, exactly.

Such a model (``KernelProvider.bf16_weights``) holds its token table once, as bfloat16: the tied head's GEMM takes it
as held and the lookup reads it through this kernel (MindSpore's CPU Gather has no bfloat16). Inference only (no
bprop); an id outside the table fails the call.
"""
from ..abi.aot import KernelCell
from ..abi.table import KERNELS


class CPURowsBF16(KernelCell):
    """``construct(table [V, H] bfloat16, ids [..] int32)`` -> float32 [.., H]: ``table``'s rows ``ids``."""

    def __init__(self, library_path, threads=None):
        super().__init__(library_path, KERNELS["gptlocal_rows_bf16_fwd"], threads=threads)

    def construct(self, table, ids):
        return self.op(table, ids, self.config)

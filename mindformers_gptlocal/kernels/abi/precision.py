"""Which bf16 GEMM the library runs on this CPU, as the ``precision`` code of the kernels' options: a query of the
built library (``gptlocal_linear_bf16_native``, under its ISA cap ``cpu_kernels.isa``), read by the Cells and the
native runner alike."""
import ctypes
import sys


PRECISIONS = ("float32", "bfloat16")
_EMULATED = set()  # library paths whose emulation was said


def bf16_native(library_path):
    """True where the library's bf16 GEMM runs oneDNN's (oneDNN's ISA here, under the library's ISA cap
    ``cpu_kernels.isa``, runs its bf16 kernels: avx512_core on); False where it emulates it, after one stderr line
    per process saying so."""
    native = bool(ctypes.CDLL(library_path).gptlocal_linear_bf16_native())
    if not native and library_path not in _EMULATED:
        _EMULATED.add(library_path)
        sys.stderr.write("gptlocal: oneDNN has no fast bfloat16 GEMM for this CPU (it needs AVX-512) or under "
                         "cpu_kernels.isa; compute_dtype bfloat16 is emulated (the same bf16 rounding, float32 "
                         "arithmetic: the same results, slower than a native bf16 GEMM).\n")
        sys.stderr.flush()
    return native


def precision_code(library_path, precision, emulate=False):
    """``LinearOptions.precision`` for ``precision`` ("float32" or "bfloat16"): 0, 1 (oneDNN's bf16 GEMM) or 2 (its
    emulation: forced by ``emulate``, or this CPU has no bf16 GEMM)."""
    if precision not in PRECISIONS:
        raise ValueError(f"CPULinearGEMM precision {precision!r}: one of {', '.join(PRECISIONS)}")
    if precision == "bfloat16":
        return 2 if emulate or not bf16_native(library_path) else 1
    return 0

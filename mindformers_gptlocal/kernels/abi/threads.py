"""The threads a kernel runs (``kernel_threads``): a leaf the options structs (``spec.py``: a ``threads`` field left
None) and the Cells (``aot.py``) both read, so the ABI machinery imports in one direction."""
import os


def kernel_threads():
    """The threads a kernel runs: MindSpore's ``runtime_num_threads``, at most the CPUs this process may use."""
    import mindspore as ms  # pylint: disable=import-outside-toplevel  (spec.py and codegen load without MindSpore)
    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    runtime = ms.get_context("runtime_num_threads") or available
    return max(1, min(int(runtime), available))

"""benchmarks/_common.Phases: each phase's own peak RSS in one process (VmHWM reset at the phase's start), as the
generate and Llama-style benchmarks report it per phase and per job."""
import os
import sys

import numpy as np
import pytest

from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import _common as C  # noqa: E402

MB = 2 ** 20


@pytest.mark.skipif(not C.reset_peak(), reason="this kernel does not reset VmHWM through /proc/self/clear_refs")
def test_each_phase_reports_its_own_peak_not_the_process_peak():
    phases = C.Phases()
    with phases("big"):
        block = np.ones(96 * MB // 8)  # 96 MB touched, then freed
        del block
    with phases("small"):
        block = np.ones(8 * MB // 8)
        del block
    # the big phase saw its 96 MB on top of what the process held after it; the small one did not
    assert phases.peaks["big"] - phases.after["big"] > 88
    assert phases.peaks["small"] - phases.after["small"] < 30
    assert phases.peaks["big"] - phases.peaks["small"] > 60
    assert phases.peak() == phases.peaks["big"] and phases.peak(("small",)) == phases.peaks["small"]
    assert phases.resets
    assert C.vm_hwm_mb() < phases.peaks["big"] - 60  # VmHWM itself was reset: the process peak is not reported

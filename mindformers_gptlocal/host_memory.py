"""Host memory: give the heap that a graph compile freed back to the system (``malloc_trim``).

Peak RSS of a MindSpore run on CPU includes heap that is already free: the graph compile frees most of what
it allocated, glibc keeps the freed pages mapped, and the first training step then grows on top of them.
``release_freed_heap`` (glibc's ``malloc_trim(0)``) hands them back; the train-one-step wrappers call it once,
after their first compile (``mf/wrapper.py``). Measured through ``gptlocal run``, LoRA r=8 on GPT-2 small
at 2 x 256: peak RSS 3,164-3,184 -> 3,034-3,043 MB, with no cost per step (it runs once). A no-op off glibc.
Two lines of libc through ctypes: no library does this.

Not done here, measured: glibc's ``MALLOC_TRIM_THRESHOLD_=0`` (or any fixed trim/mmap threshold) lowers the
peak by another ~115 MB but returns and re-faults ~240 MB of pages every step (61,000 minor faults a step
instead of 1,000-5,000, +0.15-0.3 s of system time on a 3.4-4.8 s step). A user short of memory can set it in
the environment; README says so.
"""
import ctypes
import ctypes.util

_LIBC = []


def _glibc():
    """glibc through ctypes, or None (another libc)."""
    if not _LIBC:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.append(libc if hasattr(libc, "malloc_trim") else None)
        except OSError:
            _LIBC.append(None)
    return _LIBC[0]


def release_freed_heap():
    """Give every free page of the heap back now (malloc_trim). Returns True if memory was released."""
    libc = _glibc()
    return bool(libc is not None and libc.malloc_trim(0) == 1)

"""host_memory.release_freed_heap: freed pages inside the heap go back to the system (glibc's malloc_trim),
which is what lowers a training run's peak RSS after its graph compile."""
import subprocess
import sys

import pytest

from conftest import source_env

# 2,048 touched 64 KiB heap blocks (below glibc's mmap threshold), a small block above them, then the 128 MiB
# freed: the top-of-heap trim of free() cannot give it back (the small block sits above), malloc_trim can.
CODE = """
import ctypes
from mindformers_gptlocal.host_memory import release_freed_heap
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
def rss():
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) // 1024
blocks = [libc.malloc(65536) for _ in range(2048)]
for block in blocks:
    libc.memset(block, 1, 65536)
above = libc.malloc(1024)
for block in blocks:
    libc.free(block)
before = rss()
released = release_freed_heap()
print("RESULT", released, before - rss())
"""


def _run(**env):
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, env=source_env(**env))
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT")]
    assert line, out.stdout + out.stderr
    _, released, drop = line[0].split()
    return released == "True", int(drop), out.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_release_freed_heap_returns_the_freed_pages():
    released, drop, err = _run()
    assert released and drop > 100, (drop, err)  # 128 MiB were free inside the heap

"""What every kernel module's Cells share: a kernel of the table as its AOT ``ops.Custom`` on CPU (``primitive``:
shapes, dtypes, side effects and the bprop read from ``table.py``) or as a Cell (``KernelCell``), and the library for a
float32 model; and the same C entry points and typed cores called directly on numpy arrays (``DirectCall``,
``call_core``: tests and benchmarks, outside MindSpore)."""
import ctypes
import linecache

import numpy as np
import mindspore as ms
from mindspore import nn, ops

from . import build
from .spec import DTYPES, Struct
from .table import TABLE


def custom_op(path, symbol, shape, dtype, bprop=None):
    """``symbol`` of the library at ``path`` as an AOT ``ops.Custom`` pinned to the CPU."""
    op = ops.Custom(f"{path}:{symbol}", shape, dtype, "aot", bprop=bprop)
    op.add_prim_attr("primitive_target", "CPU")
    return op


def primitive(path, kernel, bprop=None):
    """``kernel`` (a ``table.py`` entry) of the library at ``path`` as its ``ops.Custom``: its outputs' shapes and
    dtypes from the table, marked ``side_effect_mem`` where it writes an input in place, and its ``bprop`` (given,
    or ``gradient``'s where the table names the kernel's backward, else none)."""
    if bprop is None and kernel.backward:
        backward = TABLE.kernel(kernel.backward)
        bprop = gradient(kernel, backward, primitive(path, backward))
    dtypes = kernel.output_dtypes()
    dtypes = getattr(ms, dtypes) if isinstance(dtypes, str) else tuple(getattr(ms, name) for name in dtypes)
    op = custom_op(path, kernel.symbol, kernel.output_shapes, lambda *_: dtypes, bprop)
    if kernel.side_effect:
        op.add_prim_attr("side_effect_mem", True)  # writes an input (a Parameter) in place
    return op


def bprop_source(kernel, backward_kernel):
    """The source of ``kernel``'s bprop (``gradient``): one call of ``backward`` on the tensors its inputs name
    (``Kernel.gradient_plan``), then a tuple of the inputs' gradients (zeros for the others and the options), written
    out straight: MindSpore compiles a bprop per primitive instance, and a generic one (a loop over the plan, tuples
    built by concatenation) cost GPT-2 small's training graph ~8 s more to compile and ~220 MB more memory."""
    sources, grads = kernel.gradient_plan(backward_kernel)
    inputs = [t.name for t in kernel.inputs] + ["options"]
    taken = set(inputs) & {"make", "backward", "zeros_like", "bprop", "out", "dout", "found"}
    if taken:
        raise ValueError(f"{kernel.symbol} inputs {', '.join(sorted(taken))}: names its bprop uses; rename them")

    def each(name, count):
        return [name] if count == 1 else [f"{name}[{i}]" for i in range(count)]

    pool = inputs + each("out", len(kernel.outputs)) + each("dout", len(kernel.outputs))
    found = each("found", len(backward_kernel.outputs))
    result = [found[g] if g >= 0 else f"zeros_like({name})" for name, g in zip(inputs, grads)]
    return (f"def make(backward, zeros_like):\n"
            f"    def bprop({', '.join(inputs)}, out, dout):\n"
            f"        found = backward({', '.join(pool[i] for i in sources)})\n"
            f"        return {', '.join(result)},\n"
            f"    return bprop\n")


def gradient(kernel, backward_kernel, backward):
    """The bprop of ``kernel``'s primitive (``bprop_source``), ``backward`` the primitive of ``backward_kernel``.
    Compiled from its source as dataclasses compiles ``__init__``, the source kept in ``linecache`` because
    MindSpore parses a bprop from its source text."""
    source = bprop_source(kernel, backward_kernel)
    filename = f"<gptlocal bprop of {kernel.symbol}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    scope = {"__name__": __name__}  # MindSpore resolves a bprop's module by name; its names are the closure's
    exec(compile(source, filename, "exec"), scope)  # noqa: S102  (our own generated source, as above)
    return scope["make"](backward, ops.zeros_like)


class KernelCell(nn.Cell):
    """A kernel of the table as a Cell: ``construct(*tensors)`` -> its outputs (one, or a tuple), with ``config``
    its options (``kernel.options(**options)``) and ``op`` its primitive (``primitive``: the table's bprop). A
    kernel's own Cell subclasses it for its call signature."""

    def __init__(self, library_path, kernel, **options):
        super().__init__()
        self.config = kernel.options(**options).tensor()
        self.op = primitive(library_path, kernel)

    def construct(self, *tensors):
        return self.op(*tensors, self.config)


def float32_library(dtype, warn):
    """The library path, or None: silently for a dtype other than float32, after ``warn(reason)`` (once per
    reason: ``build.warn_once``) without a library."""
    if dtype != ms.float32:
        return None
    path, reason = build.library()
    if path is None:
        warn(reason)
    return path


class DirectCall:
    """A kernel entry point (a ctypes function of the library: ``ctypes.CDLL(path).gptlocal_...``) bound to numpy
    ``arrays``, its inputs then its outputs, and called with the AOT signature MindSpore uses (nparam, params, ndims,
    shapes, dtypes, stream, extra): the kernel outside MindSpore. ``call()`` returns the kernel's status (0: done).
    The arrays are kept here, so the pointers stay valid while this object lives. A uint16 array is passed as
    "bfloat16" (numpy has no bfloat16: the bits of one, as a bf16 weight is held)."""

    def __init__(self, function, arrays):
        self.function = function
        self.arrays = arrays
        count = self.count = len(arrays)
        names = ["bfloat16" if a.dtype == np.uint16 else str(a.dtype) for a in arrays]
        self.params = (ctypes.c_void_p * count)(*[a.ctypes.data for a in arrays])
        self.ndims = (ctypes.c_int * count)(*[a.ndim for a in arrays])
        self.dims = [(ctypes.c_int64 * a.ndim)(*a.shape) for a in arrays]
        self.shapes = (ctypes.POINTER(ctypes.c_int64) * count)(
            *[ctypes.cast(d, ctypes.POINTER(ctypes.c_int64)) for d in self.dims])
        self.dtypes = (ctypes.c_char_p * count)(*[name.encode() for name in names])

    def call(self):
        return self.function(self.count, self.params, self.ndims, self.shapes, self.dtypes, None, None)


def call_core(library, kernel, *arrays, options):
    """``kernel``'s typed core (``gptlocal_core_<core>`` of the ctypes library ``library``) on numpy ``arrays``, its
    tensors in the table's order (None for an optional one left out; no token), the sizes bound from their shapes as
    the entry point binds them (a ValueError where they disagree), ``options`` a value of its options struct.
    Returns the core's status (0: done). The arrays must be C-contiguous, of the table's dtypes."""
    specs = [t for t in kernel.tensors if not t.token]
    present = [(spec, a) for spec, a in zip(specs, arrays) if a is not None]
    sizes, _ = kernel.bind([a.shape for _, a in present], has_optional=len(present) == len(specs))
    for spec, array in present:
        if array.dtype != DTYPES[spec.dtype][2] or not array.flags["C_CONTIGUOUS"]:
            raise ValueError(f"{kernel.symbol} {spec}: a C-contiguous {DTYPES[spec.dtype][2].__name__} array")
    by_name = {spec.name: a for spec, a in zip(specs, arrays)}
    pointers = []
    for argument in kernel.core_arguments():  # a tensor's address, or a group's struct of them
        if isinstance(argument, Struct):
            held = argument(**{field: None if by_name[field] is None else by_name[field].ctypes.data
                               for field, _ in argument.fields if field in by_name})
            pointers.append(ctypes.byref(held))
            continue
        array = by_name[argument.name]
        pointers.append(ctypes.c_void_p(None if array is None else array.ctypes.data))
    function = getattr(library, kernel.core_symbol)
    function.restype = ctypes.c_int
    struct = options.struct()
    return function(*pointers, *[ctypes.c_int64(sizes[name]) for name in kernel.sizes], ctypes.byref(struct))

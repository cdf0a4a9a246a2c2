"""What a line of the kernel table (``table.py``) says, and what is read from it: each kernel's tensors (name, dtype,
dims), its options struct, its entry symbol, its typed core and its source file.

A kernel is one MindSpore AOT entry point (``Kernel``): MindSpore calls it with its inputs, then its options (one
int32 vector: the options struct's bytes), then its outputs. The entry point is a thin adapter the build generates
(``codegen.py``; the checks are ``aot.h``'s ``bind``): it checks each tensor's dtype and rank, binds the named dims
and checks that every other use of a name agrees, reads the options, and calls the kernel's typed core, written by
hand in the kernel's ``.cc`` file:

    int gptlocal_core_<core>(<the tensors as typed pointers, inputs const>, <the sizes, int64_t>, const <Options> &)

Tensors are written ``name: dtype[dims]``, dtype one of ``DTYPES``; a dim is a size's name (``T``), a leading group
``*T`` (first dim only: every axis before the other dims, their product the size ``T``; ``*1``: axes of one element
in all, a scalar of any rank), a number (that length) or ``_`` (any length). ``name: dtype[dims]?`` is an optional
tensor (at most one a kernel: the call has it or not; the core gets a null pointer without it);
``name: inout dtype[dims]`` an input the kernel writes in place (the primitive is then marked ``side_effect_mem``);
``name: token`` an int32 [1] output set to 0 after the core succeeds (a status for ordering, not passed to the
core). The sizes go to the core in the order their names first appear.

Nothing here imports MindSpore (``build.py`` reads the table before MindSpore is loaded); the primitives and Cells
are made in ``aot.py``.
"""
import collections
import ctypes
import re
import textwrap

import numpy as np

from .threads import kernel_threads

# dtype in the table -> (MindSpore's name, the C type of its pointer, numpy's dtype for the same bytes)
DTYPES = {"f32": ("float32", "float", np.float32), "bf16": ("bfloat16", "uint16_t", np.uint16),
          "i8": ("int8", "int8_t", np.int8), "i32": ("int32", "int32_t", np.int32)}
# option field type -> (C type, numpy's, ctypes'): all four bytes, so a struct is a vector of int32 words
FIELD_TYPES = {"int": ("int32_t", np.int32, ctypes.c_int32), "float": ("float", np.float32, ctypes.c_float)}
CORE_PREFIX = "gptlocal_core_"
_TENSOR = re.compile(r"^(\w+)\s*:\s*(?:(inout)\s+)?(?:(token)|(\w+)\[([^\]]*)\](\?)?)$")


def comment(text, width=116):
    """``text`` as C++ comment lines."""
    return ["// " + line for line in textwrap.wrap(text, width)]


class Dim(collections.namedtuple("Dim", "kind name value")):
    """One dim of a tensor: kind "size" (a name), "leading" (``*name``: the leading axes; ``*number``: leading
    axes of that many elements), "fixed" (``value``) or "any"."""

    def __str__(self):
        if self.kind == "leading":
            return f"*{self.name or self.value}"
        return {"size": self.name, "fixed": str(self.value), "any": "_"}[self.kind]


class TensorSpec(collections.namedtuple("TensorSpec", "name dtype dims optional inout token output")):
    """One tensor of a kernel (see the module docstring)."""

    @property
    def ms_dtype(self):
        return DTYPES[self.dtype][0]

    @property
    def c_type(self):
        return DTYPES[self.dtype][1]

    @property
    def const(self):
        return not (self.output or self.inout)

    def __str__(self):
        if self.token:
            return f"{self.name}: token"
        return (f"{self.name}: {'inout ' if self.inout else ''}{self.dtype}[{', '.join(map(str, self.dims))}]"
                f"{'?' if self.optional else ''}")


def _dim(text, first):
    text = text.strip()
    if text == "_":
        return Dim("any", None, None)
    if text.isdigit():
        return Dim("fixed", None, int(text))
    if text.startswith("*"):
        if not first or not (text[1:].isidentifier() or text[1:].isdigit()):
            raise ValueError(f"{text!r}: a leading group (*name, *number) is the first dim only")
        return Dim("leading", None, int(text[1:])) if text[1:].isdigit() else Dim("leading", text[1:], None)
    if not text.isidentifier():
        raise ValueError(f"{text!r} is not a dim (a name, *name, a number or _)")
    return Dim("size", text, None)


def tensors(text, output=False):
    """The ``TensorSpec`` s of a comma-separated list (commas inside brackets belong to the dims)."""
    specs = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\])?\??", text):
        item = item.strip()
        if not item:
            continue
        match = _TENSOR.match(item)
        if match is None:
            raise ValueError(f"{item!r} is not a tensor (name: dtype[dims], name: inout dtype[dims], name: token)")
        name, inout, token, dtype, dims, optional = match.groups()
        if token:
            specs.append(TensorSpec(name, "i32", (Dim("fixed", None, 1),), False, False, True, output))
            continue
        if dtype not in DTYPES:
            raise ValueError(f"{item!r}: dtype one of {', '.join(DTYPES)}")
        parts = [p for p in dims.split(",") if p.strip()] if dims.strip() else []
        specs.append(TensorSpec(name, dtype, tuple(_dim(p, i == 0) for i, p in enumerate(parts)), bool(optional),
                                bool(inout), False, output))
    return tuple(specs)


def _fields(name, fields, kinds):
    """((field, kind), ...) of "field: kind, ..." (a struct ``name``'s), each kind one of ``kinds``."""
    pairs = tuple((field.split(":")[0].strip(), field.split(":")[1].strip()) for field in fields.split(","))
    for field, kind in pairs:
        if kind not in kinds:
            raise ValueError(f"{name}.{field}: {kind!r}, one of {', '.join(kinds)}")
    return pairs


class Options:
    """An options struct: ``fields`` "name: int, name: float, ..." (the C struct's fields, in order; ints for counts and
    modes, floats for real values). ``Options(...)(threads=2, precision=0)`` is one value of it (a namedtuple:
    ``.tensor()`` the int32 vector MindSpore hands the kernel, ``.array()`` the same as numpy, ``.struct()`` as a ctypes
    Structure for a core called directly). A field named ``threads`` left None is ``threads.kernel_threads()``."""

    def __init__(self, name, fields, doc):
        self.name = name
        self.doc = doc
        self.fields = _fields(name, fields, FIELD_TYPES)
        self.words = len(self.fields)  # int32 words: every field takes four bytes
        self.value = _options_value(self)
        self.ctypes = type(name, (ctypes.Structure,), {"_fields_": [(f, FIELD_TYPES[k][2]) for f, k in self.fields]})

    def __call__(self, *args, **kwargs):
        return self.value(*args, **kwargs)

    def c_struct(self):
        lines = [*comment(self.doc), f"struct {self.name} {{"]
        lines += [f"  {FIELD_TYPES[kind][0]} {field};" for field, kind in self.fields]
        lines += ["};", f"static_assert(sizeof({self.name}) == {4 * self.words}, \"{self.name}: four bytes a field\");"]
        return "\n".join(lines)


def _options_value(options):
    base = collections.namedtuple(options.name, [field for field, _ in options.fields])

    def __new__(cls, *args, **kwargs):
        value = base.__new__(cls, *args, **kwargs)
        if "threads" in value._fields and value.threads is None:
            value = value._replace(threads=kernel_threads())
        missing = [field for field, given in zip(value._fields, value) if given is None]
        if missing:
            raise TypeError(f"{options.name}: {', '.join(missing)} not given")
        return value

    def array(self):
        """The struct's bytes as int32 words: ints as they are, floats' float32 bits."""
        words = np.zeros(options.words, np.int32)
        for i, (value, (_, kind)) in enumerate(zip(self, options.fields)):
            words[i] = np.array([value], FIELD_TYPES[kind][1]).view(np.int32)[0]
        return words

    def tensor(self):
        """The kernel's options input: ``array()`` as a MindSpore int32 Tensor."""
        from mindspore import Tensor  # pylint: disable=import-outside-toplevel
        return Tensor(self.array())

    def struct(self):
        return options.ctypes(*self)

    base.__new__.__defaults__ = (None,) * len(base._fields)  # every field must be given (__new__), but threads
    return type(options.name, (base,), {"__slots__": (), "__doc__": options.doc, "__new__": __new__,
                                        "array": array, "tensor": tensor, "struct": struct, "spec": options})


class Kernel:
    """One AOT entry point of the table: ``symbol`` in ``source``; its ``inputs`` and ``outputs`` (``tensors``
    text); ``options`` an ``Options`` (the call's last input); ``core`` the typed core's name (the C function
    ``gptlocal_core_<core>``; kernels may share one core, e.g. with and without an optional tensor); ``backward``
    the symbol of the kernel that computes its gradients (the primitive's bprop is then made from the names:
    ``aot.primitive``); ``doc`` one line; ``op`` the ``model_config.cpu_kernels`` op that chooses it
    (``provider.py`` ``OPS``), None for a kernel no model op runs yet."""

    def __init__(self, symbol, source, inputs, outputs, options, doc, core=None, backward=None, op=None, groups=()):
        self.symbol = symbol
        self.source = source
        self.op = op
        self.inputs = tensors(inputs)
        self.outputs = tensors(outputs, output=True)
        self.options = options
        self.doc = doc
        self.core = core or (symbol[len("gptlocal_"):] if symbol.startswith("gptlocal_") else symbol)
        self.backward = backward
        self.groups = tuple(groups)  # ``Struct`` s whose fields name tensors: the core takes those as one struct
        names = [t.name for t in self.tensors]
        for struct in self.groups:  # a field no tensor names: a number, zero (the core sets it from its options)
            missing = [field for field, kind in struct.fields if field not in names and "*" in kind]
            if missing:
                raise ValueError(f"{symbol}: {struct.name}'s {', '.join(missing)} not among its tensors")
        if len(set(names)) != len(names):
            raise ValueError(f"{symbol}: two tensors of one name")
        optional = [t for t in self.tensors if t.optional]
        if len(optional) > 1 or any(t.optional and t.output for t in optional):
            raise ValueError(f"{symbol}: at most one optional tensor, an input")
        bound = {d.name for t in self.tensors if not t.optional for d in t.dims if d.name}
        unbound = {d.name for t in optional for d in t.dims if d.name} - bound
        if unbound:
            raise ValueError(f"{symbol}: {', '.join(sorted(unbound))} only in the optional tensor")
        if any(d.kind == "any" for t in self.outputs for d in t.dims):
            raise ValueError(f"{symbol}: an output's dims are all known")

    @property
    def tensors(self):
        return self.inputs + self.outputs

    @property
    def core_symbol(self):
        return CORE_PREFIX + self.core

    @property
    def sizes(self):
        """The size names, in the order the core takes them (first appearance)."""
        seen = []
        for tensor in self.tensors:
            for dim in tensor.dims:
                if dim.name and dim.name not in seen:
                    seen.append(dim.name)
        return tuple(seen)

    @property
    def side_effect(self):
        return any(t.inout for t in self.inputs)

    def core_arguments(self):
        """The core's tensor arguments in order: a tensor (``TensorSpec``), or a ``groups`` struct in the place of its
        first field's tensor (its other fields' tensors left out); tokens are not passed."""
        grouped = {field: struct for struct in self.groups for field, _ in struct.fields}
        found = []
        for tensor in self.tensors:
            if tensor.token:
                continue
            struct = grouped.get(tensor.name)
            if struct is None:
                found.append(tensor)
            elif struct not in found:
                found.append(struct)
        return found

    def core_parameters(self):
        """The core's C parameters: (C declaration) for each tensor but tokens (a group's struct by const reference,
        named after it in lower case), each size, the options."""
        params = [f"const {a.name} &{a.snake_name}" if isinstance(a, Struct) else
                  f"{'const ' if a.const else ''}{a.c_type} *{a.name}" for a in self.core_arguments()]
        params += [f"int64_t {size}" for size in self.sizes]
        params.append(f"const {self.options.name} &options")
        return params

    def core_declaration(self):
        return f'extern "C" int {self.core_symbol}({", ".join(self.core_parameters())});'

    def core_types(self):
        """The core's parameter types (what two kernels of one core must agree on; the names may differ)."""
        return tuple(param.rsplit(" ", 1)[0] + ("*" if "*" in param else "") for param in self.core_parameters())

    def bind(self, shapes, has_optional=True, check=True):
        """({size: length}, {size: its axes}) from the shapes of the tensors in order (the optional one left out
        where ``has_optional`` is false; fewer shapes: the first tensors'), as the adapter binds them (``aot.h``
        ``bind``). ``check``: a ValueError where a rank, a fixed length or a second use of a name disagrees (the
        adapter fails the call there); else each name keeps its first binding (MindSpore's infer-shape, whose
        shapes may be dynamic)."""
        specs = [t for t in self.tensors if has_optional or not t.optional]
        sizes, axes = {}, {}
        for spec, shape in zip(specs, shapes):
            shape = [int(n) for n in shape]
            leading = bool(spec.dims) and spec.dims[0].kind == "leading"
            lead = len(shape) - len(spec.dims) + 1 if leading else 0
            if check and (lead < 0 or (not leading and len(shape) != len(spec.dims))):
                raise ValueError(f"{self.symbol} {spec}: rank {len(shape)}")
            groups = ([shape[:max(lead, 0)]] if leading else []) + [[n] for n in shape[max(lead, 0):]]
            for dim, group in zip(spec.dims, groups):
                length = int(np.prod(group, dtype=np.int64))
                if check and dim.value is not None and length != dim.value:
                    raise ValueError(f"{self.symbol} {spec}: {length} where {dim.value}")
                if not dim.name:
                    continue
                if check and dim.name in sizes and sizes[dim.name] != length:
                    raise ValueError(f"{self.symbol} {spec}: {dim.name} {length}, bound to {sizes[dim.name]}")
                sizes.setdefault(dim.name, length)
                axes.setdefault(dim.name, group)
        return sizes, axes

    def output_shapes(self, *input_shapes):
        """The outputs' shapes from the inputs' (MindSpore's infer-shape: the shapes as MindSpore hands them, the
        options' last). Nothing is checked here: the adapter checks at the call."""
        shapes = input_shapes[:-1]
        _, axes = self.bind(shapes, has_optional=len(shapes) == len(self.inputs), check=False)
        out = [[n for dim in spec.dims for n in ([dim.value] if dim.kind == "fixed" else axes[dim.name])]
               for spec in self.outputs]
        return out[0] if len(out) == 1 else tuple(out)

    def output_dtypes(self):
        """The outputs' MindSpore dtype names (MindSpore's infer-type)."""
        names = tuple(t.ms_dtype for t in self.outputs)
        return names[0] if len(names) == 1 else names

    def gradient_plan(self, backward):
        """How this kernel's bprop calls ``backward`` (a ``Kernel``): (sources, grads). ``sources``: for each of
        ``backward``'s inputs, its index in (this kernel's inputs, the options, its outputs, the outputs'
        gradients), found by name (an input's name, an output's, or ``d`` + an output's); ``grads``: for each input
        and the options, the index of its gradient among ``backward``'s outputs (named ``d`` + the input's name;
        outputs named ``scratch...`` are the kernel's own), or -1 (zeros). The options go to ``backward`` as its
        options."""
        pool = [t.name for t in self.inputs] + ["options"] + [t.name for t in self.outputs]
        pool += ["d" + t.name for t in self.outputs]
        if backward.options is not self.options:
            raise ValueError(f"{backward.symbol} takes {self.symbol}'s options")
        sources = []
        for spec in backward.inputs:
            if pool.count(spec.name) != 1:
                raise ValueError(f"{backward.symbol} input {spec.name}: not one of {self.symbol}'s names")
            sources.append(pool.index(spec.name))
        sources.append(pool.index("options"))
        grads = [t.name for t in backward.outputs]
        unknown = {name for name in grads if not name.startswith("scratch")} - {"d" + t.name for t in self.inputs}
        if unknown:
            raise ValueError(f"{backward.symbol} outputs {', '.join(sorted(unknown))}: not d + an input of "
                             f"{self.symbol} (nor scratch...)")
        plan = [grads.index("d" + t.name) if "d" + t.name in grads else -1 for t in self.inputs] + [-1]
        return tuple(sources), tuple(plan)


# a plain C struct's field type -> (its C declaration, ctypes' type): sizes and flags, and pointers (const unless
# "mut"), for the structs ctypes hands the library's plain C functions (``Struct``)
STRUCT_FIELDS = {"int": ("int32_t", ctypes.c_int32), "int64": ("int64_t", ctypes.c_int64),
                 "float": ("float", ctypes.c_float), "f32*": ("const float *", ctypes.c_void_p),
                 "i32*": ("const int32_t *", ctypes.c_void_p), "void*": ("const void *", ctypes.c_void_p),
                 "mut f32*": ("float *", ctypes.c_void_p), "mut i32*": ("int32_t *", ctypes.c_void_p),
                 "mut void*": ("void *", ctypes.c_void_p)}


class Struct:
    """A plain C struct a hand-written export takes by pointer (``Export``: ctypes calls it, no AOT prologue):
    ``fields`` "name: type, ..." with the types of ``STRUCT_FIELDS`` (ints, floats and pointers: the C compiler and
    ctypes lay both out by the platform's rules, so one declaration gives both). ``c_struct()`` is its C text
    (``cores.h``); ``ctypes`` its ``ctypes.Structure``, whose pointer fields take an address (an int, e.g. a numpy
    array's ``ctypes.data``) or None."""

    def __init__(self, name, fields, doc, drop=None):
        self.name = name
        self.doc = doc
        self.drop = drop  # the name of a generated function that nulls the pointers a mask names (``c_struct``)
        self.fields = _fields(name, fields, STRUCT_FIELDS)
        self.ctypes = type(name, (ctypes.Structure,), {
            "_fields_": [(f, STRUCT_FIELDS[k][1]) for f, k in self.fields], "__doc__": doc})

    @property
    def snake_name(self):
        """``TrainLayerParams`` -> ``train_layer_params`` (a core's parameter of this struct)."""
        return re.sub(r"(?<!^)([A-Z])", r"_\1", self.name).lower()

    def __call__(self, *args, **kwargs):
        """A value of the struct (its ``ctypes.Structure``)."""
        return self.ctypes(*args, **kwargs)

    def array(self, count):
        """A ctypes array of ``count`` zeroed values (null pointers)."""
        return (self.ctypes * count)()

    def c_struct(self):
        lines = [*comment(self.doc), f"struct {self.name} {{"]
        lines += [f"  {STRUCT_FIELDS[kind][0]}{'' if STRUCT_FIELDS[kind][0].endswith('*') else ' '}{field};"
                  for field, kind in self.fields]
        lines += ["};", f"static_assert(sizeof({self.name}) == {ctypes.sizeof(self.ctypes)}, \"{self.name}: the "
                  "layout ctypes gives it\");"]
        if self.drop:  # bit i of `absent`: the i-th pointer field is null (``pointer_mask``)
            pointers = [field for field, kind in self.fields if kind.endswith("*")]
            lines += [f"inline void {self.drop}({self.name} &s, int32_t absent) {{"]
            lines += [f"  if (absent & (1 << {i})) s.{field} = nullptr;" for i, field in enumerate(pointers)]
            lines += ["}"]
        return "\n".join(lines)

    def pointer_mask(self, absent):
        """The int32 mask ``drop`` reads: a bit for each pointer field named in ``absent``, in field order."""
        pointers = [field for field, kind in self.fields if kind.endswith("*")]
        if len(pointers) > 31:
            raise ValueError(f"{self.name}: {len(pointers)} pointers, more than an int32 mask holds")
        return sum(1 << i for i, field in enumerate(pointers) if field in absent)


class Export:
    """A symbol of the library that is not a generated adapter: an entry point written by hand (``prototype`` its
    C declaration, e.g. MindSpore's ABI over any dtype) or a plain C function (a probe, a test's view of a shared
    helper)."""

    def __init__(self, symbol, source, prototype, doc, op=None, structs=()):
        self.symbol = symbol
        self.source = source
        self.prototype = prototype
        self.doc = doc
        self.op = op
        self.structs = tuple(structs)  # the ``Struct`` s its prototype names (cores.h declares them before it)


class Table:
    """The kernels and exports of the library, in build order: ``kernel(symbol)``, ``sources``, ``symbols``,
    ``options`` (each struct once), checked when made (a backward that does not fit its forward, two kernels of
    one core with other signatures, a symbol twice)."""

    def __init__(self, entries, structs=()):
        self.entries = tuple(entries)
        self._structs = tuple(structs)  # plain C structs the cores take (beside the exports')
        self.kernels = tuple(e for e in self.entries if isinstance(e, Kernel))
        symbols = [e.symbol for e in self.entries]
        if len(set(symbols)) != len(symbols):
            raise ValueError("a symbol twice in the kernel table")
        self._by_symbol = {k.symbol: k for k in self.kernels}
        cores = {}
        for kernel in self.kernels:
            if cores.setdefault(kernel.core, kernel.core_types()) != kernel.core_types():
                raise ValueError(f"{kernel.symbol}: core {kernel.core} declared otherwise by another kernel")
            if kernel.backward:
                kernel.gradient_plan(self.kernel(kernel.backward))

    def kernel(self, symbol):
        return self._by_symbol[symbol]

    @property
    def sources(self):
        return tuple(dict.fromkeys(e.source for e in self.entries))

    @property
    def options(self):
        return tuple(dict.fromkeys(k.options for k in self.kernels))

    @property
    def structs(self):
        """The plain C structs the exports and the cores take (each once, in the table's order)."""
        exports = (s for e in self.entries if isinstance(e, Export) for s in e.structs)
        return tuple(dict.fromkeys((*exports, *self._structs)))

    @property
    def cores(self):
        """One kernel per core (the first that names it), in the table's order."""
        first = {}
        for kernel in self.kernels:
            first.setdefault(kernel.core, kernel)
        return tuple(first.values())

    def where(self, op):
        """Where the kernels of the ``cpu_kernels`` op ``op`` are: " (kernels/csrc/a.cc, kernels/csrc/b.cc)", or ""."""
        sources = dict.fromkeys(e.source for e in self.entries if e.op == op)
        return f" ({', '.join('kernels/csrc/' + source for source in sources)})" if sources else ""

    @property
    def symbols(self):
        """Every symbol the library exports: entry points, exports and cores."""
        return tuple(e.symbol for e in self.entries) + tuple(k.core_symbol for k in self.cores)

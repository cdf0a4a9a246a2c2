"""The C++ the build generates from the kernel table (``table.py``) into the library's build folder, beside the
sources of the package (``build.py`` compiles them together and hashes them into the cache key):

- ``cores.h``: the shared codes (``codes.py``: the MLP's form, the norm's and a weight's kind, the status codes, each a
  struct of one enum), the options structs and the typed cores' declarations (``int gptlocal_core_<core>(...)``, what
  each kernel's ``.cc`` defines) and the hand-written exports' prototypes; every source includes it;
- ``entries.cc``: one AOT entry point a kernel, a thin adapter: ``aot.h``'s ``bind`` checks the call against the
  kernel's tensors (dtypes, ranks, named dims) and its options vector's length, then the core is called with typed
  pointers, the sizes and the options struct.

``python -m mindformers_gptlocal.kernels.abi.codegen [folder]`` prints both (or writes them into ``folder``).
"""
import sys

from .codes import ENUMS, c_enum
from .spec import Export, Struct, comment
from .table import TABLE

HEADER = "cores.h"
ENTRIES = "entries.cc"
_KINDS = {"size": "kSize", "leading": "kLeading", "fixed": "kFixed", "any": "kAny"}


def header(table=TABLE):
    """``cores.h``'s text."""
    lines = ["// Generated from mindformers_gptlocal/kernels/abi/table.py by codegen.py: the options structs and the typed",
             "// cores' declarations (each core defined in its kernel's .cc). Do not edit: edit the table.",
             "#pragma once", "", "#include <cstdint>", ""]
    for cls in ENUMS:
        lines += [c_enum(cls), ""]
    for options in table.options:
        lines += [options.c_struct(), ""]
    for struct in table.structs:
        lines += [struct.c_struct(), ""]
    for kernel in table.cores:
        lines += [*comment(f"{kernel.source}: {kernel.doc}"), kernel.core_declaration()]
    lines.append("")
    for export in table.entries:
        if isinstance(export, Export):
            lines += [*comment(f"{export.source}: {export.doc}"), f'extern "C" {export.prototype};']
    return "\n".join(lines) + "\n"


def _dim(dim, sizes):
    """aot.h's Dim: a size's index; a fixed length; a leading group of a fixed element count as its negative."""
    if dim.name:
        value = sizes.index(dim.name)
    elif dim.kind == "leading":
        value = -dim.value
    else:
        value = dim.value or 0
    return f"{{{_KINDS[dim.kind]}, {value}}}"


def adapter(kernel):
    """One kernel's AOT entry point."""
    sizes = kernel.sizes
    rows = []
    for tensor in kernel.tensors:
        dims = ", ".join(_dim(d, sizes) for d in tensor.dims)
        flags = f"{'true' if tensor.optional else 'false'}, {'true' if tensor.token else 'false'}"
        rows.append(f'      {{"{tensor.ms_dtype}", {len(tensor.dims)}, {{{dims}}}, {flags}}},  // {tensor}')
    index = {t.name: i for i, t in enumerate(kernel.tensors)}

    def pointer(tensor):
        return f"call.{'in' if tensor.const else 'out'}<{tensor.c_type}>({index[tensor.name]})"

    tensors = {t.name: t for t in kernel.tensors}
    def field(name):  # a tensor's pointer, or zero for a number no tensor gives
        return pointer(tensors[name]) if name in tensors else "{}"

    args = [f"{a.name}{{{', '.join(field(name) for name, _ in a.fields)}}}" if isinstance(a, Struct)
            else pointer(a) for a in kernel.core_arguments()]
    args += [f"call.size[{i}]" for i in range(len(sizes))] + ["options"]
    name = kernel.options.name
    return "\n".join([
        *comment(f"{kernel.doc} ({kernel.source})"),
        f'extern "C" int {kernel.symbol}(int nparam, void **params, int *ndims, int64_t **shapes, '
        "const char **dtypes, void *stream, void *extra) {",
        "  (void)stream;",
        "  (void)extra;",
        "  static const Tensor kTensors[] = {",
        *rows,
        "  };",
        f"  static const Signature kSignature{{kTensors, {len(kernel.tensors)}, {len(kernel.inputs)}, "
        f"sizeof({name}) / 4}};",
        "  Call call;",
        "  const int bound = bind(kSignature, nparam, params, ndims, shapes, dtypes, &call);",
        "  if (bound != 0) return bound;",
        f"  {name} options;",
        "  std::memcpy(&options, call.options, sizeof(options));",
        f"  return finish(kSignature, call, {kernel.core_symbol}({', '.join(args)}));",
        "}",
    ])


def entries(table=TABLE):
    """``entries.cc``'s text."""
    lines = ["// Generated from mindformers_gptlocal/kernels/abi/table.py by codegen.py: each kernel's AOT entry point,",
             "// which checks the call (aot.h bind) and calls the kernel's typed core. Do not edit: edit the table.",
             "#include <cstdint>", "#include <cstring>", "", '#include "aot.h"', f'#include "{HEADER}"', "",
             "using gptlocal::aot::Call;", "using gptlocal::aot::Signature;", "using gptlocal::aot::Tensor;",
             "using gptlocal::aot::bind;", "using gptlocal::aot::finish;",
             "using gptlocal::aot::kAny;", "using gptlocal::aot::kFixed;", "using gptlocal::aot::kLeading;",
             "using gptlocal::aot::kSize;", ""]
    for kernel in table.kernels:
        lines += [adapter(kernel), ""]
    return "\n".join(lines)


def generated(table=TABLE):
    """{file name: text} of what the build generates."""
    return {HEADER: header(table), ENTRIES: entries(table)}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    for name, text in generated().items():
        if argv:
            import os  # pylint: disable=import-outside-toplevel
            with open(os.path.join(argv[0], name), "w", encoding="utf-8") as handle:
                handle.write(text)
        else:
            print(f"// ---- {name}\n{text}")


if __name__ == "__main__":
    main()

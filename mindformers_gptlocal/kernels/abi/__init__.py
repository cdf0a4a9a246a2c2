"""The ABI and build machinery of the C++ cores (``../csrc``): the kernel table (``spec.py``, ``table.py``,
``layer_table.py``), the shared codes (``codes.py``), the generated headers and adapters (``codegen.py``), the build
(``build.py``), the primitives and direct calls (``aot.py``). Imports nothing of ``../cells`` or ``../provider.py``."""

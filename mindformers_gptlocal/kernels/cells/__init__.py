"""The MindSpore Cells (and primitives) that wrap the C++ cores, one module per op or small family; built on
``../abi``, chosen by ``../provider.py`` (which they never import)."""

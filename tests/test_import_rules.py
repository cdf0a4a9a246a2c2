"""docs/ARCHITECTURE.md's "Imports point down" (under its map), read from the source (every import statement, top-level
or inside a function): ``model/`` imports none of the layers above it and, of ``generation/``, only the defaults table
(the model's default generation options, ``model/config.py``, read MindFormers' column); of ``runtime/`` (below it: the
runtime reads what the model describes, ``model/describe.py``, and imports nothing of ``model/``) the hand-overs of
``GPTLocalForCausalLM``'s ``kv_cache`` / ``generate`` and the loader's compile cache; ``generation/`` and ``kernels/``
import nothing of ours but the base; ``peft/`` (the methods' settings) is pure Python below ``model/`` (it imports the
base, ``parallel/`` and itself, never MindSpore; the methods' Cells are ``model/*_cells.py``). ``mf/`` is the one
MindFormers boundary: no module outside it imports MindFormers (the rest takes its names from ``mf/symbols.py``, the
pre-flight handed them), and ``model/`` and ``runtime/`` import nothing of it; its lowest floor, ``mf/compat.py`` (the
launcher imports it), imports only the base; ``preflight/`` sits below ``mf/`` (which calls it: ``run_yaml.preflight``)
and imports nothing of it.

No circle between the package's folders: the graph of every import (the folders, the top-level modules and the
package's own ``__init__`` as nodes) has no cycle (``test_no_import_circle_between_folders``); nor has ``kernels/``,
module by module, and its kinds import down: ``abi/`` nothing of ``cells/`` or the provider, ``cells/`` nothing of the
provider."""
import ast
import os

import mindformers_gptlocal

PACKAGE = os.path.dirname(mindformers_gptlocal.__file__)
BASE = {"errors", "yaml_io", "staging", "safetensors_io", "tokenizer_id", "host_memory"}
ABOVE_MODEL = {"training", "checkpoint", "cli", "plan", "preflight", "migrate", "data", "serve", "evaluation",
               "mf", "quantize"}


def imports(folder):
    """(file, line, our top-level module or folder, imported names) for every import of ours in ``folder``."""
    found = []
    for root, _, files in os.walk(os.path.join(PACKAGE, folder)):
        found += [row for name in sorted(files) if name.endswith(".py") for row in _scan(os.path.join(root, name))]
    return found


def test_model_imports_nothing_above_it():
    found = imports("model")
    assert len(found) > 40  # the scan reads the package
    above = sorted((f[0], f[2], f[3]) for f in found if f[2] in ABOVE_MODEL)
    assert not above, above
    # of the runtime below it: the kv_cache and generate methods hand over to it (MindFormers calls model.generate),
    # the loader attaches the compile cache
    runtime = sorted((f[0], f[3]) for f in found if f[2] == "runtime")
    gpt = os.path.join("model", "gpt.py")
    assert runtime == [(gpt, ["generate"]), (gpt, ["runner_for"]), (os.path.join("model", "loader.py"),
                                                                    ["attach", "bounds"])], runtime
    generation = [(f[0], f[2], f[3]) for f in found if f[2] == "generation"]
    assert generation == [(os.path.join("model", "config.py"), "generation", ["MINDFORMERS"])], generation


def test_runtime_imports_nothing_of_the_model_or_its_users():
    """The runtime reads the model's ``Description`` (``model/describe.py``), handed to it; it imports the kernels,
    the generation rules and the base."""
    found = imports("runtime")
    assert len(found) > 5
    assert {f[2] for f in found} - {"runtime"} <= BASE | {"kernels", "generation"}, found


def test_generation_and_kernels_import_only_the_base():
    """Each file of the folder and of its sub-folders (kernels/abi/, kernels/cells/)."""
    for folder in ("generation", "kernels"):
        found = imports(folder)
        ours = {f[2] for f in found} - {folder}
        assert ours <= BASE, (folder, ours)
    read = {os.path.dirname(f[0]) for f in imports("kernels")}
    assert {os.path.join("kernels", "abi"), os.path.join("kernels", "cells")} <= read, read  # the scan reads them


def test_peft_is_pure_python_below_model():
    """peft/ holds the methods' settings; their Cells are model/<method>_cells.py, which the settings name
    (``PetSpec.cells``) and never import."""
    folder = os.path.join(PACKAGE, "peft")
    files = sorted(os.path.join("peft", name) for name in os.listdir(folder) if name.endswith(".py"))
    methods = ("__init__.py", "base.py", "lora.py", "adapter.py", "prefix.py")
    assert {os.path.join("peft", n) for n in methods} <= set(files)
    found = imports("peft")
    assert len(found) > 10
    ours = {f[2] for f in found} - {"peft"}
    assert ours <= BASE | {"parallel"}, ours
    for path in files:  # not even inside a function
        tree = ast.parse(open(os.path.join(PACKAGE, path), encoding="utf-8").read())
        heavy = [n.lineno for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                 and any(name.split(".")[0] in ("mindspore", "mindformers") for name in
                         ([a.name for a in n.names] if isinstance(n, ast.Import) else [n.module or ""]))]
        assert not heavy, (path, heavy)


def mindformers_imports(path):
    """(line, module) of every import of MindFormers in ``path``: import statements anywhere in the file and
    ``importlib.import_module("mindformers...")`` / ``__import__`` with a literal name."""
    found = []
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) and \
                isinstance(node.args[0].value, str) and (getattr(node.func, "attr", None) == "import_module" or
                                                         getattr(node.func, "id", None) in ("import_module",
                                                                                            "__import__")):
            names = [node.args[0].value]
        found += [(node.lineno, name) for name in names if name.split(".")[0] == "mindformers"]
    return sorted(found)


def test_mindformers_is_imported_only_inside_mf():
    scanned, outside, inside = 0, [], set()
    for root, _, files in os.walk(PACKAGE):
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            relative = os.path.relpath(os.path.join(root, name), PACKAGE)
            hits = mindformers_imports(os.path.join(root, name))
            scanned += 1
            if hits and relative.split(os.sep)[0] == "mf":
                inside.add(relative.replace(os.sep, "/"))
            if relative.split(os.sep)[0] != "mf":
                outside += [(relative, line, module) for line, module in hits]
    assert scanned > 100  # the scan reads the package (test_the_scan_finds_every_form_of_import: it sees imports)
    assert {"mf/model.py", "mf/registration.py", "mf/compat.py"} <= inside, inside  # (symbols.py: through a table)
    assert not outside, f"MindFormers imported outside mindformers_gptlocal/mf/ (use mf/symbols.py): {outside}"


def test_the_scan_finds_every_form_of_import(tmp_path):
    path = tmp_path / "sample.py"
    path.write_text("import mindformers\nfrom mindformers.tools import x\nimport importlib\n"
                    "def f():\n    import mindformers.core as c\n    importlib.import_module('mindformers.trainer')\n"
                    "from mindformers_gptlocal import y\nimport mindspore\nfrom . import mindformers\n")
    assert [module for _, module in mindformers_imports(str(path))] == [
        "mindformers", "mindformers.tools", "mindformers.core", "mindformers.trainer"]


def test_the_model_and_the_inference_runtime_import_nothing_of_mf():
    for folder in ("model", "runtime", "generation", "serve", "evaluation"):
        found = imports(folder)
        assert found, folder
        assert not [f for f in found if f[2] == "mf"], (folder, found)


def test_the_boundary_imports_nothing_above_it():
    """mf/compat.py, imported by the launcher, imports only ``errors``: what its patches call of the layers above it
    (the pre-flight, the resume check ...) ``mf/registration.py`` hands to ``compat.apply``. The pre-flight's checks
    sit below ``mf/``: ``mf/run_yaml.py`` calls them, handing them MindFormers' names."""
    found = [f for f in imports("mf") if f[0] == os.path.join("mf", "compat.py")]
    assert found and {f[2] for f in found} == {"errors"}, found
    assert not [f for f in imports("preflight") if f[2] == "mf"], "preflight/ imports nothing of mf/"
    calls = [f for f in imports("mf") if f[0] == os.path.join("mf", "run_yaml.py") and f[2] == "preflight"]
    assert calls, "the boundary's pre-flight calls the checks (run_yaml.preflight)"


def folder_graph():
    """{node: {node it imports: [file:line, ...]}} over every import statement of the package, top-level or inside a
    function; a node is a folder of the package, a top-level module (the base's, ``quantize``) or ``__init__``
    (the package's own, also what ``from .. import __version__`` reaches)."""
    nodes = {name[:-3] if name.endswith(".py") else name for name in os.listdir(PACKAGE)
             if name.endswith(".py") or os.path.isfile(os.path.join(PACKAGE, name, "__init__.py"))}
    graph = {}
    for folder in sorted(nodes):
        if os.path.isdir(os.path.join(PACKAGE, folder)):
            found = imports(folder)
        else:  # a top-level module
            found = _scan(os.path.join(PACKAGE, folder + ".py"))
        for path, line, target, _ in found:
            target = target if target in nodes else "__init__"  # from .. import __version__: the package itself
            if target != folder:
                graph.setdefault(folder, {}).setdefault(target, []).append(f"{path}:{line}")
    return graph


def _scan(path):
    """imports()'s rows of one file: relative imports resolved against the file's package."""
    parts = os.path.relpath(path, PACKAGE)[:-3].split(os.sep)
    found = []
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                target = parts[:len(parts) - node.level] + (node.module.split(".") if node.module else [])
            elif (node.module or "").startswith("mindformers_gptlocal"):
                target = node.module.split(".")[1:]
            else:
                continue
            names = [alias.name for alias in node.names]
            found += [(os.path.relpath(path, PACKAGE), node.lineno, n, [n]) for n in names] if not target else \
                [(os.path.relpath(path, PACKAGE), node.lineno, target[0], names)]
        elif isinstance(node, ast.Import):
            found += [(os.path.relpath(path, PACKAGE), node.lineno, alias.name.split(".")[1], [])
                      for alias in node.names if alias.name.startswith("mindformers_gptlocal.")]
    return found


def find_cycle(graph):
    """One cycle of ``graph`` as a list of nodes (first == last), or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                return stack[stack.index(target):] + [target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        state[node] = "done"
        stack.pop()
        return None

    for start in sorted(graph):
        if start not in state:
            cycle = visit(start)
            if cycle:
                return cycle
    return None


def test_no_import_circle_between_folders():
    graph = folder_graph()
    assert {"model", "runtime", "kernels", "mf", "yaml_io", "__init__"} <= set(graph), sorted(graph)  # it reads them
    cycle = find_cycle(graph)
    assert cycle is None, "an import circle between folders: " + " -> ".join(cycle) + "; the imports: " + "; ".join(
        f"{a} -> {b}: {', '.join(graph[a][b])}" for a, b in zip(cycle, cycle[1:]))


KINDS = {"csrc", "abi", "cells", "provider", "__init__"}  # kernels/: the C++ cores, their ABI and build, the Cells, the
# provider, the package's own __init__


def kernels_graph(node):
    """{node: {node it imports: [file:line, ...]}} over every import statement of ``kernels/`` and its sub-folders,
    top-level or inside a function; ``node(parts)`` names a module of kernels/ given its path parts under it (such as
    ``["abi", "table"]``, ``["provider"]``, ``["__init__"]``)."""
    root = os.path.join(PACKAGE, "kernels")
    graph = {}
    for folder, _, files in sorted(os.walk(root)):
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            parts = os.path.relpath(path, root)[:-3].split(os.sep)
            package = parts[:-1]  # the file's package under kernels/ (a package's __init__ is in it too)
            for item in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
                if isinstance(item, ast.ImportFrom) and item.level:
                    base = ["kernels", *package][:len(package) + 2 - item.level]
                elif isinstance(item, ast.ImportFrom) and (item.module or "").startswith("mindformers_gptlocal."):
                    base = []
                else:
                    continue
                module = base + (item.module.split(".") if item.module else [])
                if item.module and not item.level:
                    module = module[1:]  # without the package's own name
                if module[:1] != ["kernels"]:
                    continue
                for alias in item.names:  # ``from . import build``: the module build; ``from .table import X``: table
                    target = module[1:] + [alias.name]
                    if not os.path.isfile(os.path.join(root, *target) + ".py"):
                        target = module[1:] or ["__init__"]
                    if os.path.isdir(os.path.join(root, *target)):
                        target = target + ["__init__"]
                    source, target = node(parts), node(target)
                    if target != source:
                        graph.setdefault(source, {}).setdefault(target, []).append(
                            f"{os.path.relpath(path, PACKAGE)}:{item.lineno}")
    return graph


def test_kernels_is_laid_out_by_kind():
    """kernels/ holds its four kinds, each a sub-folder but the provider: the C++ cores (``csrc/``: only C++), the ABI
    and build machinery (``abi/``), the Cells (``cells/``), ``provider.py``; nothing else at its top."""
    root = os.path.join(PACKAGE, "kernels")
    top = {name[:-3] if name.endswith(".py") else name for name in os.listdir(root) if name != "__pycache__"}
    assert top == KINDS, sorted(top)
    assert {os.path.splitext(name)[1] for name in os.listdir(os.path.join(root, "csrc"))} == {".cc", ".h"}
    for folder in ("abi", "cells"):
        names = set(os.listdir(os.path.join(root, folder))) - {"__pycache__"}
        assert "__init__.py" in names and {os.path.splitext(name)[1] for name in names} == {".py"}, (folder, names)


def test_no_import_circle_between_the_kernels_modules():
    """Inside ``kernels/`` too, module by module through its sub-folders (the ABI machinery: spec, table, codegen,
    aot, build; the Cells; the provider), every import counted: no circle."""
    graph = kernels_graph("/".join)
    assert {"abi/spec", "abi/table", "abi/codegen", "abi/aot", "abi/build", "cells/linear", "provider"} <= set(graph), \
        sorted(graph)  # it reads the sub-folders
    cycle = find_cycle(graph)
    assert cycle is None, "an import circle in kernels/: " + " -> ".join(cycle) + "; the imports: " + "; ".join(
        f"{a} -> {b}: {', '.join(graph[a][b])}" for a, b in zip(cycle, cycle[1:]))


def test_kernels_kinds_import_down():
    """Between kernels/' kinds the imports point down: ``abi/`` imports nothing of ``cells/`` or the provider,
    ``cells/`` nothing of the provider (which imports both: it chooses), the package's ``__init__`` nothing; no
    circle."""
    graph = kernels_graph(lambda parts: parts[0])
    assert set(graph["provider"]) == {"abi", "cells"}, graph["provider"]  # it reads them
    assert set(graph["cells"]) == {"abi"}, graph["cells"]
    assert "abi" not in graph, graph["abi"]
    assert "__init__" not in graph, graph.get("__init__")
    cycle = find_cycle(graph)
    assert cycle is None, "an import circle between kernels/' kinds: " + " -> ".join(cycle) + "; the imports: " + \
        "; ".join(f"{a} -> {b}: {', '.join(graph[a][b])}" for a, b in zip(cycle, cycle[1:]))


def test_the_cycle_finder_finds_a_circle():
    assert find_cycle({"a": {"b": []}, "b": {"c": []}, "c": {"a": []}, "d": {"a": []}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": []}, "b": {"c": []}, "d": {"a": []}}) is None

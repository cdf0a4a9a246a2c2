"""docs/ARCHITECTURE.md's "Imports point down" (under its map), read from the source (every import statement, top-level or inside
a function): ``model/`` imports none of the layers above it (but the inference runtime's ``runner_for`` /
``generate`` in ``GPTLocalForCausalLM``'s ``kv_cache`` / ``generate`` hooks) and, of ``generation/``, only the
defaults table (the model's default generation options, ``model/config.py``, read MindFormers' column);
``generation/`` and ``kernels/`` import nothing of ours but the base; ``runtime/`` imports none of the commands that
use it; ``peft/``'s settings modules (everything but its ``*_cells.py``) are pure Python below ``model/`` (they import
the base, ``parallel/`` and each other, never MindSpore), its Cells modules sit beside ``model/``'s building blocks
(they import them, nothing above ``model/``). ``mf/`` is the one MindFormers boundary: no module outside it imports
MindFormers (the rest takes its names from ``mf/symbols.py``), and ``model/`` and ``runtime/`` import nothing of
it; its lowest floor, ``mf/compat.py`` (the pre-flight and the launcher import it), imports only the base."""
import ast
import os

import mindformers_gptlocal

PACKAGE = os.path.dirname(mindformers_gptlocal.__file__)
BASE = {"errors", "yaml_io", "staging", "safetensors_io", "tokenizer_id", "host_memory"}
ABOVE_MODEL = {"training", "checkpoint", "cli", "plan", "preflight", "migrate", "data", "serve", "evaluation",
               "mf", "runtime", "quantize"}
ABOVE_RUNTIME = {"training", "checkpoint", "cli", "plan", "preflight", "migrate", "data", "serve", "evaluation",
                 "mf", "quantize"}


def imports(folder):
    """(file, line, our top-level module or folder, imported names) for every import of ours in ``folder``."""
    found = []
    for root, _, files in os.walk(os.path.join(PACKAGE, folder)):
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(root, name)
            parts = os.path.relpath(path, PACKAGE)[:-3].split(os.sep)
            for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
                if isinstance(node, ast.ImportFrom):
                    if node.level:  # relative: resolved against the file's package
                        target = parts[:len(parts) - node.level] + (node.module.split(".") if node.module else [])
                    elif (node.module or "").startswith("mindformers_gptlocal"):
                        target = node.module.split(".")[1:]
                    else:
                        continue
                    names = [alias.name for alias in node.names]
                    if not target:  # from .. import x: x is the module
                        found += [(os.path.relpath(path, PACKAGE), node.lineno, n, [n]) for n in names]
                    else:
                        found.append((os.path.relpath(path, PACKAGE), node.lineno, target[0], names))
                elif isinstance(node, ast.Import):
                    for alias in node.names:
                        if alias.name.startswith("mindformers_gptlocal."):
                            found.append((os.path.relpath(path, PACKAGE), node.lineno, alias.name.split(".")[1], []))
    return found


def test_model_imports_nothing_above_it_but_its_two_runtime_hooks():
    found = imports("model")
    assert len(found) > 40  # the scan reads the package
    above = sorted((f[0], f[2], f[3]) for f in found if f[2] in ABOVE_MODEL)
    # the exceptions: the model's kv_cache and generate methods hand over to the inference runtime (MindFormers
    # calls model.generate)
    gpt = os.path.join("model", "gpt.py")
    assert above == [(gpt, "runtime", ["generate"]), (gpt, "runtime", ["runner_for"])], above
    generation = [(f[0], f[2], f[3]) for f in found if f[2] == "generation"]
    assert generation == [(os.path.join("model", "config.py"), "generation", ["MINDFORMERS"])], generation


def test_runtime_imports_none_of_its_users():
    found = imports("runtime")
    assert len(found) > 5
    assert not [f for f in found if f[2] in ABOVE_RUNTIME], found


def test_generation_and_kernels_import_only_the_base():
    for folder in ("generation", "kernels"):
        ours = {f[2] for f in imports(folder)} - {folder}
        assert ours <= BASE, (folder, ours)


def _peft_files(cells):
    folder = os.path.join(PACKAGE, "peft")
    return sorted(os.path.join("peft", name) for name in os.listdir(folder)
                  if name.endswith(".py") and name.endswith("_cells.py") == cells)


def test_peft_settings_are_pure_python_below_model():
    pure = _peft_files(cells=False)
    methods = ("__init__.py", "base.py", "lora.py", "adapter.py", "prefix.py")
    assert {os.path.join("peft", n) for n in methods} <= set(pure)
    found = [f for f in imports("peft") if f[0] in pure]
    assert len(found) > 10
    ours = {f[2] for f in found} - {"peft"}
    assert ours <= BASE | {"parallel"}, ours
    for path in pure:  # not even inside a function: the Cells are reached through peft's *_cells modules
        tree = ast.parse(open(os.path.join(PACKAGE, path), encoding="utf-8").read())
        heavy = [n.lineno for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                 and any(name.split(".")[0] in ("mindspore", "mindformers") for name in
                         ([a.name for a in n.names] if isinstance(n, ast.Import) else [n.module or ""]))]
        assert not heavy, (path, heavy)
        top = [n for n in tree.body if isinstance(n, ast.ImportFrom) and (n.module or "").endswith("_cells")]
        assert not top, path  # a Cells module only inside the method that builds a model


def test_peft_cells_import_nothing_above_model():
    cells = _peft_files(cells=True)
    assert len(cells) == 3
    found = [f for f in imports("peft") if f[0] in cells]
    assert not [f for f in found if f[2] in ABOVE_MODEL], found
    assert {f[2] for f in found} <= BASE | {"parallel", "model", "peft", "kernels"}, found


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
    """mf/compat.py, imported by the pre-flight and the launcher, imports only ``errors``: what its patches call of the
    layers above it (the pre-flight, the resume check ...) ``mf/registration.py`` hands to ``compat.apply``."""
    found = [f for f in imports("mf") if f[0] == os.path.join("mf", "compat.py")]
    assert found and {f[2] for f in found} == {"errors"}, found
    checks = [f for f in imports("preflight") if f[0] == os.path.join("preflight", "checks.py") and f[2] == "mf"]
    assert checks, "the pre-flight calls the boundary (compat.require)"

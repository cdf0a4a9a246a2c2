"""What is fixed at build is chosen at build (docs/ARCHITECTURE.md, issue 50): no graph method branches on a Cell's
attributes that the build fixed. Read from the source, as tests/test_import_rules.py reads the imports.

A graph method is a Cell's ``construct`` or ``bprop`` (or ``get_overflow_status``, which MindFormers' train step
calls from its construct), and every method of the same class or its bases that one of them calls through ``self``,
that another Cell's graph method calls by name (``self.model.mask_bias(...)``), or that the build binds to an
attribute (``self.activate = self._relu``: the strategy construct then calls). A branch (``if``, ``x if c else y``,
``while``) in one is a build-time branch where some term of its condition (its ``and`` / ``or`` operands) reads only
attributes of ``self`` other than the train flag (through locals too) and constants: nothing of the call's arguments,
of a static shape or of ``self.training``. The graph compiler folds such a branch, but it is a choice made again in
every graph: the build makes it once instead, picking the Cell, subclass or bound method (``ParallelAttention
._choose_core``).

``python tests/model/test_build_time_choices.py [root]`` prints every build-time branch of the tree at ``root`` (the
repository by default): the count the issue asks for, before and after.
"""
import ast
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the files whose Cells run in the model's graphs (gpt_local's forward, its PEFT Cells, the train step, the runner)
FILES = ("model/gpt.py", "model/attention.py", "model/layers.py", "model/dropout.py", "model/quant_cells.py",
         "model/blockwise_attention.py", "model/kv_cache.py", "model/lora_cells.py", "model/adapter_cells.py",
         "model/prefix_cells.py", "mf/wrapper.py", "training/optim.py", "runtime/runner.py")
ENTRIES = {"construct", "bprop", "get_overflow_status"}
# The build-time branches that stay, each with why (at most 5: issue 50).
ALLOWED = {
}


def _classes(trees):
    """{class name: (file, ClassDef)} of every class in the files."""
    found = {}
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                found[node.name] = (path, node)
    return found


def _methods(cls):
    return {node.name: node for node in cls.body if isinstance(node, ast.FunctionDef)}


def _lineage(name, classes):
    """The class and its bases among ``classes`` (by name), nearest first."""
    order, todo = [], [name]
    while todo:
        current = todo.pop(0)
        if current in classes and current not in order:
            order.append(current)
            todo += [base.id if isinstance(base, ast.Name) else getattr(base, "attr", "")
                     for base in classes[current][1].bases]
    return order


def _self_calls(function):
    """Names ``m`` of ``self.m(...)`` calls and of bare ``self.m`` references (a bound method kept as a strategy);
    and names of ``<something else>.m(...)`` calls."""
    own, other = set(), set()
    for node in ast.walk(function):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            own.add(node.attr)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                not (isinstance(node.func.value, ast.Name) and node.func.value.id == "self"):
            other.add(node.func.attr)
    return own, other


def _bare_self_references(expr):
    """Names ``m`` of ``self.m`` in ``expr`` that are not called there (a bound method kept to be called later)."""
    called = {id(node.func) for node in ast.walk(expr) if isinstance(node, ast.Call)}
    return {node.attr for node in ast.walk(expr) if isinstance(node, ast.Attribute) and id(node) not in called and
            isinstance(node.value, ast.Name) and node.value.id == "self"}


def graph_methods(trees):
    """[(file, class, method FunctionDef)] of every graph method (see the module)."""
    classes = _classes(trees)
    cells = {name for name in classes if any("construct" in _methods(classes[c][1]) or c in ("Cell", "Optimizer")
                                             for c in _lineage(name, classes)) or
             any(isinstance(b, ast.Attribute) and b.attr == "Cell" for b in classes[name][1].bases) or
             name.endswith("Mixin") or name.endswith("Cell")}
    reached, seen = set(), set()  # (class that defines it, method name); (class asked, method name)
    todo = [(name, entry) for name in cells for entry in ENTRIES]
    called_elsewhere = set()
    while todo:
        name, method = todo.pop()
        if (name, method) in seen:
            continue
        seen.add((name, method))
        lineage = _lineage(name, classes)
        for owner in lineage:
            function = _methods(classes[owner][1]).get(method)
            if function is None:
                continue
            reached.add((owner, method))
            own, other = _self_calls(function)
            todo += [(name, m) for m in own if m != method]
            called_elsewhere |= other
            # a bound method the build keeps: every self.<m> assigned (in any method of the lineage: __init__, a
            # property's setter) to an attribute a graph method reads
            for cls in lineage:
                for node in ast.walk(classes[cls][1]):
                    if isinstance(node, ast.Assign) and any(
                            isinstance(t, ast.Attribute) and t.attr in own
                            for target in node.targets for t in ast.walk(target)):
                        todo += [(name, m) for m in _bare_self_references(node.value)]
            break
        if not todo:
            for other_name in cells:
                for m in called_elsewhere:
                    if m in _methods(classes[other_name][1]) and m != "__init__":
                        todo.append((other_name, m))
            called_elsewhere = set()
    return [(classes[c][0], c, _methods(classes[c][1])[m]) for c, m in sorted(reached)]


class _Reads(ast.NodeVisitor):
    """What an expression reads: self attributes (but the train flag), anything else (arguments, locals from them,
    shapes, the train flag)."""

    def __init__(self, build_locals):
        self.build = False
        self.run = False
        self.build_locals = build_locals

    def visit_Attribute(self, node):
        if node.attr in ("shape", "ndim", "dtype"):
            self.run = True
            return
        if isinstance(node.value, ast.Name) and node.value.id == "self":
            if node.attr == "training":
                self.run = True
            else:
                self.build = True
            return
        self.generic_visit(node)

    def visit_Name(self, node):
        if node.id in self.build_locals:
            self.build = True
        elif node.id not in ("None", "True", "False", "len", "isinstance", "ms", "math"):
            self.run = True

    def visit_Call(self, node):
        if not isinstance(node.func, ast.Name):  # a method or a Cell called: a value computed in the graph
            self.run = True
            return
        for arg in list(node.args) + [k.value for k in node.keywords]:
            self.visit(arg)


def _reads(expr, build_locals):
    reads = _Reads(build_locals)
    reads.visit(expr)
    return reads


def _terms(test):
    if isinstance(test, ast.BoolOp):
        return [term for value in test.values for term in _terms(value)]
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return _terms(test.operand)
    return [test]


def build_time_branches(function):
    """[(line, source of the condition)] of the build-time branches of one method."""
    build_locals = set()
    for node in ast.walk(function):  # locals assigned only from self attributes: fc1 = self.linear_fc1
        if isinstance(node, ast.Assign):
            reads = _reads(node.value, build_locals)
            names = [n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)]
            if reads.build and not reads.run:
                build_locals |= set(names)
    found = []
    for node in ast.walk(function):
        if isinstance(node, (ast.If, ast.IfExp, ast.While)):
            for term in _terms(node.test):
                reads = _reads(term, build_locals)
                if reads.build and not reads.run:
                    found.append((node.lineno, ast.unparse(node.test)))
                    break
    return found


def scan(root=ROOT):
    """{(file, class.method, line): condition} of every build-time branch under ``root``'s package."""
    package = os.path.join(root, "mindformers_gptlocal")
    trees = {}
    for path in FILES:
        full = os.path.join(package, path)
        if os.path.exists(full):
            trees[path] = ast.parse(open(full, encoding="utf-8").read())
    found = {}
    for path, cls, function in graph_methods(trees):
        for line, condition in build_time_branches(function):
            found[(path, f"{cls}.{function.name}", line)] = condition
    return found


def test_graph_methods_branch_only_on_call_arguments_shapes_and_the_train_flag():
    found = scan()
    left = {(path, where) for path, where, _ in found}
    assert left <= set(ALLOWED), sorted(left - set(ALLOWED))
    assert len(ALLOWED) <= 5


def test_the_scan_sees_the_graph_methods_and_a_build_time_branch():
    """The scan is not vacuous: it reaches the model's graph methods and flags a branch on a build attribute."""
    trees = {path: ast.parse(open(os.path.join(ROOT, "mindformers_gptlocal", path), encoding="utf-8").read())
             for path in FILES}
    names = {f"{cls}.{function.name}" for _, cls, function in graph_methods(trees)}
    assert {"GPTLocalBlock.construct", "Linear.dense", "ParallelAttention.construct",
            "GPTLocalForCausalLM.logits"} <= names, sorted(names)
    sample = ast.parse("def construct(self, x, step=None):\n"
                       "    fc = self.linear\n"
                       "    if fc.skip or step is None:\n        return x\n"
                       "    if not self.training or step is None:\n        return x\n"
                       "    y = x if x.shape[0] == 1 else x\n    return y\n").body[0]
    assert [line for line, _ in build_time_branches(sample)] == [3]


def test_no_cell_makes_a_provider_of_its_own():
    """The model asks for its provider once (``GPTLocalForCausalLM.__init__``: ``kernel_provider(config)``) and hands
    it down; no Cell of the forward or PEFT builds one (no ``kernels or kernel_provider(...)`` fallback), and the
    Cells refuse to be built without it."""
    import mindspore as ms
    import pytest
    from mindformers_gptlocal import GPTLocalConfig
    from mindformers_gptlocal.model import GPTLocalBlock
    from mindformers_gptlocal.model.layers import Activation, Linear
    from conftest import TINY
    makers = []
    for folder in ("model", "peft"):
        for name in sorted(os.listdir(os.path.join(ROOT, "mindformers_gptlocal", folder))):
            if not name.endswith(".py"):
                continue
            tree = ast.parse(open(os.path.join(ROOT, "mindformers_gptlocal", folder, name), encoding="utf-8").read())
            for function in ast.walk(tree):
                if isinstance(function, ast.FunctionDef):
                    for node in ast.walk(function):
                        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) in (
                                "kernel_provider", "KernelProvider", "from_config"):
                            makers.append(f"{folder}/{name}:{function.name}")
    # GPTLocalForCausalLM's, through layers.kernel_provider (the config's provider in this build's parallel mode)
    assert makers == ["model/gpt.py:__init__", "model/layers.py:kernel_provider"], makers
    with pytest.raises(TypeError, match="kernels"):
        Linear(4, 3, 0.02, ms.float32, ms.float32)
    with pytest.raises(TypeError, match="kernels"):
        Activation("gelu_new")  # pylint: disable=no-value-for-parameter
    with pytest.raises(TypeError, match="kernels"):
        GPTLocalBlock(GPTLocalConfig(**TINY), 1)


def test_a_bias_left_to_the_caller_is_bound_again(pynative_mode):  # pylint: disable=unused-argument
    """Linear binds its product with or without the bias at build; setting ``skip_bias_add`` afterwards (a
    tensor-parallel rank's part) binds it again: x W^T alone, then x W^T + b again."""
    import numpy as np
    import mindspore as ms
    from mindspore import Tensor
    from mindformers_gptlocal.kernels.provider import KernelProvider
    from mindformers_gptlocal.model.layers import Linear
    for kernels in (KernelProvider(device_target="CPU"), KernelProvider({"linear": "kernel"}, device_target="CPU")):
        linear = Linear(5, 3, 0.5, ms.float32, ms.float32, kernels=kernels)
        linear.bias.set_data(Tensor(np.array([1.0, -2.0, 3.0], np.float32)))
        x = np.random.default_rng(0).standard_normal((2, 5)).astype(np.float32)
        bare = x @ linear.weight.asnumpy().T
        np.testing.assert_allclose(linear(Tensor(x)).asnumpy(), bare + linear.bias.asnumpy(), rtol=1e-5, atol=1e-5)
        linear.skip_bias_add = True
        assert linear.skip_bias_add and not linear.adds_bias
        np.testing.assert_allclose(linear(Tensor(x)).asnumpy(), bare, rtol=1e-5, atol=1e-5)
        linear.skip_bias_add = False
        np.testing.assert_allclose(linear(Tensor(x)).asnumpy(), bare + linear.bias.asnumpy(), rtol=1e-5, atol=1e-5)


if __name__ == "__main__":
    branches = scan(sys.argv[1] if len(sys.argv) > 1 else ROOT)
    for (path, where, line), condition in sorted(branches.items()):
        print(f"{path}:{line} {where}: {condition}")
    print(len(branches), "build-time branches in graph methods")

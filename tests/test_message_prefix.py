"""One prefix style in what users read: a library line written to the terminal starts ``gptlocal: `` (a run's lines
``[gptlocal]``, a command's errors ``gptlocal COMMAND: error:``), never with the package's Python name
(``gpt_local``, which stays where it is a name: ``model_type: gpt_local``, the classes)."""
import ast
import os

import mindformers_gptlocal

PACKAGE = os.path.dirname(mindformers_gptlocal.__file__)
OTHER_PREFIXES = ("gpt_local:", "gpt-local:", "[gpt_local]", "[gpt-local]")


def message_starts(root):
    """(file, line, the first 40 characters) of every string literal under ``root`` (f-strings by their first
    literal part), docstrings left out."""
    found = []
    for folder, _, files in os.walk(root):
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            tree = ast.parse(open(path, encoding="utf-8").read())
            docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                          if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                          and node.body and isinstance(node.body[0], ast.Expr)
                          and isinstance(node.body[0].value, ast.Constant)}
            parts = {id(part) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for part in ast.walk(node)
                     if part is not node}  # an f-string's pieces: read as the f-string
            for node in ast.walk(tree):
                if id(node) in parts:
                    continue
                if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
                    text = node.values[0].value
                elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                    text = node.value
                else:
                    continue
                found.append((os.path.relpath(path, root), node.lineno, str(text)[:40]))
    return sorted(found)


def test_library_lines_start_gptlocal():
    starts = message_starts(PACKAGE)
    ours = [s for s in starts if s[2].startswith("gptlocal: ")]
    assert len(ours) >= 8, ours  # the scan sees the library's warning lines (kernels, compile cache, dtypes ...)
    other = [s for s in starts if s[2].lstrip().lower().startswith(OTHER_PREFIXES)]
    assert not other, f"start these lines 'gptlocal: ' (one prefix style): {other}"


def test_the_scan_reads_fstrings_and_skips_docstrings(tmp_path):
    (tmp_path / "m.py").write_text('"""gpt_local: a docstring."""\nimport sys\n\n\ndef f(x):\n'
                                   '    """gpt_local: another."""\n    sys.stderr.write(f"gpt_local: {x} off")\n'
                                   '    return "gptlocal: fine"\n')
    assert [s[1:] for s in message_starts(str(tmp_path))] == [(7, "gpt_local: "), (8, "gptlocal: fine")]


def test_a_kernel_off_is_one_gptlocal_line(capfd):
    from mindformers_gptlocal.kernels.abi import build
    build.warn_once("test kernel off, plain ops used instead", "no compiler (a test)")
    build.warn_once("test kernel off, plain ops used instead", "no compiler (a test)")
    err = capfd.readouterr().err
    assert err == ("gptlocal: test kernel off, plain ops used instead: no compiler (a test). model_config.cpu_kernels: "
                   "plain silences this by choosing the plain path.\n"), err

"""tools/mutation_check.py stays honest: every snippet matches today's code (a stale one fails the suite here,
without running any mutation), and a snippet that no longer matches is named and fails the tool."""
import importlib.util
import os

from conftest import REPO

_SPEC = importlib.util.spec_from_file_location("mutation_check", os.path.join(REPO, "tools", "mutation_check.py"))
tool = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(tool)


def test_check_stale_passes_on_this_tree(capsys):
    assert tool.main(["--check-stale"]) == 0, capsys.readouterr().out
    assert f"{len(tool.MUTATIONS)} mutations, 0 stale" in capsys.readouterr().out


def test_a_stale_snippet_fails_the_tool_by_name(capsys, monkeypatch):
    real = tool.MUTATIONS[0]
    gone = tool.Mutation("snippet the code lost", real.path, real.old + "  # no longer there", real.new, real.tests)
    twice = tool.Mutation("snippet found twice", real.path, "\n", "", real.tests)
    moved = tool.Mutation("file the code lost", "mindformers_gptlocal/no_such_module.py", "x", "y", real.tests)
    tests_gone = tool.Mutation("tests the suite lost", real.path, real.old, real.new, ["tests/test_no_such_file.py"])
    assert tool.stale_snippets([real]) == []
    assert [m.name for m, _ in tool.stale_snippets([gone, twice, moved, tests_gone])] == [
        "snippet the code lost", "snippet found twice", "file the code lost", "tests the suite lost"]
    monkeypatch.setattr(tool, "MUTATIONS", [real, gone])
    monkeypatch.setattr(tool, "scratch_copy", lambda: (_ for _ in ()).throw(AssertionError("ran tests")))
    assert tool.main([]) == 3  # the full run stops up front, before copying or testing anything
    out = capsys.readouterr().out
    assert "STALE  snippet the code lost: its snippet is found 0 times" in out and "1 stale" in out

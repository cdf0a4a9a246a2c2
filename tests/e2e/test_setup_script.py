"""run_scripts/setup_env.sh refuses an interpreter outside Python 3.9-3.11 with one clear message, before it
creates anything, and says what it installs (issue 26, item 5). A fake interpreter stands in for another
Python: it answers the version query as that Python would."""
import os
import shutil
import subprocess

import pytest

from conftest import REPO


def _run(tmp_path, version):
    repo = tmp_path / "repo"
    (repo / "run_scripts").mkdir(parents=True)
    shutil.copy(os.path.join(REPO, "run_scripts", "setup_env.sh"), repo / "run_scripts")
    fake = tmp_path / f"python{version}"
    fake.write_text(f"#!/bin/sh\n[ \"$1\" = -c ] && echo {version} && exit 0\nexit 3\n")  # no venv, no pip
    fake.chmod(0o755)
    proc = subprocess.run(["bash", str(repo / "run_scripts" / "setup_env.sh")], env=dict(os.environ, PYTHON=str(fake)),
                          capture_output=True, text=True, timeout=60)
    return proc, repo


@pytest.mark.parametrize("version", ["3.12", "3.8"])
def test_unsupported_python_is_refused_before_anything_is_made(tmp_path, version):
    proc, repo = _run(tmp_path, version)
    assert proc.returncode == 1
    assert f"is Python {version}; mindformers-gptlocal needs Python 3.9-3.11" in proc.stderr
    assert "PYTHON=python3.11" in proc.stderr
    assert not (repo / ".venv").exists()


def test_supported_python_passes_the_check_and_says_what_it_installs(tmp_path):
    proc, repo = _run(tmp_path, "3.11")
    assert "needs Python 3.9-3.11" not in proc.stderr
    assert "creating" in proc.stdout and "(Python 3.11)" in proc.stdout
    assert proc.returncode != 0  # the fake cannot make a venv: the script stops there (set -e)


def test_install_line_names_what_and_how_long(tmp_path):
    """With a venv in place (a stand-in whose pip does nothing), the install step announces itself."""
    repo = tmp_path / "repo"
    (repo / "run_scripts").mkdir(parents=True)
    shutil.copy(os.path.join(REPO, "run_scripts", "setup_env.sh"), repo / "run_scripts")
    (repo / ".venv" / "bin").mkdir(parents=True)
    (repo / ".venv" / "bin" / "python").write_text("#!/bin/sh\nexit 0\n")
    (repo / ".venv" / "bin" / "python").chmod(0o755)
    (repo / ".venv" / "bin" / "activate").write_text("")
    proc = subprocess.run(["bash", str(repo / "run_scripts" / "setup_env.sh"), "test"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "installing mindspore 2.7.2, mindformers 1.8.0 and mindformers-gptlocal, with the test peers" in proc.stdout
    assert "about 2 minutes" in proc.stdout

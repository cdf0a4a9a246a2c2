"""run_scripts/setup_env.sh refuses an interpreter outside Python 3.9-3.11 with one clear message, before it
creates anything, says what it installs, and installs one of the two MindFormers lines. A fake interpreter stands in for another
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


def _with_venv(tmp_path, folder):
    """A repo copy whose ``folder`` venv is a stand-in: its python records its arguments in pip-args and exits 0."""
    repo = tmp_path / "repo"
    (repo / "run_scripts").mkdir(parents=True, exist_ok=True)
    shutil.copy(os.path.join(REPO, "run_scripts", "setup_env.sh"), repo / "run_scripts")
    (repo / folder / "bin").mkdir(parents=True)
    (repo / folder / "bin" / "python").write_text(f"#!/bin/sh\necho \"$@\" > {repo / 'pip-args'}\nexit 0\n")
    (repo / folder / "bin" / "python").chmod(0o755)
    (repo / folder / "bin" / "activate").write_text("")
    return repo


def test_install_line_names_what_and_how_long(tmp_path):
    """With a venv in place (a stand-in whose pip does nothing), the install step announces itself, and installs
    the default MindFormers line's exact pins (setup.cfg's mf19 extra) with the test peers."""
    repo = _with_venv(tmp_path, ".venv")
    proc = subprocess.run(["bash", str(repo / "run_scripts" / "setup_env.sh"), "test"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert ("installing mindspore 2.9.0, mindformers 1.9.0, oneDNN (onednn-cpu-gomp) and mindformers-gptlocal, "
            "with the test peers") in proc.stdout
    assert "about 2 minutes" in proc.stdout
    assert (repo / "pip-args").read_text().split() == ["-m", "pip", "install", "-q", f"{repo}[test,mf19]"]


def test_the_compatibility_line_goes_to_its_own_venv(tmp_path):
    repo = _with_venv(tmp_path, ".venv-mf18")
    proc = subprocess.run(["bash", str(repo / "run_scripts" / "setup_env.sh"), "test", "mf18"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "installing mindspore 2.7.2, mindformers 1.8.0, oneDNN (onednn-cpu-gomp) and mindformers-gptlocal" in \
        proc.stdout and str(repo / ".venv-mf18") in proc.stdout
    assert (repo / "pip-args").read_text().split() == ["-m", "pip", "install", "-q", f"{repo}[test,mf18]"]
    assert not (repo / ".venv").exists()


def test_an_unknown_line_is_refused_naming_both(tmp_path):
    repo = _with_venv(tmp_path, ".venv")
    proc = subprocess.run(["bash", str(repo / "run_scripts" / "setup_env.sh"), "", "mf17"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    assert "unknown MindFormers line 'mf17'" in proc.stderr and "mf19" in proc.stderr and "mf18" in proc.stderr
    assert not (repo / "pip-args").exists()


def test_setup_cfg_pins_both_lines_exactly():
    """install_requires takes either line; the mf19 / mf18 extras pin each pair exactly (a fresh machine gets
    exactly these through setup_env.sh); the oneDNN the kernels link is pinned in install_requires."""
    import configparser
    config = configparser.ConfigParser()
    config.read(os.path.join(REPO, "setup.cfg"))
    requires = config["options"]["install_requires"].split()
    assert "mindformers>=1.8.0,<1.10" in requires and "mindspore>=2.7.2,<2.10" in requires
    assert "onednn-cpu-gomp==2023.2.0" in requires and "onednn-devel-cpu-gomp==2023.2.0" in requires
    extras = config["options.extras_require"]
    assert extras["mf19"].split() == ["mindformers==1.9.0", "mindspore==2.9.0"]
    assert extras["mf18"].split() == ["mindformers==1.8.0", "mindspore==2.7.2"]

"""The container image's install steps (scripts/install-serve.sh), run for real: a fresh virtual
environment gets the `serve` extra from PyPI, the server imports without torch and serves the artifact
with the image's command, `python -m app`, started outside the source tree."""
from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_server import running_server  # noqa: F401  (same start / ready / stop as the image)

ROOT = Path(__file__).resolve().parents[1]
# What the Dockerfile copies into its `sources` stage (the rest is kept out by .dockerignore).
IMAGE_FILES = ["pyproject.toml", "README.md", "app", "artifact", "custom_kernels", "scripts/install-serve.sh"]


def _pypi_reachable() -> bool:
    try:
        socket.create_connection(("pypi.org", 443), timeout=3).close()
        return True
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_install_script_builds_a_torch_free_server(tmp_path, tiny_artifact_dir):
    if not _pypi_reachable():
        pytest.skip("PyPI is not reachable from here")
    context = tmp_path / "context"
    for name in IMAGE_FILES:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, context / name, ignore=shutil.ignore_patterns("__pycache__", "build"))
        elif src.exists():
            (context / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, context / name)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    r = subprocess.run(["bash", str(context / "scripts/install-serve.sh"), "cpu"], env={"PYTHON": str(python),
                       "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "serving runtime OK" in r.stdout
    listed = subprocess.run([str(python), "-m", "pip", "list"], capture_output=True, text=True).stdout
    assert "torch" not in listed and "transformers" not in listed

    with running_server(tiny_artifact_dir, python=python, cwd="/") as base:
        import httpx
        r = httpx.post(f"{base}/embed", json={"inputs": ["installed", ["a", "b"]]}, timeout=30)
        assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 128
        # the page's files are package data, the docs' bundles come with the `serve` extra
        for path in ("/", "/static/page.js", "/static/page.css", "/docs", "/static/swagger-ui-bundle.js"):
            assert httpx.get(f"{base}{path}", timeout=30).status_code == 200, path


def test_deps_only_installs_what_the_extra_needs_and_not_the_project(tmp_path):
    """The Dockerfile's first install layer, from pyproject.toml and the script alone: every requirement of
    the flavour's extra, its references to this project's other extras followed, and not the project
    (whose code comes in a later layer). pip is a recorder here: the arguments it is given."""
    import tomllib

    context = tmp_path / "context"
    (context / "scripts").mkdir(parents=True)
    shutil.copy2(ROOT / "pyproject.toml", context)
    shutil.copy2(ROOT / "scripts/install-serve.sh", context / "scripts")
    recorded = tmp_path / "pip-arguments"
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nif [ "$1 $2" = "-m pip" ]; then shift 2; printf "%s\\n" "$@" > {recorded}; exit 0; fi\n'
                      f'exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    for flavour, extra, added in (("cpu", "serve", []), ("gpu", "gpu", ["onnxruntime-gpu[cuda,cudnn]"])):
        r = subprocess.run(["bash", str(context / "scripts/install-serve.sh"), flavour, "--deps-only"],
                           env={"PYTHON": str(python), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr
        given = [a for a in recorded.read_text().splitlines() if a not in ("install", "off") and not a.startswith("-")]
        own = [f"{project['name']}[http]"]
        assert own == [x for x in extras[extra] if x.startswith(project["name"])]  # what this test follows
        assert given == project["dependencies"] + extras["http"] + [x for x in extras[extra] if x not in own] + added
        assert "serving runtime OK" not in r.stdout  # the project is not installed: nothing to check yet

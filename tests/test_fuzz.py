"""Fuzzing from the OpenAPI schema: schemathesis's own client sends generated valid and invalid requests
to every endpoint of a real server, in one process and with HTTP workers, and checks that none gets a 5xx,
that statuses, content types and bodies are the documented ones (errors in our error shape), and that
invalid bodies are refused. Its check that every schema-valid body is accepted is left out: the server
refuses some bodies the schema cannot describe (blank texts, a `dimensions` beyond the model's width), with
a documented 400 / 422."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_server import running_server

SCHEMATHESIS = shutil.which("schemathesis", path=str(Path(sys.executable).parent))


@pytest.mark.slow
@pytest.mark.skipif(SCHEMATHESIS is None, reason="schemathesis is not installed (it is in the dev extra)")
@pytest.mark.parametrize("workers", [1, 2])
def test_generated_requests_get_documented_answers_and_never_a_5xx(tiny_artifact_dir, workers, tmp_path):
    with running_server(tiny_artifact_dir, workers=workers, api_key="k") as base:
        done = subprocess.run([SCHEMATHESIS, "run", f"{base}/openapi.json", "-H", "Authorization: Bearer k",
                               "--checks", "all", "--exclude-checks", "positive_data_acceptance",
                               "--max-examples", "40", "--seed", "1",
                               "--generation-database", "none"],  # nothing written into the checkout
                              capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-4000:]
    assert "passed" in done.stdout and " 0 passed" not in done.stdout, done.stdout[-2000:]

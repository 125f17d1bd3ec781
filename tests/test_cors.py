"""cors_allow_origins: pages of the origins named may call the API from a browser (preflights answered,
Access-Control-* headers on every answer, errors too); other origins, and every origin when it is unset,
get no CORS headers, so browsers refuse them. In-process with httpx, and in headless Chromium against
`python -m app` from pages of two other origins."""
from __future__ import annotations

import contextlib
import functools
import http.server
import subprocess
import sys
import threading

import httpx
import pytest

from tests.headless_chromium import chrome
from tests.test_app import run, serving
from tests.test_server import ROOT, free_port, running_server

KEY = "cors-key"
ALLOWED = "https://app.example.com"
PREFLIGHT = {"access-control-request-method": "POST", "access-control-request-headers": "authorization,content-type"}


def test_an_allowed_origin_gets_preflights_and_headers_on_answers_and_errors(tiny_artifact_dir):
    async def go():
        origins = f"{ALLOWED},http://localhost:3000"
        async with serving(tiny_artifact_dir, cors_allow_origins=origins, api_key=KEY) as (c, _):
            auth = {"authorization": f"Bearer {KEY}", "origin": ALLOWED}
            return {
                "preflight": await c.options("/embed", headers={"origin": ALLOWED, **PREFLIGHT}),
                "other_preflight": await c.options("/embed", headers={"origin": "https://evil.example", **PREFLIGHT}),
                "embed": await c.post("/embed", json={"inputs": "from a browser"}, headers=auth),
                "no_key": await c.post("/embed", json={"inputs": "x"}, headers={"origin": ALLOWED}),
                "bad_body": await c.post("/embed", json={"inputs": ""}, headers=auth),
                "other_origin": await c.post("/embed", json={"inputs": "x"},
                                             headers={**auth, "origin": "https://evil.example"}),
                "no_origin": await c.post("/embed", json={"inputs": "x"}, headers={"authorization": f"Bearer {KEY}"}),
            }
    out = run(go())
    pre = out["preflight"]
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == ALLOWED
    assert "POST" in pre.headers["access-control-allow-methods"]
    assert "authorization" in pre.headers["access-control-allow-headers"].lower()
    other = out["other_preflight"]
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    assert other.json() == {"error": {"type": "invalid_request",  # the shape of every error
                                      "message": "CORS preflight refused: origin not allowed (cors_allow_origins)"}}
    embed = out["embed"]
    assert embed.status_code == 200 and embed.headers["access-control-allow-origin"] == ALLOWED
    assert {"x-tokenize-ms", "x-queue-ms", "x-inference-ms", "retry-after"} <= {
        h.strip() for h in embed.headers["access-control-expose-headers"].lower().split(",")}
    for name, status in (("no_key", 401), ("bad_body", 422)):  # a page can read why it failed
        assert out[name].status_code == status and out[name].headers["access-control-allow-origin"] == ALLOWED
        assert set(out[name].json()["error"]) == {"type", "message"}
    assert out["other_origin"].status_code == 200 and "access-control-allow-origin" not in out["other_origin"].headers
    assert out["no_origin"].status_code == 200 and "access-control-allow-origin" not in out["no_origin"].headers


def test_unset_there_are_no_cors_headers_and_no_preflight(tiny_artifact_dir):
    async def go():
        async with serving(tiny_artifact_dir) as (c, _):
            return (await c.options("/embed", headers={"origin": ALLOWED, **PREFLIGHT}),
                    await c.post("/embed", json={"inputs": "x"}, headers={"origin": ALLOWED}))
    preflight, embed = run(go())
    assert preflight.status_code == 405
    assert embed.status_code == 200 and not any(h.startswith("access-control-") for h in embed.headers)


@pytest.mark.parametrize("value", ["app.example.com", "https://a.example,", "https://a.example/path", "*,https://a.b"])
def test_a_malformed_origin_list_is_refused_in_one_line(tiny_artifact_dir, value):
    r = subprocess.run([sys.executable, "-m", "app", "--model-dir", str(tiny_artifact_dir), "--cors-allow-origins",
                        value], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "cors_allow_origins" in r.stderr and "Traceback" not in r.stderr, r.stderr


@contextlib.contextmanager
def _static_site(folder):
    """An origin of its own: a plain HTTP server of `folder` on a free loopback port."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
    site = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
    thread = threading.Thread(target=site.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{site.server_address[1]}"
    finally:
        site.shutdown()
        site.server_close()


_FETCH = """
const [url, key, done] = [arguments[0], arguments[1], arguments[arguments.length - 1]];
fetch(url, {method: "POST", headers: {"Authorization": "Bearer " + key, "Content-Type": "application/json"},
            body: JSON.stringify({inputs: "a text from a web page"})})
  .then(r => r.json().then(body => done({status: r.status, width: body.data ? body.data[0].embedding.length : 0,
                                          tokenizeMs: r.headers.get("x-tokenize-ms")})))
  .catch(e => done({error: String(e)}));
"""


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first browser test may apt-get Chromium
def test_a_browser_page_of_an_allowed_origin_embeds_and_one_of_another_origin_is_refused(tiny_artifact_dir, tmp_path):
    (tmp_path / "index.html").write_text("<!doctype html><title>another origin</title><p>a page")
    with _static_site(tmp_path) as allowed, _static_site(tmp_path) as other, \
            running_server(tiny_artifact_dir, api_key=KEY, cors_allow_origins=allowed) as base, chrome() as browser:
        answers = {}
        for origin in (allowed, other):
            browser.get(origin + "/")
            answers[origin] = browser.execute_async_script(_FETCH, base + "/embed", KEY)
    assert answers[allowed]["status"] == 200 and answers[allowed]["width"] == 128, answers
    assert float(answers[allowed]["tokenizeMs"]) >= 0  # an exposed header the page can read
    assert "Failed to fetch" in answers[other].get("error", ""), answers  # the browser refused the answer


def test_http_workers_answer_cors_as_one_process_does(tiny_artifact_dir):
    with running_server(tiny_artifact_dir, workers=2, cors_allow_origins=ALLOWED) as base:
        with httpx.Client(base_url=base, timeout=30) as c:
            preflight = c.options("/v1/embeddings", headers={"origin": ALLOWED, **PREFLIGHT})
            answers = [c.post("/v1/embeddings", json={"input": "x"}, headers={"origin": ALLOWED}) for _ in range(4)]
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == ALLOWED
    assert all(r.status_code == 200 and r.headers["access-control-allow-origin"] == ALLOWED for r in answers)

"""The page at / and the API docs: served from the package without a key and without any other host, and,
in headless Chromium against `python -m app`, drawing what the API computes."""
from __future__ import annotations

import base64
import contextlib
import json
import re
import shutil
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urljoin, urlsplit

import httpx
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from export.pipeline import export_artifact
from tests.headless_chromium import chrome
from tests.test_app import run, serving
from tests.test_cross_encoders import SHAPES, classifier_folder
from tests.test_server import running_server, start_server
from training.model import BertForPreTraining, preset_config
from training.model_folder import save_model_folder

ROOT = Path(__file__).resolve().parents[1]
ARTEFACTS = ROOT / "test-artifacts"  # git-ignored: the screenshots
KEY = "page-key"
A = "The quick brown fox jumps over the lazy dog."
B = "The lazy dog sleeps while the fox runs away."
TEXTS = ["The quick brown fox.", "A lazy dog sleeps.", "Dynamic batching packs requests.", "Servers embed text."]
QUERY = "how do cats sleep"
CANDIDATES = ["Cats sleep for most of the day, curled up somewhere warm.", "The stock market fell on Monday.",
              "a cat", "Dynamic batching packs requests.", "https://example.com/" + "a" * 200]
# viridis' ends, where page.js draws the smallest and the largest value of a heatmap
LOWEST, HIGHEST = (68, 1, 84), (253, 231, 37)


def linked_urls(html: str) -> list[str]:
    return re.findall(r"""(?:src|href)\s*=\s*["']([^"']+)""", html) + re.findall(r"""url:\s*'([^']+)'""", html)


def test_page_and_docs_need_no_key_and_no_other_host(tiny_artifact_dir):
    async def go():
        async with serving(tiny_artifact_dir, api_key=KEY) as (c, _):
            pages = {path: await c.get(path) for path in ("/", "/docs", "/redoc")}
            linked = {url: (await c.get(url)).status_code for path, r in pages.items()
                      for url in linked_urls(r.text) if not url.startswith("data:")}
            return pages, linked, await c.get("/info"), (await c.get("/openapi.json")).json()
    pages, linked, info, openapi = run(go())
    assert {p: r.status_code for p, r in pages.items()} == {"/": 200, "/docs": 200, "/redoc": 200}
    assert all(r.headers["content-type"].startswith("text/html") for r in pages.values())
    assert all("default-src 'self'" in r.headers["content-security-policy"] for r in pages.values())
    assert {"/static/page.js", "/static/page.css", "/static/swagger-ui-bundle.js", "/static/swagger-ui.css",
            "/static/redoc.standalone.js", "/openapi.json"} <= {urljoin("/", u) for u in linked}
    assert set(linked.values()) == {200}, linked
    assert all(not urlsplit(u).netloc for u in linked), f"a page links another host: {linked}"
    assert info.status_code == 401  # the API itself still needs the key
    assert not {"/docs", "/redoc"} & set(openapi["paths"])
    assert set(openapi["paths"]["/"]) == {"get", "post"}  # the page, and the TEI route beside it


def _wait(browser, condition, what: str, seconds: float = 60):
    from selenium.webdriver.support.ui import WebDriverWait
    return WebDriverWait(browser, seconds, poll_frequency=0.1).until(lambda b: condition(), message=what)


def _js(browser, script: str, *args):
    return browser.execute_script(script, *args)


def _fill(browser, element_id: str, text: str) -> None:
    _js(browser, "document.getElementById(arguments[0]).value = arguments[1]", element_id, text)


def _submit(browser, form_id: str) -> None:
    _js(browser, "document.querySelector(`#${arguments[0]} button`).click()", form_id)


def _drawn(browser, output_id: str, inputs: list[str]):
    """Waits until the output shows `inputs`' answer (the page drew its defaults first)."""
    def shown():
        drawn = _js(browser, "return document.getElementById(arguments[0]).dataset.inputs", output_id)
        return drawn is not None and json.loads(drawn) == inputs
    _wait(browser, shown, f"#{output_id} drawn for {inputs}")


def _shown(browser, selector: str) -> np.ndarray:
    """The numbers of a figure's table (textContent: the table is folded away)."""
    cells = _js(browser, "return [...document.querySelectorAll(arguments[0])].map(td => td.textContent)", selector)
    return np.array(cells, dtype=float)


def _vectors(b64: str, rows: int) -> np.ndarray:
    return np.frombuffer(base64.b64decode(b64), dtype="<f4").reshape(rows, -1).astype(np.float64)


def _cosines(u: np.ndarray, v: np.ndarray) -> np.ndarray:
    return (u / np.linalg.norm(u, axis=1, keepdims=True)) @ (v / np.linalg.norm(v, axis=1, keepdims=True)).T


def _screenshot(browser, name: str) -> Path:
    height = _js(browser, "return document.documentElement.scrollHeight + window.outerHeight - window.innerHeight")
    browser.set_window_size(1280, height)
    ARTEFACTS.mkdir(exist_ok=True)
    path = ARTEFACTS / name
    assert browser.save_screenshot(str(path))
    print(f"screenshot: {path}")
    return path


def _check_token_heatmap(browser, api: httpx.Client) -> None:
    _fill(browser, "sentence-a", A)
    _fill(browser, "sentence-b", B)
    _submit(browser, "tokens-form")
    _drawn(browser, "tokens-output", [A, B])
    data = api.post("/embed", json={"inputs": [A, B], "pooling": "none", "return_tokens": True,
                                    "encoding_format": "base64"}).json()["data"]
    tokens = [[t["token"] for t in item["tokens"]] for item in data]
    expected = _cosines(*(_vectors(item["token_embeddings"], len(t)) for item, t in zip(data, tokens)))
    n_a, n_b = expected.shape
    canvas = _js(browser, "return {...document.querySelector('#tokens-output canvas').dataset}")
    assert (int(canvas["rows"]), int(canvas["cols"])) == (n_a, n_b)
    assert _js(browser, "return [...document.querySelectorAll('#tokens-output tbody th')].map(t => t.textContent)") \
        == tokens[0]
    shown = _shown(browser, "#tokens-output td")
    assert shown.size == n_a * n_b  # one cell per (token of A, token of B)
    np.testing.assert_allclose(shown.reshape(n_a, n_b), expected, atol=1e-3)

    # The pixels: not blank, and the largest and smallest cosines drawn in the scale's two end colours.
    pixels = _js(browser, """
        const c = document.querySelector('#tokens-output canvas'), d = c.dataset;
        const ctx = c.getContext('2d'), dpr = c.width / parseFloat(c.style.width);
        const all = ctx.getImageData(0, 0, c.width, c.height).data, colours = new Set();
        let painted = 0;
        for (let k = 0; k < all.length; k += 4) {
          if (all[k + 3]) painted++;
          colours.add((all[k] << 16) | (all[k + 1] << 8) | all[k + 2]);
        }
        // above the number a wide cell has written at its centre, below its frame
        const at = ([i, j]) => Array.from(ctx.getImageData(
          Math.round((+d.x0 + (j + 0.5) * d.cell) * dpr), Math.round((+d.y0 + i * d.cell + Math.min(6, d.cell / 2)) * dpr),
          1, 1).data.slice(0, 3));
        return {painted: painted / (all.length / 4), colours: colours.size, low: at(arguments[0]), high: at(arguments[1])};
        """, [int(x) for x in np.unravel_index(expected.argmin(), expected.shape)],
        [int(x) for x in np.unravel_index(expected.argmax(), expected.shape)])
    assert pixels["painted"] > 0.5 and pixels["colours"] > 50, pixels
    np.testing.assert_allclose(pixels["low"], LOWEST, atol=2)
    np.testing.assert_allclose(pixels["high"], HIGHEST, atol=2)


def _check_pooling_matrices(browser, api: httpx.Client, poolings: list[str]) -> None:
    _fill(browser, "texts-input", "\n".join(TEXTS))
    _submit(browser, "texts-form")
    _drawn(browser, "texts-output", TEXTS)
    shown = _js(browser, "return [...document.querySelectorAll('#texts-output figure')].map(f => f.dataset.pooling)")
    assert shown == [p for p in poolings if p != "none"]
    for pooling in shown:
        data = api.post("/embed", json={"inputs": TEXTS, "pooling": pooling}).json()["data"]
        vectors = np.array([item["embedding"] for item in data], dtype=np.float64)
        values = _shown(browser, f"#texts-output figure[data-pooling='{pooling}'] td").reshape(len(TEXTS), -1)
        np.testing.assert_allclose(values, _cosines(vectors, vectors), atol=1e-3, err_msg=pooling)


def _check_nsp(browser, api: httpx.Client) -> None:
    _fill(browser, "nsp-a", A)
    _fill(browser, "nsp-b", B)
    _submit(browser, "nsp-form")
    _drawn(browser, "nsp-output", [A, B])
    expected = [item["is_next"] for item in api.post("/nsp", json={"pairs": [[A, B], [B, A]]}).json()["data"]]
    rows = _js(browser, "return [...document.querySelectorAll('#nsp-output .nsp-row')]"
                        ".map(r => [+r.dataset.isNext, r.querySelector('.score').textContent])")
    np.testing.assert_allclose([p for p, _ in rows], expected, atol=1e-6)
    np.testing.assert_allclose([float(text.split(" %")[0]) for _, text in rows], np.array(expected) * 100, atol=0.051)


def _requested_urls(browser) -> list[str]:
    """Every URL the browser's pages fetched since the last call (Chrome's performance log), less those
    that the pages' Content-Security-Policy kept from leaving the browser."""
    messages = [json.loads(entry["message"])["message"] for entry in browser.get_log("performance")]
    blocked = {m["params"]["requestId"] for m in messages
               if m["method"] == "Network.loadingFailed" and m["params"].get("blockedReason") == "csp"}
    return [m["params"]["request"]["url"] for m in messages
            if m["method"] == "Network.requestWillBeSent" and m["params"]["requestId"] not in blocked]


def _errors(browser) -> list[dict]:
    """The page's errors since the last call; failed requests (the 401s before the key is given) aside."""
    return [e for e in browser.get_log("browser") if e["level"] == "SEVERE" and e["source"] != "network"]


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first browser test may apt-get Chromium
def test_the_page_draws_what_the_api_computes(tiny_artifact_dir):
    with running_server(tiny_artifact_dir, api_key=KEY) as base, chrome() as browser, \
            httpx.Client(base_url=base, headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as api:
        browser.get(base + "/")
        # The server has a key: the page loads without it, then asks for it.
        _wait(browser, lambda: "needs an API key" in browser.find_element("id", "status").text, "asked for the key")
        browser.find_element("id", "api-key").send_keys(KEY)
        _submit(browser, "key-form")
        info = api.get("/info").json()
        _wait(browser, lambda: browser.find_element("id", "model").text.startswith(info["model"] + ":"),
              "the model described")

        _check_token_heatmap(browser, api)
        _check_pooling_matrices(browser, api, info["poolings"])
        _check_nsp(browser, api)
        # a pre-trained encoder, no cross-encoder: the ranking section says so instead of a form that would fail
        assert info["classifier_labels"] == []
        assert "no cross-encoder head" in browser.find_element("id", "rerank-missing").text
        assert not browser.find_element("id", "rerank-form").is_displayed()
        assert not browser.find_elements("css selector", "#model a")
        assert not _errors(browser)
        _screenshot(browser, "page.png")

        browser.get(base + "/docs")  # Swagger UI draws every operation from /openapi.json
        _wait(browser, lambda: "/embed" in _js(browser, "return [...document.querySelectorAll('.opblock-summary-path')]"
                                                        ".map(e => e.textContent).join(' ')"), "Swagger UI drawn")
        assert not _errors(browser)
        _screenshot(browser, "docs.png")
        browser.get(base + "/redoc")  # whose Redocly logo from cdn.redoc.ly the policy blocks
        _wait(browser, lambda: "/embed" in browser.find_element("tag name", "body").text, "ReDoc drawn")
        urls = _requested_urls(browser)
        assert {base + "/", base + "/static/page.js", base + "/embed", base + "/nsp", base + "/docs",
                base + "/static/swagger-ui-bundle.js", base + "/openapi.json"} <= set(urls)
        elsewhere = [u for u in urls if urlsplit(u).scheme not in ("data", "blob") and not u.startswith(base + "/")]
        assert not elsewhere, f"requests to another host: {elsewhere}"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_page_says_when_the_model_has_no_nsp_head(tiny_artifact_dir, tmp_path):
    folder = tmp_path / "no-nsp"
    shutil.copytree(tiny_artifact_dir, folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps({**manifest, "has_nsp_head": False}))
    with running_server(folder) as base, chrome() as browser:
        browser.get(base + "/")
        _wait(browser, lambda: browser.find_element("id", "nsp-missing").is_displayed(), "the no-NSP note")
        assert not browser.find_element("id", "nsp-form").is_displayed()
        _wait(browser, lambda: _js(browser, "return document.getElementById('tokens-output').dataset.inputs"),
              "the rest of the page works")


def _classifier_artifact(root: Path, tokenizer_dir: Path, num_labels: int) -> Path:
    """A tiny random transformers BertForSequenceClassification exported as the server loads it: one label
    is a cross-encoder."""
    folder, _ = classifier_folder(root / "hf", tokenizer_dir, num_labels, seed=3)
    export_artifact(folder, root / "art", parity_shapes=SHAPES)
    return root / "art"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_page_ranks_texts_as_the_cross_encoder_scores_them(tmp_path, tiny_tokenizer_dir):
    artifact = _classifier_artifact(tmp_path, tiny_tokenizer_dir, 1)
    with running_server(artifact) as base, chrome() as browser, httpx.Client(base_url=base, timeout=30) as api:
        browser.get(base + "/")
        _wait(browser, lambda: _js(browser, "return document.getElementById('rerank-output').dataset.inputs"),
              "the page's own texts ranked")
        assert not browser.find_element("id", "rerank-missing").is_displayed()
        assert browser.find_element("id", "nsp-missing").is_displayed()  # a cross-encoder has no NSP head
        # the header points to the section, last on a page that is mostly about embeddings
        assert urlsplit(browser.find_element("css selector", "#model a").get_attribute("href")).fragment == "rerank"
        _fill(browser, "rerank-query", QUERY)
        _fill(browser, "rerank-texts", "\n".join(CANDIDATES))
        _submit(browser, "rerank-form")
        _drawn(browser, "rerank-output", [QUERY, *CANDIDATES])
        ranks = api.post("/rerank", json={"query": QUERY, "texts": CANDIDATES}).json()
        shown = _js(browser, """return [...document.querySelectorAll('#rerank-output li')].map(li => ({
            index: +li.dataset.index, score: +li.dataset.score, shown: li.querySelector('.score').textContent,
            text: li.querySelector('.text').textContent,
            bar: li.querySelector('.bar span').offsetWidth / li.querySelector('.bar').clientWidth}))""")
        # most relevant first, as /rerank orders them, each text under its own score
        assert [r["index"] for r in shown] == [r["index"] for r in ranks]
        assert [r["text"] for r in shown] == [CANDIDATES[r["index"]] for r in ranks]
        expected = [r["score"] for r in ranks]
        np.testing.assert_allclose([r["score"] for r in shown], expected, atol=1e-6)
        np.testing.assert_allclose([float(r["shown"]) for r in shown], expected, atol=5e-4)
        np.testing.assert_allclose([r["bar"] for r in shown], expected, atol=0.01)  # a bar's length is its score
        assert not _errors(browser)
        _screenshot(browser, "page-cross-encoder.png")

        # a phone: each text under its bar, the long URL wrapped, nothing past the screen's right edge
        browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                                {"width": 360, "height": 740, "deviceScaleFactor": 1, "mobile": True})
        page = _js(browser, "return [document.documentElement.scrollWidth, document.documentElement.clientWidth]")
        assert page == [360, 360], page
        edges = _js(browser, "return [...document.querySelectorAll('#rerank-output .rank > span')]"
                             ".map(s => s.getBoundingClientRect().right)")
        assert len(edges) == 3 * len(CANDIDATES) and max(edges) <= 360, edges

        _fill(browser, "rerank-query", " ")
        _submit(browser, "rerank-form")
        _wait(browser, lambda: browser.find_element("css selector", "#rerank .error").is_displayed(), "an error")
        assert browser.find_element("css selector", "#rerank .error").text == "Type a query."


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_page_says_a_classifier_of_several_labels_cannot_rank(tmp_path, tiny_tokenizer_dir):
    artifact = _classifier_artifact(tmp_path, tiny_tokenizer_dir, 3)
    with running_server(artifact) as base, chrome() as browser:
        browser.get(base + "/")
        _wait(browser, lambda: browser.find_element("id", "rerank-missing").is_displayed(), "the note")
        note = browser.find_element("id", "rerank-missing").text
        assert "3 labels (negative, neutral, positive)" in note and "/predict" in note, note
        assert not browser.find_element("id", "rerank-form").is_displayed()
        _wait(browser, lambda: _js(browser, "return document.getElementById('texts-output').dataset.inputs"),
              "the rest of the page works")
        assert not _errors(browser)


@pytest.fixture(scope="module")
def long_artifact_dir(tmp_path_factory, tiny_tokenizer_dir):
    """A tiny random model served up to 512 tokens a text, as BERT-base is."""
    torch.manual_seed(0)
    vocab_size = Tokenizer.from_file(str(tiny_tokenizer_dir / "tokenizer.json")).get_vocab_size()
    model = BertForPreTraining(preset_config("tiny", vocab_size=vocab_size, max_position_embeddings=512))
    root = tmp_path_factory.mktemp("long")
    export_artifact(save_model_folder(model, tiny_tokenizer_dir, root / "model"), root / "art")
    return root / "art"


def _answered(browser, section: str, output_id: str, inputs: list[str]) -> str | None:
    """Waits until the section drew `inputs`' answer or showed an error; returns the error's text."""
    def done():
        drawn = _js(browser, "return document.getElementById(arguments[0]).dataset.inputs", output_id)
        return (drawn is not None and json.loads(drawn) == inputs) or _js(
            browser, "return !document.querySelector(`#${arguments[0]} .error`).hidden", section)
    _wait(browser, done, f"#{output_id} drawn or an error shown")
    error = browser.find_element("css selector", f"#{section} .error")
    return error.text if error.is_displayed() else None


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_page_compares_two_texts_of_512_tokens(long_artifact_dir):
    long_a, long_b = " ".join([A] * 80), " ".join([B] * 80)  # each cut at 512 tokens: a 512 x 512 heatmap
    with running_server(long_artifact_dir) as base, chrome() as browser, \
            httpx.Client(base_url=base, timeout=60) as api:
        browser.get(base + "/")
        _wait(browser, lambda: _js(browser, "return document.getElementById('tokens-output').dataset.inputs"),
              "the first heatmap drawn")
        _fill(browser, "sentence-a", long_a)
        _fill(browser, "sentence-b", long_b)
        _submit(browser, "tokens-form")
        assert _answered(browser, "tokens", "tokens-output", [long_a, long_b]) is None
        data = api.post("/embed", json={"inputs": [long_a, long_b], "pooling": "none", "return_tokens": True,
                                        "encoding_format": "base64"}).json()["data"]
        expected = _cosines(*(_vectors(item["token_embeddings"], len(item["tokens"])) for item in data))
        assert expected.shape == (512, 512)
        canvas = _js(browser, "return {...document.querySelector('#tokens-output canvas').dataset}")
        assert (int(canvas["rows"]), int(canvas["cols"])) == expected.shape
        # the colour scale's ends, the smallest and the largest cosine of all 262,144
        ends = _js(browser, "return [...document.querySelectorAll('#tokens-output .legend > span')]"
                            ".map(s => parseFloat(s.textContent))")
        np.testing.assert_allclose([ends[0], ends[2]], [expected.min(), expected.max()], atol=0.006)
        assert not _errors(browser)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_page_fits_a_phones_width(tiny_artifact_dir):
    long_a, long_b = " ".join([A] * 4), " ".join([B] * 4)  # 40-odd tokens each: a heatmap wider than the screen
    with running_server(tiny_artifact_dir) as base, chrome() as browser:
        # Chromium's window is never narrower than 500 pixels: a phone's viewport, as DevTools emulates one
        browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                                {"width": 360, "height": 740, "deviceScaleFactor": 1, "mobile": True})
        browser.get(base + "/")
        _wait(browser, lambda: _js(browser, "return document.getElementById('nsp-output').dataset.inputs"), "NSP drawn")
        _fill(browser, "sentence-a", long_a)
        _fill(browser, "sentence-b", long_b)
        _submit(browser, "tokens-form")
        _drawn(browser, "tokens-output", [long_a, long_b])
        assert _js(browser, "return document.querySelector('#tokens-output canvas').clientWidth") > 360
        texts = [*TEXTS, "https://example.com/" + "a" * 200]  # listed under its number, in one word
        _fill(browser, "texts-input", "\n".join(texts))
        _submit(browser, "texts-form")
        _drawn(browser, "texts-output", texts)
        # nothing past the screen's right edge: the heatmap scrolls in its section, the NSP scores and the URL wrap
        page = _js(browser, "return [document.documentElement.scrollWidth, document.documentElement.clientWidth]")
        assert page == [360, 360], page
        edges = _js(browser, "return [...document.querySelectorAll('#nsp-output .nsp-row > span')]"
                             ".map(s => s.getBoundingClientRect().right)")
        assert len(edges) == 8 and max(edges) <= 360, edges
        assert not _errors(browser)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_page_says_when_the_server_stopped(tiny_artifact_dir):
    proc, base = start_server(tiny_artifact_dir)
    try:
        with chrome() as browser:
            browser.get(base + "/")
            _wait(browser, lambda: _js(browser, "return document.getElementById('tokens-output').dataset.inputs"),
                  "the first heatmap drawn")
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=20) == 0
            _submit(browser, "tokens-form")
            _wait(browser, lambda: browser.find_element("css selector", "#tokens .error").is_displayed(), "an error")
            assert browser.find_element("css selector", "#tokens .error").text.startswith("The server did not answer")
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_sections_error_is_announced(tiny_artifact_dir):
    with running_server(tiny_artifact_dir) as base, chrome() as browser:
        browser.get(base + "/")
        _wait(browser, lambda: _js(browser, "return document.getElementById('tokens-output').dataset.inputs"),
              "the first heatmap drawn")
        _fill(browser, "sentence-a", " ")
        _submit(browser, "tokens-form")
        _wait(browser, lambda: browser.find_element("css selector", "#tokens .error").is_displayed(), "an error")
        # a screen reader reads out an alert's text when it appears, wherever the focus is
        nodes = browser.execute_cdp_cmd("Accessibility.getFullAXTree", {})["nodes"]
        alerts = [n for n in nodes if n.get("role", {}).get("value") == "alert" and not n.get("ignored")]
        texts = [n.get("name", {}).get("value") for n in nodes if n.get("role", {}).get("value") == "StaticText"
                 and n.get("parentId") in {a["nodeId"] for a in alerts}]
        assert texts == ["Type a sentence in both fields."], (alerts, texts)

        # each table's expander has a name of its own (its figure's), not eight alike "The numbers"
        _wait(browser, lambda: _js(browser, "return document.querySelectorAll('#texts-output figure').length") > 1,
              "the texts' matrices drawn")
        nodes = browser.execute_cdp_cmd("Accessibility.getFullAXTree", {})["nodes"]
        names = [n.get("name", {}).get("value") for n in nodes
                 if n.get("role", {}).get("value") == "DisclosureTriangle" and not n.get("ignored")]
        texts_figures = _js(browser, "return document.querySelectorAll('#texts-output figure').length")
        assert len(names) == texts_figures + 1 and len(set(names)) == len(names), names
        assert all(name.startswith("The numbers") for name in names), names


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_page_loads_on_a_server_that_serves_one_request_at_once(tiny_artifact_dir):
    with running_server(tiny_artifact_dir, max_concurrent_requests=1) as base, chrome() as browser:
        browser.get(base + "/")
        for output in ("tokens-output", "texts-output", "nsp-output"):
            _wait(browser, lambda: _js(browser, "return document.getElementById(arguments[0]).dataset.inputs", output)
                  or any(e.is_displayed() for e in browser.find_elements("css selector", ".error")), f"{output} drawn")
        assert [e.text for e in browser.find_elements("css selector", ".error") if e.is_displayed()] == []


@contextlib.contextmanager
def _behind_prefix(base: str, prefix: str):
    """A reverse proxy on a loopback port that serves `base` under `prefix`, cutting the prefix off as nginx's
    `location /bert/ { proxy_pass http://server/; }` does; yields its URL for `prefix`."""
    class Proxy(BaseHTTPRequestHandler):
        def forward(self):
            if not self.path.startswith(prefix + "/"):
                self.send_error(404)
                return
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")}
            r = httpx.request(self.command, base + self.path[len(prefix):], headers=headers, content=body, timeout=60)
            self.send_response(r.status_code)
            for k, v in r.headers.items():
                if k.lower() not in ("content-length", "content-encoding", "transfer-encoding", "connection"):
                    self.send_header(k, v)
            self.send_header("content-length", str(len(r.content)))
            self.end_headers()
            self.wfile.write(r.content)

        do_GET = do_POST = forward

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Proxy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}{prefix}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_page_and_the_docs_behind_a_path_prefix(tiny_artifact_dir):
    with running_server(tiny_artifact_dir) as base, _behind_prefix(base, "/bert") as url, chrome() as browser:
        browser.get(url + "/")
        _wait(browser, lambda: _js(browser, "return document.getElementById('nsp-output').dataset.inputs"), "NSP drawn")
        browser.find_element("link text", "API docs").click()
        _wait(browser, lambda: "/embed" in _js(browser, "return [...document.querySelectorAll('.opblock-summary-path')]"
                                                        ".map(e => e.textContent).join(' ')"), "Swagger UI drawn")
        assert not _errors(browser)
        browser.get(url + "/redoc")
        _wait(browser, lambda: "/embed" in browser.find_element("tag name", "body").text, "ReDoc drawn")
        urls = _requested_urls(browser)
        assert {url + "/static/page.js", url + "/embed", url + "/openapi.json", url + "/static/redoc.standalone.js"} \
            <= set(urls)
        assert not [u for u in urls if urlsplit(u).scheme not in ("data", "blob") and not u.startswith(url + "/")]


def _try_out(browser, method: str, path: str, body: dict | None = None) -> tuple[str, str, str]:
    """Swagger UI's own way through an operation: unfold it, "Try it out", type the body, "Execute"; returns
    the request URL it shows, the status it shows and the text of the answer it shows."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    _wait(browser, lambda: _js(browser, "return document.querySelectorAll('.opblock').length"), "Swagger UI drawn")
    block = _js(browser, """return [...document.querySelectorAll('.opblock')].find(b =>
        b.querySelector('.opblock-summary-method').textContent === arguments[0]
        && b.querySelector('.opblock-summary-path').dataset.path === arguments[1])""", method, path)
    block.find_element(By.CSS_SELECTOR, ".opblock-summary").click()
    _wait(browser, lambda: block.find_elements(By.CSS_SELECTOR, ".try-out__btn"), f"{method} {path} unfolded")
    block.find_element(By.CSS_SELECTOR, ".try-out__btn").click()
    if body is not None:
        editor = block.find_element(By.CSS_SELECTOR, "textarea.body-param__text")
        editor.send_keys(Keys.CONTROL, "a")
        editor.send_keys(Keys.DELETE, json.dumps(body))
    block.find_element(By.CSS_SELECTOR, "button.execute").click()
    answered = ".live-responses-table tr.response"
    _wait(browser, lambda: block.find_elements(By.CSS_SELECTOR, answered), f"{method} {path} answered")
    url = block.find_element(By.CSS_SELECTOR, ".request-url pre").text
    status = block.find_element(By.CSS_SELECTOR, f"{answered} .response-col_status").text.split()[0]
    answer = block.find_element(By.CSS_SELECTOR, f"{answered} .highlight-code pre").get_attribute("textContent")
    return url, status, answer


def _authorize(browser, key: str) -> None:
    """Swagger UI's "Authorize": the key typed into its dialog, sent as `Authorization: Bearer` from then on."""
    from selenium.webdriver.common.by import By

    _wait(browser, lambda: browser.find_elements(By.CSS_SELECTOR, "button.authorize"), "Swagger UI drawn")
    browser.find_element(By.CSS_SELECTOR, "button.authorize").click()
    _wait(browser, lambda: browser.find_elements(By.CSS_SELECTOR, ".auth-container input"), "the key asked for")
    browser.find_element(By.CSS_SELECTOR, ".auth-container input").send_keys(key)
    browser.find_element(By.CSS_SELECTOR, ".auth-container button.authorize").click()
    browser.find_element(By.CSS_SELECTOR, ".auth-container button.btn-done").click()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_swagger_ui_tries_the_api_out_behind_a_path_prefix_and_directly(tiny_artifact_dir):
    """The proxy cuts /bert off and says nothing else (no X-Forwarded-Prefix), as nginx's plain `location`
    does, and the server is told nothing of it: "Execute" in /bert/docs reaches the server through the proxy,
    and in /docs straight."""
    with running_server(tiny_artifact_dir, api_key=KEY) as base, _behind_prefix(base, "/bert") as url, \
            chrome() as browser, httpx.Client(base_url=base, headers={"Authorization": f"Bearer {KEY}"}) as api:
        dimensions = api.get("/info").json()["dimensions"]
        for where in (url, base):
            browser.get(where + "/docs")
            _authorize(browser, KEY)
            sent, status, answer = _try_out(browser, "POST", "/v1/embeddings", {"input": A})
            assert (sent, status) == (where + "/v1/embeddings", "200"), (sent, status, answer)
            assert len(json.loads(answer)["data"][0]["embedding"]) == dimensions
            sent, status, answer = _try_out(browser, "GET", "/info")
            assert (sent, status, json.loads(answer)["dimensions"]) == (where + "/info", "200", dimensions), answer
            requested = _requested_urls(browser)
            assert {where + "/openapi.json", where + "/v1/embeddings", where + "/info"} <= set(requested), requested
            assert not _errors(browser)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_browser_asks_for_the_page_again_each_time(tiny_artifact_dir):
    """After an upgrade the next visit shows the new page, never the old one (or the new with the old page.js)
    from the browser's cache: each file is asked for again (answered 304 while unchanged)."""
    with running_server(tiny_artifact_dir) as base, chrome() as browser:
        browser.get(base + "/")
        described = "return document.getElementById('model').textContent.includes(':')"
        _wait(browser, lambda: _js(browser, described), "the model described")
        browser.get_log("performance")
        browser.get(base + "/")  # a visit, as from a bookmark: not a reload, which asks anyway
        _wait(browser, lambda: _js(browser, described), "the model described again")
        messages = [json.loads(entry["message"])["message"] for entry in browser.get_log("performance")]
        cached = {m["params"]["requestId"] for m in messages if m["method"] == "Network.requestServedFromCache"}
        answers = {m["params"]["response"]["url"]: (m["params"]["response"]["status"],
                                                    m["params"]["requestId"] in cached
                                                    or m["params"]["response"].get("fromDiskCache"))
                   for m in messages if m["method"] == "Network.responseReceived"}
        expected = {"/": (200, False), "/static/page.js": (304, False), "/static/page.css": (304, False)}
        assert {path: answers.get(base + path) for path in expected} == expected, answers

"""Start-up cost of the integrity check: Manifest.verify over an artifact against `python -m app` to /ready.

    python bench/make_base_model.py /tmp/base && python -m export --model /tmp/base/model --out /tmp/base-art
    python bench/startup_integrity.py
"""
import subprocess, sys, time, urllib.request, statistics
from pathlib import Path
ROOT = str(Path(__file__).resolve().parents[1])
sys.path.insert(0, ROOT)
from artifact.manifest import read_manifest
art = sys.argv[1] if len(sys.argv) > 1 else "/tmp/base-art"
verify, ready = [], []
for i, port in enumerate(range(8801, 8805)):
    m = read_manifest(art)
    t = time.perf_counter(); m.verify(art, m.files_sha256); verify.append(time.perf_counter() - t)
    t = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "app", "--model-dir", art, "--port", str(port)], cwd=ROOT,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while True:
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1).status == 200:
                break
        except Exception:
            time.sleep(0.05)
    ready.append(time.perf_counter() - t)
    p.terminate(); p.wait()
print(f"verify (344 MB model.onnx + tokenizer): median {statistics.median(verify):.2f} s {[round(x,2) for x in verify]}")
print(f"python -m app to /ready: median {statistics.median(ready):.2f} s {[round(x,2) for x in ready]}")

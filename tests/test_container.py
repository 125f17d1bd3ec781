"""The CPU image, built from our Dockerfile with rootful podman and run against a tiny artifact: /ready,
/embed, the HEALTHCHECK, a non-root user, a start without ONNX Runtime warnings, a clean stop.

Needs root. podman, runc and debootstrap are installed with apt-get where missing. No registry is
needed: the base image, which stands in for python:3.11-slim, is made with debootstrap from the host's
Debian mirror and kept under a fixed tag on purpose (a cache: debootstrap takes a minute or two). The
image built, its container and the temporary folders are removed, also when the test fails."""
from __future__ import annotations

import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from tests.test_server import free_port

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
TOOLS = ("podman", "runc", "debootstrap")  # Debian's package names are the commands' names
BASE_PACKAGES = "python3,python3-venv,python3-pip,python-is-python3,ca-certificates"
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")
READY_WITHIN_S = 120  # the HEALTHCHECK's start period
# Room for the server to drain and shut down on SIGTERM; past it podman kills it (exit 137: the test fails).
STOP_TIMEOUT_S = 30


def test_the_cpu_target_never_names_the_cuda_image():
    """The classic builder builds every stage up to the target; for `--target cpu` none may need CUDA."""
    lines = [line for line in DOCKERFILE.read_text().splitlines() if line.strip() and not line.startswith("#")]
    starts = [i for i, line in enumerate(lines) if line.startswith("FROM ")]
    names = [lines[i].split()[-1] for i in starts]
    assert names[-1] == "gpu", "the GPU image is the default target: the last stage"
    cpu_end = starts[names.index("cpu") + 1]
    later_stages = names[names.index("cpu") + 1:]
    up_to_cpu = [line for line in lines[:cpu_end] if not line.startswith("ARG ")]
    assert not [line for line in up_to_cpu if re.search("cuda|nvidia", line, re.I)
                or set(re.findall(r"(?:--from=|^FROM )(\S+)", line)) & set(later_stages)]


def _runs_app(pid: int) -> bool:
    """Whether the process has exec'd `python -m app` (before that it is unshare's forked child)."""
    return b"-m\x00app\x00" in Path(f"/proc/{pid}/cmdline").read_bytes()


def _blocked_signals(pid: int) -> int:
    (mask,) = re.findall(r"^SigBlk:\s*([0-9a-f]+)$", Path(f"/proc/{pid}/status").read_text(), re.M)
    return int(mask, 16)


def test_a_sigterm_while_the_server_imports_stops_it_as_pid_1(tiny_artifact_dir):
    """In the image `python -m app` is PID 1, and the kernel drops a signal that PID 1 has no handler for:
    a `docker stop` or pod deletion while its modules import must still stop it, not leave it to start,
    serve and be killed at the end of the grace period. PID 1 of a PID namespace of its own, no image."""
    if (os.geteuid() != 0 or not shutil.which("unshare")
            or subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True).returncode):
        pytest.skip("needs root, unshare (util-linux) and the right to make a PID namespace")
    env = {k: v for k, v in os.environ.items() if not k.startswith("BERTSERVE_")}
    proc = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-m", "app",
                             "--model-dir", str(tiny_artifact_dir), "--port", str(free_port())],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
        while not (server := children.read_text().split()) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert server, "unshare started no process"
        # SIGINT and SIGTERM held by app/__main__.py, which is importing the server's modules before any
        # handler is in place. Its own mask, not unshare's before the exec: a signal that PID 1 does not hold
        # and has no handler for is dropped, and the test would wait for a server that never heard it.
        held = (1 << (signal.SIGINT - 1)) | (1 << (signal.SIGTERM - 1))
        while not (_runs_app(int(server[0])) and _blocked_signals(int(server[0])) & held == held) \
                and time.monotonic() < deadline:
            time.sleep(0.005)
        os.kill(int(server[0]), signal.SIGTERM)
        rc = proc.wait(timeout=60)  # the modules finish importing first: slow on a loaded 2-core machine
    finally:
        if proc.poll() is None:
            proc.kill()
    log = proc.stdout.read()
    assert rc == 0 and "Traceback" not in log and "startup complete" not in log, f"exit {rc}:\n{log}"


def _reachable(url: str) -> bool:
    parts = urlsplit(url)
    try:
        socket.create_connection((parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)),
                                 timeout=3).close()
        return True
    except OSError:
        return False


def _debian_mirror() -> str | None:
    """The first mirror in the host's apt sources (deb822 .sources files, then sources.list)."""
    for sources in sorted(Path("/etc/apt/sources.list.d").glob("*.sources")):
        if m := re.search(r"^URIs:\s*(\S+)", sources.read_text(), re.M):
            return m.group(1)
    listed = Path("/etc/apt/sources.list")
    if listed.exists() and (m := re.search(r"^deb\s+(?:\[[^]]*\]\s+)?(\S+)", listed.read_text(), re.M)):
        return m.group(1)
    return None


def _codename() -> str | None:
    m = re.search(r"^VERSION_CODENAME=(\w+)", Path("/etc/os-release").read_text(), re.M)
    return m.group(1) if m else None


def _run(cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    assert r.returncode == 0, f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-3000:]}{r.stderr[-3000:]}"
    return r


def _install_tools() -> None:
    missing = [tool for tool in TOOLS if not shutil.which(tool)]
    if not missing:
        return
    if not shutil.which("apt-get"):
        pytest.skip(f"{', '.join(missing)} not installed, and no apt-get to install them")
    mirror = _debian_mirror()
    if not mirror or not _reachable(mirror):
        pytest.skip(f"{', '.join(missing)} not installed, and the Debian mirror ({mirror}) is not reachable")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    _run(["apt-get", "update", "-q"], timeout=300, env=env)
    _run(["apt-get", "install", "-y", "-q", *missing], timeout=600, env=env)


def _container_ulimits() -> tuple[int, int]:
    """Open files and processes for the containers, no higher than podman's own limits (which it may not
    raise without CAP_SYS_RESOURCE): this process's hard limits, at most 2**20, and for processes also
    the kernel's pid_max, to which podman lowers its own."""
    def hard(limit: int) -> int:
        value = resource.getrlimit(limit)[1]
        return 2**20 if value == resource.RLIM_INFINITY else min(value, 2**20)
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    return hard(resource.RLIMIT_NOFILE), min(hard(resource.RLIMIT_NPROC), pid_max)


@pytest.fixture(scope="module")
def podman():
    """Runs rootful podman with a containers.conf of its own; skips where podman cannot be had."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the image is built and run with rootful podman")
    _install_tools()
    with tempfile.TemporaryDirectory(prefix="bertserve-podman-") as conf_dir:
        # Limits podman can grant (its defaults ask for more), and runc: crun refuses a hybrid cgroup v1 + v2 host.
        nofile, nproc = _container_ulimits()
        conf = Path(conf_dir) / "containers.conf"
        conf.write_text(f'[containers]\ndefault_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]\n'
                        '[engine]\nruntime = "runc"\n')
        env = {**os.environ, "CONTAINERS_CONF": str(conf)}

        def run(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
            if check:
                return _run(["podman", *args], timeout=timeout, env=env)
            return subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, env=env)
        yield run


@pytest.fixture(scope="module")
def base_image(podman):
    """A Debian image with python3 and venv, made with debootstrap; kept between runs."""
    codename = _codename()
    tag = f"localhost/bertserve-test-base:{codename}"
    if podman("image", "exists", tag, check=False).returncode == 0:
        return tag
    mirror = _debian_mirror()
    if not codename or not mirror or not _reachable(mirror):
        pytest.skip(f"no base image {tag}, and no reachable Debian mirror ({mirror}) to make one")
    with tempfile.TemporaryDirectory(prefix="bertserve-rootfs-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        _run(["debootstrap", "--variant=minbase", f"--include={BASE_PACKAGES}", codename, str(rootfs), mirror],
             timeout=900)
        for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for entry in (rootfs / cache).glob("*"):
                if entry.is_file():
                    entry.unlink()
        # pip may read its own CA list (certifi); make it read the system store, which the build mounts over.
        (rootfs / "etc/pip.conf").write_text(f"[global]\ncert = {HOST_CA}\n")
        tarball = Path(tmp) / "rootfs.tar"
        _run(["tar", "-C", str(rootfs), "-cf", str(tarball), "."], timeout=300)
        podman("import", str(tarball), tag, timeout=300)
    return tag


@pytest.fixture(scope="module")
def cpu_image(podman, base_image):
    """`--target cpu` of our Dockerfile on the base image; removed afterwards."""
    if not _reachable("https://pypi.org"):
        pytest.skip("PyPI is not reachable from here: the build installs the serving runtime from it")
    tag = f"localhost/bertserve-test:{uuid.uuid4().hex[:12]}"
    # --format docker: the OCI format has no HEALTHCHECK. --layers=false: no intermediate images stay behind.
    # --network host and the host's CA bundle, for the RUN steps only: pip reaches PyPI as this host does
    # (which may be through a TLS-intercepting proxy).
    mount = ["-v", f"{HOST_CA}:{HOST_CA}:ro"] if HOST_CA.exists() else []
    try:
        podman("build", "--format", "docker", "--layers=false", "--network", "host", "--target", "cpu",
               "--build-arg", f"PYTHON_IMAGE={base_image}", *mount, "-t", tag, str(ROOT), timeout=900)
        yield tag
    finally:
        podman("rmi", "-f", tag, check=False)


def _wait_ready(podman, name: str, base: str) -> None:
    deadline = time.monotonic() + READY_WITHIN_S
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/ready", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if podman("inspect", "-f", "{{.State.Running}}", name).stdout.strip() != "true":
            pytest.fail(f"the container exited:\n{_logs(podman, name)}")
        time.sleep(0.1)
    pytest.fail(f"/ready not 200 within {READY_WITHIN_S} s:\n{_logs(podman, name)}")


def _logs(podman, name: str) -> str:
    r = podman("logs", name, check=False)
    return r.stdout + r.stderr


@pytest.mark.container
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_cpu_image_serves_and_stops_cleanly(podman, base_image, cpu_image, tiny_artifact_dir, record_property):
    name = f"bertserve-test-{uuid.uuid4().hex[:12]}"
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="bertserve-model-") as tmp:
        model = Path(tmp) / "model"  # readable by the image's user whatever this host's umask
        shutil.copytree(tiny_artifact_dir, model)
        for path in [model, *model.iterdir()]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        try:
            started = time.monotonic()
            podman("run", "-d", "--name", name, "-p", f"127.0.0.1:{port}:8000", "-v", f"{model}:/model:ro",
                   cpu_image)
            _wait_ready(podman, name, base)
            ready_s = time.monotonic() - started

            r = httpx.post(f"{base}/embed", json={"inputs": ["hello world", ["first half", "second half"]]},
                           timeout=30)
            assert r.status_code == 200, r.text
            assert [len(d["embedding"]) for d in r.json()["data"]] == [128, 128]
            podman("healthcheck", "run", name)  # fails where the image has no HEALTHCHECK or it fails
            assert podman("inspect", "-f", "{{.State.Health.Status}}", name).stdout.strip() == "healthy"
            assert podman("exec", name, "id", "-u").stdout.strip() != "0"
            assert podman("exec", name, "test", "-e", "/src", check=False).returncode == 1, "sources in the image"

            stopping = time.monotonic()
            podman("stop", "-t", str(STOP_TIMEOUT_S), name, timeout=STOP_TIMEOUT_S + 30)
            stop_s = time.monotonic() - stopping
            exit_code = podman("inspect", "-f", "{{.State.ExitCode}}", name).stdout.strip()
            logs = _logs(podman, name)
            assert exit_code == "0" and "Application shutdown complete" in logs, f"exit {exit_code}:\n{logs}"
            assert not re.search(r"\[[WEF]:onnxruntime", logs), logs
        finally:
            podman("rm", "-f", "-t", "0", name, check=False)

    size_mb = int(podman("image", "inspect", "-f", "{{.Size}}", cpu_image).stdout) / 1e6
    base_mb = int(podman("image", "inspect", "-f", "{{.Size}}", base_image).stdout) / 1e6
    for key, value in {"image_mb": size_mb, "base_image_mb": base_mb, "ready_s": ready_s, "stop_s": stop_s}.items():
        record_property(key, round(value, 2))
    print(f"\nCPU image {size_mb:.0f} MB ({size_mb - base_mb:.0f} MB over the {base_mb:.0f} MB base); "
          f"/ready 200 {ready_s:.1f} s after `podman run`; stopped in {stop_s:.1f} s")

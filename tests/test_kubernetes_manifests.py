"""deploy/kubernetes/: every manifest is valid against the Kubernetes API schemas (the copies that
kubernetes-validate bundles: no network, no cluster), and the manifests agree with the server they run:
its endpoints, port, user, settings, drain deadline and metrics."""
from __future__ import annotations

import copy
import os
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from app.metrics import MULTIPROC_DIR_VAR, Metrics
from app.multiprocess.launcher import _ENGINE_START_S
from app.settings import ENV_PREFIX, Settings

ROOT = Path(__file__).resolve().parents[1]
MANIFESTS = ROOT / "deploy" / "kubernetes"
# The oldest and the newest API that kubernetes-validate 1.37 carries: the manifests use nothing newer
# than 1.25 (autoscaling/v2, policy/v1, startupProbe) and nothing removed since.
KUBERNETES_VERSIONS = ("1.25", "1.37")
NOT_RESOURCES = {"kustomization.yaml", "prometheus-adapter-values.yaml"}  # kustomize's and Helm's inputs
EXIT_MARGIN_S = 5  # after the drain deadline: closing connections, stopping the engine process
START_MARGIN_S = 30  # around the engine's start: every artifact file's sha256 before, the HTTP workers after


def _load(name: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all((MANIFESTS / name).read_text()) if doc]


def _resources() -> list[tuple[str, dict]]:
    files = sorted(p.name for p in MANIFESTS.glob("*.yaml") if p.name not in NOT_RESOURCES)
    return [(name, doc) for name in files for doc in _load(name)]


def _one(kind: str) -> dict:
    (found,) = [doc for _, doc in _resources() if doc["kind"] == kind]
    return found


def _server(deployment: dict) -> dict:
    (container,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "server"]
    return container


def _env(container: dict) -> dict[str, str | None]:  # None: a value from a Secret
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def _image_env(name: str) -> str:
    """A variable the Dockerfile sets for the server (ENV NAME=value)."""
    (value,) = re.findall(rf"\b{name}=(\S+)", (ROOT / "Dockerfile").read_text())
    return value


def validate(resource: dict, version: str) -> None:
    """Raises unless the resource matches the API of Kubernetes `version`. The strict schemas refuse an
    unknown field as the API server does (the lax ones let a misspelt one through), and a kind without a
    bundled schema raises SchemaNotFoundError."""
    used = kubernetes_validate.validate(resource, version, strict=True)
    assert used == version, f"validated against {used}'s schemas, not {version}'s"


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_manifest_matches_the_kubernetes_api(version):
    resources = _resources()
    assert {doc["kind"] for _, doc in resources} >= {"Deployment", "Service", "HorizontalPodAutoscaler"}
    for name, doc in resources:
        try:
            validate(doc, version)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{name}: {'.'.join(map(str, e.path))}: {e.message}")


def _misspelt_probe(d: dict) -> None:
    container = d["spec"]["template"]["spec"]["containers"][0]
    container["readynessProbe"] = container.pop("readinessProbe")


def _grace_as_text(d: dict) -> None:
    d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "45s"


def _custom_kind(d: dict) -> None:
    d.update(apiVersion="monitoring.coreos.com/v1", kind="PodMonitor")


@pytest.mark.parametrize("breakage, error", [(_misspelt_probe, kubernetes_validate.ValidationError),
                                             (_grace_as_text, kubernetes_validate.ValidationError),
                                             (_custom_kind, kubernetes_validate.SchemaNotFoundError)],
                         ids=["unknown field", "wrong type", "unknown kind"])
def test_a_broken_manifest_fails_validation(breakage, error):
    broken = copy.deepcopy(_one("Deployment"))
    breakage(broken)
    with pytest.raises(error):
        validate(broken, KUBERNETES_VERSIONS[-1])


def test_kustomization_applies_every_manifest_and_names_every_image():
    kustomization = _load("kustomization.yaml")[0]
    files = {p.name for p in MANIFESTS.glob("*.yaml")} - NOT_RESOURCES
    assert set(kustomization["resources"]) == files
    pod = _one("Deployment")["spec"]["template"]["spec"]
    images = {c["image"] for c in pod["containers"] + pod.get("initContainers", [])}
    assert {i["name"] for i in kustomization["images"]} == images


def test_probes_service_and_scrape_reach_the_server_on_its_port():
    deployment, service = _one("Deployment"), _one("Service")
    server = _server(deployment)
    (port,) = server["ports"]
    assert port["containerPort"] == int(_image_env(ENV_PREFIX + "PORT"))
    assert ENV_PREFIX + "PORT" not in _env(server)  # the image's port is the one declared
    expected = {"readinessProbe": "/ready", "livenessProbe": "/health", "startupProbe": "/health"}
    for probe, path in expected.items():
        assert server[probe]["httpGet"] == {"path": path, "port": port["name"]}, probe
    (service_port,) = service["spec"]["ports"]
    assert service_port["targetPort"] == port["name"]
    pod = deployment["spec"]["template"]
    labels = pod["metadata"]["labels"].items()
    assert service["spec"]["selector"].items() <= labels
    assert _one("PodDisruptionBudget")["spec"]["selector"]["matchLabels"].items() <= labels
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(port["containerPort"])


def test_grace_period_outlasts_prestop_and_drain():
    """Kubernetes counts the grace period from the deletion: preStop's sleep, then SIGTERM and the
    server's drain, then its exit. A shorter period SIGKILLs requests the drain was finishing."""
    deployment = _one("Deployment")
    server = _server(deployment)
    command = server["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2, command
    drain = float(_env(server)[ENV_PREFIX + "DRAIN_SECONDS"])  # set, not left to a default that may change
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= int(command[1]) + drain + EXIT_MARGIN_S, (grace, command, drain)


def test_startup_probe_outlasts_the_servers_own_wait_for_its_engine():
    """The server gives its engine process _ENGINE_START_S to load and then exits saying why; a startup
    probe that gives up first kills a replica whose engine would have been ready, at every restart."""
    probe = _server(_one("Deployment"))["startupProbe"]
    window = probe.get("initialDelaySeconds", 0) + probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)
    assert window >= _ENGINE_START_S + START_MARGIN_S, (window, probe)


def test_every_server_variable_names_a_setting():
    """The server ignores a BERTSERVE_* variable that names no setting: a misspelt one would go unnoticed."""
    names = {name[len(ENV_PREFIX):].lower() for name in _env(_server(_one("Deployment")))
             if name.startswith(ENV_PREFIX)}
    assert names <= set(Settings.model_fields)


def _service_links(pod: dict) -> dict[str, str]:
    """The variables Kubernetes puts in a pod's environment for each Service of its namespace unless the pod
    turns them off (`enableServiceLinks: false`), as Docker's links did: over the image's own (ENV), under
    the container's `env`. A Service named bertserve gives BERTSERVE_PORT=tcp://IP:PORT, for one."""
    if not pod.get("enableServiceLinks", True):
        return {}
    links = {}
    for service in (doc for _, doc in _resources() if doc["kind"] == "Service"):
        name, ip = service["metadata"]["name"].upper().replace("-", "_"), "10.96.0.10"
        port = service["spec"]["ports"][0]["port"]
        address = f"tcp://{ip}:{port}"
        links.update({f"{name}_SERVICE_HOST": ip, f"{name}_SERVICE_PORT": str(port), f"{name}_PORT": address,
                      f"{name}_PORT_{port}_TCP": address, f"{name}_PORT_{port}_TCP_ADDR": ip})
    return links


def test_the_server_starts_with_the_images_and_the_manifests_values(monkeypatch, tmp_path):
    """Each value parses as its setting and the settings agree with each other (as `python -m app` checks
    them at start: a bad one stops every replica), the model folder aside: /model is the pod's. The pod's
    environment is the image's, then the Services' links, then the container's own."""
    instructions = (ROOT / "Dockerfile").read_text().replace("\\\n", " ").splitlines()
    image = {name[len(ENV_PREFIX):]: value for line in instructions if line.startswith("ENV ")
             for name, value in re.findall(r"(\w+)=(\S+)", line) if name.startswith(ENV_PREFIX)}
    deployment = _one("Deployment")
    links = {name[len(ENV_PREFIX):]: value for name, value in
             _service_links(deployment["spec"]["template"]["spec"]).items() if name.startswith(ENV_PREFIX)}
    pod = {name[len(ENV_PREFIX):]: value for name, value in _env(_server(deployment)).items()
           if name.startswith(ENV_PREFIX) and value is not None}
    for name in list(os.environ):
        if name.startswith(ENV_PREFIX):
            monkeypatch.delenv(name)
    for name, value in {**image, **links, **pod, "MODEL_DIR": str(tmp_path)}.items():
        monkeypatch.setenv(ENV_PREFIX + name, value)
    settings = Settings()
    assert (settings.workers, settings.port) == (int(pod["WORKERS"]), int(image["PORT"]))


def _exported_gauges(monkeypatch) -> set[str]:
    monkeypatch.delenv(MULTIPROC_DIR_VAR, raising=False)  # this process's registry, not another run's files
    text = Metrics().exposition().decode()
    return {f.name for f in text_string_to_metric_families(text) if f.type == "gauge"}


def test_autoscaler_scales_the_deployment_on_a_metric_the_server_exports(monkeypatch):
    deployment, hpa = _one("Deployment"), _one("HorizontalPodAutoscaler")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == ("apps/v1", "Deployment",
                                                                      deployment["metadata"]["name"])
    metrics = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]
    assert metrics and len(metrics) == len(hpa["spec"]["metrics"])
    # prometheus-adapter serves each HPA metric from a series that /metrics really has.
    rules = {r["name"]["as"]: r for r in _load("prometheus-adapter-values.yaml")[0]["rules"]["custom"]}
    gauges = _exported_gauges(monkeypatch)
    for name in metrics:
        assert name in rules, f"prometheus-adapter-values.yaml has no rule serving the HPA's {name}"
        series = re.match(r"\w+", rules[name]["seriesQuery"].strip("'\"")).group()
        assert series in gauges, f"{series} (for the HPA's {name}) is not a gauge the server exports"
        assert re.fullmatch(rules[name]["name"]["matches"], series)
        placeholders = set(re.findall(r"<<\.\w+>>", rules[name]["metricsQuery"]))
        assert {"<<.Series>>", "<<.LabelMatchers>>", "<<.GroupBy>>"} <= placeholders  # this series, per pod


def test_runs_as_the_image_user_on_a_read_only_root_with_one_gpu():
    deployment = _one("Deployment")
    pod, server = deployment["spec"]["template"]["spec"], _server(deployment)
    (image_user,) = re.findall(r"^USER (\d+)$", (ROOT / "Dockerfile").read_text(), re.M)
    assert pod["securityContext"]["runAsUser"] == int(image_user) and pod["securityContext"]["runAsNonRoot"]
    assert server["securityContext"]["readOnlyRootFilesystem"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in server["volumeMounts"]}
    assert "emptyDir" in volumes[mounts["/tmp"]["name"]]  # the only place the server writes
    model = mounts[_image_env(ENV_PREFIX + "MODEL_DIR")]
    assert model["readOnly"] and "emptyDir" in volumes[model["name"]]
    (init,) = pod["initContainers"]  # fills the model volume before the server starts
    assert [m["name"] for m in init["volumeMounts"]] == [model["name"]]
    assert server["resources"]["limits"]["nvidia.com/gpu"] == 1

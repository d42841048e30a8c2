"""deploy/k8s: the kustomize base and its cpu and gpu overlays, rendered by `kubectl kustomize`,
validated offline against the Kubernetes schemas (kubernetes-validate), and checked against the
services' real settings: every flag is a setting, ports and probes agree, the scheduler finds
the workers through their headless Service, grace periods outlast the drains, the secrets are
mounted where the flags point."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from gateway.settings import GatewaySettings
from scheduler_svc.settings import SchedulerSettings
from worker_svc.settings import WorkerSettings

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
VERSION = "1.31.0"
SETTINGS = {
    "gateway": GatewaySettings,
    "scheduler_svc": SchedulerSettings,
    "worker_svc": WorkerSettings,
}
CRDS = {"ServiceMonitor"}  # not in the Kubernetes schemas: checked by hand below


def render(target: str) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: it renders the kustomizations (kubectl kustomize)")
    done = subprocess.run(
        [kubectl, "kustomize", str(K8S / target)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


@pytest.fixture(
    scope="module", params=["base", "overlays/cpu", "overlays/gpu", "overlays/cpu-tenants"]
)
def rendered(request) -> tuple[str, list[dict]]:
    return request.param, render(request.param)


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def test_every_rendered_manifest_validates_against_the_kubernetes_schemas(rendered) -> None:
    import kubernetes_validate

    _, docs = rendered
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "StatefulSet", "Service", "ConfigMap", "PodDisruptionBudget"} <= kinds
    for doc in docs:
        if doc["kind"] in CRDS:
            continue
        kubernetes_validate.validate(doc, VERSION, strict=True)  # raises on any error


def test_a_manifest_with_a_mistake_is_refused_by_the_validation() -> None:
    import kubernetes_validate

    [deployment] = [d for d in render("base") if d["kind"] == "Deployment"][:1]
    deployment["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, VERSION, strict=True)


def containers(docs: list[dict]) -> dict[str, dict]:
    out = {}
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            [c] = d["spec"]["template"]["spec"]["containers"]
            out[d["metadata"]["name"]] = c | {"_pod": d["spec"]["template"]["spec"]}
    return out


def workload(docs: list[dict], name: str) -> dict:
    return next(d for d in docs if d["metadata"]["name"] == name and d["kind"] != "Service")


def flag_values(args: list[str]) -> dict[str, str | None]:
    out = {}
    for i, arg in enumerate(args):
        if arg.startswith("--"):
            nxt = args[i + 1] if i + 1 < len(args) else None
            out[arg] = None if nxt is None or nxt.startswith("--") else nxt
    return out


def test_every_flag_is_a_real_setting_and_every_variable_is_defined(rendered) -> None:
    _, docs = rendered
    config = by_kind(docs, "ConfigMap")["llmserve-config"]["data"]
    for name, c in containers(docs).items():
        settings = SETTINGS[c["command"][-1]]
        known = {f"--{f.replace('_', '-')}" for f in settings.__dataclass_fields__}
        flags = flag_values(c["args"])
        assert set(flags) <= known, (name, set(flags) - known)
        env = {e["name"] for e in c.get("env", [])} | set(config)
        for value in flags.values():
            for var in re.findall(r"\$\((\w+)\)", value or ""):
                assert var in env, f"{name}: $({var}) is not defined"


def test_ports_probes_and_services_agree(rendered) -> None:
    _, docs = rendered
    services = by_kind(docs, "Service")
    for name, c in containers(docs).items():
        flags = flag_values(c["args"])
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["grpc"] == int(flags["--port"]) and ports["metrics"] == int(
            flags["--metrics-port"]
        )
        for probe in ("readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"]["port"] == ports["grpc"], (name, probe)
        service = services[name]
        assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == ports
        template = workload(docs, name)["spec"]["template"]["metadata"]
        assert service["spec"]["selector"].items() <= template["labels"].items()
        annotations = template["annotations"]
        assert annotations["prometheus.io/port"] == str(ports["metrics"])


def test_the_scheduler_finds_the_workers_through_their_headless_service(rendered) -> None:
    _, docs = rendered
    c = containers(docs)
    entry = flag_values(c["llmserve-scheduler"]["args"])["--workers"]
    host, port = re.fullmatch(r"dns:([\w-]+):(\d+)", entry).groups()
    headless = by_kind(docs, "Service")[host]
    assert headless["spec"]["clusterIP"] == "None"
    assert by_kind(docs, "StatefulSet")["llmserve-worker"]["spec"]["serviceName"] == host
    assert int(port) == int(flag_values(c["llmserve-worker"]["args"])["--port"])
    gateway = flag_values(c["llmserve-gateway"]["args"])["--scheduler"]
    assert gateway == "llmserve-scheduler:" + flag_values(c["llmserve-scheduler"]["args"])["--port"]
    assert by_kind(docs, "Deployment")["llmserve-scheduler"]["spec"]["replicas"] == 1


def test_grace_outlasts_the_drain_and_secrets_are_where_the_flags_point(rendered) -> None:
    _, docs = rendered
    drain = float(by_kind(docs, "ConfigMap")["llmserve-config"]["data"]["DRAIN_TIMEOUT"])
    for name, c in containers(docs).items():
        pod = c["_pod"]
        assert pod["terminationGracePeriodSeconds"] > drain, name
        assert "$(DRAIN_TIMEOUT)" == flag_values(c["args"])["--drain-timeout"]
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        secrets = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"]}
        for flag, volume in (
            ("--internal-token-file", "internal-token"),
            ("--api-key-file", "api-key"),
            ("--api-keys-file", "api-keys"),
            ("--admin-key-file", "admin-key"),
        ):
            path = flag_values(c["args"]).get(flag)
            if path is not None:
                assert path.startswith(mounts[volume] + "/"), (name, flag)
                assert secrets[volume] == f"llmserve-{volume}"
        assert "--internal-token-file" in c["args"], name


def test_disruption_budgets_select_real_pods_and_the_dashboard_is_the_compose_one(rendered) -> None:
    _, docs = rendered
    pdbs = by_kind(docs, "PodDisruptionBudget")
    assert pdbs["llmserve-worker"]["spec"]["maxUnavailable"] == 1
    labels = [
        d["spec"]["template"]["metadata"]["labels"]
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet")
    ]
    for pdb in pdbs.values():
        assert any(pdb["spec"]["selector"]["matchLabels"].items() <= lab.items() for lab in labels)
    dashboard = by_kind(docs, "ConfigMap")["llmserve-dashboard"]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    compose_json = json.loads(
        (ROOT / "deploy" / "grafana" / "dashboards" / "llmserve.json").read_text()
    )
    assert json.loads(dashboard["data"]["llmserve.json"]) == compose_json
    [monitor] = [d for d in docs if d["kind"] == "ServiceMonitor"]
    selected = monitor["spec"]["selector"]["matchLabels"]
    assert all(
        selected.items() <= s["metadata"]["labels"].items()
        for s in by_kind(docs, "Service").values()
    )
    # the Operator names each target's job after its Service (no jobLabel): the dashboard's
    # targets-up panel must match those names, as PromQL matches a regex (whole)
    assert "jobLabel" not in monitor["spec"]
    jobs = [
        name
        for name, s in by_kind(docs, "Service").items()
        if any(p.get("name") == "metrics" for p in s["spec"]["ports"])
    ]
    [matcher] = re.findall(r'up\{job=~"([^"]+)"\}', json.dumps(compose_json).replace('\\"', '"'))
    assert jobs and all(re.fullmatch(matcher, job) for job in jobs), (matcher, jobs)
    assert all(re.fullmatch(matcher, job) for job in ("gateway", "scheduler", "worker"))


def test_the_gpu_overlay_asks_for_a_gpu_and_sizes_kv_from_memory() -> None:
    docs = render("overlays/gpu")
    worker = containers(docs)["llmserve-worker"]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert worker["image"] == "llmserve:cuda"
    config = by_kind(docs, "ConfigMap")["llmserve-config"]["data"]
    assert config["DEVICE"] == "cuda" and config["KV_CAPACITY"] == "0"
    cpu = by_kind(render("overlays/cpu"), "ConfigMap")["llmserve-config"]["data"]
    assert cpu["DEVICE"] == "cpu" and int(cpu["KV_CAPACITY"]) > 0


def test_the_tenants_overlay_gives_the_gateway_a_keys_file_and_classes_it_takes() -> None:
    """Not the one key beside it (the gateway refuses both), and classes --slo-classes parses."""
    docs = render("overlays/cpu-tenants")
    gateway = containers(docs)["llmserve-gateway"]
    args = flag_values(gateway["args"])
    assert "--api-key-file" not in args and args["--slo-classes"] == "$(SLO_CLASSES)"
    classes = by_kind(docs, "ConfigMap")["llmserve-config"]["data"]["SLO_CLASSES"]
    settings = GatewaySettings(api_keys_file=args["--api-keys-file"], slo_classes=classes)
    assert set(settings.classes()) == {"interactive", "batch"}

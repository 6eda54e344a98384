"""deploy/kubernetes, checked offline: every object against the Kubernetes API's schema (the official client's
models: an unknown or misspelt field, a wrong type or a missing required field fails), and the objects against one
another and against the server: selectors, ports and probes, the HPA's metrics and the adapter rules that make
them from metrics the server exports, the gRPC balancer's upstream, the container's command line."""
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes.client as k8s
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "deploy" / "kubernetes"
PRIMITIVES = {"str": str, "int": int, "bool": bool, "float": (int, float), "object": object, "datetime": str,
              "bytes": str}


def objects() -> list[dict]:
    kustomization = yaml.safe_load((FOLDER / "kustomization.yaml").read_text())
    found = []
    for name in kustomization["resources"]:
        for obj in yaml.safe_load_all((FOLDER / name).read_text()):
            obj.setdefault("metadata", {}).setdefault("namespace", kustomization["namespace"])
            found.append(obj)
    return found


def model_name(obj: dict) -> str:
    version = obj["apiVersion"].split("/")[-1]
    return f"V{version[1:]}{obj['kind']}"


def schema_errors(data, type_name: str, path: str) -> list[str]:
    """The client's type names: List[T], Dict[str, T], a model class or a primitive."""
    if type_name.startswith("List["):
        if not isinstance(data, list):
            return [f"{path}: expected a list"]
        return [e for i, item in enumerate(data) for e in schema_errors(item, type_name[5:-1], f"{path}[{i}]")]
    if type_name.startswith("Dict["):
        if not isinstance(data, dict):
            return [f"{path}: expected a mapping"]
        inner = type_name[type_name.index(",") + 1:-1].strip()
        return [e for key, value in data.items() for e in schema_errors(value, inner, f"{path}.{key}")]
    if type_name in PRIMITIVES:  # "object": int-or-string fields (ports, maxSurge) and free-form ones
        ok = isinstance(data, PRIMITIVES[type_name]) and not (type_name in ("int", "float") and isinstance(data, bool))
        return [] if ok else [f"{path}: expected {type_name}, got {data!r}"]
    model = getattr(k8s, type_name)
    fields = {json_name: attr for attr, json_name in model.attribute_map.items()}
    errors = []
    for key, value in data.items():
        if key not in fields:
            errors.append(f"{path}.{key}: not a field of {type_name}")
        else:
            errors += schema_errors(value, model.openapi_types[fields[key]], f"{path}.{key}")
    return errors


def by_kind(kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects() if o["kind"] == kind}


def test_every_object_fits_the_kubernetes_api_schema():
    found = objects()
    assert {o["kind"] for o in found} >= {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget",
                                          "ConfigMap", "PersistentVolumeClaim"}
    client = k8s.ApiClient()
    for obj in found:
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        assert not schema_errors(obj, model_name(obj), where), schema_errors(obj, model_name(obj), where)
        client._ApiClient__deserialize(obj, model_name(obj))  # required fields: the models' constructors refuse None


def test_kubectl_renders_the_kustomization_offline():
    if shutil.which("kubectl") is None:
        pytest.skip("no kubectl on this machine (the schema test above still ran)")
    done = subprocess.run(["kubectl", "kustomize", str(FOLDER)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    rendered = list(yaml.safe_load_all(done.stdout))
    assert sorted((o["kind"], o["metadata"]["name"]) for o in rendered) == \
        sorted((o["kind"], o["metadata"]["name"]) for o in objects())
    assert all(o["metadata"].get("namespace") == "voxbackend" for o in rendered if o["kind"] != "Namespace")


def test_selectors_ports_and_probes_meet():
    deployments, services = by_kind("Deployment"), by_kind("Service")
    for service in services.values():
        [pods] = [d for d in deployments.values()
                  if service["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        ports = {p["name"] for c in pods["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports, service["metadata"]["name"]
    triton = deployments["voxbackend"]["spec"]["template"]["spec"]
    [container] = triton["containers"]
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert named == {"http": 8000, "grpc": 8001, "metrics": 8002, "api": 9000}
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "api"}  # every engine alive
    for probe in ("startupProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["port"] in named
    labels = deployments["voxbackend"]["spec"]["template"]["metadata"]["labels"]
    [budget] = by_kind("PodDisruptionBudget").values()
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert services["voxbackend-pods"]["spec"]["clusterIP"] == "None"  # DNS lists the pods themselves


def test_the_container_runs_the_served_command_and_drains_within_its_grace():
    from voxbackend import cli

    [container] = by_kind("Deployment")["voxbackend"]["spec"]["template"]["spec"]["containers"]
    args = cli.parser().parse_args(container["args"])
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    workdir = re.search(r"^WORKDIR (\S+)", dockerfile, re.M).group(1)
    assert args.command == "serve" and args.model_repository == f"{workdir}/model_repository"
    assert args.host == "0.0.0.0" and args.api_port == 9000
    assert re.search(r'^ENTRYPOINT \["voxbackend"\]', dockerfile, re.M)
    assert set(re.search(r"^EXPOSE (.+)$", dockerfile, re.M).group(1).split()) == {"8000", "8001", "8002", "9000"}
    from voxbackend.deploy import configs

    grace = by_kind("Deployment")["voxbackend"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    exit_timeout = int(re.search(r"--exit-timeout-secs=(\d+)", (ROOT / "voxbackend/deploy/server.py").read_text())[1])
    assert grace > exit_timeout >= float(configs.ENGINE_PARAMS["drain_grace_s"])


def test_the_autoscaler_reads_metrics_the_adapter_makes_from_what_the_server_exports():
    [hpa] = by_kind("HorizontalPodAutoscaler").values()
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "voxbackend"}
    wanted = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]}
    rules = yaml.safe_load(by_kind("ConfigMap")["voxbackend-prometheus-adapter-rules"]["data"]["config.yaml"])["rules"]
    assert wanted == {r["name"]["as"] for r in rules}
    exported = set(re.findall(r'fam\("(voxbackend_\w+)"', (ROOT / "voxbackend/triton/metrics.py").read_text()))
    for rule in rules:
        used = set(re.findall(r"voxbackend_\w+", rule["seriesQuery"] + rule["metricsQuery"]))
        assert used and used <= exported, (used, exported)
        assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}  # per pod, as the HPA's Pods metrics


def test_the_grpc_balancer_spreads_streams_by_load_over_the_pods():
    envoy = yaml.safe_load(by_kind("ConfigMap")["voxbackend-envoy"]["data"]["envoy.yaml"])
    [cluster] = envoy["static_resources"]["clusters"]
    assert cluster["lb_policy"] == "LEAST_REQUEST" and cluster["type"] == "STRICT_DNS"
    options = cluster["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    assert "http2_protocol_options" in options["explicit_http_config"]  # Triton's gRPC is HTTP/2
    [address] = [e["endpoint"]["address"]["socket_address"]
                 for group in cluster["load_assignment"]["endpoints"] for e in group["lb_endpoints"]]
    headless = by_kind("Service")["voxbackend-pods"]
    assert address == {"address": f"voxbackend-pods.{headless['metadata']['namespace']}.svc.cluster.local",
                       "port_value": headless["spec"]["ports"][0]["port"]}
    [listener] = envoy["static_resources"]["listeners"]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    [route] = manager["route_config"]["virtual_hosts"][0]["routes"]
    assert route["route"]["timeout"] == "0s" and manager["stream_idle_timeout"] == "0s"  # streams run long
    front = by_kind("Service")["voxbackend-grpc"]
    assert front["spec"]["ports"][0]["port"] == listener["address"]["socket_address"]["port_value"] == 8001

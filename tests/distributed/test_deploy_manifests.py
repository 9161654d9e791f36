"""The Kubernetes manifests stay in step with the server and the router: the engine container runs
a command line that `pagellm serve` really accepts, probes hit /health on the served port,
Prometheus scrapes /metrics there; the router container runs a command line that the installed
vllm-router really accepts, listens on the pod's loopback only, discovers exactly the engine pods
on the engine's port, and may list them; the gate container beside it, the pod's only client
port, forwards to that loopback port; the client Service routes to the gate, the headless one to
the engines, and the HPA scales the engines."""

from __future__ import annotations

from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

from pagellm.entrypoints.cli import build_parser
from pagellm.entrypoints.openai.tenancy import OPEN_PATHS
from pagellm.metrics.metric_specs import prefixes
from pagellm.metrics.prometheus import PrometheusStatLogger

MANIFEST = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "pagellm.yaml"


def _docs() -> dict[tuple[str, str], dict]:
    docs = list(yaml.safe_load_all(MANIFEST.read_text()))
    by_name = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    assert len(by_name) == len(docs)  # no two objects of one kind share a name
    return by_name


def _container(deployment: dict, name: str | None = None) -> dict:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    if name is None:
        (container,) = containers
        return container
    return next(c for c in containers if c["name"] == name)


def _port(container: dict, name: str = "http") -> int:
    return {p["name"]: p["containerPort"] for p in container["ports"]}[name]


def test_container_command_is_a_valid_pagellm_serve() -> None:
    engine = _docs()["Deployment", "pagellm"]
    pod = engine["spec"]["template"]
    container = _container(engine)
    assert container["command"] == ["pagellm"]
    ns = build_parser().parse_args(container["args"])  # SystemExit on an unknown flag
    assert ns.command == "serve" and ns.host == "0.0.0.0"
    assert ns.enable_prefix_caching  # what cache-aware routing is for
    port = _port(container)
    assert ns.port == port
    gpus = container["resources"]["limits"]["nvidia.com/gpu"]
    assert ns.tensor_parallel_size == gpus  # one GPU per rank
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    notes = pod["metadata"]["annotations"]
    assert notes["prometheus.io/path"] == "/metrics" and int(notes["prometheus.io/port"]) == port
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert "/dev/shm" in mounts  # the TP broadcast ring; Docker's default 64 MiB is tight


def test_router_discovers_the_engine_pods_with_a_valid_command_line() -> None:
    from vllm_router.launch_router import parse_router_args

    docs = _docs()
    engine, router = docs["Deployment", "pagellm"], docs["Deployment", "pagellm-router"]
    container = _container(router, "router")
    assert container["command"] == ["vllm-router"]
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    args = parse_router_args([a.replace("$(POD_NAMESPACE)", "default")
                              for a in container["args"]])
    assert args.service_discovery and args.service_discovery_namespace == "default"
    assert args.policy == "cache_aware"
    engine_labels = engine["spec"]["template"]["metadata"]["labels"]
    router_labels = router["spec"]["template"]["metadata"]["labels"]
    assert args.selector == engine_labels  # every engine pod, and only those
    assert not all(router_labels.get(k) == v for k, v in args.selector.items())
    assert args.service_discovery_port == _port(_container(engine))
    # The management API (/add_worker, ...) answers anyone: loopback only, no client port.
    assert args.host == "127.0.0.1"
    assert "http" not in {p["name"] for p in container["ports"]}
    assert args.prometheus_host == "0.0.0.0"
    assert args.prometheus_port == _port(container, "metrics")
    notes = router["spec"]["template"]["metadata"]["annotations"]
    assert int(notes["prometheus.io/port"]) == args.prometheus_port
    gate = _container(router, "gate")
    assert gate["command"] == ["python", "-m", "pagellm.entrypoints.router_gate"]
    gate_args = dict(zip(gate["args"][::2], gate["args"][1::2], strict=True))
    assert gate_args["--upstream"] == f"http://127.0.0.1:{args.port}"
    assert (gate_args["--host"], int(gate_args["--port"])) == ("0.0.0.0", _port(gate))
    assert int(gate_args["--max-request-body-bytes"]) == args.max_payload_size
    # /health is 503 while any one replica is down; these two are the router's own state,
    # asked through the gate (which forwards them).
    assert gate["readinessProbe"]["httpGet"] == {"path": "/readiness", "port": "http"}
    assert gate["livenessProbe"]["httpGet"] == {"path": "/liveness", "port": "http"}
    # Discovery lists and watches pods with the Deployment's service account.
    account = router["spec"]["template"]["spec"]["serviceAccountName"]
    assert ("ServiceAccount", account) in docs
    binding = next(d for (kind, _), d in docs.items() if kind == "RoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    role = docs["Role", binding["roleRef"]["name"]]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"],
                              "verbs": ["get", "list", "watch"]}]


def test_services_and_autoscaler_point_at_the_right_pods() -> None:
    docs = _docs()
    engine, router = docs["Deployment", "pagellm"], docs["Deployment", "pagellm-router"]
    clients, engines = docs["Service", "pagellm"], docs["Service", "pagellm-engine"]
    assert clients["spec"]["selector"] == router["spec"]["template"]["metadata"]["labels"]
    assert clients["spec"]["ports"][0]["targetPort"] == "http"
    assert engines["spec"]["clusterIP"] == "None"  # headless: one record per replica
    assert engines["spec"]["selector"] == engine["spec"]["template"]["metadata"]["labels"]
    assert engines["spec"]["ports"][0]["port"] == _port(_container(engine))
    for deployment in (engine, router):
        assert deployment["spec"]["selector"]["matchLabels"] == \
            deployment["spec"]["template"]["metadata"]["labels"]
    target = docs["HorizontalPodAutoscaler", "pagellm"]["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", "pagellm")


# ---- deploy/kubernetes/inference-pool.yaml: the Gateway API Inference Extension in front ----
# Checked here for structure and cross-references (parsed with yaml; not validated against the
# Inference Extension's CRD schemas, which no installable package here carries).
POOL_MANIFEST = MANIFEST.parent / "inference-pool.yaml"
POOL_GROUP = "inference.networking.k8s.io"


def _pool_docs() -> dict[tuple[str, str], dict]:
    docs = list(yaml.safe_load_all(POOL_MANIFEST.read_text()))
    by_name = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    assert len(by_name) == len(docs)
    return by_name


def _flags(args: list[str]) -> dict[str, str]:
    """--flag value pairs (every EPP flag here takes a value, possibly empty)."""
    assert all(a.startswith("--") for a in args[::2]), args
    return dict(zip(args[::2], args[1::2], strict=True))


def test_inference_pool_selects_the_engine_pods() -> None:
    engine = _docs()["Deployment", "pagellm"]
    docs = _pool_docs()
    pool = docs["InferencePool", "pagellm"]
    assert pool["apiVersion"] == f"{POOL_GROUP}/v1"
    spec = pool["spec"]
    assert spec["selector"] == {"matchLabels": engine["spec"]["template"]["metadata"]["labels"]}
    assert spec["targetPorts"] == [{"number": _port(_container(engine))}]
    # The EPP's Service, on the port its container serves ext_proc (gRPC) on.
    ref = spec["endpointPickerRef"]
    assert ref["kind"] == "Service" and ref["failureMode"] in ("FailOpen", "FailClose")
    service = docs["Service", ref["name"]]
    (svc_port,) = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    assert svc_port["appProtocol"] == "http2"
    epp = next(d for (kind, _), d in docs.items() if kind == "Deployment"
               and service["spec"]["selector"] == d["spec"]["template"]["metadata"]["labels"])
    container = _container(epp)
    flags = _flags(container["args"])
    assert int(flags["--grpc-port"]) == _port(container, svc_port["targetPort"])
    assert flags["--pool-name"] == pool["metadata"]["name"]
    assert flags["--pool-group"] == POOL_GROUP
    assert flags["--pool-namespace"] == "$(NAMESPACE)"
    env = {e["name"]: e for e in container["env"]}
    assert env["NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    health = int(flags["--grpc-health-port"])
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == health == _port(container, "grpc-health")
    # Its plugin configuration file is the ConfigMap mounted where --config-file points.
    (mount,) = container["volumeMounts"]
    (volume,) = epp["spec"]["template"]["spec"]["volumes"]
    assert mount["name"] == volume["name"]
    config_map = docs["ConfigMap", volume["configMap"]["name"]]
    directory, _, key = flags["--config-file"].rpartition("/")
    assert directory == mount["mountPath"]
    config = yaml.safe_load(config_map["data"][key])
    assert config["kind"] == "EndpointPickerConfig"
    declared = {p["type"] for p in config["plugins"]}
    used = {ref["pluginRef"] for profile in config["schedulingProfiles"]
            for ref in profile["plugins"]}
    assert used == declared


def test_the_endpoint_picker_reads_metrics_the_engines_serve() -> None:
    engine_ns = build_parser().parse_args(_container(_docs()["Deployment", "pagellm"])["args"])
    # The metric families a server with the engine's command line exports.
    served_by = PrometheusStatLogger(engine_ns.served_model_name or "m", engine_ns.max_model_len,
                                     metric_names=engine_ns.metrics_names,
                                     cache_config_info={"block_size": "16"})
    served = {f.name for f in text_string_to_metric_families(served_by.render()[0].decode())}
    assert "vllm" in prefixes(engine_ns.metrics_names)
    epp = _pool_docs()["Deployment", "pagellm-epp"]
    flags = _flags(_container(epp)["args"])
    assert flags["--total-queued-requests-metric"] == "vllm:num_requests_waiting" in served
    assert flags["--kv-cache-usage-percentage-metric"] == "vllm:kv_cache_usage_perc" in served
    # pagellm has no LoRA adapters: no vllm:lora_requests_info, so the EPP must not ask for it.
    assert "vllm:lora_requests_info" not in served
    assert flags["--lora-info-metric"] == ""
    # The engines' /metrics answers without an API key (the EPP sends none).
    assert "/metrics" in OPEN_PATHS


def test_route_and_permissions_of_the_endpoint_picker() -> None:
    docs = _pool_docs()
    route = docs["HTTPRoute", "pagellm"]
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [{"group": POOL_GROUP, "kind": "InferencePool",
                                    "name": "pagellm"}]
    assert route["spec"]["parentRefs"][0]["kind"] == "Gateway"
    epp = docs["Deployment", "pagellm-epp"]
    account = epp["spec"]["template"]["spec"]["serviceAccountName"]
    assert ("ServiceAccount", account) in docs
    rules: list[dict] = []
    for (kind, _), binding in docs.items():
        if kind in ("RoleBinding", "ClusterRoleBinding"):
            assert [s["name"] for s in binding["subjects"]] == [account]
            role_kind = "Role" if kind == "RoleBinding" else "ClusterRole"
            assert binding["roleRef"]["kind"] == role_kind
            rules += docs[role_kind, binding["roleRef"]["name"]]["rules"]
    granted = {(group, resource, verb) for r in rules for group in r["apiGroups"]
               for resource in r["resources"] for verb in r["verbs"]}
    for group, resource in (("", "pods"), (POOL_GROUP, "inferencepools"),
                            ("inference.networking.x-k8s.io", "inferenceobjectives")):
        for verb in ("get", "list", "watch"):
            assert (group, resource, verb) in granted
    assert ("authentication.k8s.io", "tokenreviews", "create") in granted

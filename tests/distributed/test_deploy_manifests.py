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

from pagellm.entrypoints.cli import build_parser

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

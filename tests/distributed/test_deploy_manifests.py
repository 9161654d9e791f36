"""The Kubernetes manifests stay in step with the server: the container runs a command line that
`pagellm serve` really accepts, probes hit /health on the served port, Prometheus scrapes
/metrics there, the Service routes to that port, and the HPA scales that Deployment."""

from __future__ import annotations

from pathlib import Path

import yaml

from pagellm.entrypoints.cli import build_parser

MANIFEST = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "pagellm.yaml"


def _docs() -> dict[str, dict]:
    return {d["kind"]: d for d in yaml.safe_load_all(MANIFEST.read_text())}


def test_container_command_is_a_valid_pagellm_serve() -> None:
    docs = _docs()
    pod = docs["Deployment"]["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert container["command"] == ["pagellm"]
    ns = build_parser().parse_args(container["args"])  # SystemExit on an unknown flag
    assert ns.command == "serve" and ns.host == "0.0.0.0"
    port = {p["name"]: p["containerPort"] for p in container["ports"]}["http"]
    assert ns.port == port
    gpus = container["resources"]["limits"]["nvidia.com/gpu"]
    assert ns.tensor_parallel_size == gpus  # one GPU per rank
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    notes = pod["metadata"]["annotations"]
    assert notes["prometheus.io/path"] == "/metrics" and int(notes["prometheus.io/port"]) == port
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert "/dev/shm" in mounts  # the TP broadcast ring; Docker's default 64 MiB is tight


def test_service_and_autoscaler_point_at_the_deployment() -> None:
    docs = _docs()
    labels = docs["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert docs["Service"]["spec"]["selector"] == labels
    assert docs["Service"]["spec"]["ports"][0]["targetPort"] == "http"
    target = docs["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]
    assert target["kind"] == "Deployment"
    assert target["name"] == docs["Deployment"]["metadata"]["name"]

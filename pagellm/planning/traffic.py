"""Observed request lengths: a running server's /metrics, or a log of per-request token counts.

``--from-log FILE``, one request per line, blank lines and ``#`` comments ignored:
- JSON objects: ``{"prompt_tokens": 812, "output_tokens": 140}`` (``completion_tokens``, the
  OpenAI usage name, is accepted for ``output_tokens``; other keys are ignored), or
- ``prompt_tokens=812 output_tokens=140`` (key=value pairs in any order, other text ignored).

``--from-metrics URL``: the Prometheus text of a pagellm server (``/metrics`` is appended when the
URL has no path); the histograms ``pagellm:request_prompt_tokens`` and
``pagellm:request_generation_tokens`` (vLLM's ``vllm:`` names are read too), summed over labels.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

from pagellm.planning.recommend import Histogram

PROMPT_METRIC = "request_prompt_tokens"
OUTPUT_METRIC = "request_generation_tokens"
_PREFIXES = ("pagellm:", "vllm:")
_PAIR = re.compile(r"\b(prompt_tokens|output_tokens|completion_tokens)=(\d+)\b")


def _row(fields: object, where: str) -> tuple[int, int]:
    if not isinstance(fields, dict):
        raise ValueError(f"--from-log {where}: expected a JSON object")
    prompt = fields.get("prompt_tokens")
    output = fields.get("output_tokens", fields.get("completion_tokens"))
    if not isinstance(prompt, int) or not isinstance(output, int) or prompt < 0 or output < 0:
        raise ValueError(f"--from-log {where}: need non-negative integer prompt_tokens and "
                         "output_tokens")
    return prompt, output


def read_length_log(path: str) -> list[tuple[int, int]]:
    """(prompt_tokens, output_tokens) per request."""
    rows: list[tuple[int, int]] = []
    try:
        with open(path) as f:
            lines = f.readlines()
    except OSError as e:
        raise ValueError(f"--from-log {path!r}: {e.strerror or e}") from None
    for number, line in enumerate(lines, 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        where = f"{path}:{number}"
        if text.startswith("{"):
            try:
                fields = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"--from-log {where}: not valid JSON ({e.msg})") from None
        else:
            fields = {key: int(value) for key, value in _PAIR.findall(text)}
        rows.append(_row(fields, where))
    if not rows:
        raise ValueError(f"--from-log {path!r}: no requests in the file")
    return rows


@dataclass
class _Accumulator:
    buckets: dict[float, float] = field(default_factory=dict)
    count: float = 0.0
    sum: float = 0.0


def parse_metrics_text(text: str) -> dict[str, Histogram]:
    """Histograms by metric name without prefix (``request_prompt_tokens``), label sets summed."""
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, _Accumulator] = {}
    for family in text_string_to_metric_families(text):
        prefix = next((p for p in _PREFIXES if family.name.startswith(p)), None)
        if family.type != "histogram" or prefix is None:
            continue
        acc = found.setdefault(family.name[len(prefix):], _Accumulator())
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                bound = float(sample.labels["le"])
                acc.buckets[bound] = acc.buckets.get(bound, 0.0) + sample.value
            elif sample.name.endswith("_count"):
                acc.count += sample.value
            elif sample.name.endswith("_sum"):
                acc.sum += sample.value
    return {name: Histogram(tuple(sorted(acc.buckets.items())), acc.count, acc.sum)
            for name, acc in found.items()}


def metrics_url(url: str) -> str:
    parts = urlsplit(url if "://" in url else f"http://{url}")
    path = parts.path if parts.path not in ("", "/") else "/metrics"
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


def fetch_length_histograms(url: str, timeout_s: float = 10.0) -> tuple[Histogram, Histogram]:
    """(prompt, output) token histograms from a server's /metrics."""
    import httpx

    target = metrics_url(url)
    try:
        response = httpx.get(target, timeout=timeout_s)
        response.raise_for_status()
    except httpx.HTTPError as e:
        raise ValueError(f"--from-metrics {target}: cannot read the metrics ({e})") from None
    histograms = parse_metrics_text(response.text)
    missing = [m for m in (PROMPT_METRIC, OUTPUT_METRIC) if m not in histograms]
    if missing:
        raise ValueError(f"--from-metrics {target}: no {' or '.join(missing)} histogram "
                         "(is it a pagellm or vLLM server?)")
    return histograms[PROMPT_METRIC], histograms[OUTPUT_METRIC]

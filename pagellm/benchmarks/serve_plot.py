"""The PNG of ``pagellm bench serve --plot``: latency percentiles and achieved throughput against
the offered request rate, one colour per server (sweep), p50 solid and p99 dashed.

matplotlib is optional (``pip install pagellm[plot]``); it is imported only when plotting, with
the Agg backend (no display needed).
"""

from __future__ import annotations

from typing import Any

PANELS = (("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"),
          ("e2e_latency_ms", "E2E latency (ms)"))
PERCENTILES = (("median", "p50", "-"), ("p99", "p99", "--"))


def _finite_runs(sweep: dict[str, Any]) -> list[dict[str, Any]]:
    """Runs at a finite rate, by rate (``inf`` has no place on a rate axis)."""
    runs = [r for r in sweep["runs"] if isinstance(r.get("request_rate"), (int, float))]
    return sorted(runs, key=lambda r: r["request_rate"])


def plot_sweeps(sweeps: list[dict[str, Any]], path: str, title: str | None = None) -> None:
    """Write the figure of ``build_figure`` to ``path`` (PNG)."""
    fig = build_figure(sweeps, title)
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)


def build_figure(sweeps: list[dict[str, Any]], title: str | None = None) -> Any:
    """A 2x2 matplotlib figure: TTFT, TPOT and E2E (p50 and p99) and achieved request throughput
    against request rate; unsustained rates are marked with an x."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'pagellm[plot]'.") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    max_rate = 0.0
    for i, sweep in enumerate(sweeps):
        runs = _finite_runs(sweep)
        if not runs:
            continue
        color = colors[i % len(colors)]
        rates = [r["request_rate"] for r in runs]
        max_rate = max(max_rate, *rates)
        for ax, (key, ylabel) in zip(axes.flat, PANELS, strict=False):
            for stat, name, style in PERCENTILES:
                ax.plot(rates, [r[key][stat] for r in runs], style, color=color, marker="o",
                        label=f"{sweep['label']} {name}")
            ax.set_ylabel(ylabel)
        ax = axes.flat[3]
        ax.plot(rates, [r["request_throughput"] for r in runs], "-", color=color, marker="o",
                label=f"{sweep['label']} achieved")
        bad = [r for r in runs if r.get("sustained") is False]
        if bad:
            ax.scatter([r["request_rate"] for r in bad], [r["request_throughput"] for r in bad],
                       marker="x", s=120, color=color, zorder=3,
                       label=f"{sweep['label']} not sustained")
        sus = sweep.get("max_sustained_rate")
        if sus is not None:
            ax.axvline(sus, color=color, linestyle=":", alpha=0.7)
    tput = axes.flat[3]
    if max_rate:
        tput.plot([0, max_rate], [0, max_rate], ":", color="grey", label="offered")
    tput.set_ylabel("request throughput (req/s)")
    for ax in axes.flat:
        ax.set_xlabel("offered request rate (req/s, Poisson)")
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    labels = ", ".join(s["label"] for s in sweeps)
    fig.suptitle(title or f"pagellm bench serve: {labels}")
    fig.tight_layout()
    return fig


__all__ = ["build_figure", "plot_sweeps"]

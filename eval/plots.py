"""PNG plots of an eval report: acceptance by draft slot, alpha by sequence position, alpha by temperature
and domain, and observed speedup against the theoretical curve over alpha."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from eval.metrics import Costs, predicted_speedup, theory_k  # noqa: E402
from eval.settings import EvalSettings  # noqa: E402


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def plot_slot_acceptance(report: dict, path: Path) -> str:
    fig, ax = plt.subplots(figsize=(6, 4))
    for t, agg in report["by_temperature"].items():
        slots = range(1, len(agg["slot_acceptance_conditional"]) + 1)
        ax.plot(slots, [v if v is not None else float("nan") for v in agg["slot_acceptance_conditional"]], "o-", label=f"T={t} conditional")
        ax.plot(slots, [v if v is not None else float("nan") for v in agg["slot_acceptance_unconditional"]], "x--", label=f"T={t} unconditional")
    ax.set(xlabel="draft slot", ylabel="acceptance", ylim=(0, 1.05), title="Acceptance by draft position")
    ax.legend(fontsize=7)
    return _save(fig, path)


def plot_alpha_by_position(report: dict, path: Path) -> str:
    fig, ax = plt.subplots(figsize=(6, 4))
    for t, agg in report["by_temperature"].items():
        names = list(agg["alpha_by_position"])
        values = [agg["alpha_by_position"][n] for n in names]
        ax.plot(names, [v if v is not None else float("nan") for v in values], "o-", label=f"T={t}")
    ax.set(xlabel="position in generated sequence (tokens)", ylabel="alpha", ylim=(0, 1.05), title="alpha by position in the sequence")
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_alpha_by_temperature_domain(report: dict, path: Path) -> str:
    temps = list(report["by_domain"])
    domains = sorted({d for t in temps for d in report["by_domain"][t]})
    width = 0.8 / max(len(temps), 1)
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, t in enumerate(temps):
        values = [(report["by_domain"][t].get(d) or {}).get("alpha") or 0.0 for d in domains]
        ax.bar([j + i * width for j in range(len(domains))], values, width, label=f"T={t}")
    ax.set_xticks([j + width * (len(temps) - 1) / 2 for j in range(len(domains))], domains)
    ax.set(ylabel="alpha", ylim=(0, 1.05), title="alpha by temperature and domain")
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_speedup_vs_alpha(report: dict, records: list[dict], path: Path) -> str:
    costs, k = Costs.from_dict(report["costs"]), report["settings"]["k"]
    fixed_k = EvalSettings.of_report(report).fixed_k  # None (dynamic draft length): the best fixed k's curve
    grid = [i / 100 for i in range(101)]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(grid, [predicted_speedup(a, theory_k(a, costs, fixed_k), costs) for a in grid], "k-",
            label=f"theory, {'best fixed k' if fixed_k is None else f'k={k}'}, measured costs")
    for t in report["by_temperature"]:
        pts = [(r["alpha"], r["speedup_observed"]) for r in records if str(r["temperature"]) == t and r["alpha"] is not None]
        color = None
        if pts:
            color = ax.scatter(*zip(*pts), s=12, alpha=0.6, label=f"requests T={t}").get_facecolor()[0][:3]
        agg = report["by_temperature"][t]
        if agg["alpha"] is not None and agg["speedup_observed"] is not None:
            ax.scatter([agg["alpha"]], [agg["speedup_observed"]], marker="*", s=160, edgecolor="k", color=color)
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set(xlabel="alpha", ylabel="speedup over vanilla", title="Observed speedup vs theory (stars: pooled)")
    ax.legend(fontsize=7)
    return _save(fig, path)


def write_plots(report: dict, records: list[dict], out_dir: Path) -> dict:
    out_dir = Path(out_dir)
    return {
        "acceptance_by_draft_position": plot_slot_acceptance(report, out_dir / "acceptance_by_draft_position.png"),
        "alpha_by_sequence_position": plot_alpha_by_position(report, out_dir / "alpha_by_sequence_position.png"),
        "alpha_by_temperature_domain": plot_alpha_by_temperature_domain(report, out_dir / "alpha_by_temperature_domain.png"),
        "speedup_vs_alpha": plot_speedup_vs_alpha(report, records, out_dir / "speedup_vs_alpha.png"),
    }

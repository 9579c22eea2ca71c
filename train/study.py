"""Studies: a base recipe plus named variants, each measured the same way. Run:
`python -m train.study STUDY.yaml [--dry-run] [--report] [--variants A,B]` (or under `accelerate launch`, as
`python -m train`), or, over runs that already finished: `python -m train.study --runs RUN_DIR... --out DIR`.

A study file names a base recipe, overrides applied to every variant, and the variants, each a list
of dotted overrides exactly as on the `python -m train` command line:

    name: objectives
    base: ../default.yaml                 # relative to the study file
    overrides: ["distill.max_steps=300"]  # every variant
    variants:
      forward_kl: ["distill.losses={forward_kl: 1.0}"]
      reverse_kl: ["distill.losses={reverse_kl: 1.0}"]

Every variant is resolved and validated before any work (a bad one: one line naming the variant and
the key, exit 2). Variants whose generated data would be the same (same target, data, generate and
seed sections) share it: it is generated once under RUN/_data/<key>/ and each variant's
`generate/` links to it. Each variant then runs its recipe's stages (distill, eval of every
checkpoint on the same evaluation prompts, export) into RUN/<variant>/ as a `python -m train`
child, which inherits an `accelerate launch` environment. A finished variant leaves
RUN/<variant>/study_row.json; a rerun after a kill skips those and resumes the others where their
stages stopped. RUN/study.json, study.md and study.png compare the variants; the winner is the
variant with the highest mean observed speedup over the eval temperatures (ties: mean alpha).

`--runs` writes the same tables and plot for finished `python -m train` run directories (or a study's
variant directories) made apart from any study file, one row per directory, named by it; they must have
been measured with the same target and eval settings, or their figures would not compare.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import statistics
import subprocess
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path

from eval.errors import UserError, cli_main
from eval.fsutil import atomic_write_json, atomic_write_text
from eval.models import log
from train.recipe import Recipe, _build, dump_recipe, load_recipe, read_recipe_file

DATA_SECTIONS = ("target", "data", "generate", "seed")  # what the generated data depends on
ROW_FILE = "study_row.json"


@dataclass
class StudyFile:
    """A study: one base recipe, overrides for all, and named variants of overrides."""

    name: str = "study"
    """The study's name; its directory is `runs/<name>/` unless `output_dir` is set."""
    base: str = ""
    """The base recipe (YAML), relative to the study file."""
    overrides: list[str] = field(default_factory=list)
    """Dotted overrides applied to every variant, before the variant's own (equal budgets go here)."""
    variants: dict[str, list[str]] = field(default_factory=dict)
    """Variant name -> its dotted overrides (an empty list: the base recipe as it is)."""
    output_dir: str | None = None

    def __post_init__(self):
        if not self.base:
            raise UserError("study key 'base': required (the base recipe file)")
        if not self.variants:
            raise UserError("study key 'variants': expected at least one variant")
        for name in self.variants:
            if not name or "/" in name or name.startswith(("_", ".")):
                raise UserError(f"study variant '{name}': a name must be non-empty, without '/', not start with '_' or '.'")


@dataclass
class Variant:
    name: str
    overrides: list[str]
    """The complete override list passed to `python -m train` (study's, variant's, then name and output_dir)."""
    recipe: Recipe
    data_key: str


def load_study(path: str | os.PathLike) -> tuple[StudyFile, Path, Path]:
    """The study, its base recipe's path and its run directory."""
    data = read_recipe_file(path)
    if not isinstance(data, dict):
        raise UserError(f"study file '{path}': expected a mapping (name, base, overrides, variants)")
    data.setdefault("name", Path(path).stem)
    try:
        study = _build(StudyFile, data, "")
    except UserError as err:
        raise UserError(str(err).replace("recipe key", "study key", 1)) from None
    base = (Path(path).parent / study.base).resolve()
    if not base.is_file():
        raise UserError(f"study key 'base': recipe file '{base}' not found")
    run_dir = Path(study.output_dir) if study.output_dir else Path("runs") / study.name
    return study, base, run_dir


def data_key(recipe: Recipe) -> str:
    """A short hash of the sections the generated data depends on: equal keys, same data."""
    identity = {key: recipe.to_dict()[key] for key in DATA_SECTIONS}
    return hashlib.sha1(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:10]


def resolve_variants(study: StudyFile, base: Path, run_dir: Path) -> list[Variant]:
    """Every variant's resolved recipe, checked before any work; errors name the variant."""
    variants = []
    for name, own in study.variants.items():
        overrides = [*study.overrides, *own, f"name={study.name}-{name}", f"output_dir={run_dir / name}"]
        try:
            recipe = load_recipe(base, overrides)
        except UserError as err:
            raise UserError(f"study variant '{name}': {err}") from None
        variants.append(Variant(name, overrides, recipe, data_key(recipe)))
        row = _read_row(run_dir / name)
        if row is not None and _differs(row["recipe"], json.loads(json.dumps(recipe.to_dict()))):
            raise UserError(f"study variant '{name}': {run_dir / name} holds results of a different recipe; "
                            "remove that directory or rename the variant")
    return variants


def _differs(stored: dict, current: dict, section=None) -> bool:
    """Whether a finished variant's recipe differs from what the study file resolves to now. A key the stored
    recipe lacks did not exist when it ran (a newer version added it), so only the stored keys are compared;
    sections are compared key by key, every other value whole."""
    hints = typing.get_type_hints(section or Recipe)
    for key, value in stored.items():
        if key not in current:
            return True
        if dataclasses.is_dataclass(hints.get(key)) and isinstance(value, dict):
            if _differs(value, current[key], hints[key]):
                return True
        elif value != current[key]:
            return True
    return False


def _read_row(variant_dir: Path) -> dict | None:
    path = variant_dir / ROW_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def _is_main() -> bool:
    return int(os.environ.get("RANK", "0")) == 0  # under accelerate launch, one driver per process


def _train(base: Path, overrides: list[str], *options: str, index: int) -> None:
    """The study's `index`-th `python -m train` child; under `accelerate launch` the children of the same index
    on every process form one process group."""
    env = dict(os.environ)
    if int(env.get("WORLD_SIZE", "1")) > 1 and "MASTER_PORT" in env:
        # Each child group meets on a port of its own, with rank 0's child hosting the store. The launcher's
        # store (and the same port) would still hold the previous group's addresses, and a process that
        # starts its next child first would read them and fail to connect.
        env["MASTER_PORT"] = str(int(env["MASTER_PORT"]) + 1 + index)
        env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    proc = subprocess.run([sys.executable, "-m", "train", str(base), *overrides, *options], env=env)
    if proc.returncode != 0:
        log(f"study: `python -m train` exited with status {proc.returncode}; rerun the study to resume")
        sys.exit(proc.returncode)


def data_dir_of(run_dir: Path, variant: Variant) -> Path:
    """Where a variant's generated data lives: RUN/_data/<key>, shared by every variant with that key."""
    return Path(run_dir) / "_data" / variant.data_key


def link_data(variant_dir: Path, data_dir: Path) -> None:
    """RUN/<variant>/generate -> the shared RUN/_data/<key>/generate (relative, so the study directory can move)."""
    link = variant_dir / "generate"
    variant_dir.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() or link.exists():
        return
    try:
        link.symlink_to(os.path.relpath(data_dir / "generate", variant_dir), target_is_directory=True)
    except FileExistsError:  # another process of the launch made it
        pass


def run_study(study: StudyFile, base: Path, run_dir: Path, dry_run: bool = False, report: bool = False,
              only: list[str] | None = None) -> dict | None:
    """Run every variant, or those named in `only` (the tables still list the others, as pending)."""
    variants = resolve_variants(study, base, run_dir)
    unknown = [name for name in only or () if name not in study.variants]
    if unknown:
        raise UserError(f"--variants: no variant '{unknown[0]}' in study '{study.name}' "
                        f"(variants: {', '.join(study.variants)})")
    selected = [v for v in variants if only is None or v.name in only]
    keys = sorted({v.data_key for v in variants})
    chosen = "" if only is None else f" ({len(selected)} selected by --variants)"
    log(f"study '{study.name}': {len(variants)} variants{chosen}, {len(keys)} generated data set(s), directory {run_dir}")
    if dry_run:  # every variant was resolved (so checked) above; the selected ones are listed
        for v in selected:
            print(f"# variant {v.name} (data {v.data_key}): {' '.join(v.overrides[:-2]) or '(base recipe)'}")
            print(dump_recipe(v.recipe))
        log("dry run: every variant is valid; nothing was run")
        return None
    done = {v.name for v in variants if _read_row(run_dir / v.name) is not None}
    if report:  # the rows again from the finished variants' files, then the tables; nothing is run
        if not done:
            raise UserError(f"study '{study.name}': no variant has finished yet in {run_dir}")
        for v in variants:
            if v.name in done:
                atomic_write_json(run_dir / v.name / ROW_FILE, variant_row(v, run_dir / v.name))
        return write_study(study, variants, run_dir)
    if done:
        log(f"study: {len(done)} of {len(variants)} variants already finished ({', '.join(sorted(done))}); skipped")
    children = 0  # the same count on every process: each sees the same finished variants and data sets
    for v in selected:
        if v.name in done:
            continue
        data_dir = data_dir_of(run_dir, v)
        if not (data_dir / "generate" / "manifest.json").is_file():
            log(f"study: generating data {v.data_key} (shared by "
                f"{', '.join(w.name for w in variants if w.data_key == v.data_key)})")
            # --overwrite: the directory's name is the hash of every section the data depends on.
            _train(base, [*v.overrides[:-1], f"output_dir={data_dir}", "tracking.report_to=none"],
                   "--stages", "generate", "--overwrite", index=children)
            children += 1
        link_data(run_dir / v.name, data_dir)  # on every process, before its child looks for the data
        log(f"study: variant '{v.name}'")
        _train(base, v.overrides, index=children)
        children += 1
        if _is_main():
            atomic_write_json(run_dir / v.name / ROW_FILE, variant_row(v, run_dir / v.name))
            if v is not selected[-1]:  # the table so far, to look at while the rest runs
                write_study(study, variants, run_dir, final=False)
    if not _is_main():
        return None
    return write_study(study, variants, run_dir)


# ---------------------------------------------------------------------------- results


def variant_row(variant: Variant, variant_dir: Path) -> dict:
    """One variant's measurements: its best checkpoint's report, distill time and tokens, data size."""
    summary = json.loads((variant_dir / "eval" / "summary.json").read_text())
    report = json.loads((variant_dir / "eval" / summary["best"] / "report.json").read_text())
    requests = [json.loads(line) for line in (variant_dir / "eval" / summary["best"] / "requests.jsonl").read_text().splitlines()]
    keys = ("alpha", "tau", "speedup_observed", "speedup_theoretical", "drafted_per_round")
    steps = []
    log_path = variant_dir / "distill" / "log.jsonl"
    if log_path.is_file():
        steps = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    return {
        "variant": variant.name,
        "overrides": variant.overrides[:-2],
        "recipe": json.loads(json.dumps(variant.recipe.to_dict())),
        "data_key": variant.data_key,
        "data": data_size(variant_dir / "generate"),
        "best_checkpoint": summary["best"],
        "by_temperature": {t: {**{k: r.get(k) for k in keys},
                               **spread_over_prompts([q for q in requests if str(q["temperature"]) == t])}
                           for t, r in report["by_temperature"].items()},
        "alpha_by_domain": {t: {d: r["alpha"] for d, r in domains.items()} for t, domains in report["by_domain"].items()},
        "greedy_identical_to_vanilla": report.get("greedy_identical_to_vanilla"),
        "c": report["costs"]["c"],
        # The draft's head: its size (None: every token) and the share of the target's tokens inside, per temperature.
        "draft_head": {"size": report.get("draft_vocab_size"), "coverage": report.get("draft_vocab_coverage")},
        "distill_steps": len(steps),
        "distill_tokens": int(sum(s["train/tokens"] for s in steps)),
        # Step time only (the logged tokens/s of each step); checkpoint writing and measuring excluded.
        "distill_seconds": sum(s["train/tokens"] / s["train/tokens_per_s"] for s in steps if s["train/tokens_per_s"]),
        **distill_progress(steps),
        "wall_seconds": wall_seconds(variant_dir, (variant_dir / "generate").resolve().parent),
        "run_dir": str(variant_dir),
    }


def distill_progress(steps: list[dict], window: int = 50) -> dict:
    """The training loss at the start and at the end (the mean over the first and the last `window` steps, a
    quarter of the run when that is fewer) and the step throughput (the median training tokens a second over
    the steps after the first quarter, so the warm-up and the first compilation stay out)."""
    if not steps:
        return {"distill_loss": None, "distill_tokens_per_s": None}
    n = min(window, max(1, len(steps) // 4))
    losses = [s["train/loss"] for s in steps]
    return {"distill_loss": {"steps": n, "first": statistics.fmean(losses[:n]), "last": statistics.fmean(losses[-n:])},
            "distill_tokens_per_s": statistics.median(s["train/tokens_per_s"] for s in steps[len(steps) // 4:])}


def wall_seconds(variant_dir: Path, data_dir: Path) -> dict:
    """Wall time per stage from the runs' timings.json (train/pipeline.py): the shared data's generate stage,
    then the variant's own stages (distill includes measuring its checkpoints); `total` is their sum, as one
    `python -m train` of the variant's recipe would take (less loading the models once more). Stages without
    a record (a run before timings were kept) are left out."""
    def last(path: Path) -> dict:
        entries = json.loads(path.read_text())["entries"] if path.is_file() else []
        return {e["what"]: e["seconds"] for e in entries}  # a resumed stage: its last record

    stages = {"generate": last(data_dir / "timings.json").get("generate")}
    own = last(variant_dir / "timings.json")
    stages.update({stage: own.get(stage) for stage in ("distill", "eval", "export")})
    stages = {k: v for k, v in stages.items() if v is not None}
    return {**stages, "total": sum(stages.values())} if stages else {}


def spread_over_prompts(requests: list[dict]) -> dict:
    """The standard error of the mean per-request alpha and observed speedup: how much the figures would move
    with another draw of as many prompts (the variants share their prompts, so a paired difference moves less)."""
    from eval.compare import mean_and_se

    def se(values):
        return mean_and_se([v for v in values if v is not None])[1]

    return {"alpha_se": se([q["alpha"] for q in requests]),
            "speedup_observed_se": se([q["speedup_observed"] for q in requests]), "requests": len(requests)}


def data_size(generate_dir: Path) -> dict:
    """Rows, prompts and completion tokens of a generated data set."""
    import pyarrow.parquet as pq

    manifest = json.loads((generate_dir / "manifest.json").read_text())
    tokens = 0
    for shard in manifest["shards"]:
        column = pq.read_table(generate_dir / shard["file"], columns=["completion_ids"]).column("completion_ids")
        tokens += sum(len(ids) for ids in column.to_pylist())
    return {"rows": manifest["rows"], "prompts": manifest["prompts"], "completion_tokens": tokens}


def score(row: dict) -> tuple[float, float]:
    """The winner's key: mean observed speedup over the eval temperatures, then mean alpha."""
    rows = list(row["by_temperature"].values())
    return (sum(r["speedup_observed"] or 0.0 for r in rows) / len(rows), sum(r["alpha"] or 0.0 for r in rows) / len(rows))


def write_study(study: StudyFile, variants: list[Variant], run_dir: Path, final: bool = True) -> dict:
    """study.json, study.md and study.png over the finished variants (`pending` names the others)."""
    read = {v.name: _read_row(run_dir / v.name) for v in variants}
    rows = [row for row in read.values() if row is not None]
    return write_result(study.name, rows, [name for name, row in read.items() if row is None], run_dir, final)


def write_result(name: str, rows: list[dict], pending: list[str], run_dir: Path, final: bool = True,
                 collected: bool = False) -> dict:
    """study.json, study.md and study.png over these rows; `collected`: rows of finished runs, not of a study file."""
    winner = max(rows, key=score)["variant"]
    result = {"study": name, "winner": winner,
              "rule": "max mean observed speedup over the eval temperatures; ties by mean alpha", "variants": rows,
              "pending": pending, "collected": collected}
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(run_dir / "study.json", result)
    atomic_write_text(run_dir / "study.md", study_markdown(result))
    plot_study(result, run_dir / "study.png")
    if final:
        print(study_markdown(result))
        log(f"study: winner '{winner}' (by mean observed speedup); {run_dir / 'study.md'}, study.json, study.png")
    else:
        log(f"study: {len(rows)} of {len(rows) + len(pending)} variants finished; best so far '{winner}'; "
            f"{run_dir / 'study.md'}")
    return result


# Eval settings that change what alpha and the speedup measure; `compile` and `reuse_vanilla` change neither.
COMPARED_SETTINGS = ("prompts", "num_prompts", "max_new_tokens", "temperatures", "k", "draft_confidence", "top_p",
                     "top_k", "seed", "max_prompt_tokens", "fallback_window", "fallback_threshold")


def collect_runs(paths: list[str], out: Path) -> dict:
    """A study's tables and plot over finished run directories: one row per directory, by its best checkpoint."""
    dirs = [Path(p) for p in paths]
    names = [d.name for d in dirs]
    if len(set(names)) < len(names):  # runs/a/x and runs/b/x: name each by its whole path instead
        names = [str(d) for d in dirs]
    # Every run checked before any row is built (a row reads the run's whole generated data).
    measured = [(run, eval_settings(run)) for run in dirs]
    reference, settings = measured[0]
    for run, own in measured[1:]:
        for key, value in own.items():
            if value != settings[key]:
                raise UserError(f"--runs: '{run}' was measured with {key} {value!r}, '{reference}' with "
                                f"{settings[key]!r}: their figures do not compare")
    rows = []
    for name, run in zip(names, dirs):
        recipe = load_recipe(run / "recipe.yaml", [])
        # The two overrides a study appends to every variant's (and `variant_row` leaves out): the run has no others.
        variant = Variant(name, [f"name={recipe.name}", f"output_dir={run}"], recipe, data_key(recipe))
        rows.append(variant_row(variant, run))
    log(f"study: {len(rows)} finished runs, measured alike ({settings['prompts']} prompts, "
        f"{settings['max_new_tokens']} new tokens)")
    return write_result(out.name, rows, [], out, collected=True)


def eval_settings(run: Path) -> dict:
    """The target and the eval settings a finished run's best checkpoint was measured with."""
    if not (run / "recipe.yaml").is_file() or not (run / "eval" / "summary.json").is_file():
        raise UserError(f"--runs: '{run}' is not a finished run directory (no recipe.yaml or eval/summary.json)")
    summary = json.loads((run / "eval" / "summary.json").read_text())
    report = json.loads((run / "eval" / summary["best"] / "report.json").read_text())
    return {"target": report["pair"]["target"], **{k: report["settings"].get(k) for k in COMPARED_SETTINGS}}


def _pm(value, se) -> str:
    """`value ± standard error` (over the evaluation prompts)."""
    if value is None:
        return "-"
    return f"{value:.3f}" + (f" ± {se:.3f}" if se is not None else "")


def _head(head: dict | None, temps: list[str]) -> str:
    """`full`, or the reduced head's size with the share of the target's tokens inside it at each temperature."""
    if not head:
        return "-"
    if head["size"] is None:
        return "full"
    coverage = head.get("coverage") or {}
    inside = " / ".join(f"{100 * coverage[t]:.1f}%" for t in temps if coverage.get(t) is not None)
    return f"{head['size']}" + (f" ({inside} inside)" if inside else "")


def study_markdown(result: dict) -> str:
    from eval.report import markdown_table

    rows = result["variants"]
    temps = list(rows[0]["by_temperature"])
    headers = ["variant"] + [f"{name} T={t}" for t in temps for name in ("α", "τ", "speedup")] + [
        "draft head", "distill min", "distill tokens", "loss first → last", "tokens/s", "data tokens", "generate min", "wall min", "best", "winner"]
    table = []
    for r in rows:
        cells = [r["variant"]]
        for t in temps:
            m = r["by_temperature"][t]
            cells += [_pm(m["alpha"], m.get("alpha_se")), m["tau"], _pm(m["speedup_observed"], m.get("speedup_observed_se"))]
        wall = r.get("wall_seconds") or {}
        minutes = [round(wall[key] / 60, 1) if key in wall else "-" for key in ("generate", "total")]
        loss = r.get("distill_loss")  # absent in a row written before it was kept: `--report` adds it
        throughput = r.get("distill_tokens_per_s")
        cells += [_head(r.get("draft_head"), temps), round(r["distill_seconds"] / 60, 1), r["distill_tokens"],
                  f"{loss['first']:.2f} → {loss['last']:.2f}" if loss else "-", round(throughput) if throughput else "-",
                  r["data"]["completion_tokens"], *minutes,
                  r["best_checkpoint"], "*" if r["variant"] == result["winner"] else ""]
        table.append(cells)
    domains = sorted({d for r in rows for t in temps for d in r["alpha_by_domain"].get(t, {})})
    domain_table = [[r["variant"]] + [r["alpha_by_domain"].get(t, {}).get(d) for t in temps for d in domains] for r in rows]
    if result.get("collected"):  # finished runs, each with its own recipe: where each one lives
        overrides = "\n".join(f"- `{r['variant']}`: `{r['run_dir']}/recipe.yaml`" for r in rows)
    else:
        overrides = "\n".join(f"- `{r['variant']}`: {' '.join(f'`{o}`' for o in r['overrides']) or '(base recipe)'}"
                               for r in rows)
    pending = (f" Not finished yet: {', '.join(result['pending'])}." if result.get("pending") else "")
    spread = ("± is the standard error of the per-prompt values over the evaluation prompts (every variant is "
              "measured on the same prompts, so differences between variants are steadier than that).")
    if result.get("collected"):
        spread += (" These runs were collected after they finished: their α compares wherever they ran, their "
                   "observed speedups only between runs measured in one session on one machine.")
    return (f"# Study `{result['study']}`\n\nWinner: **{result['winner']}** ({result['rule']}).{pending} {spread}\n\n"
            f"{markdown_table(headers, table)}\n\n### α by domain\n\n"
            f"{markdown_table(['variant'] + [f'{d} T={t}' for t in temps for d in domains], domain_table)}\n\n"
            f"### {'Recipes' if result.get('collected') else 'Overrides'}\n\n{overrides}\n")


def _alpha_against(ax, rows: list[dict], temps: list[str], sizes: list[int], xlabel: str, title: str) -> None:
    """Alpha per temperature against a token count, on a log axis (sizes grow by factors: 60k, 220k, 660k)."""
    import matplotlib.ticker

    for t in temps:
        ys = [r["by_temperature"][t]["alpha"] or 0.0 for r in rows]
        ax.scatter(sizes, ys, label=f"T={t}")
        for x, y, r in zip(sizes, ys, rows):
            ax.annotate(r["variant"], (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set(xlabel=xlabel, ylabel="alpha", title=title)
    ax.set_xscale("log")
    # ticks at the variants' own sizes (a range inside one decade would otherwise show no label at all), one
    # for sizes within 5% of each other, whose labels would overlap
    ticks = []
    for size in sorted(set(sizes)):
        if not ticks or size > ticks[-1] * 1.05:
            ticks.append(size)
    ax.set_xticks(ticks)
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.xaxis.set_major_formatter(lambda x, _: f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1000:,.0f}k")
    ax.tick_params(axis="x", labelsize=7, labelrotation=30)
    ax.margins(x=0.15)


def plot_study(result: dict, path: Path) -> None:
    """Observed speedup and alpha per variant and temperature (bars with their standard errors); alpha against
    generated training tokens when the variants' data differ in size, else alpha by domain at the first
    temperature; and alpha against the tokens distilled when the variants' steps or data differ."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["variants"]
    temps = list(rows[0]["by_temperature"])
    names = [r["variant"] for r in rows]
    width = 0.8 / len(temps)
    distilled = [r["distill_tokens"] for r in rows]
    panels = 4 if len(set(distilled)) > 1 else 3
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4.5))
    for ax, key, label in ((axes[0], "speedup_observed", "observed speedup"), (axes[1], "alpha", "alpha")):
        for i, t in enumerate(temps):
            values = [r["by_temperature"][t][key] or 0.0 for r in rows]
            errors = [r["by_temperature"][t].get(f"{key}_se") or 0.0 for r in rows]
            ax.bar([x + i * width for x in range(len(rows))], values, width, yerr=errors, capsize=2, label=f"T={t}")
        ax.set_xticks([x + width * (len(temps) - 1) / 2 for x in range(len(rows))], names, rotation=30, ha="right",
                      fontsize=8)
        ax.set(ylabel=label, title=f"{label} by variant")
        ax.legend(fontsize=8)
    axes[0].axhline(1.0, color="grey", lw=0.8, ls="--")
    sizes = [r["data"]["completion_tokens"] for r in rows]
    if len(set(sizes)) > 1:
        _alpha_against(axes[2], rows, temps, sizes, "generated training tokens", "alpha against training data")
    else:  # one data set for all: where each variant's alpha comes from instead
        t = temps[0]
        domains = sorted({d for r in rows for d in r["alpha_by_domain"].get(t, {})})
        dw = 0.8 / max(len(rows), 1)
        for i, r in enumerate(rows):
            axes[2].bar([x + i * dw for x in range(len(domains))],
                        [r["alpha_by_domain"].get(t, {}).get(d) or 0.0 for d in domains], dw, label=r["variant"])
        axes[2].set_xticks([x + dw * (len(rows) - 1) / 2 for x in range(len(domains))], domains)
        axes[2].set(ylabel="alpha", title=f"alpha by domain, T={t}")
    axes[2].legend(fontsize=7)
    if len(axes) == 4:  # steps times tokens a step: what the draft was trained on, passes over the data included
        _alpha_against(axes[3], rows, temps, distilled, "tokens distilled", "alpha against tokens distilled")
        axes[3].legend(fontsize=7)
    fig.suptitle(f"study {result['study']}: winner {result['winner']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m train.study", description=__doc__.split("\n\n")[0])
    parser.add_argument("study", nargs="?", help="study YAML file")
    parser.add_argument("--dry-run", action="store_true", help="list the variants and their resolved recipes; run nothing")
    parser.add_argument("--report", action="store_true",
                        help="write study.json/md/png from the variants finished so far; run nothing")
    parser.add_argument("--variants", type=lambda text: [name for name in text.split(",") if name], default=None,
                        help="comma-separated: run only these variants (the tables list the others as pending)")
    parser.add_argument("--runs", nargs="+", metavar="RUN_DIR",
                        help="instead of a study file: finished run directories, measured alike, one row each")
    parser.add_argument("--out", type=Path, help="with --runs: the directory for study.json/md/png")
    return parser.parse_args(argv)


@cli_main
def main(argv=None):
    args = parse_args(argv)
    if args.runs:
        if args.study or not args.out or args.dry_run or args.report or args.variants:
            raise UserError("--runs: give the run directories and --out DIR, without a study file or its options")
        collect_runs(args.runs, args.out)
        return
    if not args.study:
        raise UserError("give a study file (STUDY.yaml), or --runs RUN_DIR... --out DIR")
    study, base, run_dir = load_study(args.study)
    run_study(study, base, run_dir, dry_run=args.dry_run, report=args.report, only=args.variants)


if __name__ == "__main__":
    main()

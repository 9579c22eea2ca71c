"""Compare two measurements on the same prompts, paired: `python -m eval.compare A B [--out FILE]`.

A and B are eval directories (a checkpoint's `RUN/eval/checkpoint-N`, a `python -m eval --out` directory) or
their `requests.jsonl`. Requests are matched by prompt id and temperature; per temperature the table gives
each side's mean per-request α and observed speedup and the mean of B − A over the matched requests, ± its
standard error. Two drafts measured on the same prompts differ less than their separate standard errors
suggest (a hard prompt is hard for both), so the paired error is the one that says whether B beat A.
`--by-position` adds α by position in the generated sequence (the report's buckets: 0-9, 10-49, ...), paired
over the requests that drafted a token in that bucket on both sides: where a draft trained on shorter answers
than the eval writes loses α, this shows it.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from eval.errors import UserError, cli_main
from eval.fsutil import atomic_write_json
from eval.report import format_table
from eval.speculative import BUCKET_NAMES, ratio

METRICS = ("alpha", "speedup_observed")


def read_requests(path: str | Path) -> dict[tuple[str, float], dict]:
    """The requests of one measurement, keyed by (prompt id, temperature)."""
    path = Path(path)
    file = path / "requests.jsonl" if path.is_dir() else path
    if not file.is_file():
        raise UserError(f"'{path}' holds no requests.jsonl (an eval directory, e.g. RUN/eval/checkpoint-600)")
    requests = {}
    for number, line in enumerate(file.read_text().splitlines(), 1):
        try:
            row = json.loads(line)
            requests[(row["request_id"], float(row["temperature"]))] = row
        except (ValueError, KeyError, TypeError):
            raise UserError(f"{file}:{number}: not a request record of `python -m eval`") from None
    return requests


def mean_and_se(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, None
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1) / len(values))


def paired(pairs: list[tuple[float, float]]) -> dict:
    """A's mean, B's mean, and the mean paired difference B − A with its standard error."""
    diff, diff_se = mean_and_se([y - x for x, y in pairs])
    return {"a": mean_and_se([x for x, _ in pairs])[0], "b": mean_and_se([y for _, y in pairs])[0],
            "b_minus_a": diff, "b_minus_a_se": diff_se}


def bucket_alpha(request: dict, bucket: int) -> float | None:
    """One request's α over the drafted positions that fell in a position bucket; None where it drafted none."""
    counts = request.get("bucket_count") or []  # absent in records written before the buckets were
    return ratio(request["bucket_beta_sum"][bucket], counts[bucket]) if bucket < len(counts) else None


def compare(a: dict, b: dict) -> dict:
    """Per temperature and metric (and per position bucket for α): A's mean, B's mean, and the mean paired
    difference B − A with its standard error."""
    shared = sorted(set(a) & set(b))
    if not shared:
        raise UserError("the two measurements share no request (prompt id and temperature): nothing to pair")
    result = {"requests_paired": len(shared), "only_a": len(set(a) - set(b)), "only_b": len(set(b) - set(a)),
              "by_temperature": {}}
    for temperature in sorted({t for _, t in shared}):
        keys = [key for key in shared if key[1] == temperature]
        row = {"requests": len(keys)}
        for metric in METRICS:
            row[metric] = paired([(a[k][metric], b[k][metric]) for k in keys
                                  if a[k].get(metric) is not None and b[k].get(metric) is not None])
        row["alpha_by_position"] = {}
        for bucket, name in enumerate(BUCKET_NAMES):
            pairs = [(bucket_alpha(a[k], bucket), bucket_alpha(b[k], bucket)) for k in keys]
            pairs = [(x, y) for x, y in pairs if x is not None and y is not None]
            if pairs:
                row["alpha_by_position"][name] = {"requests": len(pairs)} | paired(pairs)
        result["by_temperature"][str(temperature)] = row
    return result


def pm(value, se) -> str:
    return "-" if value is None else f"{value:+.3f}" + ("" if se is None else f" ± {se:.3f}")


def table(result: dict) -> str:
    rows = []
    for temperature, row in result["by_temperature"].items():
        alpha, speedup = row["alpha"], row["speedup_observed"]
        rows.append([temperature, row["requests"], alpha["a"], alpha["b"], pm(alpha["b_minus_a"], alpha["b_minus_a_se"]),
                     speedup["a"], speedup["b"], pm(speedup["b_minus_a"], speedup["b_minus_a_se"])])
    return format_table(["T", "requests", "alpha A", "alpha B", "B - A (paired)", "speedup A", "speedup B",
                         "B - A (paired)"], rows)


def position_table(result: dict) -> str:
    rows = [[temperature, name, cell["requests"], cell["a"], cell["b"], pm(cell["b_minus_a"], cell["b_minus_a_se"])]
            for temperature, row in result["by_temperature"].items()
            for name, cell in row["alpha_by_position"].items()]
    return format_table(["T", "positions", "requests", "alpha A", "alpha B", "B - A (paired)"], rows)


@cli_main
def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m eval.compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", help="the first measurement: an eval directory or its requests.jsonl")
    parser.add_argument("b", help="the second, on the same prompts")
    parser.add_argument("--by-position", action="store_true",
                        help="also print α by position in the generated sequence, paired per bucket")
    parser.add_argument("--out", default=None, help="also write the comparison as JSON here")
    args = parser.parse_args(argv)
    result = {"a": str(args.a), "b": str(args.b)} | compare(read_requests(args.a), read_requests(args.b))
    print(f"A: {args.a}\nB: {args.b}\n{result['requests_paired']} requests paired"
          + (f" ({result['only_a']} only in A, {result['only_b']} only in B)" if result["only_a"] or result["only_b"] else ""))
    print(table(result))
    if args.by_position:
        print("alpha by position in the generated sequence (requests that drafted there on both sides):")
        print(position_table(result))
    if args.out:
        print(f"wrote {atomic_write_json(args.out, result)}")


if __name__ == "__main__":
    main()

"""The generate stage: the target writes completions for the prompt set, sharded parquet under RUN/generate/.

Rows are (prompt, temperature, sample) in a fixed order, cut into shards of `generate.shard_size`
rows. A shard is the unit of work and of resumption: it is generated in fixed batches with a seed
of its own, written to a temporary name and renamed, so a finished shard is never redone and a
half-written one is never read. Under `accelerate launch` process r takes shards r, r + n, ...;
the union equals a one-process run with the same seed. The manifest is written last.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

from tqdm.auto import tqdm

from eval.packed import packed_linears
from eval.errors import UserError
from eval.fsutil import atomic_path, atomic_write_json
from eval.models import dtype_name, log
from eval.prompts import Prompt, builtin_prompts, read_jsonl_prompts, row_to_prompt, spread
from eval.lean import lean_unsupported, runs_lean
from train.completions import Row, build_rows, generate_batch
from train.models import cast_weights, generation_dtype
from train.self_written import write_self_prompts

SCHEMA_VERSION = 1


# ---------------------------------------------------------------------------- prompt sources


def load_prompts(data) -> list[Prompt]:
    """Prompts named by the recipe's `data` section (built-in train split, local files, or a hub dataset)."""
    columns = dict(prompt_column=data.prompt_column, id_column=data.id_column, domain_column=data.domain_column,
                   chat_column=data.chat_column)
    if data.source == "builtin":
        prompts = builtin_prompts("train")
    elif data.source == "files" and str(data.path).endswith(".jsonl"):
        prompts = read_jsonl_prompts(data.path, **columns)
    else:
        prompts = _dataset_prompts(data, columns)
    return spread(prompts, data.max_prompts)  # a capped set still covers every domain


def _dataset_prompts(data, columns) -> list[Prompt]:
    """CSV / parquet / JSON files, a dataset saved with `save_to_disk`, or a hub dataset id, via `datasets`."""
    import datasets

    path = str(data.path)
    try:
        if data.source == "files":
            suffix = Path(path.split("*")[0]).suffix.lstrip(".") or Path(path).suffix.lstrip(".")
            builder = {"csv": "csv", "parquet": "parquet", "json": "json", "jsonl": "json"}.get(suffix)
            if builder is None:
                raise UserError(f"recipe key 'data.path': '{path}' is not a .jsonl, .json, .csv or .parquet file")
            table = datasets.load_dataset(builder, data_files=path, split="train")
        elif Path(path).is_dir() and (Path(path) / "dataset_info.json").exists():
            table = datasets.load_from_disk(path)
        elif Path(path).is_dir() and any((Path(path) / data.split).glob("dataset_info.json")):
            table = datasets.load_from_disk(str(Path(path) / data.split))
        else:
            table = datasets.load_dataset(path, split=data.split)
    except FileNotFoundError as err:
        raise UserError(f"recipe key 'data.path': {str(err).splitlines()[0]}") from None
    except (ValueError, ConnectionError, OSError) as err:
        raise UserError(f"cannot load dataset '{path}': {str(err).splitlines()[0]}") from None
    needed = data.chat_column or data.prompt_column
    if needed not in table.column_names:
        raise UserError(f"dataset '{path}' has no column '{needed}' (columns: {', '.join(table.column_names)})")
    return [row_to_prompt(row, i, f"dataset '{path}' row {i}", **columns) for i, row in enumerate(table)]


def self_written_prompts(recipe, target, tokenizer, out_dir: Path, state) -> list[Prompt]:
    """`data.source: self`: the main process has the target write the prompts (train/self_written.py), the
    others wait and read them; with `with_builtin` the built-in train prompts join them."""
    if state.is_main_process:
        with packed_linears(target):
            write_self_prompts(recipe, target, tokenizer, out_dir)
    state.wait_for_everyone()
    prompts = read_jsonl_prompts(Path(out_dir) / "prompts.jsonl")
    if recipe.data.self_written.with_builtin:
        prompts = prompts + builtin_prompts("train")
    return spread(prompts, recipe.data.max_prompts)


# ---------------------------------------------------------------------------- rows and shards


def shard_path(out_dir: Path, index: int) -> Path:
    return out_dir / "data" / f"shard-{index:05d}.parquet"


def write_shard(path: Path, rows: list[Row], results) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = {
        "prompt_id": [r.prompt.id for r in rows],
        "domain": [r.prompt.domain for r in rows],
        "temperature": [float(r.temperature) for r in rows],
        "sample": [r.sample for r in rows],
        "prompt_ids": [r.prompt_ids for r in rows],
        "completion_ids": [res[0] for res in results],
        "finish_reason": [res[1] for res in results],
    }
    if results and results[0][2] is not None:
        table["topk_ids"] = [res[2][0] for res in results]
        table["topk_logprobs"] = pa.array([res[2][1] for res in results], type=pa.list_(pa.list_(pa.float16())))
    with atomic_path(path) as tmp:
        pq.write_table(pa.table(table), tmp)


def shard_batches(rows: list[Row], batch_size: int) -> list[list[int]]:
    """A shard's rows (their indices) in batches of at most `batch_size`: never two temperatures in one batch, and
    within a temperature the rows sorted by prompt length, so a batch's prompts are alike in length and little
    left padding is computed. Deterministic: a resumed run writes the same batches (and seeds) again."""
    order = sorted(range(len(rows)), key=lambda i: (rows[i].temperature, len(rows[i].prompt_ids)))
    batches, current = [], []
    for i in order:
        if current and (rows[i].temperature != rows[current[0]].temperature or len(current) == batch_size):
            batches.append(current)
            current = []
        current.append(i)
    return batches + [current]


def run_generate_stage(recipe, target, tokenizer, run_dir: Path, state=None) -> Path:
    """Generate every unfinished shard this process owns; the main process writes the manifest last."""
    from train.dist import distributed_state

    state = state or distributed_state()
    out_dir = Path(run_dir) / "generate"
    manifest_path = out_dir / "manifest.json"
    if manifest_path.is_file():
        log(f"generate: already finished ({manifest_path}); skipped")
        return out_dir
    gen = recipe.generate
    dtype = generation_dtype(gen.dtype, target)
    if dtype != target.dtype:  # a copy for this stage: the target itself stays as loaded for distill and eval
        log(f"generate: the target writes in {dtype_name(dtype)} (generate.dtype: {gen.dtype}; loaded in {dtype_name(target.dtype)})")
        target = cast_weights(copy.deepcopy(target), dtype)
    steps = "lean" if runs_lean(target, gen.steps) else "transformers"
    if steps != gen.steps:
        log(f"generate: the target runs its own forward ({lean_unsupported(target)})")
    if recipe.data.source == "self":
        prompts = self_written_prompts(recipe, target, tokenizer, out_dir, state)
    else:
        prompts = load_prompts(recipe.data)
    if not prompts:
        raise UserError("recipe key 'data': the prompt source holds no prompts")
    rows = build_rows(prompts, tokenizer, gen, recipe.data.max_prompt_tokens)
    n_shards = (len(rows) + gen.shard_size - 1) // gen.shard_size
    mine = [i for i in range(n_shards) if i % state.num_processes == state.process_index]
    todo = [i for i in mine if not shard_path(out_dir, i).is_file()]
    todo_rows = sum(len(rows[i * gen.shard_size:(i + 1) * gen.shard_size]) for i in todo)
    if len(todo) < len(mine):
        log(f"generate: {len(mine) - len(todo)} of this process's {len(mine)} shards already written; resuming")
    bar = tqdm(total=todo_rows, desc=f"generate [{state.process_index}]", unit="row", disable=not todo_rows,
               position=state.process_index)
    start, new_tokens = time.perf_counter(), 0
    with packed_linears(target):  # a CPU target reads packed weights (eval/packed.py)
        for index in todo:
            shard_rows = rows[index * gen.shard_size:(index + 1) * gen.shard_size]
            results = [None] * len(shard_rows)
            for b, batch in enumerate(shard_batches(shard_rows, gen.batch_size)):
                out = generate_batch(target, tokenizer, [shard_rows[i] for i in batch], gen,
                                     seed=recipe.seed * 1_000_003 + index * 1_009 + b, steps=steps)
                for i, result in zip(batch, out):
                    results[i] = result
                new_tokens += sum(len(r[0]) for r in out)
                bar.update(len(batch))
                bar.set_postfix(tok_s=f"{new_tokens / (time.perf_counter() - start):.0f}")
            write_shard(shard_path(out_dir, index), shard_rows, results)
    bar.close()
    elapsed = time.perf_counter() - start
    state.wait_for_everyone()
    if state.is_main_process:
        missing = [i for i in range(n_shards) if not shard_path(out_dir, i).is_file()]
        if missing:
            raise RuntimeError(f"generate: shards {missing[:5]} missing after all processes finished")
        import pyarrow.parquet as pq

        counts = [pq.read_metadata(shard_path(out_dir, i)).num_rows for i in range(n_shards)]
        manifest = {
            "schema_version": SCHEMA_VERSION,
            "rows": sum(counts),
            "shards": [{"file": shard_path(out_dir, i).relative_to(out_dir).as_posix(), "rows": c} for i, c in enumerate(counts)],
            "prompts": len(prompts),
            "temperatures": gen.temperatures,
            "num_samples": gen.num_samples,
            "max_new_tokens": gen.max_new_tokens,
            "topk_logprobs": gen.topk_logprobs,
            "dtype": dtype_name(dtype),
            "steps": steps,
            "seed": recipe.seed,
            "processes": state.num_processes,
        }
        atomic_write_json(manifest_path, manifest)
        rate = new_tokens / elapsed if elapsed > 0 else 0.0
        log(f"generate: {manifest['rows']} rows in {n_shards} shards ({len(todo)} written now); "
            f"this process: {new_tokens} new tokens in {elapsed:.1f}s = {rate:.1f} tokens/s; {out_dir}")
    state.wait_for_everyone()
    return out_dir


def load_generated(run_dir: Path):
    """The generated rows as a `datasets.Dataset` (parquet shards listed in the manifest)."""
    import datasets

    out_dir = Path(run_dir) / "generate"
    manifest = json.loads((out_dir / "manifest.json").read_text())
    files = [str(out_dir / s["file"]) for s in manifest["shards"]]
    return datasets.load_dataset("parquet", data_files=files, split="train")

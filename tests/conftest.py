"""Shared fixtures: a tiny tokenizer and tiny Llama models built from configs (no network, no hub)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    '{"name": "Ada", "age": 36, "langs": ["python", "c"]}',
    "The quick brown fox jumps over the lazy dog. " * 3,
    "What is 12 + 30? The answer is 42.",
    "Hello! How can I help you today? Tell me about the weather.",
    "for i in range(10):\n    print(i * i)\n",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def make_tokenizer(vocab_size: int = 300, extra: str = ""):
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS + [extra], vocab_size=vocab_size, min_frequency=1,
                            special_tokens=["<pad>", "<s>", "</s>"], show_progress=False)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<s>", eos_token="</s>",
                                  pad_token="<pad>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def make_model(vocab_size: int, layers: int = 2, hidden: int = 64, seed: int = 0, scale: float = 8.0, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, tie_word_embeddings=True, bos_token_id=1,
                         eos_token_id=2, pad_token_id=0, **overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # Sharper than the default init, so greedy outputs are not all one token.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(scale)
    return model.eval()


def trained_draft(target, steps=30, vocab_size=None):
    """A draft partly trained toward the target (a few steps of forward KL on random text)."""
    V = vocab_size or target.config.vocab_size
    draft = make_model(V, layers=1, hidden=32, seed=3).train()
    opt = torch.optim.Adam(draft.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        ids = torch.randint(0, V, (4, 24), generator=g)
        with torch.no_grad():
            p = target(ids).logits.log_softmax(-1)
        q = draft(ids).logits.log_softmax(-1)
        loss = (p.exp() * (p - q)).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return draft.eval()


class StubDraft(torch.nn.Module):
    """Wraps a model; its logits always put all mass on `token` (a draft that is never accepted)."""

    def __init__(self, model, token):
        super().__init__()
        self.model, self.token = model, token
        self.config = model.config

    def get_output_embeddings(self):
        return self.model.get_output_embeddings()

    def forward(self, **kwargs):
        out = self.model(**kwargs)
        logits = torch.full_like(out.logits, -1e4)
        logits[..., self.token] = 0.0
        out.logits = logits
        return out


LONGEST_FIRST = ["test_distill.py", "test_faults.py", "test_quickstart.py", "test_study.py", "test_sampling_distribution.py",
                 "test_compiled.py", "test_generate.py"]
"""Test files by their time on a 2-core CPU, longest first. scripts/test.sh hands whole files to pytest-xdist's
workers in collection order: the long ones start first, the short ones fill in behind them."""


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's own order is kept


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory, tiny_tokenizer):
    path = tmp_path_factory.mktemp("target")
    make_model(len(tiny_tokenizer), layers=2, seed=0).save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory, tiny_tokenizer):
    path = tmp_path_factory.mktemp("draft")
    make_model(len(tiny_tokenizer), layers=1, hidden=32, seed=1).save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(autouse=True)
def _no_inherited_wandb_service():
    """A W&B run started inside the test process sets WANDB_SERVICE; a run started later as a subprocess
    would attach to that service, which may be gone by then. Every test starts without it."""
    os.environ.pop("WANDB_SERVICE", None)
    yield


@pytest.fixture(autouse=True)
def _own_auto_decisions(tmp_path, monkeypatch):
    """`eval.compile: auto` remembers its decisions on disk (eval/compiled.py): each test, and the commands it
    runs, starts with none and leaves the user's cache alone."""
    monkeypatch.setenv("SPECDISTILL_AUTO_DECISIONS", str(tmp_path / "compile_auto.json"))


# ---------------------------------------------------------------------------- runs of the real commands (subprocesses)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rows_of(run_dir):
    """A run's generated rows, order-free: the dataset as sorted JSON lines."""
    from train.generate import load_generated

    return sorted(json.dumps(r, sort_keys=True) for r in load_generated(run_dir).to_list())


def write_distill_recipe(tmp_path, target_dir, run_dir, stages=("generate", "distill"), tracking="none", eval_=None, **distill):
    settings = {"losses": {"reverse_kl": 1.0, "sequence_ce": 0.1}, "max_steps": 6, "batch_size": 2, "grad_accum": 2,
                "checkpoint_every": 3, "lr": 3e-3, "warmup_steps": 1, "loss_chunk_size": 4,
                # float32 on every CPU (auto picks bf16 on one with avx512_bf16): the comparisons below need it
                "mixed_precision": "no", **distill}
    recipe = {"name": "distill", "output_dir": str(run_dir), "seed": 1, "stages": list(stages),
              "target": {"model": str(target_dir)}, "draft": {"layers": [0]}, "data": {"max_prompts": 16},
              "generate": {"temperatures": [0.0, 1.0], "max_new_tokens": 12, "batch_size": 8, "topk_logprobs": 8},
              "distill": settings,
              # eager decoding: compiling tiny models would cost more than the runs (tests/test_compiled.py covers it)
              "eval": {"compile": "off", **(eval_ or {"k": 2, "temperatures": [0.0, 1.0], "max_new_tokens": 10, "num_prompts": 2})},
              "tracking": {"report_to": tracking}}
    path = tmp_path / f"{run_dir.name}.yaml"
    path.write_text(json.dumps(recipe))
    return path


def run_train(recipe, *extra, env=None, launcher=()):
    return subprocess.run([sys.executable, *launcher, "-m", "train", str(recipe), *extra], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, timeout=900)


def steps_logged(run_dir):
    return [json.loads(line) for line in (run_dir / "distill" / "log.jsonl").read_text().splitlines()]


def weights(run_dir, step):
    from safetensors.torch import load_file

    tensors = load_file(str(run_dir / f"checkpoint-{step}" / "model.safetensors"))
    # Tied head: a plain save stores it once, a DeepSpeed-gathered state dict twice.
    tensors.setdefault("lm_head.weight", tensors["model.embed_tokens.weight"])
    return tensors


def assert_weights_close(a, b, atol=2e-4):
    # Adam divides by sqrt(v): float32 summation-order noise in near-zero gradients shows up at ~1e-6, and
    # reached 5e-5 in one embedding element of 19,200 (2 DDP processes against 1, AMD EPYC Zen 3, AVX2).
    # A missing gradient sync or a wrong normalisation moves weights by ~lr (1e-3), 5x this tolerance.
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=atol, rtol=1e-4, msg=lambda m: f"{key}: {m}")


@pytest.fixture(scope="module")
def generated(tmp_path_factory, tiny_target_dir):
    """A generate stage shared by the runs below (copied into each run directory)."""
    tmp = tmp_path_factory.mktemp("distill-gen")
    recipe = write_distill_recipe(tmp, tiny_target_dir, tmp / "gen", stages=("generate",))
    proc = run_train(recipe)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp / "gen" / "generate"


def prepared(tmp_path, generated, name, tiny_target_dir, **kw):
    run_dir = tmp_path / name
    shutil.copytree(generated, run_dir / "generate")
    return run_dir, write_distill_recipe(tmp_path, tiny_target_dir, run_dir, stages=kw.pop("stages", ("distill",)), **kw)

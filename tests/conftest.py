"""Shared fixtures: a tiny tokenizer and tiny Llama models built from configs (no network, no hub)."""

from __future__ import annotations

import os
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

"""A language-modeling task on a corpus that ships with Python: the docstrings of the
standard library's top-level modules (no download).

The corpus is byte-level (vocabulary 256): every module, class and function docstring
of ``<stdlib>/*.py`` in file-name order, joined by blank lines, then cut to
``max_bytes``. The first 90 % trains, the last 10 % validates. The corpus depends on the
Python version (docstrings change between releases), so results name it; all ranks of a
job run the same interpreter and read identical bytes.

The model is a small GPT-2 (``transformers.GPT2Config``: 2 layers, 128 wide, 4 heads,
128-token context, no dropout); quality is the validation perplexity per byte.

The harder task (``code``) models the standard library's source itself (4 MB of Python)
with a deeper GPT-2 (4 layers, 192 wide, 6 heads).
"""
from __future__ import annotations

import ast
import math
import sysconfig
from functools import lru_cache
from pathlib import Path

import torch

__all__ = ["TextSplit", "lm_loss", "lm_model", "load_text_split", "perplexity", "stdlib_docstrings",
           "stdlib_source"]


@lru_cache(maxsize=4)
def stdlib_docstrings(max_bytes: int = 1_500_000) -> bytes:
    """The docstring corpus, at most ``max_bytes`` bytes of UTF-8."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs, size = [], 0
    for path in sorted(root.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    docs.append(doc)
                    size += len(doc) + 2
        if size >= max_bytes:
            break
    text = "\n\n".join(docs).encode("utf-8")[:max_bytes]
    if len(text) < 10_000:
        raise RuntimeError(f"the standard library under {root} yielded only {len(text)} bytes of docstrings")
    return text


class TextSplit:
    """Byte tokens of one split and deterministic windows over them."""

    def __init__(self, data: torch.Tensor, block: int):
        self.data, self.block = data, block

    def batch(self, size: int, generator: torch.Generator):
        """``size`` random windows: (inputs, next-byte targets), each ``(size, block)``."""
        start = torch.randint(len(self.data) - self.block - 1, (size,), generator=generator)
        idx = (start[:, None] + torch.arange(self.block + 1)).to(self.data.device)
        win = self.data[idx]
        return win[:, :-1], win[:, 1:]

    def windows(self, limit: int):
        """Up to ``limit`` consecutive non-overlapping windows (the evaluation set)."""
        n = min(limit, (len(self.data) - 1) // self.block)
        win = self.data[: n * self.block + 1]
        x = win[:-1].view(n, self.block)
        y = win[1:].view(n, self.block)
        return x, y


@lru_cache(maxsize=4)
def stdlib_source(max_bytes: int = 4_000_000) -> bytes:
    """The harder corpus: the source code of ``<stdlib>/*.py`` itself (code, comments and
    docstrings), in file-name order, cut to ``max_bytes``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, size = [], 0
    for path in sorted(root.glob("*.py")):
        try:
            text = path.read_bytes()
        except OSError:
            continue
        parts.append(text)
        size += len(text) + 1
        if size >= max_bytes:
            break
    data = b"\n".join(parts)[:max_bytes]
    if len(data) < 100_000:
        raise RuntimeError(f"the standard library under {root} yielded only {len(data)} bytes")
    return data


def load_text_split(block: int = 128, max_bytes: int = 1_500_000, corpus: str = "docstrings"):
    """(train, validation) splits of a corpus (``docstrings`` or ``source``), identical on
    every rank."""
    raw = stdlib_docstrings(max_bytes) if corpus == "docstrings" else stdlib_source(max_bytes)
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
    cut = int(0.9 * len(data))
    return TextSplit(data[:cut], block), TextSplit(data[cut:], block)


def lm_model(block: int = 128, width: int = 128, layers: int = 2, heads: int = 4):
    import transformers

    cfg = transformers.GPT2Config(vocab_size=256, n_positions=block, n_embd=width, n_layer=layers,
                                  n_head=heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=None, eos_token_id=None)
    return transformers.GPT2LMHeadModel(cfg)


def lm_loss(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=x).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def perplexity(model, split: TextSplit, limit: int = 96) -> float:
    """exp(mean next-byte cross entropy) over the split's first ``limit`` windows."""
    model.eval()
    with torch.no_grad():
        x, y = split.windows(limit)
        loss = sum(lm_loss(model, x[i:i + 32], y[i:i + 32]) * len(x[i:i + 32])
                   for i in range(0, len(x), 32)) / len(x)
    model.train()
    return math.exp(float(loss))

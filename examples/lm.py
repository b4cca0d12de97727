"""The byte-level language model of examples/lm_train.py (elastic) and lm_plain.py (its
plain twin): a 2-layer causal transformer over windows of a memory-mapped byte file, AdamW
with weight decay on the matrices, and a linear warmup then cosine decay; how FSDP2 shards
it (`shard`, for lm_train.py --shard)."""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

CONTEXT, WIDTH, HEADS, LAYERS = 64, 48, 4, 2


def corpus(path: Path | None = None) -> Path:
    """The training text as a byte file: `path`, else this repository's docs joined (made
    once, atomically, in the temp directory: ranks starting together share it)."""
    if path is not None:
        return path
    made = Path(tempfile.gettempdir()) / "cohort-lm-corpus.bin"
    if not made.exists():
        docs = Path(__file__).resolve().parents[1] / "docs"
        text = b"\n".join(p.read_bytes() for p in sorted(docs.glob("*.md")))
        partial = made.with_suffix(f".{os.getpid()}.part")
        partial.write_bytes(text)
        partial.replace(made)
    return made


class Windows(Dataset):  # type: ignore[type-arg]
    """Windows of CONTEXT + 1 bytes of a memory-mapped file, from `start` on (a map-style
    dataset: any sample can be read by index, as cohort's placement needs)."""

    def __init__(self, path: Path, start: int = 0, count: int | None = None) -> None:
        self.bytes = np.memmap(path, dtype=np.uint8, mode="r")
        available = (len(self.bytes) - 1) // CONTEXT - start
        self.start, self.count = start, available if count is None else min(count, available)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        at = (self.start + index) * CONTEXT
        window = torch.from_numpy(self.bytes[at : at + CONTEXT + 1].astype(np.int64))
        return window[:-1], window[1:]


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(WIDTH), torch.nn.LayerNorm(WIDTH)
        self.qkv, self.out = torch.nn.Linear(WIDTH, 3 * WIDTH), torch.nn.Linear(WIDTH, WIDTH)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.GELU(), torch.nn.Linear(4 * WIDTH, WIDTH)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(WIDTH, dim=2)
        heads = [t.view(batch, length, HEADS, WIDTH // HEADS).transpose(1, 2) for t in (q, k, v)]
        attended = torch.nn.functional.scaled_dot_product_attention(*heads, is_causal=True)
        x = x + self.out(attended.transpose(1, 2).reshape(batch, length, WIDTH))
        return x + self.mlp(self.norm2(x))


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens = torch.nn.Embedding(256, WIDTH)
        self.positions = torch.nn.Embedding(CONTEXT, WIDTH)
        self.blocks = torch.nn.Sequential(*(Block() for _ in range(LAYERS)))
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.head = torch.nn.Linear(WIDTH, 256, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        where = torch.arange(x.shape[1], device=x.device)
        return self.head(self.norm(self.blocks(self.tokens(x) + self.positions(where))))


def shard(module: TinyLM, mesh: Any) -> None:
    """FSDP2 over `mesh` (a DeviceMesh): each transformer block a unit of its own, then the
    root, which holds the embeddings, the last norm and the head."""
    from torch.distributed.fsdp import fully_shard

    for block in module.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(module, mesh=mesh)


def build(seed: int = 0, lr: float = 3e-3) -> tuple[TinyLM, torch.optim.Optimizer]:
    """The model and AdamW, weight decay on the matrices only (as nanoGPT does)."""
    torch.manual_seed(seed)
    model = TinyLM()
    decayed = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decayed, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}]
    return model, torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def schedule(warmup: int, total: int):  # type: ignore[no-untyped-def]
    """Linear warmup over `warmup` updates, then cosine decay to a tenth by `total`."""

    def factor(update: int) -> float:
        if update < warmup:
            return (update + 1) / warmup
        progress = min(1.0, (update - warmup) / max(1, total - warmup))
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))

    return factor


def loss_of(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, precision: str
) -> torch.Tensor:
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        logits = model(x)
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def options(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options both scripts take: the data, the optimizer and the schedule, precision."""
    parser.add_argument("--corpus", type=Path, help="a byte file (default: the docs, joined)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=10, help="warmup updates")
    parser.add_argument("--clip", type=float, default=1.0, help="gradient norm clip")
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=10, help="updates between log lines")
    parser.add_argument("--save", help="write the final state_dict here (torch.save)")
    return parser

"""The weights digest, computed where the weights are.

Every rank reports a digest of its weights now and then (StepDone), a receiver checks the
weights a world starts from against the journaled one, and a checkpoint is checked as it
loads: the digest must be equal for equal weights on any device and for any summation
order, and differ for any change a training divergence makes. Hashing the bytes on the
host (sha256) would copy the whole model off a GPU on the training thread each time.

Instead each tensor's bytes are read as 32-bit words, in rows of `ROW`, and every row is
multiplied by a fixed matrix of small integers (`MIX`: a column of ones, one of the word's
place in its row, two of fixed pseudo-random values) in float64, on the tensor's device.
Every product is below 2^41 and every row's sum below 2^51, so float64 holds each exactly:
the result is the same integers on any device, whatever order a BLAS adds in. Only those
sums (32 bytes per 4 KiB of weights) cross to the host, in one copy per device, where
sha256 binds them to each tensor's name, dtype and shape.

Any single changed word changes its row's first sum; two changed words of a row would have
to cancel in all four sums at once (impossible for the first two: a change at one place
only ever equals minus a change at the same place), and wider cancellations must fall in
the kernel of a fixed pseudo-random matrix. This guards against divergence and corruption,
not against an adversary (the checkpoint file itself carries a sha256 for that).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

import torch

ROW = 1024
"""Words per row: 1024 products below 2^41 each sum below 2^51, inside float64's 2^53."""
CHUNK_ROWS = 1024
"""Rows converted to float64 at a time: bounds the extra memory to 8 MiB per tensor."""


def _mix_columns() -> list[list[float]]:
    """The matrix's columns: ones, the place in the row, and two fixed columns of values in
    [0, 1024) from a 64-bit LCG (Knuth's MMIX constants), the same in every process."""
    state, drawn = 0x636F686F7274, []  # "cohort"
    for _ in range(2 * ROW):
        state = (state * 6364136223846793005 + 1442695040888963407) % 2**64
        drawn.append(float(state >> 54))
    return [[1.0] * ROW, [float(i) for i in range(ROW)], drawn[:ROW], drawn[ROW:]]


_MIX = torch.tensor(_mix_columns(), dtype=torch.float64).T.contiguous()
_MIX_ON: dict[torch.device, torch.Tensor] = {}


def _mix(device: torch.device) -> torch.Tensor:
    mix = _MIX_ON.get(device)
    if mix is None:
        mix = _MIX_ON[device] = _MIX.to(device)
    return mix


def words(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`'s bytes as int32 words in rows of ROW, the last padded with zeros (its
    dtype and shape, which the digest binds, tell the padding from data)."""
    raw = tensor.detach().reshape(-1).contiguous().view(torch.uint8)
    pad = -raw.numel() % (4 * ROW)
    if pad or raw.storage_offset() % 4:
        raw = torch.cat([raw, raw.new_zeros(pad)])
    return raw.view(torch.int32).view(-1, ROW)


def row_sums(tensor: torch.Tensor) -> torch.Tensor:
    """The exact integer sums of each row of `tensor`'s words times MIX: int64 (rows, 4),
    on the tensor's device."""
    rows = words(tensor)
    mix = _mix(rows.device)
    parts = [
        (rows[i : i + CHUNK_ROWS].to(torch.float64) @ mix).to(torch.int64)
        for i in range(0, rows.shape[0], CHUNK_ROWS)
    ]
    if len(parts) == 1:
        return parts[0]
    return torch.cat(parts) if parts else rows.new_zeros((0, mix.shape[1]), dtype=torch.int64)


def weights_digest(state: Mapping[str, Any]) -> str:
    """The digest of a state dict's tensors (its other values are left out), 32 hex
    characters: equal for equal tensors on any device."""
    named = sorted((k, v) for k, v in state.items() if torch.is_tensor(v))
    sums = [row_sums(tensor) for _, tensor in named]
    h = hashlib.sha256()
    for (name, tensor), host in zip(named, _on_host(sums), strict=True):
        h.update(f"{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
        h.update(host.numpy().tobytes())
    return h.hexdigest()[:32]


def _on_host(sums: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Each of `sums` on the CPU, with one copy per device (a GPU's read is one sync)."""
    sums = list(sums)
    by_device: dict[torch.device, list[int]] = {}
    for i, part in enumerate(sums):
        by_device.setdefault(part.device, []).append(i)
    out: list[torch.Tensor] = list(sums)
    for device, places in by_device.items():
        if device.type == "cpu":
            continue
        joined = torch.cat([sums[i] for i in places]).cpu()
        for i, piece in zip(places, joined.split([sums[i].shape[0] for i in places]), strict=True):
            out[i] = piece
    return [part.contiguous() for part in out]


def bytes_digest(state: Mapping[str, Any]) -> str:
    """The digest cohort computed before `weights_digest` (sha256 of each tensor's bytes on
    the host): a checkpoint journaled then is still checked against it as it loads."""
    h = hashlib.sha256()
    for name, tensor in sorted(state.items()):
        h.update(name.encode())
        array = tensor.detach().cpu().contiguous().reshape(-1)
        h.update(memoryview(array.view(torch.uint8).numpy()) if array.numel() else b"")
    return h.hexdigest()[:32]

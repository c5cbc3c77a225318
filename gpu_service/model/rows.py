"""Row padding that makes a token's result independent of what it is batched with.

A CPU GEMM computes rows in ISA-dependent blocks and a partial block sums in another order, so
every product's rows are padded to a multiple of the block, measured once per process
(`row_block`: the smallest of 4, 8, 16, 32 for which each row of a padded product equals it padded
alone). On CUDA it is 1 (CUDA graphs pad to their buckets).
"""
from __future__ import annotations

import torch

CANDIDATES = (4, 8, 16, 32)
_BLOCK: dict[tuple, int] = {}
# (K, N) pairs probed besides a model's own: small and odd shapes where blocking shows
PROBE_SHAPES = ((64, 96), (96, 256), (192, 96), (96, 1024), (512, 96))


def _invariant(t: int, K: int, N: int, dtype: torch.dtype) -> bool:
    """Every row of x[:M] @ W (M = t, 2t, 3t, 4t) equals that row padded alone to t rows."""
    g = torch.Generator().manual_seed(K * 131 + N)
    w = torch.randn(N, K, generator=g).to(dtype).t()  # weight.t(), as the linears use it
    x = torch.randn(4 * t, K, generator=g).to(dtype)
    alone = [torch.mm(torch.cat([x[i:i + 1], x.new_zeros(t - 1, K)]), w)[0] for i in range(4 * t)]
    return all(torch.equal(torch.mm(x[:M], w)[i], alone[i]) for M in range(t, 4 * t + 1, t) for i in range(M))


def row_block(device: torch.device, dtype: torch.dtype = torch.float32, shapes=()) -> int:
    """Rows a step's products are padded to a multiple of on `device` (measured once per CPU, dtype
    and shape set; 1 on CUDA)."""
    if device.type != "cpu":
        return 1
    key = (dtype, tuple(sorted(set(shapes))), torch.get_num_threads())
    if key not in _BLOCK:
        probe = tuple(PROBE_SHAPES) + tuple(shapes)
        _BLOCK[key] = next((t for t in CANDIDATES if all(_invariant(t, K, N, dtype) for K, N in probe)),
                           CANDIDATES[-1])
    return _BLOCK[key]


def padded(n: int, block: int) -> int:
    """n rounded up to a multiple of block."""
    return -(-n // block) * block


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """t with zero rows appended up to `rows` (t itself when it has them)."""
    if t.shape[0] >= rows:
        return t
    return torch.cat([t, t.new_zeros((rows - t.shape[0],) + tuple(t.shape[1:]))])

"""The mixes of a manifold-constrained hyper-connection site, from its projected logits.

Per token, the site's linear map gives (2 + n) * n logits: n for `pre` (sigmoid + eps), n for `post`
(2 * sigmoid), n * n for `comb` (row softmax + eps, then Sinkhorn-Knopp: a column normalisation and
`iters - 1` row-then-column rounds, making it doubly stochastic). All of it is a few dozen numbers per
token, but in torch it is ~130 kernel launches per site (each Sinkhorn round is four), which made the
mHC sites most of a decode step's kernels. `hc_mixes` runs it as one Triton program per token on the
GPU; `hc_mixes_reference` is the plain torch definition (the CPU path and the test oracle).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference path runs
    triton = None


def hc_mixes_reference(
    logits: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int, hc_eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [T, (2 + n) * n] float32 -> (pre [T, n], post [T, n], comb [T, n, n]), float32."""
    pre_w, post_w, comb_w = logits.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre_s, post_s, comb_s = scale.unbind(0)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    comb = torch.softmax(comb_w.view(-1, n, n) * comb_s + comb_b.view(n, n), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return pre, post, comb


def hc_mixes(
    logits: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int, hc_eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`hc_mixes_reference`, as one Triton kernel where it can run (CUDA, n a power of two)."""
    if triton is None or not logits.is_cuda or n & (n - 1):
        return hc_mixes_reference(logits, base, scale, n, iters, hc_eps)
    return hc_mixes_triton(logits, base, scale, n, iters, hc_eps)


def hc_mixes_triton(
    logits: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int, hc_eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tokens = logits.shape[0]
    logits = logits.contiguous()
    pre = torch.empty(tokens, n, dtype=torch.float32, device=logits.device)
    post = torch.empty_like(pre)
    comb = torch.empty(tokens, n, n, dtype=torch.float32, device=logits.device)
    if tokens:
        _hc_mixes_kernel[(tokens,)](
            logits, base.float().contiguous(), scale.float().contiguous(), pre, post, comb, hc_eps, iters, n
        )
    return pre, post, comb


if triton is not None:

    @triton.jit
    def _hc_mixes_kernel(logits_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, hc_eps, iters, N: tl.constexpr):
        token = tl.program_id(0)
        row = logits_ptr + token * (2 + N) * N
        i = tl.arange(0, N)
        pre = tl.sigmoid(tl.load(row + i) * tl.load(scale_ptr) + tl.load(base_ptr + i)) + hc_eps
        post = 2 * tl.sigmoid(tl.load(row + N + i) * tl.load(scale_ptr + 1) + tl.load(base_ptr + N + i))
        tl.store(pre_ptr + token * N + i, pre)
        tl.store(post_ptr + token * N + i, post)
        square = i[:, None] * N + i[None, :]  # comb[j, k] at logit 2N + j * N + k
        comb = tl.load(row + 2 * N + square) * tl.load(scale_ptr + 2) + tl.load(base_ptr + 2 * N + square)
        comb = tl.exp(comb - tl.max(comb, axis=1)[:, None])
        comb = comb / tl.sum(comb, axis=1)[:, None] + hc_eps
        comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
        for _ in range(iters - 1):
            comb = comb / (tl.sum(comb, axis=1)[:, None] + hc_eps)
            comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
        tl.store(comb_ptr + token * N * N + square, comb)

"""The Gated DeltaNet's sequence math (Qwen3-Next, Qwen3.5), in torch on any device: the short
causal conv over q/k/v, the gated delta rule in its two forms, and the gated RMSNorm of its output.

The delta rule keeps one state S [heads, key_dim, value_dim] per sequence and layer. Each token t
decays it by exp(g_t), writes beta_t * (v_t - S^T k_t) along k_t, and reads q_t through it.
Prompt chunks run the chunked form (the rule over blocks of ``CHUNK`` tokens as a few matmuls, a
triangular solve per block); decode rows the recurrent form, one token each, batched over rows.
Both start from the state a sequence left and leave theirs, so a prompt split over any number of
launches continues exactly. The arithmetic follows transformers' reference implementation
(float32 throughout, q and k L2-normalised, q scaled by 1 / sqrt(key_dim)).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fusedserve.kernels.model_description.hybrid import LinearAttention

CHUNK = 64  # tokens per block of the chunked form (transformers' and FLA's)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def conv_prompt(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One sequence's new inputs ``x`` [L, C] through the depthwise causal conv ``weight`` [C, K]
    and SiLU, continuing from ``state`` [C, K - 1] (its K - 1 inputs before these), which is left
    holding the last K - 1 inputs."""
    c, k = weight.shape
    full = torch.cat([state, x.t().to(weight.dtype)], dim=-1)  # [C, K - 1 + L]
    out = F.conv1d(full.unsqueeze(0), weight.unsqueeze(1), groups=c)[0]  # [C, L]
    state.copy_(full[:, full.shape[1] - (k - 1):])
    return F.silu(out).t()


def conv_decode(x: torch.Tensor, states: torch.Tensor,
                weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """n rows of one token each: ``x`` [n, C], their states [n, C, K - 1]. Returns (SiLU(conv)
    [n, C], the new states [n, C, K - 1])."""
    c = weight.shape[0]
    full = torch.cat([states, x.unsqueeze(-1).to(weight.dtype)], dim=-1)  # [n, C, K]
    out = F.conv1d(full, weight.unsqueeze(1), groups=c)[:, :, 0]
    return F.silu(out), full[:, :, 1:]


def prepare_qk(q: torch.Tensor, k: torch.Tensor, value_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [n, key_heads, dk] as the rule reads them: each key head repeated for its value heads,
    float32, L2-normalised, q scaled by 1 / sqrt(dk)."""
    r = value_heads // q.shape[1]
    if r > 1:
        q, k = q.repeat_interleave(r, dim=1), k.repeat_interleave(r, dim=1)
    q, k = l2norm(q.float()), l2norm(k.float())
    return q * q.shape[-1] ** -0.5, k


def rule_inputs(conv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, neg_a: torch.Tensor,
                dt_bias: torch.Tensor, la: LinearAttention) -> tuple[torch.Tensor, ...]:
    """The rule's (q, k, v, g, beta) from the conv's output [n, q + k + v] and the projection's b and a
    [n, H], as transformers computes them: beta = sigmoid(b) in the model's dtype, g = -exp(A_log) *
    softplus(a + dt_bias) in float32, v as float32 heads."""
    n, kd, nk = conv.shape[0], la.key_dim, la.num_key_heads
    q, k = prepare_qk(conv[:, :kd].reshape(n, nk, -1), conv[:, kd : 2 * kd].reshape(n, nk, -1),
                      la.num_value_heads)
    v = conv[:, 2 * kd :].reshape(n, la.num_value_heads, la.value_head_dim).float()
    return q, k, v, neg_a * F.softplus(a.float() + dt_bias), torch.sigmoid(b).float()


def recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of n rows: q, k [n, H, dk], v [n, H, dv], g and beta [n, H], all
    float32; ``state`` [n, H, dk, dv]. Returns (output [n, H, dv], the new state)."""
    state = state * g.exp()[..., None, None]
    remembered = (state * k.unsqueeze(-1)).sum(dim=-2)  # what S already says for k: [n, H, dv]
    delta = (v - remembered) * beta.unsqueeze(-1)
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return (state * q.unsqueeze(-1)).sum(dim=-2), state


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's L tokens: q, k [L, H, dk], v [L, H, dv], g and beta [L, H], float32, from
    ``state`` [H, dk, dv]. Returns (output [L, H, dv], the state after them)."""
    length = q.shape[0]
    pad = (CHUNK - length % CHUNK) % CHUNK
    # heads first, the sequence padded to whole blocks: [H, blocks, CHUNK, ...]
    q, k, v = (F.pad(x.transpose(0, 1), (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x.t(), (0, pad)) for x in (g, beta))
    h, blocks = q.shape[0], q.shape[1] // CHUNK
    k_beta, v_beta = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (x.reshape(h, blocks, CHUNK, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    decay = g.reshape(h, blocks, CHUNK).cumsum(dim=-1)  # log of the decay from a block's start
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    pair = (decay.unsqueeze(-1) - decay.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * pair  # the block's updates, solved at once
    inner = (q @ k.transpose(-1, -2)) * pair
    values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_decayed = torch.linalg.solve_triangular(system, k_beta * decay.exp().unsqueeze(-1), upper=False,
                                              unitriangular=True)
    q = q * decay.exp().unsqueeze(-1)
    k = k * (decay[..., -1:] - decay).exp().unsqueeze(-1)
    block_decay = decay[..., -1].exp()[..., None, None]
    out = torch.empty_like(values)
    s = state
    for i in range(blocks):
        new = values[:, i] - k_decayed[:, i] @ s
        out[:, i] = q[:, i] @ s + inner[:, i] @ new
        s = s * block_decay[:, i] + k[:, i].transpose(-1, -2) @ new
    return out.reshape(h, -1, out.shape[-1])[:, :length].transpose(0, 1), s


def gated_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
               dtype: torch.dtype) -> torch.Tensor:
    """The output's RMSNorm per head, gated by SiLU(z): x and z [n, H, dv]; in ``dtype`` as
    transformers rounds (the norm in float32, rounded, times the weight, times the float32 gate)."""
    xf = x.to(dtype).float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return ((weight * normed).float() * F.silu(z.float())).to(dtype)

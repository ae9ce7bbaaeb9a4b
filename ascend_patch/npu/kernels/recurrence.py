"""The recurrences of state-space and linear-attention layers, in plain torch ops, per sequence.

Shared, like :mod:`.composed`, by the reference kernels (the documented output of the NPU's
gated-delta-rule ops) and by the composed path (:mod:`ascend_patch.npu.ops.recurrent`), which
runs what no torch_npu op takes with these generic ops. Every function computes in float32 and
follows the published recurrence:

- the short causal convolution: ``y_t = act(bias + sum_k w[:, k] * x_{t - (K - 1) + k})`` over
  the previous ``K - 1`` inputs (the conv state) and the sequence;
- Mamba-2's selective state space (SSD, Dao & Gu 2024): ``h_t = exp(dt_t A) h_{t-1} +
  dt_t x_t B_t^T``, ``y_t = h_t C_t + D x_t``, with a state ``[heads, head_dim, d_state]`` and
  B, C shared by the heads of a group; the chunked form computes the same within a chunk as
  one masked matmul and carries the state from chunk to chunk;
- the gated delta rule (Yang, Kautz & Hatamizadeh 2024, Qwen3-Next): ``S_t = exp(g_t) S_{t-1}
  + beta_t (v_t - exp(g_t) S_{t-1} k_t) k_t^T``, ``o_t = S_t q_t * scale``, with a state
  ``[v_heads, v_dim, k_dim]`` (vLLM's and torch_npu's layout) and query/key heads shared by
  ``v_heads / k_heads`` value heads.
"""

import torch
import torch.nn.functional as F


def causal_conv1d(x, weight, bias, state, activation):
    """One sequence: x ``[dim, L]`` after ``state`` ``[dim, K - 1]`` (the inputs before it)
    -> ``(y [dim, L], new state [dim, K - 1])``, float32."""
    width = weight.shape[1]
    padded = torch.cat([state.float(), x.float()], dim=-1)
    y = F.conv1d(padded[None], weight.float()[:, None], None if bias is None else bias.float(),
                 groups=weight.shape[0])[0]
    if activation in ("silu", "swish", True):
        y = F.silu(y)
    return y, padded[:, padded.shape[1] - (width - 1):]


def _group_to_heads(t, heads):
    """``[..., groups, n]`` -> ``[..., heads, n]``: each group's row for its heads."""
    return t.repeat_interleave(heads // t.shape[-2], dim=-2)


def ssd_chunk(x, dt, A, B, C, state):
    """Mamba-2 over one chunk of one sequence, in the chunked form: x ``[L, H, P]``, dt ``[L, H]``
    (after bias and softplus), A ``[H]``, B/C ``[L, G, N]``, state ``[H, P, N]`` before the
    chunk -> ``(y [L, H, P] without the D skip, state after the chunk)``, float32."""
    x, dt, B, C, state = x.float(), dt.float(), B.float(), C.float(), state.float()
    heads = x.shape[1]
    B, C = _group_to_heads(B, heads), _group_to_heads(C, heads)
    decay = torch.cumsum(dt * A.float(), dim=0)  # [L, H]: log of the decay from the chunk start
    length = x.shape[0]
    causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
    # segment[h, t, s] = exp(decay_t - decay_s) for s <= t: the decay from token s to token t
    gap = (decay.T[:, :, None] - decay.T[:, None, :]).masked_fill(~causal, float("-inf"))
    scores = torch.einsum("thn,shn->hts", C, B) * gap.exp()  # [H, L, L]
    y = torch.einsum("hts,sh,shp->thp", scores, dt, x)
    y = y + torch.einsum("thn,hpn,th->thp", C, state, decay.exp())
    to_end = (decay[-1] - decay).exp()  # [L, H]
    state = state * decay[-1].exp()[:, None, None] + torch.einsum(
        "sh,sh,shp,shn->hpn", to_end, dt, x, B)
    return y, state


def ssm_step(x, dt, A, B, C, state):
    """One Mamba-2 token: x ``[H, P]``, dt ``[H]`` (after bias and softplus), A ``[H]``,
    B/C ``[G, N]``, state ``[H, P, N]`` -> ``(y [H, P] without the D skip, new state)``."""
    heads = x.shape[0]
    B, C = _group_to_heads(B.float(), heads), _group_to_heads(C.float(), heads)
    dt = dt.float()
    state = state.float() * (dt * A.float()).exp()[:, None, None] + (
        dt[:, None, None] * x.float()[:, :, None] * B[:, None, :])
    return torch.einsum("hpn,hn->hp", state, C), state


def gated_delta_step(q, k, v, g, beta, state, scale):
    """One gated-delta-rule token: q/k ``[Hk, Dk]``, v ``[Hv, Dv]``, g/beta ``[Hv]``, state
    ``[Hv, Dv, Dk]`` -> ``(o [Hv, Dv], new state)``, float32."""
    heads = v.shape[0]
    q, k = _group_to_heads(q.float(), heads), _group_to_heads(k.float(), heads)
    state = state.float() * g.float().exp()[:, None, None]
    error = (v.float() - torch.einsum("hvk,hk->hv", state, k)) * beta.float()[:, None]
    state = state + error[:, :, None] * k[:, None, :]
    return torch.einsum("hvk,hk->hv", state, q) * scale, state


def gated_delta_chunk(q, k, v, g, beta, state, scale):
    """The gated delta rule over one chunk of one sequence, in the chunked (WY) form: q/k
    ``[L, Hk, Dk]``, v ``[L, Hv, Dv]``, g/beta ``[L, Hv]``, state ``[Hv, Dv, Dk]`` before the
    chunk -> ``(o [L, Hv, Dv], state after the chunk)``, float32.

    Within the chunk the delta-rule writes ``u_t = beta_t (v_t - S_{t-1} k_t)`` solve one unit
    lower-triangular system: ``u_t + beta_t sum_{s<t} exp(G_t - G_s) (k_t . k_s) u_s =
    beta_t (v_t - exp(G_t) S_0 k_t)``, with ``G`` the cumulative gate from the chunk start."""
    heads, length = v.shape[1], v.shape[0]
    q, k = _group_to_heads(q.float(), heads), _group_to_heads(k.float(), heads)
    v, beta, state = v.float(), beta.float(), state.float()
    G = torch.cumsum(g.float(), dim=0).T  # [Hv, L]
    causal = torch.ones(length, length, dtype=torch.bool, device=v.device).tril()
    # decay[h, t, s] = exp(G_t - G_s) for s <= t: the gates between token s and token t
    decay = (G[:, :, None] - G[:, None, :]).masked_fill(~causal, float("-inf")).exp()
    kk = torch.einsum("thd,shd->hts", k, k) * decay.tril(-1)  # s < t
    lower = torch.eye(length, device=v.device) + beta.T[:, :, None] * kk
    start = torch.einsum("hvd,thd->htv", state, k) * G.exp()[:, :, None]  # exp(G_t) S_0 k_t
    u = torch.linalg.solve_triangular(lower, beta.T[:, :, None] * (v.transpose(0, 1) - start),
                                      upper=False, unitriangular=True)  # [Hv, L, Dv]
    qk = torch.einsum("thd,shd->hts", q, k) * decay
    o = (torch.einsum("hts,hsv->htv", qk, u)
         + torch.einsum("hvd,thd->htv", state, q) * G.exp()[:, :, None]) * scale
    to_end = (G[:, -1:] - G).exp()  # [Hv, L]
    state = state * G[:, -1].exp()[:, None, None] + torch.einsum(
        "hsv,hs,shd->hvd", u, to_end, k)
    return o.transpose(0, 1), state

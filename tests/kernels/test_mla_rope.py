"""The MLA layer's fused rope ops (npu_kv_rmsnorm_rope_cache_v2, npu_interleave_rope) against vLLM's
native path: kv_a_layernorm (vLLM's RMSNorm), its interleaved rope (plain and DeepSeek YaRN) and the
scores q · k the attention takes; and each documented contract violation refused."""

import re

import pytest
import torch
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.rotary_embedding import (
    DeepseekScalingRotaryEmbedding,
    RotaryEmbedding,
)

from ascend_patch.npu import kernels
from ascend_patch.npu.attention.mla import latent_planes
from ascend_patch.npu.kernels import KernelContractError
from tests.kernels.test_layers import vllm_layer

BF16 = torch.bfloat16
KV_ROPE = "npu_kv_rmsnorm_rope_cache_v2"
ROPES = {
    "plain": lambda dtype: vllm_layer(RotaryEmbedding, 64, 64, 4096, 10000.0, False, dtype),
    "deepseek yarn": lambda dtype: vllm_layer(
        DeepseekScalingRotaryEmbedding, 64, 64, 4096, 10000.0, False, 40.0, dtype,
        beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0),
}


def half_cos_sin(rope, positions, dtype):
    """vLLM's cos|sin rows at ``positions`` in the half layout the ops take ([T, 64] each)."""
    cos, sin = rope.cos_sin_cache[positions].to(dtype).chunk(2, dim=-1)
    return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
@pytest.mark.parametrize("rope_name", ROPES)
def test_fused_ops_score_as_vllms_norm_and_rope(rope_name, dtype):
    """One kv_a row per token through the fused cache write and the query through
    npu_interleave_rope: the cached latent is vLLM's kv_a_layernorm output, and every query-key
    score (over the rope lanes, in whatever order the ops leave them) is vLLM's."""
    generator = torch.Generator().manual_seed(0)
    tokens, heads, blocks, block_size = 9, 4, 4, 16
    rope = ROPES[rope_name](dtype)
    norm = vllm_layer(RMSNorm, 512, eps=1e-6, dtype=dtype)
    norm.weight.data.copy_(torch.rand(512, generator=generator) + 0.5)
    positions = torch.randint(0, 4096, (tokens,), generator=generator)
    kv = torch.randn(tokens, 576, generator=generator).to(dtype)
    q_pe = torch.randn(tokens, heads, 64, generator=generator).to(dtype)
    slots = torch.randperm(blocks * block_size, generator=generator)[:tokens]

    cache = torch.zeros(blocks, block_size, 576, dtype=dtype)
    kv_c_plane, k_pe_plane = latent_planes(cache, 512)
    cos, sin = half_cos_sin(rope, positions, dtype)
    shape = (1, 1, tokens, 64)
    kernels.kv_rmsnorm_rope_cache(kv.view(1, 1, tokens, 576), norm.weight.data, cos.view(shape),
                                  sin.view(shape), slots, k_pe_plane, kv_c_plane, epsilon=1e-6,
                                  cache_mode="PA")
    q_rot = kernels.interleave_rope(q_pe.unsqueeze(2).contiguous(), cos.view(tokens, 1, 1, 64),
                                    sin.view(tokens, 1, 1, 64))[:, :, 0]

    q_native, k_native = rope.forward_native(positions, q_pe.clone(), kv[:, None, 512:].clone())
    tol = 2e-2 if dtype == BF16 else 2e-3
    torch.testing.assert_close(kv_c_plane.view(-1, 512)[slots].float(),
                               norm.forward_native(kv[:, :512]).float(), atol=tol, rtol=tol)
    k_cached = k_pe_plane.view(-1, 64)[slots]
    scores = torch.einsum("tnd,td->tn", q_rot.float(), k_cached.float())
    expected = torch.einsum("tnd,td->tn", q_native.float(), k_native[:, 0].float())
    torch.testing.assert_close(scores, expected, atol=0.15 if dtype == BF16 else 0.02, rtol=tol)
    # The cache holds vLLM's rotated key with its lanes reordered, even then odd.
    lanes = torch.cat((torch.arange(0, 64, 2), torch.arange(1, 64, 2)))
    torch.testing.assert_close(k_cached.float(), k_native[:, 0, lanes].float(), atol=tol, rtol=tol)
    # Only the mapped slots are written.
    unmapped = torch.ones(blocks * block_size, dtype=torch.bool)
    unmapped[slots] = False
    assert not kv_c_plane.view(-1, 512)[unmapped].any() and not k_pe_plane.view(-1, 64)[unmapped].any()


def kv_rope(**overrides):
    """A valid PA call (5 tokens as one batch into 4 blocks of 16), then overrides."""
    tokens = overrides.pop("tokens", 5)
    blocks = overrides.pop("blocks", 4)
    args = dict(kv=torch.zeros(1, 1, tokens, 576, dtype=BF16), gamma=torch.ones(512, dtype=BF16),
                cos=torch.ones(1, 1, tokens, 64, dtype=BF16),
                sin=torch.zeros(1, 1, tokens, 64, dtype=BF16),
                index=torch.arange(tokens) * 3, k_cache=torch.zeros(blocks, 16, 1, 64, dtype=BF16),
                ckv_cache=torch.zeros(blocks, 16, 1, 512, dtype=BF16), cache_mode="PA")
    args.update(overrides)
    positional = [args.pop(name) for name in ("kv", "gamma", "cos", "sin", "index", "k_cache",
                                              "ckv_cache")]
    return kernels.kv_rmsnorm_rope_cache(*positional, **args)


def interleave(**overrides):
    args = dict(x=torch.zeros(3, 4, 2, 64, dtype=BF16), cos=torch.ones(3, 1, 1, 64, dtype=BF16),
                sin=torch.zeros(3, 1, 1, 64, dtype=BF16))
    args.update(overrides)
    return kernels.interleave_rope(args["x"], args["cos"], args["sin"])


VIOLATIONS = {
    "kv tokens first (T, 1, 1, 576): more blocks than the cache has": (
        lambda: kv_rope(kv=torch.zeros(40, 1, 1, 576, dtype=BF16),
                        cos=torch.ones(40, 1, 1, 64, dtype=BF16),
                        sin=torch.zeros(40, 1, 1, 64, dtype=BF16), index=torch.arange(40),
                        blocks=4),
        f"{KV_ROPE}: k_cache must be block_num ≥ Ceil(seq_len / block_size) × batch_size = 40, "
        "got 4"),
    "kv width not 576": (
        lambda: kv_rope(kv=torch.zeros(1, 1, 5, 640, dtype=BF16)),
        f"{KV_ROPE}: kv must be [batch_size, 1, seq_len, 576], got (1, 1, 5, 640)"),
    "kv strided": (
        lambda: kv_rope(kv=torch.zeros(1, 1, 5, 700, dtype=BF16)[..., :576]),
        f"{KV_ROPE}: kv must be contiguous"),
    "kv fp32": (
        lambda: kv_rope(kv=torch.zeros(1, 1, 5, 576)),
        f"{KV_ROPE}: kv must be float16 or bfloat16, got torch.float32"),
    "index int32": (
        lambda: kv_rope(index=torch.arange(5, dtype=torch.int32)),
        f"{KV_ROPE}: index must be int64, got torch.int32"),
    "index repeated": (
        lambda: kv_rope(index=torch.tensor([0, 1, 1, 2, 3])),
        f"{KV_ROPE}: index must be free of duplicates, got 1 duplicate slot(s)"),
    "index out of the cache": (
        lambda: kv_rope(index=torch.tensor([0, 1, 2, 3, 64])),
        f"{KV_ROPE}: index must be within [0, 63], got range [0, 64]"),
    "cos per head": (
        lambda: kv_rope(cos=torch.ones(1, 2, 5, 64, dtype=BF16)),
        f"{KV_ROPE}: cos must be shape (1, 1, 5, 64), got (1, 2, 5, 64)"),
    "ckv_cache unlike k_cache": (
        lambda: kv_rope(ckv_cache=torch.zeros(3, 16, 1, 512, dtype=BF16)),
        f"{KV_ROPE}: ckv_cache must be shape (4, 16, 1, 512), got (3, 16, 1, 512)"),
    "interleave_rope strided x": (
        lambda: interleave(x=torch.zeros(3, 4, 3, 64, dtype=BF16)[:, :, 2:]),
        "npu_interleave_rope: x must be contiguous"),
    "interleave_rope D 128": (
        lambda: interleave(x=torch.zeros(3, 4, 2, 128, dtype=BF16),
                           cos=torch.ones(3, 1, 1, 128, dtype=BF16),
                           sin=torch.zeros(3, 1, 1, 128, dtype=BF16)),
        "npu_interleave_rope: x must be D = 64, got 128"),
    "interleave_rope cos per head": (
        lambda: interleave(cos=torch.ones(3, 4, 1, 64, dtype=BF16),
                           sin=torch.zeros(3, 4, 1, 64, dtype=BF16)),
        "npu_interleave_rope: cos must be shape (3, 1, 1 or 2, 64), got (3, 4, 1, 64)"),
}


@pytest.mark.parametrize("call, message", VIOLATIONS.values(), ids=VIOLATIONS.keys())
def test_violation_is_rejected_with_a_clear_message(call, message):
    with pytest.raises(KernelContractError, match=re.escape(message)):
        call()


def test_the_baselines_are_valid():
    """Each violation above is one change away from a call that passes: cos 1 and sin 0 leave
    the rope lanes as they are, reordered even then odd."""
    kv = torch.randn(1, 1, 5, 576).to(BF16)
    k_cache = torch.zeros(4, 16, 1, 64, dtype=BF16)
    kv_rope(kv=kv, k_cache=k_cache)
    lanes = torch.cat((torch.arange(0, 64, 2), torch.arange(1, 64, 2)))
    torch.testing.assert_close(k_cache.view(-1, 64)[torch.arange(5) * 3], kv[0, 0, :, 512 + lanes])
    x = torch.randn(3, 4, 2, 64).to(BF16)
    torch.testing.assert_close(interleave(x=x), x[..., lanes])

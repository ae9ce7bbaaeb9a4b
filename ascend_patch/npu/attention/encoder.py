"""Encoder-only attention on the NPU: the self-attention of BERT, XLM-RoBERTa and the other
bidirectional encoders vLLM runs as embedders, classifiers and cross-encoders (vLLM's
``EncoderOnlyAttention`` layers, ``AttentionType.ENCODER_ONLY``).

Each sequence's tokens attend to all of that sequence's tokens (or, in a windowed layer such as
ModernBERT's local ones, to those within the window on either side) and nothing is cached: vLLM
gives these layers no KV-cache spec, runs each request's whole prompt in one step and wraps the
builder so that the metadata is non-causal. One ``npu_fusion_attention`` launch per layer and
step serves the batch in TND layout with the host cumulative query lengths as both
``actual_seq_qlen`` and ``actual_seq_kvlen`` (vllm-ascend's encoder attention does the same), at
most :data:`~ascend_patch.npu.kernels.limits.FA_TND_MAX_SEQUENCES` sequences a launch:

- no window: ``sparse_mode=0`` without a mask, every key of the sequence;
- a window of ``W`` (vLLM's ``sliding_window``; its FlashAttention backends give encoder layers
  ``window_size=(W - 1, W - 1)``): the band ``sparse_mode=4`` with ``pre_tockens = next_tockens
  = W - 1`` over the op's 2048×2048 compressed mask.

What the op does not take runs *composed*, the same per-sequence attention in standard torch
ops: logit soft-capping (no soft-cap input), head sizes above its 768 or more than 256 heads.
ALiBi (the op's ``pse``) is not wired up and is refused. The op is not documented for graph
capture, so the layers refuse to run inside one; vLLM runs pooling models eager or with PIECEWISE
graphs, where attention stays outside the captured pieces.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.v1.attention.backend import (
    AttentionCGSupport,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)

from ascend_patch.npu import kernels
from ascend_patch.npu.attention.base import AscendBackend, AscendImpl, causal_mask
from ascend_patch.npu.compilation import acl_graph
from ascend_patch.npu.kernels import composed, limits


class AscendEncoderOnlyBackend(AscendBackend):
    @staticmethod
    def get_impl_cls() -> type[AscendEncoderOnlyImpl]:
        return AscendEncoderOnlyImpl

    @staticmethod
    def get_builder_cls() -> type[AscendEncoderMetadataBuilder]:
        return AscendEncoderMetadataBuilder

    @classmethod
    def kv_block_shape(cls, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        raise NotImplementedError("encoder-only attention has no KV cache")

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.ENCODER_ONLY


@dataclass
class AscendEncoderMetadata:
    num_tokens: int
    """Real (unpadded) tokens in the step."""
    query_ends: list[int]
    """Cumulative per-sequence token counts, host side (the op's actual_seq_qlen/kvlen)."""


class AscendEncoderMetadataBuilder(AttentionMetadataBuilder[AscendEncoderMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        return AttentionCGSupport.NEVER  # [FA-WHEEL] "不支持aclgraph"

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> AscendEncoderMetadata:
        meta = common_attn_metadata
        if meta.causal:  # EncoderOnlyAttention's builder wrapper always clears it
            raise NotImplementedError("causal encoder-only attention is not supported on Ascend")
        ends = meta.query_start_loc_cpu[1 : meta.num_reqs + 1].tolist()
        return AscendEncoderMetadata(num_tokens=meta.num_actual_tokens, query_ends=ends)


class AscendEncoderOnlyImpl(AscendImpl[AscendEncoderMetadata]):
    served_attn_type = AttentionType.ENCODER_ONLY
    label = "Ascend encoder-only attention"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # W keys either side of the query, itself included (vLLM's window_size=(W-1, W-1)).
        self.reach = None if self.sliding_window is None else self.sliding_window - 1

    def composed_reason(self) -> str | None:
        """Why npu_fusion_attention cannot serve this layer, or None when it can."""
        if self.soft_cap is not None:
            return f"logits soft-cap {self.soft_cap:g}: npu_fusion_attention has no soft-cap input"
        if self.head_size > limits.FA_MAX_HEAD_DIM:
            return (f"head size {self.head_size}: npu_fusion_attention takes at most "
                    f"{limits.FA_MAX_HEAD_DIM}")
        if self.num_heads > limits.FA_MAX_HEADS:
            return f"{self.num_heads} heads: npu_fusion_attention takes at most {limits.FA_MAX_HEADS}"
        return None

    def attend(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               kv_cache: torch.Tensor, meta: AscendEncoderMetadata, output: torch.Tensor) -> None:
        if acl_graph.capturing():
            raise RuntimeError("encoder-only attention inside a graph capture: npu_fusion_attention "
                               "is not documented for ACL graphs and takes host lengths")
        n = meta.num_tokens
        query, key, value = (t[:n].contiguous() for t in (query, key, value))
        out = output[:n]
        ends = meta.query_ends
        if self.composed_reason() is not None:
            starts = [0, *ends[:-1]]
            for start, end in zip(starts, ends):
                rows = slice(start, end)
                out[rows] = composed.attend(query[rows], key[rows], value[rows], self.scale,
                                         pre_tokens=self.reach, next_tokens=self.reach,
                                         soft_cap=self.soft_cap)
            return
        band = {} if self.reach is None else {
            "sparse_mode": 4, "pre_tockens": self.reach, "next_tockens": self.reach,
            "atten_mask": causal_mask(query.device, torch.bool, limits.FA_MASK_SIZE)}
        for first in range(0, len(ends), limits.FA_TND_MAX_SEQUENCES):
            group = ends[first: first + limits.FA_TND_MAX_SEQUENCES]
            start = ends[first - 1] if first else 0
            rows = slice(start, group[-1])
            group_ends = [end - start for end in group]  # cumulative within the launch
            out[rows] = kernels.fusion_attention(
                query[rows], key[rows], value[rows], self.num_heads, "TND", scale=self.scale,
                actual_seq_qlen=group_ends, actual_seq_kvlen=group_ends, **band)

"""The attention of multimodal encoders (vLLM's ``MMEncoderAttention``: the ViTs of BLIP-2, CLIP,
SigLIP, the Qwen VL families and others) on ``npu_fusion_attention``.

Each image's (or video frame group's) tokens attend to all of its own tokens, nothing is cached:
the same attention as encoder-only text models, so the encoder backend's impl serves it
(:class:`~ascend_patch.npu.attention.encoder.AscendEncoderOnlyImpl`): one TND launch per layer
and batch of images, the sequence ends as ``actual_seq_qlen``/``actual_seq_kvlen`` (vllm-ascend's
``AscendMMEncoderAttention`` launches its FIA the same way), its composed fallback for what the
op does not take. Sequences are the batch rows (``[B, S, ...]`` inputs, BLIP/CLIP style) or, for
packed inputs (``[1, T, ...]``, Qwen VL style), the segments of ``cu_seqlens``; reading those
ends is a host copy, as vLLM's FlashAttention path reads ``max_seqlen``.

Where query and key lengths differ (cross-attention) vLLM's native per-sequence SDPA runs.
"""

import torch
from vllm.model_executor.layers.attention.mm_encoder_attention import MMEncoderAttention

from ascend_patch.npu.attention.encoder import AscendEncoderMetadata, AscendEncoderOnlyImpl


class AscendMMEncoderAttention(MMEncoderAttention):
    def __init__(self, num_heads: int, head_size: int, scale: float | None = None,
                 num_kv_heads: int | None = None, prefix: str = "") -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads, prefix)
        self.impl = AscendEncoderOnlyImpl(self.num_heads, self.head_size, self.scale,
                                          self.num_kv_heads)

    def forward_oot(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    cu_seqlens: torch.Tensor | None = None, max_seqlen: torch.Tensor | None = None,
                    sequence_lengths: torch.Tensor | None = None) -> torch.Tensor:
        batch, length = query.shape[:2]
        if key.shape[1] != length:
            return self.forward_native(query, key, value, cu_seqlens, max_seqlen, sequence_lengths)
        flat = query.dim() != 4  # [B, S, heads * head size]: returned the same way
        query, key, value = self.view_qkv_to_4d(query, key, value, batch, length, length)
        tokens = batch * length
        if cu_seqlens is None:
            ends = [length * (row + 1) for row in range(batch)]
        else:  # packed sequences in one batch row
            ends = [int(end) for end in cu_seqlens[1:].tolist()]
        out = query.new_empty(tokens, self.num_heads, self.head_size)
        self.impl.forward(self, *(x.reshape(tokens, *x.shape[2:]) for x in (query, key, value)),
                          None, AscendEncoderMetadata(num_tokens=tokens, query_ends=ends), out)
        return out.view(batch, length, -1) if flat else out.view(batch, length, *out.shape[1:])

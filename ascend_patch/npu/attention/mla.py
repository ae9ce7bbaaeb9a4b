"""The Ascend MLA backend: DeepSeek-style multi-head latent attention on the kernel seam.

vLLM's own ``MLAAttention`` layer (``model_executor/layers/attention/mla_attention.py``, 0.20–0.33)
keeps everything but the attention and the cache: the model's projections, norms and rotary, the
decode-first split of each batch, the absorption of ``W_UK`` into decode queries and the ``W_UV``
up-projection of their output. It calls this backend's impl for three things per layer and step:

- ``do_kv_cache_update``: ``npu_scatter_pa_kv_cache`` writes each token's latent ``kv_c`` and rope
  key ``k_pe`` into their two cache planes (vLLM's default is CUDA ``concat_and_cache_mla``);
- ``forward_mqa`` (the decode tokens, queries already absorbed): ATB
  ``npu_multi_head_latent_attention`` over the planes, heads zero-padded to a count it takes;
- ``forward_mha`` (the prefill tokens): ``npu_fused_infer_attention_score`` in its MLA form.
  Prefills with no cached context run up-projected (D = 128, ``kv_b_proj(kv_c)`` per head) over
  the step's own tokens; once any prefill has cached context (chunked prefill, prefix-cache hits)
  the step's prefills run absorbed (D = 512) straight over the paged latent cache, one launch,
  with the layer's ``W_UK_T``/``_v_up_proj`` as vLLM's decode path uses them.

Both fused kernels take fp16/bf16 with the DeepSeek-V2/V3 dimensions (latent 512, rope 64, a
power-of-two head count up to 128; the up-projected prefill also needs nope = value = 128, else
prefills run absorbed too). fp32 models, and other dimensions (with one warning naming them), run
the same cache and metadata through *composed* attention: the latent math of
:mod:`ascend_patch.npu.kernels.mla` in generic torch ops.

KV cache: one region per layer, as vLLM sizes it (``num_blocks × block_size × (kv_lora_rank +
rope)`` elements), read as two contiguous planes: ``[num_blocks, block_size, 1, kv_lora_rank]``
then ``[num_blocks, block_size, 1, rope]`` (:func:`latent_planes`). The kernels read the latent
and rope caches separately and refuse strided tensors, so interleaving them per token (vLLM's
``[.., kv_lora_rank + rope]`` rows) would cost a copy of the cache every step.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionType,
    CommonAttentionMetadata,
    MLAAttentionImpl,
)

from ascend_patch.npu import kernels
from ascend_patch.npu.attention.backend import AscendAttentionBackend, AscendMetadataBuilder
from ascend_patch.npu.kernels import mla as latent

logger = logging.getLogger("vllm.ascend_patch")

FUSED_DTYPES = (torch.float16, torch.bfloat16)
_MASK_SIZE = 2048  # sparse_mode=3 reads this fixed-size "optimised" mask
_masks: dict[torch.device, torch.Tensor] = {}


def latent_planes(kv_cache: torch.Tensor, kv_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's cache region as ``([blocks, block_size, 1, kv_lora_rank], [blocks, block_size,
    1, rope])``, both contiguous views of its bytes (the layer tensor is ``[blocks, (1,)
    block_size, kv_lora_rank + rope]`` as vLLM shapes it, contiguous: ``kv_cache.py``)."""
    blocks, width = kv_cache.shape[0], kv_cache.shape[-1]
    block_size = kv_cache.numel() // (blocks * width)
    flat = kv_cache.view(-1)
    split = blocks * block_size * kv_lora_rank
    return (flat[:split].view(blocks, block_size, 1, kv_lora_rank),
            flat[split:].view(blocks, block_size, 1, width - kv_lora_rank))


def _causal_mask(device: torch.device) -> torch.Tensor:
    """The sparse_mode=3 mask, one per device for every layer (the reference kernel verifies a
    mask's content once per tensor)."""
    if device not in _masks:
        # A normal tensor, not an inference-mode one, so kernels can cache checks on it.
        with torch.inference_mode(False):
            ones = torch.ones(_MASK_SIZE, _MASK_SIZE, dtype=torch.int8, device=device)
            _masks[device] = ones.triu_(1)
    return _masks[device]


class AscendMLABackend(AscendAttentionBackend):
    """The Ascend backend's cache policy (LBNHC, dtypes, decoder only, 128-token kernel blocks,
    which npu_multi_head_latent_attention takes too: block_size ≤ 128) with the MLA impl."""

    @staticmethod
    def get_impl_cls() -> type[AscendMLAImpl]:
        return AscendMLAImpl

    @staticmethod
    def get_builder_cls() -> type[AscendMLAMetadataBuilder]:
        return AscendMLAMetadataBuilder

    @classmethod
    def is_mla(cls) -> bool:
        return True

    if hasattr(AttentionBackend, "get_kv_cache_shape"):  # seam: until vLLM 0.29

        @staticmethod
        def get_kv_cache_shape(
            num_blocks: int,
            block_size: int,
            num_kv_heads: int,
            head_size: int,
            cache_dtype_str: str = "auto",
        ) -> tuple[int, ...]:
            return (num_blocks, block_size, head_size)


@dataclass
class AscendMLADecodeMetadata:
    block_table: torch.Tensor
    """[num_decodes, max_blocks] int32, in kernel blocks."""
    seq_lens: list[int]
    """Per-sequence KV lengths including this step, host side."""


@dataclass
class AscendMLAPrefillMetadata:
    block_table: torch.Tensor
    query_ends: list[int]
    """Cumulative query lengths of the prefills, from their first token (FIA TND)."""
    seq_lens: list[int]
    has_context: bool
    """Whether any prefill attends to tokens cached before this step."""


@dataclass
class AscendMLAMetadata:
    """What vLLM's ``MLAAttention.forward_impl`` reads (the counts; ``decode`` set whenever
    there are decodes) and what the impl needs. Decodes come first in the batch."""

    num_actual_tokens: int
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    slot_mapping: torch.Tensor
    decode: AscendMLADecodeMetadata | None
    prefill: AscendMLAPrefillMetadata | None


class AscendMLAMetadataBuilder(AscendMetadataBuilder):
    """The standard backend's host-side batch description, split decode-first."""

    # The runner orders each batch decode-first: single-token requests, then the rest.
    reorder_batch_threshold: int = 1

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> AscendMLAMetadata:
        batch = super().build(common_prefix_len, common_attn_metadata, fast_build)
        query_ends, seq_lens, block_table = batch.query_ends, batch.seq_lens, batch.block_table
        q_lens = [end - start for start, end in zip([0, *query_ends[:-1]], query_ends)]
        num_reqs = len(q_lens)
        num_decodes = next((i for i, n in enumerate(q_lens) if n > 1), num_reqs)
        decode = prefill = None
        if num_decodes:
            decode = AscendMLADecodeMetadata(block_table[:num_decodes], seq_lens[:num_decodes])
        if num_decodes < num_reqs:
            prefill = AscendMLAPrefillMetadata(
                block_table=block_table[num_decodes:],
                query_ends=[end - num_decodes for end in query_ends[num_decodes:]],
                seq_lens=seq_lens[num_decodes:],
                has_context=any(s > q for s, q in zip(seq_lens[num_decodes:], q_lens[num_decodes:])),
            )
        return AscendMLAMetadata(
            num_actual_tokens=batch.num_tokens,
            num_decodes=num_decodes,
            num_decode_tokens=num_decodes,
            num_prefills=num_reqs - num_decodes,
            slot_mapping=batch.slot_mapping,
            decode=decode,
            prefill=prefill,
        )


@functools.cache
def _warn_composed(kv_lora_rank: int, rope: int, heads: int) -> None:
    logger.warning(
        "ascend-patch: MLA with kv_lora_rank %d, qk_rope_head_dim %d and %d heads runs composed "
        "attention: the NPU MLA kernels take kv_lora_rank 512, rope 64 and 1/2/4/.../128 heads",
        kv_lora_rank, rope, heads)


class AscendMLAImpl(MLAAttentionImpl[AscendMLAMetadata]):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None,
        attn_type: str,
        kv_sharing_target_layer_name: str | None,
        *,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        qk_head_dim: int,
        v_head_dim: int,
        kv_b_proj,
        **unsupported,
    ) -> None:
        features = {
            "ALiBi": alibi_slopes is not None,
            "sliding window": sliding_window is not None,
            "logits soft-cap": bool(logits_soft_cap),
            f"attention type {attn_type}": attn_type != AttentionType.DECODER,
            "KV sharing": kv_sharing_target_layer_name is not None,
            f"KV cache dtype {kv_cache_dtype}": kv_cache_dtype not in ("auto", "float16", "bfloat16"),
            "decode context parallelism": self.dcp_world_size > 1,
            **{name: value is not None for name, value in unsupported.items()},
        }
        missing = [name for name, used in features.items() if used]
        if missing:
            raise NotImplementedError(f"Ascend MLA backend does not support {', '.join(missing)}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.kv_b_proj = kv_b_proj
        # The fused kernels' shapes: latent 512 and rope 64 ([FIA] MLA, [ATB-MLA]); query heads a
        # power of two up to 128 for the absorbed FIA form, ATB padded up to 8/16/32/64/128.
        self.fused_dims = (kv_lora_rank == latent.LATENT_DIM and qk_rope_head_dim == latent.ROPE_DIM
                           and num_heads in latent.FIA_LATENT_HEADS)
        self.up_projected_prefill = qk_nope_head_dim == v_head_dim == latent.UP_PROJECTED_DIM
        self.decode_heads = next((n for n in latent.ATB_MLA_HEADS if n >= num_heads), None)
        if not self.fused_dims:
            _warn_composed(kv_lora_rank, qk_rope_head_dim, num_heads)
        self._owner = None

    # -- vLLM's MLAAttention layer this impl belongs to --------------------------------------

    def _layer(self):
        """The ``MLAAttention`` holding this impl (its name, ``W_UK_T`` and ``_v_up_proj``)."""
        if self._owner is None:
            from vllm.forward_context import get_forward_context

            layers = get_forward_context().no_compile_layers.values()
            self._owner = next(layer for layer in layers if getattr(layer, "impl", None) is self)
        return self._owner

    def _metadata(self) -> AscendMLAMetadata | None:
        from vllm.forward_context import get_forward_context

        metadata = get_forward_context().attn_metadata
        if isinstance(metadata, dict):
            return metadata.get(self._layer().layer_name)
        return metadata

    # -- cache write ---------------------------------------------------------------------------

    def do_kv_cache_update(self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype,
                           k_scale, skip_scale=False) -> None:
        if slot_mapping is None or kv_cache.numel() == 0:  # memory profiling: no cache yet
            return
        metadata = self._metadata()
        if metadata is None:  # a dummy run: its slots are all -1, which CUDA's kernel skips
            return
        n = metadata.num_actual_tokens
        kv_c_plane, k_pe_plane = latent_planes(kv_cache, self.kv_lora_rank)
        kernels.scatter_pa_kv_cache(
            kv_c_normed[:n].unsqueeze(1).contiguous(), k_pe[:n].contiguous(),
            kv_c_plane, k_pe_plane, slot_mapping[:n],
        )

    # -- decode: absorbed queries over the latent cache ----------------------------------------

    def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata: AscendMLAMetadata, layer):
        if isinstance(q, tuple):
            q_nope, q_pe = q
        else:
            q_nope, q_pe = q[..., : self.kv_lora_rank], q[..., self.kv_lora_rank :]
        meta = attn_metadata.decode
        kv_c, k_pe = latent_planes(kv_c_and_k_pe_cache, self.kv_lora_rank)
        if not (self.fused_dims and q_nope.dtype in FUSED_DTYPES):
            out = latent.latent_decode(q_nope, q_pe, kv_c, k_pe, meta.block_table, meta.seq_lens,
                                       self.scale)
        else:
            out = self._atb_decode(q_nope, q_pe, kv_c, k_pe, meta)
        return out, None

    def _atb_decode(self, q_nope, q_pe, kv_c, k_pe, meta: AscendMLADecodeMetadata):
        heads = self.decode_heads
        if heads != self.num_heads:  # zero query heads: attention is per head, they are dropped
            batch = q_nope.shape[0]
            q_nope = torch.cat((q_nope, q_nope.new_zeros(batch, heads - self.num_heads,
                                                         q_nope.shape[-1])), dim=1)
            q_pe = torch.cat((q_pe, q_pe.new_zeros(batch, heads - self.num_heads,
                                                   q_pe.shape[-1])), dim=1)
        out = kernels.multi_head_latent_attention(q_nope, q_pe, kv_c, k_pe, meta.block_table,
                                                  meta.seq_lens, heads, self.scale, 1)
        return out[:, : self.num_heads]

    def _absorbed(self, q_nope, q_pe, kv_c, k_pe, block_table, query_ends, seq_lens):
        """FIA's MLA form, D = 512, over the paged latent cache: ``[T, N, kv_lora_rank]``."""
        num_blocks, block_size = kv_c.shape[:2]
        latent_cache = kv_c.view(num_blocks, block_size, -1)
        out, _ = kernels.fused_infer_attention_score_mla(
            q_nope.contiguous(), latent_cache, latent_cache,
            query_rope=q_pe.contiguous(), key_rope=k_pe.view(num_blocks, block_size, -1),
            atten_mask=_causal_mask(q_nope.device), block_table=block_table,
            actual_seq_lengths=query_ends, actual_seq_lengths_kv=seq_lens,
            num_heads=self.num_heads, num_key_value_heads=1, scale=self.scale,
            input_layout="TND", block_size=block_size, sparse_mode=3,
        )
        return out

    # -- prefill ---------------------------------------------------------------------------------

    def forward_mha(self, q, kv_c_normed, k_pe, kv_c_and_k_pe_cache, attn_metadata, k_scale,
                    output, output_scale=None) -> None:
        if output_scale is not None:
            raise NotImplementedError("fused output quantization is not supported on Ascend")
        meta = attn_metadata.prefill
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        fused = self.fused_dims and q.dtype in FUSED_DTYPES
        if fused and self.up_projected_prefill and not meta.has_context:
            self._up_projected(q_nope, q_pe, kv_c_normed, k_pe, meta, output)
            return
        # Absorbed: queries into the latent space with the layer's W_UK_T, as vLLM does for
        # decodes, and the latent output back through its W_UV.
        layer = self._layer()
        absorbed = q.new_empty(q.shape[0], self.num_heads, self.kv_lora_rank)
        torch.bmm(q_nope.transpose(0, 1), layer.W_UK_T, out=absorbed.transpose(0, 1))
        kv_c, k_pe_cache = latent_planes(kv_c_and_k_pe_cache, self.kv_lora_rank)
        if fused:
            out = self._absorbed(absorbed, q_pe, kv_c, k_pe_cache, meta.block_table,
                                 meta.query_ends, meta.seq_lens)
        else:
            out = self._composed_prefill(absorbed, q_pe, kv_c, k_pe_cache, meta)
        layer._v_up_proj(out, out=output)

    def _up_projected(self, q_nope, q_pe, kv_c_normed, k_pe, meta: AscendMLAPrefillMetadata,
                      output) -> None:
        """Fresh prefills: FIA's MLA form, D = 128, over the step's own up-projected K/V."""
        heads = self.num_heads
        kv = self.kv_b_proj(kv_c_normed)[0].view(-1, heads, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, value = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        out, _ = kernels.fused_infer_attention_score_mla(
            q_nope.contiguous(), k_nope.contiguous(), value.contiguous(),
            query_rope=q_pe.contiguous(), key_rope=k_pe.expand(-1, heads, -1).contiguous(),
            atten_mask=_causal_mask(q_nope.device), actual_seq_lengths=meta.query_ends,
            actual_seq_lengths_kv=meta.query_ends, num_heads=heads, num_key_value_heads=heads,
            scale=self.scale, input_layout="TND", sparse_mode=3,
        )
        output.view(-1, heads, self.v_head_dim).copy_(out)

    def _composed_prefill(self, q_nope, q_pe, kv_c, k_pe, meta: AscendMLAPrefillMetadata):
        """Absorbed causal attention per prefill over the latent planes, in generic torch ops."""
        out = q_nope.new_empty(q_nope.shape)
        start = 0
        for end, seq_len, blocks in zip(meta.query_ends, meta.seq_lens, meta.block_table):
            rows = slice(start, end)
            latent_kv = latent.gather_plane(kv_c, blocks, seq_len)
            rope = latent.gather_plane(k_pe, blocks, seq_len)
            out[rows] = latent.latent_attention(q_nope[rows], q_pe[rows], latent_kv, rope,
                                                latent_kv, self.scale, causal=True)
            start = end
        return out

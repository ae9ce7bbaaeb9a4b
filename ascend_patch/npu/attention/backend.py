"""The Ascend attention backend: paged KV cache, mixed prefill/decode batches, chunked
prefill and prefix caching, on the kernel seam.

Per step and layer, ``forward`` writes the new K/V into the paged cache
(``npu_scatter_pa_kv_cache``) and then runs one attention launch:

- a batch of single-token queries (pure decode): ``_npu_paged_attention``;
- anything else (prefill, chunked prefill behind a cached prefix, mixed):
  ``npu_fused_infer_attention_score`` in TND layout with cumulative host query
  lengths, per-sequence host KV lengths, an int32 block table and the causal
  ``sparse_mode=3`` mask.

Both fused kernels take fp16/bf16 only. An fp32 model runs the same cache and
metadata through *composed* attention: the gather/matmul/softmax of standard
torch ops, which the NPU runs as generic kernels (several launches, not one).

KV cache: each layer's cache is ``[2, num_blocks, block_size, num_kv_heads,
head_size]`` (K plane, V plane), the ND layout the kernels read. vLLM 0.20–0.28
shape it from ``get_kv_cache_shape``; from 0.29 :mod:`ascend_patch.npu.kv_cache`
carves it out of vLLM's single allocation.

Graphs: FULL graphs hold uniform single-token decode batches (``_npu_paged_attention``,
whose host context lengths every replay re-issues through :func:`acl_graph.launch`).
Prefill and mixed batches (FIA, with host query and KV lengths) stay outside graphs:
eager, or between PIECEWISE graphs. A FULL graph's batch is padded to its capture size;
its padded requests get one token each over vLLM's null block (block 0), and every
token without a slot (padding, dummy runs) writes its K/V into a slot of that block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)

from ascend_patch.npu import kernels
from ascend_patch.npu.compilation import acl_graph
from ascend_patch.npu.kernels import paged

# Block sizes the fused kernels accept for queries longer than one token
# (npu_fused_infer_attention_score PageAttention rule: a multiple of 128 in [128, 512]).
KERNEL_BLOCK_SIZE = 128
FUSED_DTYPES = (torch.float16, torch.bfloat16)
FUSED_HEAD_SIZES = (64, 128)
# sparse_mode=3 reads this fixed-size "optimised" mask (nonzero above the diagonal).
_MASK_SIZE = 2048


class AscendAttentionBackend(AttentionBackend):
    accept_output_buffer = True
    supported_dtypes = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes = ["auto", "float16", "bfloat16"]
    forward_includes_kv_cache_update = True

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[AscendAttentionImpl]:
        return AscendAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[AscendMetadataBuilder]:
        return AscendMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int]:
        return [KERNEL_BLOCK_SIZE]

    @classmethod
    def supported_kv_cache_layouts(cls):
        # vLLM 0.29+. Layer-outermost: each layer owns one dense region, which
        # kv_cache.py re-views as separate K and V planes.
        from vllm.v1.kv_cache_layout import KVCacheLayout

        return (KVCacheLayout.LBNHC,)

    if hasattr(AttentionBackend, "get_kv_cache_shape"):  # seam: until vLLM 0.29
        # vLLM 0.20–0.28 view each layer's raw KV bytes in the shape the backend
        # names here (with the default identity stride order): the K and V planes
        # come out contiguous, as the kernels read them. 0.29 removed the hook.

        @staticmethod
        def get_kv_cache_shape(
            num_blocks: int,
            block_size: int,
            num_kv_heads: int,
            head_size: int,
            cache_dtype_str: str = "auto",
        ) -> tuple[int, ...]:
            return (2, num_blocks, block_size, num_kv_heads, head_size)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER


@dataclass
class AscendMetadata:
    num_tokens: int
    """Real (unpadded) tokens in the step."""
    query_ends: list[int]
    """Cumulative query lengths, host side (FIA ``actual_seq_lengths``)."""
    seq_lens: list[int]
    """Per-sequence KV lengths including this step, host side."""
    context_lens: torch.Tensor
    """``seq_lens`` as a host int32 tensor (``_npu_paged_attention`` context_lens)."""
    block_table: torch.Tensor
    """[num_seqs, max_blocks] int32, in kernel blocks."""
    slot_mapping: torch.Tensor
    """vLLM's slots, -1 for a token without one (padding, dummy runs)."""
    null_slots: torch.Tensor
    """A slot of the null block for each token position (the stand-ins for -1)."""
    max_query_len: int
    _kv_slots: torch.Tensor | None = None

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1

    def kv_slots(self) -> torch.Tensor:
        """The step's KV-cache slots with the missing ones in the null block: one device op per
        step (every layer shares it), inside a FULL graph when captured."""
        if self._kv_slots is None:
            self._kv_slots = torch.where(self.slot_mapping < 0, self.null_slots, self.slot_mapping)
        return self._kv_slots


class AscendMetadataBuilder(AttentionMetadataBuilder[AscendMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.device = device
        # Slot i of the null block for token i (block 0, which vLLM never hands to a request).
        tokens = vllm_config.scheduler_config.max_num_batched_tokens
        self._null_slots = torch.arange(tokens, device=device) % kv_cache_spec.block_size

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        # FULL graphs for single-token decode batches on the fused kernels (see the module
        # docstring); the composed fp32 path turns host lengths into new tensors every step.
        fused = (vllm_config.model_config.dtype in FUSED_DTYPES
                 and kv_cache_spec.head_size in FUSED_HEAD_SIZES)
        return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE if fused else AttentionCGSupport.NEVER

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> AscendMetadata:
        meta = common_attn_metadata
        num_seqs = meta.num_reqs
        query_ends = meta.query_start_loc_cpu[1 : num_seqs + 1].tolist()
        # A host copy of the KV lengths, exact outside speculative decoding (which
        # this backend does not support); otherwise one device-to-host copy.
        host_seq_lens = meta.seq_lens_cpu_upper_bound
        if host_seq_lens is None:
            host_seq_lens = meta.seq_lens.cpu()
        seq_lens = host_seq_lens[:num_seqs].to(torch.int32)
        num_tokens = meta.num_actual_tokens
        padding = num_seqs - 1 - query_ends.index(query_ends[-1]) if query_ends else 0
        if padding:
            # A FULL graph's padded batch: its last requests have no token. Each gets one,
            # attending to one null-block slot, so the batch has the captured shape.
            real = num_seqs - padding
            query_ends[real:] = range(query_ends[real - 1] + 1, query_ends[real - 1] + padding + 1)
            seq_lens[real:] = 1
        if query_ends and query_ends[-1] != num_tokens:
            raise NotImplementedError(
                f"a padded batch of {num_tokens} tokens for {num_seqs} requests ending at "
                f"{query_ends[-1]}: the Ascend backend pads single-token decode batches only")
        block_table = meta.block_table_tensor[:num_seqs]
        if block_table.dtype != torch.int32:
            block_table = block_table.to(torch.int32)
        return AscendMetadata(
            num_tokens=num_tokens,
            query_ends=query_ends,
            seq_lens=seq_lens.tolist(),
            context_lens=seq_lens,
            block_table=block_table,
            slot_mapping=meta.slot_mapping[:num_tokens],
            null_slots=self._null_slots[:num_tokens],
            max_query_len=meta.max_query_len,
        )


class AscendAttentionImpl(AttentionImpl[AscendMetadata]):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        **unsupported,
    ) -> None:
        features = {
            "ALiBi": alibi_slopes is not None,
            "sliding window": sliding_window is not None,
            "logits soft-cap": bool(logits_soft_cap),
            f"attention type {attn_type}": attn_type != AttentionType.DECODER,
            **{name: value is not None for name, value in unsupported.items()},
        }
        missing = [name for name, used in features.items() if used]
        if missing:
            raise NotImplementedError(
                f"Ascend attention backend does not support {', '.join(missing)}"
            )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self._mask: torch.Tensor | None = None

    def _causal_mask(self, device: torch.device) -> torch.Tensor:
        if self._mask is None or self._mask.device != device:
            # A normal tensor, not an inference-mode one, so kernels can cache checks on it.
            with torch.inference_mode(False):
                ones = torch.ones(_MASK_SIZE, _MASK_SIZE, dtype=torch.int8, device=device)
                self._mask = ones.triu_(1)
        return self._mask

    def forward(
        self,
        layer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AscendMetadata,
        output: torch.Tensor | None = None,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported on Ascend")
        if attn_metadata is None:  # memory-profiling pass: no KV cache yet
            return output.fill_(0)
        n = attn_metadata.num_tokens
        key_cache, value_cache = kv_cache.unbind(0)
        if self.kv_sharing_target_layer_name is None and key is not None:
            kernels.scatter_pa_kv_cache(
                key[:n].contiguous(),
                value[:n].contiguous(),
                key_cache,
                value_cache,
                attn_metadata.kv_slots(),
            )
        query = query[:n]
        out = output[:n]
        if query.dtype in FUSED_DTYPES and self.head_size in FUSED_HEAD_SIZES:
            self._fused(layer.layer_name, query, key_cache, value_cache, attn_metadata, out)
        else:
            _composed(query, key_cache, value_cache, attn_metadata, self.scale, out)
        return output

    def _fused(self, layer_name, query, key_cache, value_cache, meta: AscendMetadata, out) -> None:
        query = query.contiguous()
        if meta.decode_only:
            # Its context lengths are host data: a graph replay must be handed the step's.
            args = (query, key_cache, value_cache, self.num_kv_heads, self.num_heads, self.scale)

            def issue(params: AscendMetadata, workspace) -> None:
                kernels.paged_attention(*args, params.block_table, params.context_lens, out,
                                        workspace=workspace)

            def workspace(params: AscendMetadata):
                return kernels.paged_attention_workspace(*args, params.block_table,
                                                         params.context_lens, out)

            acl_graph.launch(layer_name, meta, issue, workspace)
            return
        if acl_graph.capturing():  # FULL graphs hold single-token decode batches only
            raise RuntimeError("npu_fused_infer_attention_score inside a graph capture: its host "
                               "query/KV lengths would be replayed unchanged")
        num_blocks, block_size = key_cache.shape[:2]
        attn, _ = kernels.fused_infer_attention_score(
            query,
            key_cache.view(num_blocks, block_size, -1),
            value_cache.view(num_blocks, block_size, -1),
            atten_mask=self._causal_mask(query.device),
            block_table=meta.block_table,
            actual_seq_lengths=meta.query_ends,
            actual_seq_lengths_kv=meta.seq_lens,
            num_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            scale=self.scale,
            input_layout="TND",
            block_size=block_size,
            sparse_mode=3,
        )
        out.copy_(attn)


def _composed(query, key_cache, value_cache, meta: AscendMetadata, scale, out) -> None:
    """Causal attention over the paged cache with standard torch ops (fp32 models; head
    sizes the fused kernels reject): every single-token query in one batched call, each
    longer one on its own, query row i seeing keys up to position kv_len - q_len + i."""
    starts = [0, *meta.query_ends[:-1]]
    lengths = [end - start for start, end in zip(starts, meta.query_ends)]
    decodes = [i for i, n in enumerate(lengths) if n == 1]
    if decodes:
        rows = torch.tensor([starts[i] for i in decodes], device=query.device)
        out[rows] = paged.decode_batch(query[rows], key_cache, value_cache, meta.block_table[decodes],
                                       [meta.seq_lens[i] for i in decodes], scale)
    for i, n in enumerate(lengths):
        if n > 1:
            keys, values = paged.gather_sequence(key_cache, value_cache, meta.block_table[i], meta.seq_lens[i])
            rows = slice(starts[i], starts[i] + n)
            out[rows] = paged.attend(query[rows], keys, values, scale, causal=True)

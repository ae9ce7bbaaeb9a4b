"""The Ascend MLA backend: DeepSeek-style multi-head latent attention on the kernel seam.

vLLM's own ``MLAAttention`` layer (``model_executor/layers/attention/mla_attention.py``, 0.20–0.33)
keeps everything but the attention and the cache: the model's projections, norms and rotary, the
decode-first split of each batch, the absorption of ``W_UK`` into decode queries and the ``W_UV``
up-projection of their output. It calls this backend's impl for three things per layer and step:

- ``do_kv_cache_update``: ``npu_scatter_pa_kv_cache`` writes each token's latent ``kv_c`` and rope
  key ``k_pe`` into their two cache planes (vLLM's default is CUDA ``concat_and_cache_mla``).
  In bf16/fp16 the layer hands this impl its ``kv_a_layernorm`` and rotary instead
  (:func:`fuse_kv_rope`): ``npu_kv_rmsnorm_rope_cache_v2`` then norms ``kv_c``, rotates
  ``k_pe`` and writes both in one launch, and ``npu_interleave_rope`` rotates the queries' rope
  part in one more, over cos/sin the builder gathers once per step. Both ops leave the rope
  lanes reordered (even, then odd) against vLLM's interleaved rope; query and key alike, so
  scores are vLLM's, and every reader of the rope plane (decode, prefill, KV transfer of the
  whole cache) sees one order;
- ``forward_mqa`` (the decode tokens, queries already absorbed): ATB
  ``npu_multi_head_latent_attention`` over the planes, heads zero-padded to a count it takes; in
  an engine with FULL graphs, ``npu_fused_infer_attention_score``'s MLA (rope) form instead, the
  one vllm-ascend captures (``mla_v1``): its ``.out`` call with a workspace sized at capture,
  launched through :func:`acl_graph.launch` so every replay re-issues it with the step's host KV
  lengths (``actual_seq_lengths_kv``), heads zero-padded to the 32, 64 or 128 it takes. There,
  with speculative decoding (MTP), uniform verification rows (1 + k ≤ 16 queries per request)
  are decodes too (in eager engines as well): the same form with S = 1 + k and the causal mask (``sparse_mode=3``), in
  BNSD, the layouts the wheels document for the rope branch (vllm-ascend runs it in TND);
- ``forward_mha`` (the prefill tokens, fresh or behind cached context: chunked prefill,
  prefix-cache hits): up-projected attention, as vLLM's own MLA prefill runs it. Each prefill's
  latent rows (its cached context and its new tokens, which the cache write has just stored) are
  read out of the cache, up-projected with ``kv_b_proj`` to per-head ``k_nope``/``v``, and
  attended in ``npu_fused_infer_attention_score``'s TND form without rope inputs (query
  ``q_nope ++ q_pe`` and key ``k_nope ++ k_pe``, 192; value 128), causal: one launch per step
  for all of its prefills. A step whose up-projected context would exceed a workspace bound
  (vLLM's ``determine_chunked_prefill_workspace_size``: 8 × max_model_len, at most 64K rows)
  attends its new tokens and its context in bounded chunks, merged by their log-sum-exp.

Why up-projected and not the absorbed form over the paged latent cache (one launch, no
gather): the op documents its rope (MLA) branch for query D = 512 only with 1–16 query tokens
per sequence and 32/64/128 heads in BSH/BSND/BNSD (the torch-npu wheels' docstring; vllm-ascend
caps it at 16 tokens the same way), so a chunked prefill would need one padded 16-token row per
16 query tokens and at least 32 heads, while the TND form takes each prefill whole and up to the
step's token budget in one launch. The two forms round the same products in bf16 (the emulated
figures of ``tests/test_mla.py`` track HF's own bf16 run on either); the up-projected one is
what vLLM and vllm-ascend run for prefills.

The fused kernels' limits (:mod:`ascend_patch.npu.kernels.limits`): the decode takes latent 512,
rope 64 and up to 128 heads (padded to 8/16/32/64/128); the prefill takes nope + rope = 192 with
value 128 (DeepSeek-V2/V3, Kimi), bf16 only, 8/16/32/64/128 heads (fewer are zero-padded: each
head attends on its own, the padded ones are dropped). fp16 models run the prefill attention in
bf16 (what vllm-ascend does: the op's TND form is bf16-only). fp32 models, and other dimensions
or more than 128 heads (with one warning naming them), run the same cache, metadata and launch
plan through *composed* attention: generic torch ops.

KV cache: one region per layer, as vLLM sizes it (``num_blocks × block_size × (kv_lora_rank +
rope)`` elements), read as two contiguous planes: ``[num_blocks, block_size, 1, kv_lora_rank]``
then ``[num_blocks, block_size, 1, rope]`` (:func:`latent_planes`). The kernels read the latent
and rope caches separately and refuse strided tensors, so interleaving them per token (vLLM's
``[.., kv_lora_rank + rope]`` rows) would cost a copy of the cache every step.
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass

import torch
from vllm.v1.attention.backend import (
    AttentionCGSupport,
    AttentionType,
    CommonAttentionMetadata,
    MLAAttentionImpl,
)

from ascend_patch.npu import kernels
from ascend_patch.npu.attention import paths
from ascend_patch.npu.attention.backend import AscendAttentionBackend, AscendMetadataBuilder
from ascend_patch.npu.attention.base import causal_mask
from ascend_patch.npu.attention.paths import FUSED_DTYPES, KERNEL_BLOCK_SIZE
from ascend_patch.npu.compilation import acl_graph
from ascend_patch.npu.kernels import composed, limits

logger = logging.getLogger("vllm.ascend_patch")


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

    @classmethod
    def kv_block_shape(cls, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        # One latent + rope vector per token, read as two planes (latent_planes).
        return (block_size, head_size)


@dataclass
class AscendMLADecodeMetadata:
    block_table: torch.Tensor
    """[num_decodes, max_blocks] int32, in kernel blocks."""
    seq_lens: list[int]
    """Per-sequence KV lengths including this step, host side."""


@dataclass
class PrefillLaunch:
    """One attention launch of a step's prefills: KV rows ``[start, end)`` of some prefills'
    sequences, read out of the cache by slot, attended by all of those prefills' new tokens."""

    queries: slice
    """The launch's query rows among the step's prefill tokens (its prefills are consecutive)."""
    query_ends: list[int]
    """Cumulative query lengths of its prefills (FIA TND ``actual_seq_lengths``)."""
    kv_ends: list[int]
    """Cumulative KV rows of its prefills (``actual_seq_lengths_kv``)."""
    slots: torch.Tensor
    """[rows] int64 cache slots of the KV rows, sequence by sequence, on the device."""
    causal: bool
    """The rows run to each sequence's end, its new tokens last (``sparse_mode=3``); otherwise
    they are context wholly before every query (``sparse_mode=0``)."""


@dataclass
class AscendMLAPrefillMetadata:
    launches: list[PrefillLaunch]
    """The step's prefill attention launches: one, unless its context exceeds the workspace
    bound (:func:`plan_prefill_launches`)."""


@dataclass
class AscendMLAMetadata:
    """What vLLM's ``MLAAttention.forward_impl`` reads (the counts; ``decode`` set whenever
    there are decodes) and what the impl needs. Decodes come first in the batch."""

    num_actual_tokens: int
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    slot_mapping: torch.Tensor | None  # None: a dummy pass that writes no KV
    """The step's cache slots, a slot of the null block for each token without one (padding)."""
    decode: AscendMLADecodeMetadata | None
    prefill: AscendMLAPrefillMetadata | None
    rope: dict | None = None
    """Per rotary module of the layers that fuse their rope (:func:`fuse_kv_rope`): the step's
    ``(cos, sin)`` ``[tokens, 64]``, half layout, in the builder's persistent buffers."""


def check_config(vllm_config) -> None:
    """Start-up refusal of a batch the MLA prefill cannot attend: a step's prefill tokens are the
    queries (and, beyond the workspace bound, the keys) of one TND launch."""
    tokens = vllm_config.scheduler_config.max_num_batched_tokens
    if tokens > limits.FIA_TND_MAX_TOKENS:
        raise ValueError(
            f"--max-num-batched-tokens {tokens} is not supported for MLA models on Ascend: a "
            f"step's prefill tokens are attended in one npu_fused_infer_attention_score TND "
            f"launch, which takes at most {limits.FIA_TND_MAX_TOKENS}; use "
            f"--max-num-batched-tokens {limits.FIA_TND_MAX_TOKENS} or less (chunked prefill)")


def prefill_workspace_rows(max_model_len: int, max_num_seqs: int, block_size: int) -> int:
    """The most up-projected context rows one prefill launch may hold: vLLM's own MLA bound
    (``MLACommonMetadataBuilder.determine_chunked_prefill_workspace_size``, 0.33: room for 8
    full-length requests or 4 blocks per request, at most 64K rows, which is also the TND
    form's token limit), rounded up to a block."""
    rows = min(max(8 * max_model_len, 4 * max_num_seqs * block_size), limits.FIA_TND_MAX_TOKENS)
    return -(-rows // block_size) * block_size


def plan_prefill_launches(query_lens: list[int], seq_lens: list[int],
                          budget: int) -> list[tuple[list[tuple[int, int, int]], bool]]:
    """The launches of a step's prefills, as ``(rows, causal)`` with ``rows`` a list of
    ``(prefill, start, end)`` KV ranges over consecutive prefills.

    Every prefill's whole sequence in one causal launch when its context (what precedes its new
    tokens) fits the budget together with the others'; otherwise one causal launch of the new
    tokens over themselves and the contexts packed into non-causal launches of at most
    ``budget`` rows (vLLM's ``plan_mla_context_chunks``: a context that does not fit is split,
    a prefill without context ends a chunk). Their outputs then merge by log-sum-exp."""
    contexts = [seq - q for q, seq in zip(query_lens, seq_lens)]
    if not any(contexts) or sum(seq_lens) <= budget:
        return [([(i, 0, seq) for i, seq in enumerate(seq_lens)], True)]
    launches = [([(i, ctx, ctx + q) for i, (ctx, q) in enumerate(zip(contexts, query_lens))], True)]
    chunk, used = [], 0
    for i, ctx in enumerate(contexts):
        start = 0
        while start < ctx:
            take = min(ctx - start, budget - used)
            chunk.append((i, start, start + take))
            used, start = used + take, start + take
            if used == budget:
                launches.append((chunk, False))
                chunk, used = [], 0
        if chunk and (ctx == 0 or i == len(contexts) - 1):
            launches.append((chunk, False))
            chunk, used = [], 0
    return launches


def prefill_metadata(query_lens: list[int], seq_lens: list[int], block_table: torch.Tensor,
                     budget: int) -> AscendMLAPrefillMetadata:
    """A step's prefills (their query and KV lengths, their block table in kernel blocks) with
    their launches: each launch's KV rows as cache slots, computed once per step on the device."""
    query_ends = torch.tensor(query_lens).cumsum(0).tolist()
    query_starts = [end - q for end, q in zip(query_ends, query_lens)]
    launches = []
    for rows, causal in plan_prefill_launches(query_lens, seq_lens, budget):
        prefills, starts, ends = zip(*rows)
        lengths = torch.tensor([end - start for start, end in zip(starts, ends)])
        first_row = lengths.cumsum(0) - lengths
        positions = torch.arange(int(lengths.sum())) + torch.repeat_interleave(
            torch.tensor(starts) - first_row, lengths)
        sequences = torch.repeat_interleave(torch.tensor(prefills), lengths)
        positions, sequences = positions.to(block_table.device), sequences.to(block_table.device)
        blocks = block_table[sequences, positions // KERNEL_BLOCK_SIZE].long()
        q_lens = [query_lens[i] for i in prefills]
        launches.append(PrefillLaunch(
            queries=slice(query_starts[prefills[0]], query_ends[prefills[-1]]),
            query_ends=torch.tensor(q_lens).cumsum(0).tolist(),
            kv_ends=lengths.cumsum(0).tolist(),
            slots=blocks * KERNEL_BLOCK_SIZE + positions % KERNEL_BLOCK_SIZE,
            causal=causal,
        ))
    return AscendMLAPrefillMetadata(launches)


class AscendMLAMetadataBuilder(AscendMetadataBuilder):
    """The standard backend's host-side batch description, split decode-first, and the step's
    prefill launch plan (shared by every layer)."""

    # The runner orders each batch decode-first: single-token requests, then the rest. The ATB
    # decode takes one query per sequence, so speculative verification rows (1 + k tokens) would
    # run on the prefill path, causal over their context (vLLM's MLA builders say this with
    # QueryLenSupport.SINGLE_ONLY); where FIA's MLA form takes them they are decodes on it
    # instead, causal (QueryLenSupport.UNIFORM): see __init__.
    reorder_batch_threshold: int = 1

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        # FULL graphs for decode batches on FIA's MLA form (its host KV lengths re-issued on
        # every replay): single-token ones and, with speculative decoding, uniform verification
        # rows (paths.verify_graph_refusal); prefills bake host lengths and stay outside graphs.
        model = vllm_config.model_config
        if paths.mla_graph_decode_refusal(model.dtype, model.hf_text_config) is not None:
            return AttentionCGSupport.NEVER
        if (vllm_config.speculative_config is not None
                and paths.verify_graph_refusal(vllm_config, kv_cache_spec.head_size) is None):
            return AttentionCGSupport.UNIFORM_BATCH
        return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # Verification rows are decodes where FIA's MLA form takes them (QueryLenSupport.UNIFORM):
        # uniform 1 + k ≤ 16 rows per request (paths.speculative_rows), at the dimensions and
        # dtypes it takes.
        if (self._verify_rows is not None
                and paths.verify_graph_refusal(vllm_config, kv_cache_spec.head_size) is None):
            self.reorder_batch_threshold = max(self._verify_rows)
        self.prefill_budget = prefill_workspace_rows(vllm_config.model_config.max_model_len,
                                                     vllm_config.scheduler_config.max_num_seqs,
                                                     KERNEL_BLOCK_SIZE)
        # The fused layers' cos/sin, gathered once per step for all of them (a FULL graph's
        # captured layers read them where the capture found them): per rotary module, its cos
        # and sin tables in the half layout and the step's rows of each.
        layers = vllm_config.compilation_config.static_forward_context
        tokens = vllm_config.scheduler_config.max_num_batched_tokens
        self._ropes = {}
        for name in layer_names:
            rope = layers[name].impl.rope
            if rope is not None and rope not in self._ropes:
                cos, sin = rope.cos_sin_cache.to(device, vllm_config.model_config.dtype).chunk(2, dim=-1)
                tables = (torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1))
                self._ropes[rope] = (tables, tuple(torch.empty(tokens, cos.shape[-1] * 2,
                                                               dtype=cos.dtype, device=device)
                                                   for _ in tables))

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> AscendMLAMetadata:
        batch = self.describe_batch(common_attn_metadata)  # MLA writes and reads vLLM's own slots
        query_ends, seq_lens, block_table = batch.query_ends, batch.seq_lens, batch.block_table
        q_lens = [end - start for start, end in zip([0, *query_ends[:-1]], query_ends)]
        num_reqs = len(q_lens)
        # The decodes: the leading requests of one query length up to the threshold (uniform, as
        # the decode form takes them); the rest run the prefill path.
        rows = q_lens[0] if q_lens and q_lens[0] <= self.reorder_batch_threshold else 0
        num_decodes = next((i for i, n in enumerate(q_lens) if n != rows), num_reqs) if rows else 0
        n = batch.num_tokens
        # In the builder's persistent buffer (a FULL graph's captured cache write reads it there);
        # the tokens without a slot (padding, dummy runs) write into slots of the null block.
        slots = torch.where(batch.slot_mapping < 0, self._null_slots[:n], batch.slot_mapping,
                            out=self._kv_slots[:n])
        decode = prefill = None
        if num_decodes:
            decode = AscendMLADecodeMetadata(block_table[:num_decodes], seq_lens[:num_decodes])
        if num_decodes < num_reqs:
            prefill = prefill_metadata(q_lens[num_decodes:], seq_lens[num_decodes:],
                                       block_table[num_decodes:], self.prefill_budget)
        rope = None
        if self._ropes:  # the runner's positions of the step (fused layers: no speculative decoding)
            positions = common_attn_metadata.positions[:n]
            rope = {module: tuple(torch.index_select(table, 0, positions, out=buffer[:n])
                                  for table, buffer in zip(tables, buffers))
                    for module, (tables, buffers) in self._ropes.items()}
        return AscendMLAMetadata(
            num_actual_tokens=batch.num_tokens,
            num_decodes=num_decodes,
            num_decode_tokens=num_decodes * rows,
            num_prefills=num_reqs - num_decodes,
            slot_mapping=None if self.writes_no_kv(n) else slots,
            decode=decode,
            prefill=prefill,
            rope=rope,
        )


@functools.cache
def _warn_composed(path: str, why: str) -> None:
    logger.warning("ascend-patch: MLA %s runs composed attention: %s", path, why)


@functools.cache
def _warn_bf16_prefill() -> None:
    logger.warning("ascend-patch: an fp16 MLA model runs its prefill attention in bf16: "
                   "npu_fused_infer_attention_score's TND form takes bf16 only")


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
        paths.refuse_unsupported("Ascend MLA backend", {
            "ALiBi": alibi_slopes is not None,
            "sliding window": sliding_window is not None,
            "logits soft-cap": bool(logits_soft_cap),
            f"attention type {attn_type}": attn_type != AttentionType.DECODER,
            "KV sharing": kv_sharing_target_layer_name is not None,
            f"KV cache dtype {kv_cache_dtype}": kv_cache_dtype not in ("auto", "float16", "bfloat16"),
            "decode context parallelism": self.dcp_world_size > 1,
        }, unsupported)
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.kv_b_proj = kv_b_proj
        # The fused kernels' shapes (ascend_patch.npu.kernels.limits): ATB's decode takes latent 512,
        # rope 64 and 8/16/32/64/128 heads; FIA's TND prefill Q/K 192 with V 128 (or 192) and
        # 8/16/32/64/128 heads. Fewer heads are zero-padded up to the next count.
        self.decode_heads = next((n for n in limits.ATB_MLA_HEADS if n >= num_heads), None)
        if not (kv_lora_rank == limits.LATENT_DIM and qk_rope_head_dim == limits.ROPE_DIM
                and self.decode_heads):
            self.decode_heads = None
            _warn_composed("decode", f"kv_lora_rank {kv_lora_rank}, qk_rope_head_dim "
                           f"{qk_rope_head_dim}, {num_heads} heads: npu_multi_head_latent_attention "
                           f"takes kv_lora_rank 512, rope 64 and at most 128 heads")
        self.prefill_heads = next((n for n in limits.FIA_TND_MLA_HEADS if n >= num_heads), None)
        if (qk_nope_head_dim + qk_rope_head_dim, v_head_dim) not in limits.FIA_TND_MLA_HEAD_DIMS:
            self.prefill_heads = None
        if self.prefill_heads is None:
            _warn_composed("prefill", f"qk_nope_head_dim {qk_nope_head_dim} + qk_rope_head_dim "
                           f"{qk_rope_head_dim}, v_head_dim {v_head_dim}, {num_heads} heads: "
                           "npu_fused_infer_attention_score's TND form takes query/key 192 with "
                           "value 128 or 192 and at most 128 heads")
        # In an engine with FULL graphs the decode runs on FIA's MLA form, the one with a replay
        # update; eager engines keep the ATB op (no padding of fewer than 32 heads up to 32) for
        # one-token decodes, and run verification rows (1 + k tokens) on FIA's MLA form, the one
        # that takes them (causal).
        self.graph_heads = None
        if self.decode_heads:
            self.graph_heads = next(n for n in limits.FIA_ROPE_HEADS if n >= num_heads)
        self._graph_decode = acl_graph.full_graphs_configured()
        self._owner = None
        # Handed over by fuse_kv_rope: vLLM's layer then passes kv_c un-normed and q_pe and
        # k_pe un-rotated, and this impl applies both with the cache write.
        self.kv_norm = self.rope = None

    def fuses_kv_rope(self, layer, fuse_qkv_rmsnorm: bool) -> bool:
        """Whether ``layer`` (vLLM's MultiHeadLatentAttentionWrapper holding this impl) can hand
        its kv_a_layernorm and rotary to the fused ops: the decode kernels' dimensions
        (latent 512, rope 64), a half dtype (the ops take bf16/fp16; fp32 engines keep vLLM's
        path), vLLM's interleaved rope over its cos|sin cache, an RMSNorm with a weight, and
        none of the layer's other paths that read kv_c_normed or the rotated q (sparse
        indexer, fused q/kv norms; DCP, which replicates queries, is refused). Not with
        speculative decoding: the cos/sin are gathered by the runner's positions, which the
        drafter's metadata does not carry."""
        from vllm.config import get_current_vllm_config
        from vllm.model_executor.layers.layernorm import RMSNorm
        from vllm.model_executor.layers.rotary_embedding import (
            DeepseekScalingRotaryEmbedding,
            RotaryEmbedding,
        )

        config = get_current_vllm_config()
        rope, norm = layer.rotary_emb, layer.kv_a_layernorm
        return (self.decode_heads is not None and config.model_config.dtype in FUSED_DTYPES
                and config.speculative_config is None
                and self.qk_nope_head_dim % limits.ROPE_DIM == 0
                and not layer.is_sparse and not fuse_qkv_rmsnorm
                and rope is not None and not rope.is_neox_style
                and rope.rotary_dim == rope.head_size == limits.ROPE_DIM
                and type(rope).forward_native in (RotaryEmbedding.forward_native,
                                                  DeepseekScalingRotaryEmbedding.forward_native)
                and isinstance(norm, RMSNorm) and norm.has_weight)

    def _rotate(self, q_pe: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``q_pe [T, N, 64]`` (a view of vLLM's query rows ``[T, N, nope + 64]``) rotated as the
        cache's keys are (npu_interleave_rope: lanes reordered, even then odd), one launch: the
        op runs on the contiguous rows themselves as ``[T, N, (nope + 64) / 64, 64]`` and only
        the last chunk is read (the nope chunks are rotated and dropped: 3× the work of a tiny
        op instead of a copy launch). Rows laid out otherwise are copied first."""
        tokens, heads, rope = q_pe.shape
        width = self.qk_nope_head_dim + rope
        if (q_pe.stride() == (heads * width, width, 1)
                and q_pe.storage_offset() >= self.qk_nope_head_dim):
            rows = q_pe.as_strided((tokens, heads, width // rope, rope),
                                   (heads * width, width, rope, 1),
                                   q_pe.storage_offset() - self.qk_nope_head_dim)
        else:
            rows = q_pe.contiguous().unsqueeze(2)
        shape = (tokens, 1, 1, rope)
        return kernels.interleave_rope(rows, cos.view(shape), sin.view(shape))[:, :, -1]

    # -- vLLM's MLAAttention layer this impl belongs to --------------------------------------

    def _metadata(self) -> AscendMLAMetadata | None:
        from vllm.forward_context import get_forward_context

        context = get_forward_context()
        metadata = context.attn_metadata
        if isinstance(metadata, dict):
            if self._owner is None:  # the MLAAttention holding this impl, for its layer name
                layers = context.no_compile_layers.values()
                owned = (layer for layer in layers
                         if getattr(layer, "impl", None) is self)  # not a seam: not every layer attends
                self._owner = next(owned)
            return metadata.get(self._owner.layer_name)
        return metadata

    # -- cache write ---------------------------------------------------------------------------

    def do_kv_cache_update(self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype,
                           k_scale, skip_scale=False) -> None:
        if slot_mapping is None or kv_cache.numel() == 0:  # memory profiling: no cache yet
            return
        metadata = self._metadata()
        if metadata is None or metadata.slot_mapping is None:  # a dummy run (see writes_no_kv)
            return
        n = metadata.num_actual_tokens
        kv_c_plane, k_pe_plane = latent_planes(kv_cache, self.kv_lora_rank)
        if self.rope is not None:  # kv_c un-normed, k_pe un-rotated: normed and rotated here
            cos, sin = metadata.rope[self.rope]
            shape = (1, 1, n, self.qk_rope_head_dim)  # one batch: block_num ≥ Ceil(n / block_size)
            kernels.kv_rmsnorm_rope_cache(
                _latent_rows(kv_c_normed, k_pe, n), self.kv_norm.weight, cos.view(shape),
                sin.view(shape), metadata.slot_mapping, k_pe_plane, kv_c_plane,
                epsilon=self.kv_norm.variance_epsilon, cache_mode="PA")
            return
        kernels.scatter_pa_kv_cache(
            kv_c_normed[:n].unsqueeze(1).contiguous(), k_pe[:n].contiguous(),
            kv_c_plane, k_pe_plane, metadata.slot_mapping,
        )

    # -- decode: absorbed queries over the latent cache ----------------------------------------

    def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata: AscendMLAMetadata, layer):
        if isinstance(q, tuple):
            q_nope, q_pe = q
        else:
            q_nope, q_pe = q[..., : self.kv_lora_rank], q[..., self.kv_lora_rank :]
        meta = attn_metadata.decode
        if self.rope is not None:
            cos, sin = attn_metadata.rope[self.rope]
            q_pe = self._rotate(q_pe, cos[: q_pe.shape[0]], sin[: q_pe.shape[0]])
        kv_c, k_pe = latent_planes(kv_c_and_k_pe_cache, self.kv_lora_rank)
        verification = q_nope.shape[0] > meta.block_table.shape[0]  # 1 + k rows per request
        if (self.graph_heads and q_nope.dtype in FUSED_DTYPES
                and (self._graph_decode or verification)):
            out = self._fia_decode(q_nope, q_pe, kv_c, k_pe, attn_metadata, layer.layer_name)
        elif self.decode_heads and q_nope.dtype in FUSED_DTYPES:
            out = self._atb_decode(q_nope, q_pe, kv_c, k_pe, meta)
        else:
            out = composed.latent_decode(q_nope, q_pe, kv_c, k_pe, meta.block_table, meta.seq_lens,
                                       self.scale)
        return out, None

    def _atb_decode(self, q_nope, q_pe, kv_c, k_pe, meta: AscendMLADecodeMetadata):
        heads = self.decode_heads
        if heads != self.num_heads:  # zero query heads: attention is per head, they are dropped
            q_nope, q_pe = _pad_heads(q_nope, heads), _pad_heads(q_pe, heads)
        out = kernels.multi_head_latent_attention(q_nope, q_pe, kv_c, k_pe, meta.block_table,
                                                  meta.seq_lens, heads, self.scale, 1)
        return out[:, : self.num_heads]

    def _fia_decode(self, q_nope, q_pe, kv_c, k_pe, metadata: AscendMLAMetadata, layer_name):
        """FIA's MLA form: BNSD queries (S of them per sequence: one, or 1 + k verification
        rows, causal) over the BnBsH latent planes, written into buffers of this step (of the
        graph's pool in a capture), its host KV lengths those of the metadata each launch or
        task update is handed."""
        heads = self.graph_heads
        batch = metadata.decode.block_table.shape[0]
        rows = q_nope.shape[0] // batch

        def bnsd(x):  # [B·S, N, D] → [B, heads, S, D]
            return _pad_heads(x, heads).view(batch, rows, heads, -1).transpose(1, 2).contiguous()

        query, query_rope = bnsd(q_nope), bnsd(q_pe)
        blocks, block_size = kv_c.shape[:2]
        key, key_rope = kv_c.view(blocks, block_size, -1), k_pe.view(blocks, block_size, -1)
        out = torch.empty_like(query)
        lse = torch.empty(0, dtype=torch.float32, device=query.device)  # no softmax_lse_flag
        call = dict(query_rope=query_rope, key_rope=key_rope,
                    block_table=metadata.decode.block_table, num_heads=heads,
                    num_key_value_heads=1, scale=self.scale, input_layout="BNSD",
                    block_size=block_size)
        if rows > 1:  # each row sees the keys up to its own token (rightDownCausal)
            call.update(atten_mask=causal_mask(query.device), sparse_mode=3)

        def issue(params: AscendMLAMetadata, workspace) -> None:
            kernels.fused_infer_attention_score_mla_decode(
                query, key, key, actual_seq_lengths_kv=params.decode.seq_lens, **call,
                attention_out=out, softmax_lse=lse, workspace=workspace)

        def workspace(params: AscendMLAMetadata):
            return kernels.fused_infer_attention_score_mla_decode_workspace(
                query, key, key, actual_seq_lengths_kv=params.decode.seq_lens, **call)

        acl_graph.launch(layer_name, metadata, issue, workspace)
        return out.transpose(1, 2).reshape(batch * rows, heads, -1)[:, : self.num_heads]

    # -- prefill: up-projected from the cached latent rows -------------------------------------

    def forward_mha(self, q, kv_c_normed, k_pe, kv_c_and_k_pe_cache, attn_metadata, k_scale,
                    output, output_scale=None) -> None:
        if output_scale is not None:
            raise NotImplementedError("fused output quantization is not supported on Ascend")
        if self.rope is not None:  # the prefill tokens follow the decodes in the step
            cos, sin = attn_metadata.rope[self.rope]
            rows = slice(attn_metadata.num_decode_tokens, attn_metadata.num_decode_tokens + q.shape[0])
            q_pe = self._rotate(q[..., self.qk_nope_head_dim:], cos[rows], sin[rows])
            q = torch.cat((q[..., : self.qk_nope_head_dim], q_pe), dim=-1)
        kv_c, k_pe_cache = latent_planes(kv_c_and_k_pe_cache, self.kv_lora_rank)
        latent_rows = kv_c.view(-1, self.kv_lora_rank)
        rope_rows = k_pe_cache.view(-1, self.qk_rope_head_dim)
        launches = attn_metadata.prefill.launches
        merge = len(launches) > 1
        parts = [self._attend(q[launch.queries], latent_rows[launch.slots], rope_rows[launch.slots],
                              launch, merge) for launch in launches]
        out = parts[0][0]
        if merge:  # the first launch holds every prefill's new tokens, the others context chunks
            out, lse = out.float(), parts[0][1]
            for launch, (part, part_lse) in zip(launches[1:], parts[1:]):
                rows = launch.queries
                merged = torch.logaddexp(lse[rows], part_lse)
                out[rows] = (out[rows] * (lse[rows] - merged).exp()
                             + part.float() * (part_lse - merged).exp())
                lse[rows] = merged
        output.view(-1, self.num_heads, self.v_head_dim).copy_(out)

    def _attend(self, q, latent_rows, rope_rows, launch: PrefillLaunch, with_lse: bool):
        """One launch: up-project its latent rows, attend its queries; ``(out [T, N, V],
        lse [T, N, 1] or None)``."""
        heads, nope = self.num_heads, self.qk_nope_head_dim
        kv = self.kv_b_proj(latent_rows)[0].view(-1, heads, nope + self.v_head_dim)
        # vLLM's own prefill layout: key k_nope ++ k_pe (the rope key shared by every head).
        key = torch.cat((kv[..., :nope], rope_rows[:, None].expand(-1, heads, -1)), dim=-1)
        value = kv[..., nope:]
        if self.prefill_heads is None or q.dtype not in FUSED_DTYPES:
            return composed.prefill_attention(q, key, value, launch.query_ends, launch.kv_ends,
                                            self.scale, launch.causal)
        if q.dtype != torch.bfloat16:
            _warn_bf16_prefill()
        padded = self.prefill_heads
        query, key, value = (_pad_heads(x, padded).to(torch.bfloat16).contiguous()
                             for x in (q, key, value))
        out, lse = kernels.fused_infer_attention_score_mla(
            query, key, value, atten_mask=causal_mask(q.device) if launch.causal else None,
            actual_seq_lengths=launch.query_ends, actual_seq_lengths_kv=launch.kv_ends,
            num_heads=padded, num_key_value_heads=padded, scale=self.scale, input_layout="TND",
            sparse_mode=3 if launch.causal else 0, softmax_lse_flag=with_lse,
        )
        return out[:, :heads], lse[:, :heads] if with_lse else None


def _pad_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``x [T, N, D]`` with zero heads appended up to ``heads`` (itself when N = heads)."""
    if x.shape[1] == heads:
        return x
    return torch.cat((x, x.new_zeros(x.shape[0], heads - x.shape[1], x.shape[2])), dim=1)


def _latent_rows(kv_c: torch.Tensor, k_pe: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` tokens' ``kv_c ++ k_pe`` as npu_kv_rmsnorm_rope_cache_v2's kv ``[1, 1, n,
    576]``: the rows of vLLM's kv_a projection themselves when kv_c and k_pe are the two halves
    of each (no launch; models without query LoRA), else copied (one launch: with query LoRA the
    rows are strided inside the fused q/kv projection, and the op's doc is silent on strides)."""
    width = kv_c.shape[-1] + k_pe.shape[-1]
    if (kv_c.stride(-1) == 1 and k_pe.stride(-1) == 1 and k_pe.stride(0) == kv_c.stride(0)
            and k_pe.untyped_storage().data_ptr() == kv_c.untyped_storage().data_ptr()
            and k_pe.storage_offset() == kv_c.storage_offset() + kv_c.shape[-1]):
        rows = kv_c.as_strided((n, width), (kv_c.stride(0), 1)).contiguous()
    else:
        rows = torch.cat((kv_c[:n], k_pe[:n].reshape(n, -1)), dim=-1)
    return rows.view(1, 1, n, width)


def fuse_kv_rope(wrapped, instance, args, kwargs) -> None:
    """``MultiHeadLatentAttentionWrapper.__init__``, then, where its impl can
    (:meth:`AscendMLAImpl.fuses_kv_rope`), its kv_a_layernorm and rotary handed to the impl:
    the layer's forward (vLLM's, unchanged) then passes ``kv_a_layernorm(kv_c)`` through an
    identity and skips its rotary (``if self.rotary_emb is not None``) with the write of the
    rotated q_pe back into q, and the impl normalises, rotates and caches kv in one launch
    (npu_kv_rmsnorm_rope_cache_v2) and rotates q_pe in one more (npu_interleave_rope). The
    norm's weight stays registered under the model's own attention module, so checkpoints
    load as before."""
    wrapped(*args, **kwargs)
    impl = instance.mla_attn.impl
    # fuse_qkv_rmsnorm (0.30+, a declared signature) reads kv_a_layernorm's weight itself.
    fused_norms = inspect.signature(wrapped).bind(*args, **kwargs).arguments.get(
        "fuse_qkv_rmsnorm", False)
    if isinstance(impl, AscendMLAImpl) and impl.fuses_kv_rope(instance, fused_norms):
        impl.kv_norm, impl.rope = instance.kv_a_layernorm, instance.rotary_emb
        instance.kv_a_layernorm = torch.nn.Identity()
        instance.rotary_emb = None

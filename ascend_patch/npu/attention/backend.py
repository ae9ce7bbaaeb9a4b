"""The Ascend attention backend: paged KV cache, mixed prefill/decode batches, chunked
prefill and prefix caching, sliding windows and logit soft-capping, on the kernel seam.

Per step and layer, ``forward`` writes the new K/V into the paged cache
(``npu_scatter_pa_kv_cache``) and then runs one attention launch:

- a batch of single-token queries (pure decode): ``_npu_paged_attention``; in a layer
  with a sliding window, ``npu_fused_infer_attention_score`` in BSH layout over the
  paged cache with a (batch, KV) mask that hides the keys before each window (the op
  ignores ``sparse_mode`` and ``pre_tokens`` for single-token queries, and
  ``_npu_paged_attention`` takes no mask);
- anything else (prefill, chunked prefill behind a cached prefix, mixed):
  ``npu_fused_infer_attention_score`` in TND layout with cumulative host query
  lengths, per-sequence host KV lengths, an int32 block table and the causal
  ``sparse_mode=3`` mask; in a windowed layer the band ``sparse_mode=4`` with
  ``pre_tokens = window - 1``, ``next_tokens = 0`` on the same mask.

What no fused kernel takes runs *composed* attention over the same cache and metadata:
the gather/matmul/softmax of standard torch ops, which the NPU runs as generic kernels
(several launches, not one). That is every layer of an fp32 model (the kernels take
fp16/bf16 only), every layer with soft-capped attention logits (Gemma 2: the kernels
have no soft-cap input), and the prefill of head sizes the TND kernel rejects (it takes
64 and 128 over a paged cache); decode of those head sizes still runs fused
(``_npu_paged_attention`` takes head sizes up to 576). The model runner logs once per
model which layers run composed and why (:func:`report_attention_paths`); which path a layer
takes, and the kernel limits that decide it, are :mod:`ascend_patch.npu.attention.paths`.

Windowed layers get vLLM's ``SlidingWindowManager``: in a uniformly windowed model their one
KV-cache group, beside full-attention layers (the hybrid KV-cache manager) a group per layer of
the model's pattern, each with its own block table and builder. It frees the blocks wholly before
the window (other requests, or other groups, may reuse them; the V1 block table keeps their ids)
and a prefix-cache hit puts the null block in their place: every path hides those keys (the
band, the window mask, the composed ``pre_tokens``), so their contents never reach the output.
Layers of different groups may share one KV tensor, a block id belonging to one group at a
time; each builder keeps its own kernel block table and slots.

KV cache: each layer's cache is ``[num_blocks, 2, block_size, num_kv_heads, head_size]``
(block-outermost, each page its K half then its V half), the layout vLLM's KV connectors and
offloading read; the kernels get it as two contiguous ND caches over doubled block ids
(:func:`ascend_patch.npu.attention.kv_layout.kernel_caches`). vLLM 0.20–0.28 shape it from
``get_kv_cache_shape``; from 0.29 :mod:`ascend_patch.npu.runner.kv_allocation` carves it out of vLLM's
single allocation.

Graphs: FULL graphs hold uniform single-token decode batches of models whose every layer
decodes on ``_npu_paged_attention`` or, in windowed layers, on the masked one-token FIA
(launched in its ``.out`` form with a workspace sized at capture in engines with FULL graphs),
their host KV lengths re-issued on every replay through :func:`acl_graph.launch`. With
speculative decoding they also hold uniform verification batches (1 + k ≤ 16 query tokens per
request, the builder reporting ``UNIFORM_BATCH``) at the TND head sizes: the TND FIA (causal,
or the band in windowed layers) in its ``.out`` form, its host query ends and KV lengths re-issued on
every replay (:func:`~ascend_patch.npu.attention.paths.verify_graph_refusal` says where not). The
KV lengths are exact there: with speculative decoding the builder reads vLLM's device lengths
(one copy per build), never the optimistic host upper bound. Composed
attention (fp32, soft-capped logits) refuses to run inside a capture. Prefill and mixed batches (FIA, with host query and
KV lengths) stay outside graphs: eager, or between PIECEWISE graphs. A FULL graph's batch
is padded to its capture size; its padded requests get one token each (1 + k with
speculative decoding) over vLLM's null block (block 0), and every token without a slot
(padding, dummy runs) writes its K/V into a slot of that block.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass, field

import torch
from vllm.v1.attention.backend import (
    AttentionCGSupport,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)

from ascend_patch.npu import kernels
from ascend_patch.npu.attention import kv_layout as kv_cache_layout
from ascend_patch.npu.attention.base import AscendBackend, AscendImpl, causal_mask
from ascend_patch.npu.attention.paths import (
    FUSED_DTYPES,
    KERNEL_BLOCK_SIZE,
    AttentionPaths,
    choose_paths,
    graph_decode_refusal,
    speculative_rows,
    verify_graph_refusal,
)
from ascend_patch.npu.compilation import acl_graph
from ascend_patch.npu.kernels import composed, limits

logger = logging.getLogger("vllm.ascend_patch")


class AscendAttentionBackend(AscendBackend):
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
        # vLLM 0.29+. Layer-outermost: each layer owns one dense region of block pages,
        # which kv_cache.py re-views as each page's K half then V half.
        from vllm.v1.kv_cache_layout import KVCacheLayout

        return (KVCacheLayout.LBNHC,)

    @classmethod
    def kv_block_shape(cls, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        # K half then V half of each block (kv_layout.py).
        return (2, block_size, num_kv_heads, head_size)

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
    device_seq_lens: torch.Tensor
    """``seq_lens`` on the device, for the window masks."""
    block_table: torch.Tensor
    """[num_seqs, max_blocks] int32, in kernel blocks (vLLM's ids; the kernels read
    :attr:`kernel_block_table`)."""
    slot_mapping: torch.Tensor
    """vLLM's slots, -1 for a token without one (padding, dummy runs)."""
    max_query_len: int
    key_positions: torch.Tensor
    """0 .. block_table columns × KERNEL_BLOCK_SIZE - 1 on the device (built once)."""
    kv_slots: torch.Tensor | None = None
    """The step's KV-cache slots in :func:`~ascend_patch.npu.attention.kv_layout.kernel_caches`, the
    missing ones in a slot of the null block each (built once per step by the builder, for every
    layer); None in a dummy pass wider than the null block, which writes no KV."""
    kernel_block_table: torch.Tensor | None = None
    """:attr:`block_table` in :func:`~ascend_patch.npu.attention.kv_layout.kernel_caches`' block ids (built
    like :attr:`kv_slots`)."""
    verification: bool = False
    """Speculative verification rows: every request has 1 + k query tokens."""
    _window_masks: dict = field(default_factory=dict, repr=False)

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1

    def window_mask(self, window: int) -> torch.Tensor:
        """[num_seqs, key_positions] bool, True for the keys before each sequence's last
        ``window``: built once per step and window (two launches), shared by the layers."""
        mask = self._window_masks.get(window)
        if mask is None:
            first_visible = self.device_seq_lens - window
            mask = self._window_masks[window] = self.key_positions < first_visible[:, None]
        return mask


_dummy_forward = False


@contextlib.contextmanager
def dummy_forward():
    """A runner's dummy forward pass (sampler warm-up, an idle data-parallel rank): its tokens
    have no KV to keep. Model Runner V2 builds attention metadata for them with every slot PAD,
    which the builder sends to the null block's slots; a pass with more tokens than the null block
    has slots writes no KV at all (npu_scatter_pa_kv_cache refuses a slot given twice)."""
    global _dummy_forward
    previous, _dummy_forward = _dummy_forward, True
    try:
        yield
    finally:
        _dummy_forward = previous


class AscendMetadataBuilder(AttentionMetadataBuilder[AscendMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.device = device
        self._key_positions = torch.empty(0, dtype=torch.int64, device=device)
        # Slot i of the null block for token i (block 0, which vLLM never hands to a request). A
        # KV-cache block longer than a kernel block spans several kernel blocks, and the spec vLLM
        # hands the builder then has the kernel block's size.
        tokens = vllm_config.scheduler_config.max_num_batched_tokens
        self._null_block_size = max(kv_cache_spec.block_size, vllm_config.cache_config.block_size)
        self._null_slots = torch.arange(tokens, device=device) % self._null_block_size
        # ... and where the K|V page kernels find them (kv_layout.kernel_slots).
        self._null_kv_slots = kv_cache_layout.kernel_slots(self._null_slots, KERNEL_BLOCK_SIZE)
        # The kernels' slots and block table, rebuilt in place every step: a FULL graph's captured
        # kernels read them where the capture found them.
        self._kv_slots = torch.empty(tokens, dtype=torch.int64, device=device)
        self._kernel_block_table = torch.empty(0, 0, dtype=torch.int32, device=device)
        self._max_seqs = vllm_config.scheduler_config.max_num_seqs
        # With speculative decoding vLLM's host KV lengths are not exact: async scheduling
        # counts every draft as accepted, and the drafter lengthens queries on the device only
        # (spec_decode/utils.py extend_all_queries_by_N).
        self._host_lengths_exact = vllm_config.speculative_config is None
        spec = vllm_config.speculative_config
        self._verify_rows = speculative_rows(spec) if spec is not None else None

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        # FULL graphs for single-token decode batches on the decode kernels with a replay update
        # and, with speculative decoding, for uniform verification rows on the TND FIA .out form
        # (see the module docstring); every other path bakes host data or refuses to run inside
        # a capture.
        if graph_decode_refusal(vllm_config.model_config, kv_cache_spec.head_size) is not None:
            return AttentionCGSupport.NEVER
        if (vllm_config.speculative_config is not None
                and verify_graph_refusal(vllm_config, kv_cache_spec.head_size) is None):
            return AttentionCGSupport.UNIFORM_BATCH
        return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def _positions(self, width: int) -> torch.Tensor:
        if self._key_positions.numel() != width:  # the block table's width is fixed: once
            self._key_positions = torch.arange(width, device=self.device)
        return self._key_positions

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> AscendMetadata:
        """The step's batch and, once for every layer, the kernels' KV slots and block table."""
        batch = self.describe_batch(common_attn_metadata)
        n, slots = batch.num_tokens, batch.slot_mapping
        kv_slots = torch.where(slots < 0, self._null_kv_slots[:n],
                               kv_cache_layout.kernel_slots(slots, KERNEL_BLOCK_SIZE),
                               out=self._kv_slots[:n])
        table = kv_cache_layout.kernel_block_table(
            batch.block_table, out=self._table_rows(*batch.block_table.shape))
        if self.writes_no_kv(n):
            kv_slots = None
        return dataclasses.replace(batch, kv_slots=kv_slots, kernel_block_table=table)

    def writes_no_kv(self, num_tokens: int) -> bool:
        """A dummy pass with more slotless tokens than the null block has slots writes no KV:
        its write would hit some slot twice, which the NPU's cache writes refuse."""
        return _dummy_forward and num_tokens > self._null_block_size

    def _table_rows(self, rows: int, width: int) -> torch.Tensor:
        buffer = self._kernel_block_table
        if buffer.shape[1] != width or buffer.shape[0] < rows:  # fixed width, <= max_num_seqs rows: once
            buffer = self._kernel_block_table = torch.empty(
                max(rows, self._max_seqs), width, dtype=torch.int32, device=self.device)
        return buffer[:rows]

    def describe_batch(self, common_attn_metadata: CommonAttentionMetadata) -> AscendMetadata:
        """The step's batch on the host and vLLM's device tensors, without the kernels' views."""
        meta = common_attn_metadata
        num_seqs = meta.num_reqs
        query_ends = meta.query_start_loc_cpu[1 : num_seqs + 1].tolist()
        # vLLM's host copy of the KV lengths where it is exact; otherwise one device-to-host copy.
        host_seq_lens = meta.seq_lens_cpu_upper_bound if self._host_lengths_exact else None
        if host_seq_lens is None:
            host_seq_lens = meta.seq_lens.cpu()
        seq_lens = host_seq_lens[:num_seqs].to(torch.int32)
        num_tokens = meta.num_actual_tokens
        padding = num_seqs - 1 - query_ends.index(query_ends[-1]) if query_ends else 0
        if padding:
            # A FULL graph's padded batch: its last requests have no token. Each gets as many as
            # the uniform batch's requests (one, or 1 + k verification rows), attending to that
            # many null-block slots, so the batch has the captured shape.
            real = num_seqs - padding
            last = query_ends[real - 1]
            rows = max(1, (num_tokens - last) // padding)
            query_ends[real:] = range(last + rows, last + rows * padding + 1, rows)
            seq_lens[real:] = rows
        if query_ends and query_ends[-1] != num_tokens:
            raise NotImplementedError(
                f"a padded batch of {num_tokens} tokens for {num_seqs} requests ending at "
                f"{query_ends[-1]}: the Ascend backend pads uniform decode batches only")
        starts = [0, *query_ends[:-1]]
        widths = {end - start for start, end in zip(starts, query_ends)}
        verification = (self._verify_rows is not None and len(widths) == 1
                        and widths.pop() in self._verify_rows)
        block_table = meta.block_table_tensor[:num_seqs]
        if block_table.dtype != torch.int32:
            block_table = block_table.to(torch.int32)
        return AscendMetadata(
            num_tokens=num_tokens,
            query_ends=query_ends,
            seq_lens=seq_lens.tolist(),
            context_lens=seq_lens,
            device_seq_lens=meta.seq_lens[:num_seqs],
            block_table=block_table,
            slot_mapping=meta.slot_mapping[:num_tokens],
            max_query_len=meta.max_query_len,
            key_positions=self._positions(block_table.shape[1] * KERNEL_BLOCK_SIZE),
            verification=verification,
        )


class AscendAttentionImpl(AscendImpl[AscendMetadata]):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._paths: dict[torch.dtype, AttentionPaths] = {}
        # In an engine with FULL graphs the windowed decode launches FIA's .out form, whose
        # workspace is sized at capture and whose host lengths every replay re-issues.
        self._graph_decode = acl_graph.full_graphs_configured()

    def paths(self, dtype: torch.dtype) -> AttentionPaths:
        """The kernels that serve this layer for a model in ``dtype``."""
        paths = self._paths.get(dtype)
        if paths is None:
            paths = self._paths[dtype] = choose_paths(dtype, self.head_size, self.num_kv_heads,
                                                      self.sliding_window, self.soft_cap)
        return paths

    def attend(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               kv_cache: torch.Tensor, meta: AscendMetadata, output: torch.Tensor) -> None:
        n = meta.num_tokens
        key_cache, value_cache = kv_cache_layout.kernel_caches(kv_cache)
        if self.kv_sharing_target_layer_name is None and key is not None and meta.kv_slots is not None:
            kernels.scatter_pa_kv_cache(
                key[:n].contiguous(),
                value[:n].contiguous(),
                key_cache,
                value_cache,
                meta.kv_slots,
            )
        query = query[:n]
        out = output[:n]
        paths = self.paths(query.dtype)
        path = paths.decode if meta.decode_only else paths.prefill
        if path == "paged_attention":
            self._paged_attention(layer.layer_name, query.contiguous(), key_cache, value_cache, meta, out)
            return
        if path == "fused_masked" and self._graph_decode:
            self._windowed_decode(layer.layer_name, query.contiguous(), key_cache, value_cache,
                                  meta, out)
            return
        if path == "fused" and meta.verification and self._graph_decode:
            self._verification(layer.layer_name, query.contiguous(), key_cache, value_cache,
                               meta, out)
            return
        if acl_graph.capturing():  # FULL graphs hold decode batches of the kernels above only
            raise RuntimeError(f"{path} attention inside a graph capture: its host query/KV lengths "
                               "would be replayed unchanged")
        if path == "composed":
            _composed(query, key_cache, value_cache, meta, self.scale, out,
                      self._pre_tokens(), self.soft_cap)
        elif path == "fused_masked":  # one-token BSH queries, the window as a mask
            self._fused_attention(
                query.contiguous().view(n, 1, -1), key_cache, value_cache, meta, out,
                atten_mask=meta.window_mask(self.sliding_window), input_layout="BSH",
            )
        else:
            self._fused_attention(
                query.contiguous(), key_cache, value_cache, meta, out,
                atten_mask=causal_mask(query.device), actual_seq_lengths=meta.query_ends,
                input_layout="TND", **self._band(),
            )

    def _paged_attention(self, layer_name, query, key_cache, value_cache, meta: AscendMetadata,
                         out) -> None:
        # Its context lengths are host data: a graph replay must be handed the step's. The kernel
        # block table is the builder's persistent buffer, rebuilt before every step, so a task
        # update re-issues only the kernel.
        args = (query, key_cache, value_cache, self.num_kv_heads, self.num_heads, self.scale,
                meta.kernel_block_table)

        def issue(params: AscendMetadata, workspace) -> None:
            kernels.paged_attention(*args, params.context_lens, out, workspace=workspace)

        def workspace(params: AscendMetadata):
            return kernels.paged_attention_workspace(*args, params.context_lens, out)

        acl_graph.launch(layer_name, meta, issue, workspace)

    def _windowed_decode(self, layer_name, query, key_cache, value_cache, meta: AscendMetadata,
                         out) -> None:
        """The masked one-token BSH FIA. Its mask is computed on the device from vLLM's device
        sequence lengths (captured with the step); the host KV lengths move every replay."""
        n = query.shape[0]
        self._fia_out(layer_name, "fused_infer_attention_score_decode", query.view(n, 1, -1),
                      key_cache, value_cache, meta, out.view(n, 1, -1),
                      lambda params: dict(actual_seq_lengths_kv=params.seq_lens),
                      atten_mask=meta.window_mask(self.sliding_window))

    def _verification(self, layer_name, query, key_cache, value_cache, meta: AscendMetadata,
                      out) -> None:
        """Speculative verification rows (1 + k per request) on the TND FIA, causal or in a
        windowed layer the band. Its host query ends are fixed by the captured shape, its host KV
        lengths move every replay."""
        self._fia_out(layer_name, "fused_infer_attention_score_verify", query, key_cache,
                      value_cache, meta, out,
                      lambda params: dict(actual_seq_lengths=params.query_ends,
                                          actual_seq_lengths_kv=params.seq_lens),
                      atten_mask=causal_mask(query.device), **self._band())

    def _fia_out(self, layer_name, op: str, query, key_cache, value_cache, meta: AscendMetadata,
                 out, lengths, **call) -> None:
        """The seam's FIA ``.out`` form ``op`` written into ``out``, launched through
        :func:`acl_graph.launch` with its ``op + "_workspace"`` twin: ``lengths(params)``, the
        host lengths, are re-issued on every replay; the block table is the builder's persistent
        buffer."""
        num_blocks, block_size = key_cache.shape[:2]
        args = (query, key_cache.view(num_blocks, block_size, -1),
                value_cache.view(num_blocks, block_size, -1))
        call.update(block_table=meta.kernel_block_table, num_heads=self.num_heads,
                    num_key_value_heads=self.num_kv_heads, scale=self.scale, block_size=block_size)
        lse = torch.empty(0, dtype=torch.float32, device=query.device)  # no softmax_lse_flag

        def issue(params: AscendMetadata, workspace) -> None:
            getattr(kernels, op)(*args, **lengths(params), **call, attention_out=out,
                                 softmax_lse=lse, workspace=workspace)

        def workspace(params: AscendMetadata):
            return getattr(kernels, f"{op}_workspace")(*args, **lengths(params), **call)

        acl_graph.launch(layer_name, meta, issue, workspace)

    def _band(self) -> dict:
        """The TND mask mode: causal, or in a windowed layer the band of the window."""
        if self.sliding_window is None:
            return {"sparse_mode": 3}
        return {"sparse_mode": 4, "pre_tokens": self._pre_tokens(), "next_tokens": 0}

    def _pre_tokens(self) -> int | None:
        """The band's reach before each query in a windowed layer: ``window - 1``.

        vLLM's window of W keys is the query's own key and the W - 1 before it (its FlashAttention
        backends pass ``window_size=(W - 1, 0)``; HF's ``sliding_window`` means the same). The
        op's band, anchored at the bottom right, lets the query on diagonal d see keys
        ``d - pre_tokens ... d + next_tokens``: npu_fusion_attention's doc builds the band of
        ``sparse_mode=4`` as the mask ``triu(ones, next + 1) + tril(ones, -pre - 1)``, and FIA's
        doc calls ``pre_tokens`` the earlier tokens a query attends to ("需要和前几个Token计算关联")
        and cuts rows only for ``pre_tokens < 0``, so ``pre_tokens = 0`` leaves the query itself.
        vllm-ascend passes W, one key more than the model's window.
        """
        return None if self.sliding_window is None else self.sliding_window - 1

    def _fused_attention(self, query, key_cache, value_cache, meta: AscendMetadata, out,
                         **call) -> None:
        """One npu_fused_infer_attention_score over the paged cache (BnBsH) into ``out``."""
        num_blocks, block_size = key_cache.shape[:2]
        attn, _ = kernels.fused_infer_attention_score(
            query,
            key_cache.view(num_blocks, block_size, -1),
            value_cache.view(num_blocks, block_size, -1),
            block_table=meta.kernel_block_table,
            actual_seq_lengths_kv=meta.seq_lens,
            num_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            scale=self.scale,
            block_size=block_size,
            **call,
        )
        out.copy_(attn.view(out.shape))


def _composed(query, key_cache, value_cache, meta: AscendMetadata, scale, out, pre_tokens,
              soft_cap) -> None:
    """Causal attention over the paged cache with standard torch ops: every single-token query
    in one batched call, each longer one on its own, query row i seeing keys up to position
    kv_len - q_len + i and, in a windowed layer, no more than pre_tokens before it."""
    starts = [0, *meta.query_ends[:-1]]
    lengths = [end - start for start, end in zip(starts, meta.query_ends)]
    block_table = meta.kernel_block_table
    decodes = [i for i, n in enumerate(lengths) if n == 1]
    if decodes:
        rows = torch.tensor([starts[i] for i in decodes], device=query.device)
        out[rows] = composed.decode_batch(query[rows], key_cache, value_cache, block_table[decodes],
                                       [meta.seq_lens[i] for i in decodes], scale,
                                       pre_tokens=pre_tokens, soft_cap=soft_cap)
    for i, n in enumerate(lengths):
        if n > 1:
            keys, values = composed.gather_sequence(key_cache, value_cache, block_table[i], meta.seq_lens[i])
            rows = slice(starts[i], starts[i] + n)
            out[rows] = composed.attend(query[rows], keys, values, scale, pre_tokens=pre_tokens,
                                     next_tokens=0, soft_cap=soft_cap)


def report_attention_paths(layers: dict, dtype: torch.dtype, model: str) -> None:
    """Log once per model which attention layers run composed, in which steps and why: one
    line per reason, a warning where a fused kernel would serve the same model in fp16/bf16.

    ``layers`` maps layer names to vLLM attention layers (vLLM's static forward context)."""
    groups: dict[tuple[str, str], list[str]] = {}
    total = 0
    for name, layer in layers.items():
        impl = getattr(layer, "impl", None)  # not a seam: not every layer attends
        if isinstance(impl, AscendAttentionImpl):
            total += 1
            paths = impl.paths(dtype)
            if paths.why is not None:
                groups.setdefault((paths.why, paths.composed_steps()), []).append(name)
    for (why, steps), names in groups.items():
        which = f"all {total} attention layers" if len(names) == total else ", ".join(names)
        log = logger.info if dtype not in FUSED_DTYPES else logger.warning
        log("ascend-patch: %s: %s run composed attention (standard torch ops, not one fused "
            "kernel) for %s: %s", model, which, steps, why)

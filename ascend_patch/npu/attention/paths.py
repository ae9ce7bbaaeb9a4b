"""Which kernels serve an attention layer's steps, decided from the kernels' documented limits
(:mod:`ascend_patch.npu.kernels.limits`, which the reference kernels enforce too).

A layer's prefill (prefill, chunked and mixed batches) runs ``npu_fused_infer_attention_score``
in TND layout ("fused") or composed attention; its decode-only batches run
``_npu_paged_attention``, the BSH form of ``npu_fused_infer_attention_score`` with the window as a
mask ("fused_masked"), or composed attention. What no fused kernel takes runs composed: every
layer of an fp32 model, every layer with soft-capped logits, and the head sizes a kernel rejects.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ascend_patch.npu.kernels import limits

# Block sizes the fused kernels accept for queries longer than one token
# (npu_fused_infer_attention_score PageAttention rule: a multiple of 128 in [128, 512]).
KERNEL_BLOCK_SIZE = limits.FIA_PREFILL_BLOCK_ALIGN
FUSED_DTYPES = (torch.float16, torch.bfloat16)
# npu_fused_infer_attention_score TND over a paged cache takes 64 and 128 ([FIA-TILING], [FIA-V2]).
FIA_TND_HEAD_SIZES = limits.FIA_TND_PAGED_HEAD_SIZES


def graph_decode_refusal(model_config, head_size: int) -> str | None:
    """Why not every layer's decode can be held in a FULL graph, or None. The decode kernels with
    a replay update of their host lengths: ``_npu_paged_attention`` (layers without a window),
    the one-token BSH ``npu_fused_infer_attention_score`` with the window as a mask (windowed
    layers), FIA's MLA form (MLA models: :func:`mla_graph_decode_refusal`). Composed attention
    (fp32, soft-capped logits, head sizes no kernel takes) turns host lengths into new tensors
    every step and cannot be captured."""
    if model_config.use_mla:
        return mla_graph_decode_refusal(model_config.dtype, model_config.hf_text_config)
    window = None if model_config.disable_sliding_window else model_config.get_sliding_window()
    hf = model_config.hf_text_config
    # attn_logit_softcapping: what vLLM's soft-capped models (Gemma 2) pass their layers
    soft_cap = getattr(hf, "attn_logit_softcapping", None)  # not a seam: HF
    kv_heads = getattr(hf, "num_key_value_heads", None) or 1  # not a seam: HF
    kinds = [("global", None)] + ([("windowed", window)] if window is not None else [])
    composed = [(kind, paths) for kind, layer_window in kinds
                if (paths := choose_paths(model_config.dtype, head_size, kv_heads, layer_window,
                                          soft_cap or None)).decode == "composed"]
    if composed:  # which layers (a windowed model may have global layers too) and why
        which = " and ".join(kind for kind, _ in composed) if window is not None else "all"
        return (f"{composed[0][1].why}: its {which} layers decode on composed attention "
                "(standard torch ops, host lengths made into tensors every step)")
    return None


def speculative_rows(spec) -> tuple[int, ...]:
    """Query tokens per request of the uniform batches speculative decoding runs, which FULL
    graphs hold: 1 + k verification rows (an EAGLE or MTP drafter's prefill runs over the same),
    and 2 + k for a draft model's prefill, which adds a correction token per request (Model
    Runner V2 captures it in graphs of its own)."""
    rows = 1 + spec.num_speculative_tokens
    return (rows, rows + 1) if spec.method == "draft_model" else (rows,)


def verify_graph_refusal(vllm_config, head_size: int) -> str | None:
    """Why FULL graphs cannot hold this engine's speculative verification rows (1 + k queries per
    request, uniform; :func:`speculative_rows`), or None: they run on the TND
    ``npu_fused_infer_attention_score`` with the causal mask (the band in windowed layers) in its
    ``.out`` form, whose host query and KV lengths every replay re-issues, at the head sizes and
    dtypes its paged TND form takes, for at most 16 rows per request; in MLA models on the op's
    MLA form (BNSD, causal), where its decode runs (:func:`mla_graph_decode_refusal`), for at
    most 16 rows per request. None also without speculative decoding."""
    spec = vllm_config.speculative_config
    if spec is None:
        return None
    model_config = vllm_config.model_config
    rows = max(speculative_rows(spec))
    if model_config.use_mla:  # FIA's MLA form, causal over 1 + k absorbed queries (BNSD)
        refusal = mla_graph_decode_refusal(model_config.dtype, model_config.hf_text_config)
        if refusal is None and rows > limits.FIA_ROPE_MAX_QUERY:
            refusal = (f"{rows} verification rows per request: npu_fused_infer_attention_score's "
                       f"MLA form takes at most {limits.FIA_ROPE_MAX_QUERY} query tokens per "
                       "sequence (1 + num_speculative_tokens, one more for a draft model)")
        return refusal
    if rows > limits.FIA_VERIFY_MAX_QUERY:
        return (f"{rows} verification rows per request: the TND npu_fused_infer_attention_score "
                f"takes at most {limits.FIA_VERIFY_MAX_QUERY} (1 + num_speculative_tokens, one more "
                "for a draft model)")
    hf = model_config.hf_text_config
    soft_cap = getattr(hf, "attn_logit_softcapping", None)  # not a seam: HF
    kv_heads = getattr(hf, "num_key_value_heads", None) or 1  # not a seam: HF
    paths = choose_paths(model_config.dtype, head_size, kv_heads, None, soft_cap or None)
    if paths.prefill != "fused":
        return f"{paths.why}: verification rows run composed attention"
    return None


def mla_graph_decode_refusal(dtype: torch.dtype, hf_config) -> str | None:
    """Why an MLA model's decode does not run on ``npu_fused_infer_attention_score``'s MLA form
    (the one MLA decode with a replay update), or None: it takes fp16/bf16, latent 512, rope 64,
    and 32, 64 or 128 query heads (fewer are zero-padded)."""
    rank = getattr(hf_config, "kv_lora_rank", None)  # not a seam: HF (DeepSeek-style configs)
    rope = getattr(hf_config, "qk_rope_head_dim", None)  # not a seam: HF
    heads = getattr(hf_config, "num_attention_heads", 0)  # not a seam: HF
    if dtype not in FUSED_DTYPES:
        return f"{str(dtype).removeprefix('torch.')} MLA decodes on composed attention"
    if (rank, rope) != (limits.LATENT_DIM, limits.ROPE_DIM) or heads > max(limits.FIA_ROPE_HEADS):
        return (f"MLA kv_lora_rank {rank}, qk_rope_head_dim {rope}, {heads} heads: "
                "npu_fused_infer_attention_score's MLA form takes 512, 64 and at most "
                f"{max(limits.FIA_ROPE_HEADS)} heads")
    return None


@dataclass(frozen=True)
class AttentionPaths:
    """What serves a layer's steps: ``prefill`` (prefill, chunked and mixed batches) is
    "fused" or "composed"; ``decode`` (decode-only batches) is "paged_attention",
    "fused_masked" or "composed"; ``why`` says what forces the composed path, if anything."""

    prefill: str
    decode: str
    why: str | None = None

    def composed_steps(self) -> str:
        if self.prefill == self.decode == "composed":
            return "every step"
        if self.prefill == "composed":
            return "prefill and mixed batches (decode-only batches stay fused)"
        return "decode-only batches"


def choose_paths(dtype: torch.dtype, head_size: int, num_kv_heads: int,
                 sliding_window: int | None, soft_cap: float | None) -> AttentionPaths:
    """The kernels that serve a layer of these dimensions for a model in ``dtype``."""
    if dtype not in FUSED_DTYPES:
        name = str(dtype).removeprefix("torch.")
        return AttentionPaths("composed", "composed",
                              f"{name}: the fused attention kernels take fp16/bf16 only")
    if soft_cap is not None:
        return AttentionPaths("composed", "composed",
                              f"logits soft-cap {soft_cap:g}: the fused attention "
                              f"kernels have no soft-cap input")
    size = head_size
    prefill = "fused" if size in FIA_TND_HEAD_SIZES else "composed"
    if sliding_window is None:
        decode = "paged_attention" if size <= limits.PA_MAX_HEAD_SIZE else "composed"
    else:
        aligned = (size * dtype.itemsize % limits.FIA_HEAD_ALIGN_BYTES == 0
                   and num_kv_heads * size <= limits.FIA_MAX_KV_HIDDEN)
        decode = ("fused_masked" if size <= limits.FIA_DECODE_MAX_HEAD_SIZE and aligned
                  else "composed")
    reasons = []
    if prefill == "composed":
        reasons.append("npu_fused_infer_attention_score over a paged cache (TND) takes "
                       + " and ".join(map(str, FIA_TND_HEAD_SIZES)))
    if decode == "composed" and sliding_window is None:
        reasons.append(f"_npu_paged_attention takes at most {limits.PA_MAX_HEAD_SIZE}")
    elif decode == "composed":
        reasons.append("npu_fused_infer_attention_score for one-token queries takes at most "
                       f"{limits.FIA_DECODE_MAX_HEAD_SIZE}, {limits.FIA_HEAD_ALIGN_BYTES}-byte "
                       "aligned")
    why = f"head size {size}: {'; '.join(reasons)}" if reasons else None
    return AttentionPaths(prefill, decode, why)


def refuse_unsupported(subject: str, features: dict[str, bool], unknown: dict) -> None:
    """Refuse, in one line naming them all, the features an Ascend attention impl was given and
    cannot serve; ``unknown`` holds the keyword arguments a newer vLLM passes that it does not
    know (refused when set)."""
    features = {**features, **{name: value is not None for name, value in unknown.items()}}
    missing = [name for name, used in features.items() if used]
    if missing:
        raise NotImplementedError(f"{subject} does not support {', '.join(missing)}")


def check_config(vllm_config) -> None:
    """Refuse, in one line, a KV block size the NPU attention kernels cannot page."""
    cache = vllm_config.cache_config
    if cache is not None and cache.user_specified_block_size and cache.block_size % KERNEL_BLOCK_SIZE:
        raise ValueError(
            f"--block-size {cache.block_size} is not supported on Ascend: the NPU "
            f"attention kernels need a KV block size that is a multiple of "
            f"{KERNEL_BLOCK_SIZE} (npu_fused_infer_attention_score, paged). Use "
            f"--block-size {KERNEL_BLOCK_SIZE} or leave it unset"
        )

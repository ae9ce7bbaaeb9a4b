"""Graph-mode policy: which ACL graph mode and capture sizes a configuration gets on the NPU.

:func:`apply_defaults` runs before vLLM settles the compilation mode and the graph mode (eager
torch; FULL_DECODE_ONLY ACL graphs where they are proven, else off with the reason in one line);
:func:`check_config` runs after, and checks the mode vLLM settled on and keeps the capture sizes
the NPU can hold (:func:`settle_graph_mode`). The wrapper that captures and replays is
:mod:`.acl_graph`.

Docs: docs/graph-mode.md, "Graph mode (ACL graphs)".
"""

from __future__ import annotations

import logging
import os

from ascend_patch import release

logger = logging.getLogger("vllm.ascend_patch")

# The head sizes the graph suites replay against eager: Llama 64 (tests/test_graph.py), Mistral
# 128 and Gemma 3 256 (tests/test_graph_windowed.py); MLA models at their own dimensions.
GRAPH_PROVEN_HEAD_SIZES = (64, 128, 256)



def apply_defaults(vllm_config) -> None:
    """Before vLLM settles the compilation mode, the custom-op default and the graph mode from the
    optimization level: eager torch (every custom op dispatches to forward_oot, under
    torch.compile too: the seam's layer ops trace as torch ops), and FULL_DECODE_ONLY ACL graphs
    where they are proven."""
    from vllm.config import CompilationMode, CUDAGraphMode

    compilation = vllm_config.compilation_config
    if compilation.mode is None:
        compilation.mode = CompilationMode.NONE
    passes = compilation.pass_config
    for name in ("fuse_norm_quant", "fuse_act_quant", "fuse_attn_quant"):
        # vLLM turns these on with the RMSNorm/SiluAndMul custom ops (or a quantized model)
        # under torch.compile, but its pass manager imports them on CUDA/ROCm/XPU only.
        if getattr(passes, name) is None:
            setattr(passes, name, False)
    if compilation.cudagraph_mode is None:
        off = vllm_config.optimization_level == 0 or graphs_off_by_default(vllm_config)
        compilation.cudagraph_mode = CUDAGraphMode.NONE if off else CUDAGraphMode.FULL_DECODE_ONLY
        if isinstance(off, str):  # not -O0's choice: say why (vLLM's capture warning does not)
            logger.info("ascend-patch: ACL graph mode is off by default: %s", off)


def check_config(vllm_config) -> None:
    """After vLLM settled it: a compilation mode the NPU path runs, and the graph mode and capture
    sizes it can hold."""
    from vllm.config import CompilationMode

    compilation = vllm_config.compilation_config
    if compilation.mode not in (CompilationMode.NONE, CompilationMode.VLLM_COMPILE):
        logger.warning("ascend-patch: compilation mode %s is not supported on Ascend; running "
                       "without torch.compile", compilation.mode.name)
        compilation.mode = CompilationMode.NONE
    if vllm_config.model_config is not None:
        settle_graph_mode(vllm_config)
    if vllm_config.lora_config is not None:
        logger.info("ascend-patch: LoRA adapters with ACL graph mode %s",
                    compilation.cudagraph_mode.name)


def graphs_off_by_default(vllm_config) -> str | None:
    """Why graph mode stays off unless asked for, and how to ask where asking works; None where it
    is on: where this vLLM release's emulated end-to-end suite (or a hardware run) passed with it on
    (compat_matrix.yaml status), for models whose every layer decodes on a kernel with a replay
    update, at the dimensions that suite runs: the fused paged-attention kernel and, in windowed
    layers, the masked one-token FIA (fp16/bf16, head sizes 64, 128, 256, no soft-cap), or for MLA
    models FIA's MLA form (latent 512, rope 64). The fp32 composed attention reads host data into new tensors every step and cannot
    be captured. With speculative decoding the verification rows must be capturable too
    (:func:`~ascend_patch.npu.attention.paths.verify_graph_refusal`)."""
    import vllm

    from ascend_patch.npu.attention.paths import graph_decode_refusal, verify_graph_refusal
    from ascend_patch.npu.ops.recurrent_layers import recurrent_layers

    ask = "; ask for it with -cc.cudagraph_mode=FULL_DECODE_ONLY"
    model_config = vllm_config.model_config
    if model_config is None:
        return "no model configuration to check"
    if model_config.pooler_config is not None:
        # No decode steps to capture; vLLM 0.28 would also turn the default into PIECEWISE,
        # which needs torch.compile the NPU path does not run by default.
        return "a pooling model runs no decode steps"
    if recurrent_layers(model_config):
        return "recurrent layers run composed, reading sequence boundaries on the host"
    head_size = model_config.get_head_size()
    refusal = graph_decode_refusal(model_config, head_size)
    if refusal is not None:
        return f"{refusal}, which FULL ACL graphs cannot hold"
    verify = verify_graph_refusal(vllm_config, head_size)
    if verify is not None:
        return f"speculative decoding: {verify}"
    if not release.proven_end_to_end:
        return (f"vLLM {vllm.__version__} has not passed ascend-patch's end-to-end suite with graphs "
                f"(compat_matrix.yaml){ask}")
    if head_size not in GRAPH_PROVEN_HEAD_SIZES and not model_config.use_mla:
        return (f"head size {head_size}: the end-to-end suite proves graphs at head sizes "
                f"{', '.join(map(str, GRAPH_PROVEN_HEAD_SIZES))}{ask}")
    return None


def settle_graph_mode(vllm_config) -> None:
    """Check the graph mode vLLM settled on and choose the capture sizes the NPU can hold.

    Runs after vLLM has applied --enforce-eager (mode NONE) and its default capture sizes. Keeps
    sizes a FULL graph can pad (its padded tokens write their K/V into vLLM's null block, one
    slot each) and, of those, as many as the NPU's streams allow (vllm-ascend's budget), and says
    in one log line how many it kept and why.
    """
    from vllm.config import CUDAGraphMode

    from ascend_patch.npu.attention.paths import KERNEL_BLOCK_SIZE, verify_graph_refusal
    from ascend_patch.npu.compilation import acl_graph
    from ascend_patch.npu.ops.recurrent_layers import recurrent_layers

    compilation = vllm_config.compilation_config
    mode = compilation.cudagraph_mode
    if mode == CUDAGraphMode.NONE:
        return
    if os.environ.get("VLLM_USE_BREAKABLE_CUDAGRAPH", "0") not in ("", "0"):
        logger.warning("ascend-patch: breakable CUDA graphs are CUDA-only; running without graphs")
        compilation.cudagraph_mode = CUDAGraphMode.NONE
        return
    if os.environ.get("ASCEND_LAUNCH_BLOCKING") == "1":
        raise ValueError("ASCEND_LAUNCH_BLOCKING=1 cannot capture ACL graphs: unset it, or run with "
                         "--enforce-eager")
    if (mode.has_full_cudagraphs() and vllm_config.model_config is not None
            and recurrent_layers(vllm_config.model_config)):
        raise ValueError(f"{mode.name} ACL graphs are not supported for models with recurrent "
                         "layers (their composed path reads sequence boundaries on the host): "
                         "run with --enforce-eager or -cc.cudagraph_mode=NONE")
    verify = (verify_graph_refusal(vllm_config, vllm_config.model_config.get_head_size())
              if mode.has_full_cudagraphs() and vllm_config.speculative_config is not None
              else None)
    if verify is not None:
        # Where the builder cannot report UNIFORM_BATCH, vLLM would drop the graphs with no more
        # than a warning.
        raise ValueError(f"{mode.name} ACL graphs cannot hold speculative decoding here ({verify}): "
                         "run with --enforce-eager or "
                         "-cc.cudagraph_mode=NONE")
    full, piecewise = mode.has_full_cudagraphs(), mode.has_piecewise_cudagraphs()
    cache = vllm_config.cache_config  # its block size is the backend's unless given
    null_slots = cache.block_size if cache.user_specified_block_size else KERNEL_BLOCK_SIZE
    budget = acl_graph.capture_size_budget(vllm_config, piecewise=piecewise, full=full)
    if release.runner == "v2":
        _settle_request_keyed_sizes(vllm_config, null_slots, budget)
        return
    sizes = sorted(compilation.cudagraph_capture_sizes or [])
    kept, reasons = _kept_sizes(sizes, 1, full, null_slots, budget)
    logger.info("ascend-patch: ACL graphs (%s): capturing %d of %d sizes%s%s", mode.name, len(kept),
                len(sizes), f" up to {kept[-1]}" if kept else "",
                f" ({'; '.join(reasons)})" if reasons else f" ({budget.reason})")
    if not kept:
        compilation.cudagraph_mode = CUDAGraphMode.NONE
        return
    if kept != sizes:
        compilation.cudagraph_capture_sizes = kept
        compilation.max_cudagraph_capture_size = kept[-1]
        compilation.post_init_cudagraph_sizes()


def _kept_sizes(sizes: list[int], tokens_per_size: int, full: bool, null_slots: int,
                budget) -> tuple[list[int], list[str]]:
    """Of the ascending capture ``sizes`` (graphs of ``size * tokens_per_size`` tokens), those a
    FULL graph can pad (its padded tokens write their K/V into vLLM's null block, one slot each)
    and, of those, as many as the NPU's streams allow (vllm-ascend's budget); and why any went."""
    from ascend_patch.npu.compilation import acl_graph

    kept, reasons = sizes, []
    if full:
        kept = [size for size in kept if size * tokens_per_size <= null_slots]
        if len(kept) < len(sizes):
            reasons.append(f"FULL graphs pad at most {null_slots} tokens (one null-block slot each)")
    if len(kept) > budget.max_sizes:
        kept = acl_graph.sample_sizes(kept, budget.max_sizes)
        reasons.append(f"at most {budget.max_sizes} fit: {budget.reason}")
    return kept, reasons


def _settle_request_keyed_sizes(vllm_config, null_slots: int, budget) -> None:
    """Model Runner V2's capture sizes (vLLM 0.34+): it captures uniform decode batches by request
    count (``decode_cudagraph_capture_request_sizes``: n requests of q tokens, n * q tokens) and
    other batches by token count (``prefill_cudagraph_capture_token_sizes``), both resolved by vLLM
    before this hook; ``cudagraph_capture_sizes`` only records their token counts. Each list the
    mode captures keeps what :func:`_kept_sizes` keeps, by its graphs' mode."""
    from vllm.config import CUDAGraphMode

    compilation = vllm_config.compilation_config
    mode = compilation.cudagraph_mode
    query_len = vllm_config.uniform_decode_query_len
    decode_mode = mode.decode_mode() if mode.separate_routine() else CUDAGraphMode.NONE
    mixed_mode = mode.mixed_mode()
    decode = (sorted(compilation.decode_cudagraph_capture_request_sizes or [])
              if decode_mode != CUDAGraphMode.NONE else [])
    prefill = (sorted(compilation.prefill_cudagraph_capture_token_sizes or [])
               if mixed_mode != CUDAGraphMode.NONE else [])
    kept_decode, decode_reasons = _kept_sizes(decode, query_len, decode_mode == CUDAGraphMode.FULL,
                                              null_slots, budget)
    kept_prefill, prefill_reasons = _kept_sizes(prefill, 1, mixed_mode == CUDAGraphMode.FULL,
                                                null_slots, budget)
    reasons = list(dict.fromkeys(decode_reasons + prefill_reasons))
    lists = [f"{len(kept)} of {len(sizes)} {what}{f' up to {kept[-1]}' if kept else ''}"
             for kept, sizes, what in ((kept_decode, decode, "decode request counts"),
                                       (kept_prefill, prefill, "token sizes")) if sizes]
    logger.info("ascend-patch: ACL graphs (%s): capturing %s%s", mode.name,
                " and ".join(lists) or "no sizes",
                f" ({'; '.join(reasons)})" if reasons else f" ({budget.reason})")
    tokens = sorted({n * query_len for n in kept_decode} | set(kept_prefill))
    if not tokens:
        compilation.cudagraph_mode = CUDAGraphMode.NONE
        return
    if decode:
        compilation.decode_cudagraph_capture_request_sizes = kept_decode
        compilation.max_decode_cudagraph_capture_requests = max(kept_decode, default=0)
    if prefill:
        compilation.prefill_cudagraph_capture_token_sizes = kept_prefill
        compilation.max_prefill_cudagraph_capture_tokens = max(kept_prefill, default=0)
    # The record also counts the drafter's one-token decode graphs (their request counts), as vLLM
    # records them: a config resolved again (the draft model's) checks the record against it.
    tokens = sorted({*tokens, *vllm_config.get_draft_decode_cudagraph_request_sizes()})
    compilation.cudagraph_capture_sizes = tokens
    compilation.max_cudagraph_capture_size = tokens[-1]
    compilation.post_init_cudagraph_sizes()

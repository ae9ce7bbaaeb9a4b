"""``NPUPlatform``: what ``vllm.platforms.current_platform`` becomes.

Most of the overlay's work goes through vLLM's own platform hooks, which have
been stable from 0.20 to 0.33: the attention backend, the worker class, the
device communicator and the distributed backend are all chosen here.

There are two classes with one code path. :class:`NPUPlatform` drives real
Ascend devices through torch_npu. ``EmulatedNPUPlatform``
(:mod:`ascend_patch.npu.emulation.platform`) is the same platform on CPU tensors.
"""

from __future__ import annotations

import logging
import os

import torch
from vllm.platforms.interface import Platform, PlatformEnum

from ascend_patch import env, release
from ascend_patch.npu import device

logger = logging.getLogger("vllm.ascend_patch")

ATTENTION_BACKEND = "ascend_patch.npu.attention.backend.AscendAttentionBackend"
MLA_BACKEND = "ascend_patch.npu.attention.mla.AscendMLABackend"
ENCODER_ONLY_BACKEND = "ascend_patch.npu.attention.encoder.AscendEncoderOnlyBackend"
WORKER = "ascend_patch.npu.worker.NPUWorker"
COMMUNICATOR = "ascend_patch.npu.distributed.communicator.NPUCommunicator"
GRAPH_WRAPPER = "ascend_patch.npu.compilation.acl_graph.NPUGraphWrapper"
PUNICA_WRAPPER = "ascend_patch.npu.lora.punica.PunicaWrapperNPU"
EMULATED_PLATFORM = "ascend_patch.npu.emulation.platform.EmulatedNPUPlatform"


class NPUPlatform(Platform):
    _enum = PlatformEnum.OOT
    device_name = "npu"
    device_type = "npu"
    dispatch_key = "PrivateUse1"
    ray_device_key = "NPU"
    device_control_env_var = "ASCEND_RT_VISIBLE_DEVICES"
    ray_noset_device_env_vars = ["RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES"]
    dist_backend = "hccl"
    # No Inductor on the NPU path: torch.compile (PIECEWISE graphs, the simple fns) runs eager.
    simple_compile_backend = "eager"
    emulated = False
    kernel_backend = "npu"

    def __init__(self) -> None:
        from ascend_patch.npu import kernels

        # The NPU ops: torch_npu on hardware, the contract-checking references when emulated.
        # (The torch device-API overrides and the forced vLLM settings are patches in the
        # manifest, applied by the loader when it activates.)
        kernels.use(self.kernel_backend)

    @classmethod
    def runtime(cls) -> device.Runtime:
        return device.runtime(emulated=cls.emulated)

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None) -> str:
        config = attn_selector_config
        for feature in ("use_sparse", "has_sink"):
            if getattr(config, feature):
                raise NotImplementedError(
                    f"the Ascend attention backend does not support models that need "
                    f"{feature.removeprefix('use_').removeprefix('has_')} attention"
                )
        if config.use_mla:
            return MLA_BACKEND
        from vllm.v1.attention.backend import AttentionType

        if config.attn_type == AttentionType.ENCODER_ONLY:  # bidirectional, no KV cache
            return ENCODER_ONLY_BACKEND
        return ATTENTION_BACKEND

    @classmethod
    def get_mla_prefill_backend_cls(cls, mla_selector_config):
        # vLLM 0.32+ asks the platform (0.21–0.31: the selector replacement in the manifest).
        from ascend_patch.npu.attention.mla_prefill import AscendMLAPrefillBackend

        return AscendMLAPrefillBackend

    @classmethod
    def pre_register_and_update(cls, parser=None) -> None:
        # Before vLLM builds its config or parses --quantization: `ascend` must be known.
        from ascend_patch.npu import quantization

        quantization.register_config()

    @classmethod
    def apply_config_platform_defaults(cls, vllm_config) -> None:
        # Runs before vLLM settles the compilation mode, the custom-op default and the graph
        # mode from the optimization level: eager torch (every custom op dispatches to
        # forward_oot, under torch.compile too: the seam's layer ops trace as torch ops), and
        # FULL_DECODE_ONLY ACL graphs where they are proven.
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

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        from vllm.config import CompilationMode

        from ascend_patch.npu import distributed, quantization
        from ascend_patch.npu.attention.paths import KERNEL_BLOCK_SIZE
        from ascend_patch.npu.distributed import kv_transfer

        from ascend_patch.npu import spec_decode

        model = vllm_config.model_config
        spec_decode.config.check(vllm_config)
        unsupported = {
            # vLLM's FusedMoEWithLoRA wants a modular-kernel MoE method whose experts take its
            # LoRA context: the NPU experts do on 0.28+ (ascend_patch.npu.lora.moe), unquantized.
            "LoRA on a mixture-of-experts model (vLLM 0.20-0.27, or quantized)":
            vllm_config.lora_config is not None and model is not None and model.is_moe
            and (not moe_lora_release() or model.quantization is not None),
            # vLLM's fully sharded MoE LoRA gathers the rank-split shrink inside its Triton
            # path; the NPU experts' plain path does not.
            "fully sharded LoRA on a mixture-of-experts model with tensor parallelism":
            vllm_config.lora_config is not None and model is not None and model.is_moe
            and vllm_config.lora_config.fully_sharded_loras
            and vllm_config.parallel_config.tensor_parallel_size > 1,
            "expert-parallel load balancing (EPLB)": vllm_config.parallel_config.enable_eplb,
        }
        for feature, requested in unsupported.items():
            if requested:
                raise NotImplementedError(f"{feature} is not supported by ascend-patch yet")
        recurrent = model and recurrent_layers(model)
        if recurrent:
            refusal = recurrent_refusal(vllm_config, recurrent)
            if refusal:
                raise NotImplementedError(f"{model.model}: {refusal}")
            logger.warning("ascend-patch: %s: %s", model.model, served_layers(model))

        if model is not None and model.use_mla:
            from ascend_patch.npu.attention import mla

            mla.check_config(vllm_config)

        quantization.register_config()  # a VllmConfig built without EngineArgs skips the hook
        quantization.detect(vllm_config)
        kv_transfer.check_config(vllm_config, emulated=cls.emulated)
        distributed.check_config(vllm_config)

        parallel = vllm_config.parallel_config
        if parallel.worker_cls == "auto":
            parallel.worker_cls = WORKER

        cache = vllm_config.cache_config
        if cache is not None and cache.user_specified_block_size:
            if cache.block_size % KERNEL_BLOCK_SIZE:
                raise ValueError(
                    f"--block-size {cache.block_size} is not supported on Ascend: the NPU "
                    f"attention kernels need a KV block size that is a multiple of "
                    f"{KERNEL_BLOCK_SIZE} (npu_fused_infer_attention_score, paged). Use "
                    f"--block-size {KERNEL_BLOCK_SIZE} or leave it unset"
                )

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

    @classmethod
    def register_triton_kernel_overrides(cls) -> None:
        # vLLM 0.31+ asks before any worker code runs (0.20-0.30: the kernel patches).
        if release.runner == "v2":
            from ascend_patch.npu.runner.v2 import kernels
        else:
            from ascend_patch.npu.spec_decode import install as kernels
        kernels.register()

    @classmethod
    def check_runner_kv_caches_multi_layer(cls) -> None:
        # A draft model's layers share the target's layer indices; the runner's flat KV list is
        # only iterated whole (block copies), never indexed by layer on the NPU path.
        return None

    @classmethod
    def support_static_graph_mode(cls) -> bool:
        return True

    @classmethod
    def get_static_graph_wrapper_cls(cls) -> str:
        return GRAPH_WRAPPER

    @classmethod
    def graph_pool_handle(cls):
        # vLLM's get_global_graph_pool() and its graph-memory profiling ask the platform for it.
        return cls.runtime().graphs().graph_pool_handle()

    @classmethod
    def opaque_attention_op(cls) -> bool:
        # Under torch.compile attention must be one opaque op: the split point of PIECEWISE
        # graphs, and never traced (its metadata is host data that changes every step).
        from vllm.config import CompilationMode, get_current_vllm_config

        return get_current_vllm_config().compilation_config.mode == CompilationMode.VLLM_COMPILE

    @classmethod
    def import_ir_kernels(cls) -> None:
        import vllm.kernels  # noqa: F401  (vLLM's own IR implementations)

        from ascend_patch.npu import ops

        ops.register()

    @classmethod
    def get_default_ir_op_priority(cls, vllm_config):
        from dataclasses import fields

        from vllm.config.kernel import IrOpPriorityConfig

        from ascend_patch.npu.ops import ir

        if "none" in vllm_config.compilation_config.custom_ops:
            return IrOpPriorityConfig.with_default(["native"])  # custom ops switched off
        known = {field.name for field in fields(IrOpPriorityConfig)}  # seam fused_add_rms_norm: 0.21+
        return IrOpPriorityConfig.with_default(
            ["native"], **{op: [ir.PROVIDER, "native"] for op in ir.OPS if op in known}
        )

    @classmethod
    def get_device_communicator_cls(cls) -> str:
        return COMMUNICATOR

    @classmethod
    def get_punica_wrapper(cls) -> str:
        return PUNICA_WRAPPER

    @classmethod
    def import_kernels(cls) -> None:
        # vLLM's CUDA/CPU extensions do not exist on Ascend; every op goes
        # through ascend_patch.npu.kernels instead. Importing them only logs noise.
        return None

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return cls.runtime().device_name(device_id)

    @classmethod
    def get_device_uuid(cls, device_id: int = 0) -> str:
        return cls.runtime().device_uuid(device_id)

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return cls.runtime().mem_get_info(device_id)[1]

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        cls.runtime().set_device(device)

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        cls.runtime().manual_seed_all(seed)

    @classmethod
    def get_current_memory_usage(cls, device: torch.types.Device | None = None) -> float:
        return float(cls.runtime().memory_allocated(device))

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return cls.runtime().pin_memory_available()

    def is_sleep_mode_available(self) -> bool:
        return True  # offload-and-free, ascend_patch.npu.sleep_mode: no device memory pool needed

    @classmethod
    def check_if_supports_dtype(cls, dtype: torch.dtype) -> None:
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"{cls.__name__} supports float16, bfloat16 and float32, not {dtype}")

    @classmethod
    def inference_mode(cls):
        return torch.inference_mode(mode=True)

    @classmethod
    def num_compute_units(cls, device_id: int = 0) -> int:
        return cls.runtime().num_compute_units(device_id)

    @classmethod
    def support_hybrid_kv_cache(cls) -> bool:
        # vLLM's hybrid KV-cache manager: a model mixing sliding-window and full-attention layers
        # gets a KV-cache group per layer of its pattern (each its own block table, builder and
        # manager), the windowed groups freeing (or, on a prefix-cache hit, nulling) the blocks
        # before their window. Every attention path hides those keys (backend.py), and layers of
        # different groups may share a KV tensor: a block id belongs to one group at a time.
        # Recurrent (Mamba-2) layers are one more group each: their state pages are blocks of
        # the same tensor (kv_cache.allocate_kv_cache keeps vLLM's page views for them).
        return True


# The layer_types names of attention layers (transformers names recurrent ones "linear_attention").
_ATTENTION_KINDS = {"attention", "full_attention", "sliding_attention"}


def recurrent_layers(model) -> str | None:
    """What a model has that keeps a recurrent state (Mamba, linear-attention layers), for the
    refusal, or None for a model whose every layer attends."""
    if model.is_attention_free:
        return "Mamba (state-space) layers and no attention"
    if not model.is_hybrid:
        return None
    names = getattr(model.hf_config, "layer_types", None)  # not a seam: an HF field some models lack
    kinds = sorted(set(names or ()) - _ATTENTION_KINDS)
    named = f" ({', '.join(map(repr, kinds))} in its layer_types)" if kinds else ""
    return f"Mamba or linear-attention layers{named} beside its attention layers"


# The head sizes the graph suites replay against eager: Llama 64 (tests/test_graph.py), Mistral
# 128 and Gemma 3 256 (tests/test_graph_windowed.py); MLA models at their own dimensions.
GRAPH_PROVEN_HEAD_SIZES = (64, 128, 256)

# The recurrent layer kind the NPU path serves, by architecture (what vLLM builds for its
# non-attention layer_types), on the release whose mixer calls the composed path replaces
# (patches/recurrent.py).
SERVED_RECURRENT = {
    "GraniteMoeHybridForCausalLM": "Mamba-2 (MambaMixer2)",
    "Qwen3NextForCausalLM": "gated DeltaNet (QwenGatedDeltaNetAttention)",
}
_COMPOSED = "run composed (generic torch ops per sequence: no torch_npu op takes them)"
# How each kind runs: ascend_patch.npu.ops.recurrent says which torch_npu ops fit and why.
_HOW = {
    "GraniteMoeHybridForCausalLM": _COMPOSED,
    "Qwen3NextForCausalLM": "run their convolution and chunked prefill composed (generic torch ops "
                            "per sequence) and their decode on npu_recurrent_gated_delta_rule in "
                            "bf16 (composed in other dtypes, which the op does not take)",
}
SERVED_RECURRENT_RELEASES = "0.33"


def moe_lora_release() -> bool:
    """Whether this vLLM serves LoRA on MoE layers here: the active patch set installs the wrapper
    of FusedMoEWithLoRA (ascend_patch.npu.lora.moe) on this release (patches/lora.py, MOE_LORA)."""
    return "ascend_patch.npu.lora.moe:modular_for_lora" in release.patched


def recurrent_refusal(vllm_config, recurrent: str) -> str | None:
    """Why a model with recurrent layers cannot run here (one line), or None where it can."""
    import vllm

    model = vllm_config.model_config
    served = SERVED_RECURRENT.get(model.architecture)
    if served is None:
        kinds = ", ".join(f"{arch} ({kind})" for arch, kind in SERVED_RECURRENT.items())
        return (f"{model.architecture} has {recurrent}: ascend-patch serves recurrent layers of "
                f"{kinds} only")
    release = ".".join(vllm.__version__.split(".")[:2])
    if release != SERVED_RECURRENT_RELEASES:
        return (f"{model.architecture}'s {served} layers are served on vLLM "
                f"{SERVED_RECURRENT_RELEASES} only, not {vllm.__version__}")
    if vllm_config.cache_config.enable_prefix_caching:
        return (f"prefix caching of {model.architecture}'s {served} states is not supported by "
                f"ascend-patch yet: run with --no-enable-prefix-caching")
    if vllm_config.speculative_config is not None:
        return (f"speculative decoding with {model.architecture}'s {served} layers is not "
                f"supported by ascend-patch yet")
    return None


def recurrent_states_uncached_by_default(wrapped, instance, args, kwargs):
    """vLLM's engine arguments turn prefix caching on by default; for a model whose recurrent
    layers the NPU path serves, whose states it does not cache, left unset it goes off here with
    one line (asked for explicitly, recurrent_refusal refuses it)."""
    unset = instance.enable_prefix_caching is None
    result = wrapped(*args, **kwargs)
    model = args[0] if args else kwargs["model_config"]
    if unset and instance.enable_prefix_caching and model.architecture in SERVED_RECURRENT:
        instance.enable_prefix_caching = False
        logger.info("ascend-patch: prefix caching is off by default for %s: ascend-patch does not "
                    "cache its %s states yet", model.architecture, SERVED_RECURRENT[model.architecture])
    return result


def served_layers(model) -> str:
    """The served recurrent layers of ``model``, by kind and index, and how they run: the
    start-up line."""
    indices = [i for i, layer in enumerate(model.hf_config.layer_types)
               if layer not in _ATTENTION_KINDS]
    return (f"{len(indices)} {SERVED_RECURRENT[model.architecture]} layers "
            f"({', '.join(map(str, indices))}) {_HOW[model.architecture]}")


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
        raise ValueError(f"{mode.name} ACL graphs cannot hold speculative decoding's verification "
                         f"rows here ({verify}): run with --enforce-eager or "
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
    compilation.cudagraph_capture_sizes = tokens
    compilation.max_cudagraph_capture_size = tokens[-1]
    compilation.post_init_cudagraph_sizes()


def select_platform(wrapped, instance, args, kwargs) -> str:
    """Wrapper of ``vllm.platforms.resolve_current_platform_cls_qualname``.

    Installed only once the loader has verified the patch set for this process's mode,
    so the mode alone decides: emulated when ``ASCEND_PATCH=emulate``, else the NPU.
    """
    if env.mode() == "emulate":
        return EMULATED_PLATFORM
    return f"{NPUPlatform.__module__}.{NPUPlatform.__qualname__}"

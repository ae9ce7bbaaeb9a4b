"""``NPUPlatform``: what ``vllm.platforms.current_platform`` becomes.

This room owns the platform hooks, which have been stable from 0.20 to 0.33: the attention
backend, the device communicator, the distributed backend, the device queries and the static
graph hooks are chosen here. A configuration is checked by the rooms that own its parts
(``check_and_update_config`` calls each room's ``check_config``: speculative decoding, LoRA,
recurrent layers, MLA, quantization, KV transfer, parallelism, the runner generation's worker,
attention paging and the graph mode), never re-derived here.

There are two classes with one code path. :class:`NPUPlatform` drives real
Ascend devices through torch_npu. ``EmulatedNPUPlatform``
(:mod:`ascend_patch.npu.emulation.platform`) is the same platform on CPU tensors.

Docs: docs/design.md, "What the overlay does on the NPU".
"""

from __future__ import annotations

import torch
from vllm.platforms.interface import Platform, PlatformEnum

from ascend_patch import release
from ascend_patch.npu import device

ATTENTION_BACKEND = "ascend_patch.npu.attention.backend.AscendAttentionBackend"
MLA_BACKEND = "ascend_patch.npu.attention.mla.AscendMLABackend"
ENCODER_ONLY_BACKEND = "ascend_patch.npu.attention.encoder.AscendEncoderOnlyBackend"
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
        # Runs before vLLM settles the compilation mode, the custom-op default and the graph mode.
        from ascend_patch.npu.compilation import graph_mode

        graph_mode.apply_defaults(vllm_config)

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        # Each room checks what it owns, in this order (the graph mode last: it reads the rest).
        from ascend_patch.npu import distributed, lora, quantization, runner, spec_decode
        from ascend_patch.npu.attention import paths
        from ascend_patch.npu.compilation import graph_mode
        from ascend_patch.npu.distributed import kv_transfer
        from ascend_patch.npu.ops import recurrent_layers

        spec_decode.config.check(vllm_config)
        lora.check_config(vllm_config)
        recurrent_layers.check_config(vllm_config)
        model = vllm_config.model_config
        if model is not None and model.use_mla:
            from ascend_patch.npu.attention import mla

            mla.check_config(vllm_config)
        quantization.register_config()  # a VllmConfig built without EngineArgs skips the hook
        quantization.detect(vllm_config)
        kv_transfer.check_config(vllm_config, emulated=cls.emulated)
        distributed.check_config(vllm_config)
        runner.check_config(vllm_config)
        paths.check_config(vllm_config)
        graph_mode.check_config(vllm_config)

    @classmethod
    def register_triton_kernel_overrides(cls) -> None:
        # vLLM 0.31+ asks before any worker code runs (0.20-0.30: the V1 kernel patches).
        from ascend_patch.npu import runner

        runner.register_triton_kernel_overrides()

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
    def log_warnings(cls) -> None:
        release.announce()  # vLLM 0.33+ calls this once it has configured logging

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
        return True  # offload-and-free, ascend_patch.npu.runner.sleep_mode: no device memory pool needed

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


def select_platform(wrapped, instance, args, kwargs) -> str:
    """Wrapper of ``vllm.platforms.resolve_current_platform_cls_qualname``.

    Installed only once the loader has verified the patch set for this process's mode, so the
    mode it decided alone decides (:data:`ascend_patch.release.mode`): emulated or the NPU.
    """
    if release.mode == "emulate":
        return EMULATED_PLATFORM
    return f"{NPUPlatform.__module__}.{NPUPlatform.__qualname__}"

"""``NPUPlatform``: what ``vllm.platforms.current_platform`` becomes.

Most of the overlay's work goes through vLLM's own platform hooks, which have
been stable from 0.20 to 0.33: the attention backend, the worker class, the
device communicator and the distributed backend are all chosen here.

There are two classes with one code path. :class:`NPUPlatform` drives real
Ascend devices through torch_npu. :class:`EmulatedNPUPlatform` is the same
platform on CPU tensors: every name vLLM turns into a ``torch.device``
(``device_type``, and ``device_name`` for ``GroupCoordinator``'s
``f"{device_name}:{index}"``) names the CPU, gloo replaces HCCL, and the device
memory is the configured emulated HBM.
"""

from __future__ import annotations

import logging

import torch
from vllm.platforms.interface import Platform, PlatformEnum

from ascend_patch import env
from ascend_patch.npu import device

logger = logging.getLogger("vllm.ascend_patch")

ATTENTION_BACKEND = "ascend_patch.npu.attention.backend.AscendAttentionBackend"
WORKER = "ascend_patch.npu.worker.NPUWorker"
COMMUNICATOR = "ascend_patch.npu.distributed.communicator.NPUCommunicator"


class NPUPlatform(Platform):
    _enum = PlatformEnum.OOT
    device_name = "npu"
    device_type = "npu"
    dispatch_key = "PrivateUse1"
    ray_device_key = "NPU"
    device_control_env_var = "ASCEND_RT_VISIBLE_DEVICES"
    ray_noset_device_env_vars = ["RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES"]
    dist_backend = "hccl"
    # torch.compile is not part of the supported path; eager for the simple fns.
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
        for feature in ("use_mla", "use_sparse", "has_sink"):
            if getattr(config, feature, False):
                raise NotImplementedError(
                    f"the Ascend attention backend does not support models that need "
                    f"{feature.removeprefix('use_').removeprefix('has_')} attention"
                )
        return ATTENTION_BACKEND

    @classmethod
    def apply_config_platform_defaults(cls, vllm_config) -> None:
        # Runs before vLLM settles the compilation mode and the custom-op default:
        # eager mode makes every custom op ("all") dispatch to forward_oot.
        from vllm.config import CompilationMode

        if vllm_config.compilation_config.mode is None:
            vllm_config.compilation_config.mode = CompilationMode.NONE

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        from vllm.config import CompilationMode, CUDAGraphMode

        from ascend_patch.npu.attention.backend import KERNEL_BLOCK_SIZE

        model = vllm_config.model_config
        unsupported = {
            "speculative decoding": vllm_config.speculative_config is not None,
            "LoRA": vllm_config.lora_config is not None,
            "expert-parallel load balancing (EPLB)": getattr(
                vllm_config.parallel_config, "enable_eplb", False),
            # Their layers keep a recurrent state instead of (or beside) a KV cache.
            "a model with Mamba (state-space) or linear-attention layers": model is not None and (
                model.is_attention_free or model.is_hybrid),
        }
        for feature, requested in unsupported.items():
            if requested:
                raise NotImplementedError(f"{feature} is not supported by ascend-patch yet")

        parallel = vllm_config.parallel_config
        if parallel.worker_cls == "auto":
            parallel.worker_cls = WORKER

        cache = vllm_config.cache_config
        if cache is not None and getattr(cache, "user_specified_block_size", False):
            if cache.block_size % KERNEL_BLOCK_SIZE:
                raise ValueError(
                    f"--block-size {cache.block_size} is not supported on Ascend: the NPU "
                    f"attention kernels need a KV block size that is a multiple of "
                    f"{KERNEL_BLOCK_SIZE} (npu_fused_infer_attention_score, paged). Use "
                    f"--block-size {KERNEL_BLOCK_SIZE} or leave it unset"
                )

        compilation = vllm_config.compilation_config
        if compilation.mode != CompilationMode.NONE:
            logger.warning("ascend-patch: torch.compile is not supported on Ascend yet; running eager")
            compilation.mode = CompilationMode.NONE
        compilation.cudagraph_mode = CUDAGraphMode.NONE
        compilation.cudagraph_capture_sizes = []
        if vllm_config.model_config is not None:
            vllm_config.model_config.enforce_eager = True

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
        raise NotImplementedError("LoRA is not supported by ascend-patch yet")

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
        # False: in a model mixing sliding-window and full-attention layers vLLM promotes the
        # window specs to full attention (blocks kept for every token; the attention applies the
        # window), so one block table serves all layers. A uniformly windowed model still gets
        # vLLM's SlidingWindowManager, which frees (or, on a prefix-cache hit, nulls) the blocks
        # before the window: the attention hides those keys, so their contents never matter.
        return False


class EmulatedNPUPlatform(NPUPlatform):
    """The NPU platform on CPU tensors (``ASCEND_PATCH=emulate``)."""

    device_name = "cpu"
    device_type = "cpu"
    dispatch_key = "CPU"
    dist_backend = "gloo"
    emulated = True
    kernel_backend = "reference"

    @classmethod
    def mem_get_info(cls, device=None) -> tuple[int, int]:
        # vLLM before 0.25 reads free/total device memory from the platform, which
        # would otherwise look for it in torch.cpu.
        return cls.runtime().mem_get_info()


def select_platform(wrapped, instance, args, kwargs) -> str:
    """Wrapper of ``vllm.platforms.resolve_current_platform_cls_qualname``.

    Installed only once the loader has verified the patch set for this process's mode,
    so the mode alone decides: emulated when ``ASCEND_PATCH=emulate``, else the NPU.
    """
    cls = EmulatedNPUPlatform if env.mode() == "emulate" else NPUPlatform
    return f"{cls.__module__}.{cls.__qualname__}"

"""Quantised checkpoints: msModelSlim AscendV1 and compressed-tensors int8, linear layers and
experts."""

from ascend_patch.overlay.declarations import Patch, Seam
from ascend_patch.patches._declare import contract, platform_hook

_QUANT = "vllm.model_executor.layers.quantization"
_MOE = "vllm.model_executor.layers.fused_moe"
_CT = f"{_QUANT}.compressed_tensors"
_CT_MOE = f"{_CT}.compressed_tensors_moe"
_INT8_KERNELS = "vllm.model_executor.kernels.linear"
_SCALED_MM = f"{_INT8_KERNELS}.scaled_mm.ScaledMMLinearKernel"
_QUANTIZATION = "ascend_patch.npu.quantization"
_MODELSLIM = f"{_QUANTIZATION}.modelslim:AscendModelSlimConfig"
_ASCEND_LINEAR = f"{_QUANTIZATION}.linear:AscendW8A8LinearMethod"
_INT8_KERNEL = f"{_QUANTIZATION}.compressed_tensors:AscendInt8ScaledMMLinearKernel"
_W8A8_MOE = f"{_QUANTIZATION}.moe:AscendW8A8MoEMethod"
_QUANT_API = (f"{_QUANT.replace('.', '/')}/__init__.py and base_config.py: out-of-tree "
              "quantization configs and their methods")
_INT8_API = (f"{_INT8_KERNELS.replace('.', '/')}/__init__.py: int8 ScaledMM kernels are chosen "
             "from _POSSIBLE_INT8_KERNELS[platform], which has no out-of-tree entry")
_CT_MOE_API = (f"{_CT_MOE.replace('.', '/')}/compressed_tensors_moe.py: get_moe_method imports "
               "CompressedTensorsW8A8Int8MoEMethod by name when it builds an int8 expert layer; "
               "its kernel selection has nothing for an out-of-tree platform")

# Quantised checkpoints: the `ascend` (msModelSlim AscendV1) method registered with vLLM's
# quantization registry, the NPU int8 kernel registered for vLLM's compressed-tensors scheme,
# the NPU method for int8 experts, and unsupported schemes refused by layer.
QUANT_CONTRACTS = [
    platform_hook("pre_register_and_update", "(cls, parser=...)",
                  "register the `ascend` quantization method before vLLM builds its config"),
    contract(f"{_QUANT}:register_quantization_config", "(quantization)",
             "the `ascend` method joins vLLM's quantization registry (--quantization ascend)",
             implementation=f"{_QUANTIZATION}:register_config", upstream=_QUANT_API),
    *(contract(f"{_QUANT}.base_config:QuantizationConfig.{name}", signature,
               "AscendModelSlimConfig implements the quantization-config interface",
               implementation=_MODELSLIM, upstream=_QUANT_API)
      for name, signature in (("get_quant_method", "(self, layer, prefix)"),
                              ("get_config_filenames", "()"), ("from_config", "(cls, config)"),
                              ("get_supported_act_dtypes", "(self)"),
                              ("get_min_capability", "(cls)"))),
    contract("vllm.config.vllm:VllmConfig.get_quantization_config", "(model_config, load_config)",
             "a checkpoint detected as AscendV1 gets its quantization config rebuilt",
             implementation=f"{_QUANTIZATION}:detect",
             upstream="vllm/config/model.py _verify_quantization detects a method only from an "
                      "HF quantization_config, which msModelSlim removes from config.json",
             remove_when="vLLM lets a quantization method detect its checkpoint by its files"),
    *(contract(f"vllm.model_executor.layers.linear:LinearMethodBase.{name}", signature,
               "AscendV1 W8A8 / W8A8_DYNAMIC linear layers", implementation=_ASCEND_LINEAR,
               upstream="vllm/model_executor/layers/linear.py: the linear-method interface")
      for name, signature in (
          ("create_weights", "(self, layer, input_size_per_partition, output_partition_sizes, "
                             "input_size, output_size, params_dtype, **extra_weight_attrs)"),
          ("apply", "(self, layer, x, bias=...)"))),
    contract(f"{_INT8_KERNELS}:register_linear_kernel", "(kernel_class, platform, kernel_type=...)",
             "the NPU int8 kernel for PlatformEnum.OOT", implementation=f"{_QUANTIZATION}:register_kernels",
             upstream=_INT8_API, pr="vllm-project/vllm#37989"),
    contract(f"{_INT8_KERNELS}:init_int8_linear_kernel",
             ("(is_channelwise, is_static_input_scheme, input_symmetric, module_name)",
              "(is_channelwise, is_static_input_scheme, input_symmetric, module_name, "
              "is_fused_module=...)"),  # 0.33
             "vLLM's int8 scheme builds the chosen kernel from its config and parameter names",
             implementation=_INT8_KERNEL, upstream=_INT8_API, pr="vllm-project/vllm#27814"),
    *(contract(f"{_SCALED_MM}:{name}", signature, "the int8 ScaledMM kernel interface",
               implementation=_INT8_KERNEL, upstream=_INT8_API, pr=pr)
      for name, signature, pr in (
          ("ScaledMMLinearKernel.__init__", "(self, c, layer_param_names)", None),
          ("ScaledMMLinearKernel.is_supported", "(cls, compute_capability=...)", None),
          ("ScaledMMLinearKernel.can_implement", "(cls, c)", None),
          ("ScaledMMLinearKernel.process_weights_after_loading", "(self, layer)", None),
          ("ScaledMMLinearKernel.apply_weights", "(self, layer, x, bias=...)", None),
          ("Int8ScaledMMLinearKernel._get_layer_params", "(self, layer)",
           "vllm-project/vllm#27814"))),
    contract(f"{_CT}.schemes.compressed_tensors_w8a8_int8:CompressedTensorsW8A8Int8.__init__",
             "(self, strategy, is_static_input_scheme, input_symmetric)",
             "check_scheme reads the int8 scheme's is_static_input_scheme and input_symmetric",
             implementation=f"{_QUANTIZATION}.compressed_tensors:check_scheme",
             upstream=f"{_CT.replace('.', '/')}/schemes/compressed_tensors_w8a8_int8.py"),
    Patch(
        f"{_CT}.compressed_tensors:CompressedTensorsConfig.get_scheme",
        reason="a compressed-tensors scheme the NPU cannot run (W4A16, W4A8, FP8, MXFP/NVFP4, "
               "dynamic asymmetric int8) fails when the layer is built, naming layer and scheme",
        signature=("(self, layer, layer_name=...)",),
        wrapper=f"{_QUANTIZATION}.compressed_tensors:check_scheme",
        upstream=f"{_CT.replace('.', '/')}/compressed_tensors.py: an unsupported scheme fails "
                 "later, in kernel selection, without naming the layer",
        remove_when="vLLM names the layer when no kernel implements its scheme",
    ),
    Patch(
        f"{_CT_MOE}.compressed_tensors_moe:CompressedTensorsMoEMethod.get_moe_method",
        reason="an expert scheme the NPU cannot run fails when the layer is built, naming it",
        signature=("(quant_config, layer, layer_name)",),
        replacement=f"{_QUANTIZATION}.compressed_tensors:check_moe_method",
        upstream=_CT_MOE_API,
        remove_when="vLLM names the layer when no MoE kernel implements its scheme",
    ),
    Patch(
        f"{_CT_MOE}.compressed_tensors_moe_w8a8_int8:CompressedTensorsW8A8Int8MoEMethod",
        reason="compressed-tensors int8 experts run on the NPU MoE ops (vLLM's method finds no "
               "int8 MoE kernel for an out-of-tree platform)",
        replacement=f"{_QUANTIZATION}.moe:compressed_tensors_moe_method",
        implementation=f"{_QUANTIZATION}.moe:AscendCompressedTensorsW8A8Int8MoEMethod",
        upstream=_CT_MOE_API,
        remove_when="vLLM's int8 MoE backend selection admits an out-of-tree platform's kernel",
    ),
    contract(f"{_CT_MOE}.compressed_tensors_moe_w8a8_int8:CompressedTensorsW8A8Int8MoEMethod.__init__",
             "(self, weight_quant, input_quant, moe, layer_name=...)",
             "the NPU method stands in with the same constructor",
             implementation=f"{_QUANTIZATION}.moe:AscendCompressedTensorsW8A8Int8MoEMethod",
             upstream=_CT_MOE_API),
    *(contract(f"{_MOE}.fused_moe_method_base:FusedMoEMethodBase.{name}", signature,
               "the W8A8 expert method implements vLLM's MoE-method interface (monolithic)",
               implementation=_W8A8_MOE, upstream=f"{_MOE.replace('.', '/')}/fused_moe_method_base.py",
               pr=pr)
      for name, signature, pr in (
          ("__init__", "(self, moe)", None),
          ("create_weights", "(self, layer, num_experts, hidden_size, "
                             "intermediate_size_per_partition, params_dtype, **extra_weight_attrs)",
           None),
          ("get_fused_moe_quant_config", "(self, layer)", None),
          ("apply_monolithic", "(self, layer, x, router_logits, input_ids=...)",
           "vllm-project/vllm#31996"))),
]

# Names that appear inside the 0.20-0.33 range; the NPU wing probes for them at run time.
SEAMS = [
    Seam("vllm.model_executor.layers.fused_moe:RoutedExperts",
         "recognise an expert layer (before 0.22 the class is FusedMoE)", since="0.22",
         implementation="ascend_patch.npu.quantization.modelslim:AscendModelSlimConfig.get_quant_method",
         pr="vllm-project/vllm#40735"),
]

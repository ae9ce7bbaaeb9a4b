"""ACL graphs: the platform's static-graph hooks and what NPUGraphWrapper builds on."""

from ascend_patch.overlay.declarations import Patch, Seam
from ascend_patch.patches._declare import contract, platform_hook

_GRAPH_WRAPPER = "ascend_patch.npu.compilation.acl_graph:NPUGraphWrapper"
_CUDA_GRAPH = ("vllm/compilation/cuda_graph.py: CUDAGraphWrapper, which vLLM's runner builds for FULL "
               "graphs and NPUGraphWrapper subclasses (its capture and replay are torch.cuda's)")
_REMOVE_WITH_WRAPPER = "vLLM captures graphs through the platform (torch.accelerator graphs)"

# ACL graphs: the platform's static-graph hooks and what NPUGraphWrapper builds on.
GRAPH_MODE = [
    platform_hook("support_static_graph_mode", "(cls)",
                  "graph mode: vLLM settles the CUDA-graph mode and its capture sizes"),
    platform_hook("get_static_graph_wrapper_cls", "(cls)",
                  "the PIECEWISE backend wraps each compiled piece in NPUGraphWrapper"),
    platform_hook("get_global_graph_pool", "(self)",
                  "the graphs' shared pool, from NPUPlatform.graph_pool_handle (the device runtime's)"),
    platform_hook("opaque_attention_op", "(cls)",
                  "under torch.compile attention is one opaque op: the PIECEWISE split point"),
    contract("vllm.compilation.cuda_graph:CUDAGraphWrapper.__init__",
             "(self, runnable, vllm_config, runtime_mode, cudagraph_options=...)",
             "NPUGraphWrapper is built like it and keeps its state (runnable, mode, pool, entries)",
             implementation=_GRAPH_WRAPPER, upstream=_CUDA_GRAPH, remove_when=_REMOVE_WITH_WRAPPER,
             pr="vllm-project/vllm#20059"),
    contract("vllm.compilation.cuda_graph:CUDAGraphWrapper.clear_graphs", "(self)",
             "vLLM clears every wrapper's graphs through it; NPUGraphWrapper drops its updates too",
             implementation=_GRAPH_WRAPPER, upstream=_CUDA_GRAPH, remove_when=_REMOVE_WITH_WRAPPER),
    contract("vllm.compilation.cuda_graph:CUDAGraphEntry", None,
             "NPUGraphWrapper keeps one entry per batch descriptor, as vLLM's wrapper does",
             implementation=_GRAPH_WRAPPER, upstream=_CUDA_GRAPH, remove_when=_REMOVE_WITH_WRAPPER,
             pr="vllm-project/vllm#20059"),
    contract("vllm.forward_context:ForwardContext.cudagraph_runtime_mode", None,
             "each step's graph mode, which NPUGraphWrapper dispatches on", implementation=_GRAPH_WRAPPER,
             upstream="vllm/forward_context.py", remove_when=_REMOVE_WITH_WRAPPER,
             pr="vllm-project/vllm#20059"),
    contract("vllm.forward_context:ForwardContext.batch_descriptor", None,
             "each step's padded batch, the key of its graph", implementation=_GRAPH_WRAPPER,
             upstream="vllm/forward_context.py", remove_when=_REMOVE_WITH_WRAPPER,
             pr="vllm-project/vllm#20059"),
    contract("vllm.v1.attention.backend:AttentionMetadataBuilder.get_cudagraph_support",
             "(cls, vllm_config, kv_cache_spec)",
             "FULL graphs for single-token decode on the fused kernels, none for composed fp32 "
             "attention", implementation="ascend_patch.npu.attention.backend:AscendMetadataBuilder",
             upstream="vllm/v1/attention/backend.py: the attention backend interface"),
    Patch(
        "vllm.distributed.parallel_state:graph_capture",
        reason="capture on the NPU's own stream without the CUDA communicators' capture contexts",
        signature=("(device)", "(device, graph_capture_context=...)",  # the context: 0.26-0.30
                   "(device, stream=...)"),  # a stream to share the pool's blocks: 0.34
        replacement="ascend_patch.npu.distributed.graph_capture:npu_graph_capture",
        upstream="vllm/distributed/parallel_state.py: GroupCoordinator.graph_capture asserts a "
                 "group's device communicator is CUDA's or XPU's (0.22+) and enters their "
                 "custom all-reduce capture",
        remove_when="GroupCoordinator.graph_capture asks the device communicator for its context",
    ),
    contract("vllm.distributed.parallel_state:GraphCaptureContext", None,
             "the capture context graph_capture yields",
             implementation="ascend_patch.npu.distributed.graph_capture:graph_capture",
             upstream="vllm/distributed/parallel_state.py"),
]

# Names the graph code probes for at run time: declared in the set whose releases lack them.
SEAMS = [
    Seam("vllm.compilation.monitor:validate_cudagraph_capturing_enabled",
         "NPUGraphWrapper captures only while vLLM allows captures, where vLLM still asks (the V1 "
         "runner that enabled captures went with it)", until="0.34", signature=("()",),
         implementation=_GRAPH_WRAPPER),
]

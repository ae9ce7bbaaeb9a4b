"""Declarations of speculative decoding (ngram, draft_model, EAGLE, MTP) that hold whichever runner
generation runs it. The NPU implementations of the V1 runner's spec-decode Triton kernels, and
how each release reaches them, are the V1 runner's (:mod:`.runner_v1`).
"""

from ascend_patch.overlay.declarations import Contract

DRAFT_MODEL = [
    Contract(
        "vllm.platforms.interface:Platform.check_runner_kv_caches_multi_layer",
        reason="a draft model's layers share the target's layer indices: the NPU runner never "
               "indexes its flat KV list by layer, so the platform allows it",
        vllm=">=0.28",
        signature=("(cls)",),
        upstream="vllm/v1/worker/utils.py bind_kv_cache (0.28+) asks the platform when two KV "
                 "layers share an index; the default raises",
        remove_when="never: vLLM's own extension point; the contract only guards its signature",
        implementation="ascend_patch.npu.platform:NPUPlatform",
    ),
]

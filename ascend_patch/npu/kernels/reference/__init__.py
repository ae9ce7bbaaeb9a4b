"""The reference kernel backend (``kernels.use("reference")``): one plain-torch twin per seam op,
with the signature of its :mod:`ascend_patch.npu.kernels.npu` counterpart. Each enforces its op's
documented input contract (the limits in :mod:`ascend_patch.npu.kernels.limits`), then computes
the op's documented output, so the emulated engine fails where the NPU would, and says why.

One module per area: :mod:`.attention` (the KV-cache write, fused and paged attention),
:mod:`.fusion_attention` (encoder-only attention),
:mod:`.layers` (norms, SwiGLU, rotary), :mod:`.sampling`, :mod:`.moe`, :mod:`.quant`,
:mod:`.mla`, :mod:`.lora` (LoRA's batched gather matmul), :mod:`.blocks` (KV offload's block
copies between device and host) and :mod:`.recurrent` (the gated delta rule's decode); this
package's namespace is the backend.

Docs: docs/reference.md, "Modes".
"""

from .attention import (
    fused_infer_attention_score,
    fused_infer_attention_score_decode,
    fused_infer_attention_score_decode_workspace,
    fused_infer_attention_score_verify,
    fused_infer_attention_score_verify_workspace,
    paged_attention,
    paged_attention_workspace,
    scatter_pa_kv_cache,
)
from .blocks import swap_blocks
from .fusion_attention import fusion_attention
from .layers import add_rms_norm, mrope, rms_norm, rotary_mul, swiglu
from .lora import batch_gather_matmul_
from .mla import (
    fused_infer_attention_score_mla,
    fused_infer_attention_score_mla_decode,
    fused_infer_attention_score_mla_decode_workspace,
    multi_head_latent_attention,
)
from .mla_rope import interleave_rope, kv_rmsnorm_rope_cache
from .moe import (
    grouped_matmul,
    moe_finalize_routing,
    moe_gating_top_k,
    moe_gating_top_k_softmax,
    moe_gating_top_k_softmax_v2,
    moe_init_routing_v2,
    moe_token_unpermute,
)
from .quant import dynamic_quant, quant_matmul, quantize
from .recurrent import recurrent_gated_delta_rule
from .sampling import top_k_top_p

__all__ = [
    "add_rms_norm", "batch_gather_matmul_", "dynamic_quant", "fused_infer_attention_score",
    "fused_infer_attention_score_decode", "fused_infer_attention_score_decode_workspace",
    "fused_infer_attention_score_verify", "fused_infer_attention_score_verify_workspace",
    "fused_infer_attention_score_mla", "fused_infer_attention_score_mla_decode",
    "fused_infer_attention_score_mla_decode_workspace", "fusion_attention", "grouped_matmul",
    "interleave_rope", "kv_rmsnorm_rope_cache", "moe_finalize_routing",
    "moe_gating_top_k", "moe_gating_top_k_softmax", "moe_gating_top_k_softmax_v2",
    "moe_init_routing_v2", "moe_token_unpermute",
    "mrope", "multi_head_latent_attention", "paged_attention", "paged_attention_workspace", "quant_matmul",
    "quantize", "recurrent_gated_delta_rule", "rms_norm", "rotary_mul", "scatter_pa_kv_cache", "swap_blocks",
    "swiglu", "top_k_top_p",
]

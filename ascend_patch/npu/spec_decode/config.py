"""Which speculative-decoding configurations the NPU path serves exactly, settled at start-up."""

from __future__ import annotations

import logging

logger = logging.getLogger("vllm.ascend_patch")

METHODS = ("ngram", "draft_model", "eagle", "eagle3", "mtp")
"""The methods served: their drafters are vLLM's own and reach only the kernels of
:mod:`ascend_patch.npu.runner.v1.spec_decode.kernels` and the Ascend attention builders (EAGLE,
EAGLE-3 and MTP drafters attend through them, with the device KV lengths copied to the host). Suffix decoding, DFlash and the rest are
not ported."""

MTP_MODEL_TYPES = ("deepseek_mtp",)
"""The MTP drafts served: DeepSeek's (``DeepSeekMTPModel``, a full DeepSeek layer on the MLA
backend and the MoE method). vLLM maps other models' MTP layers onto the same proposer; none of
them is checked on the NPU path."""


def check(vllm_config) -> None:
    """Refuse a method the NPU path does not serve, in one line, and turn async scheduling off.

    Under async scheduling vLLM schedules a step before the previous step's drafts are verified,
    so a verification row's ``seq_lens_cpu_upper_bound`` counts every draft as accepted; the
    Ascend attention ops take host KV lengths, and would attend over the rejected drafts' slots.
    """
    speculative = vllm_config.speculative_config
    if speculative is None:
        return
    if speculative.method not in METHODS:
        raise NotImplementedError(
            f"speculative decoding with method {speculative.method!r} is not supported by "
            f"ascend-patch yet (supported: {', '.join(METHODS)})")
    if speculative.method == "mtp":
        model_type = speculative.draft_model_config.hf_config.model_type
        if model_type not in MTP_MODEL_TYPES:
            raise NotImplementedError(
                f"speculative decoding with method 'mtp' on a {model_type} draft is not supported "
                f"by ascend-patch yet (supported: {', '.join(MTP_MODEL_TYPES)})")
    scheduler = vllm_config.scheduler_config
    if scheduler.async_scheduling:
        logger.warning("ascend-patch: async scheduling is off with speculative decoding (the Ascend "
                       "attention takes exact host KV lengths, which async scheduling does not "
                       "have for verification rows)")
        scheduler.async_scheduling = False

"""Models with recurrent layers (Mamba-2 mixers, gated DeltaNet): which ones the NPU path serves,
where, and how, settled at start-up (:func:`check_config`). The composed path that runs them is
:mod:`ascend_patch.npu.ops.recurrent`; its declarations are ``patches/recurrent.py``, and a
release serves them where the active patch set installs them there.

Docs: docs/design.md, "Recurrent layers (Mamba-2, gated DeltaNet)".
"""

from __future__ import annotations

import logging

from ascend_patch import release
from ascend_patch.npu.ops import recurrent as composed

logger = logging.getLogger("vllm.ascend_patch")

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
# The release whose mixer calls the composed path was checked against (tests/test_recurrent.py),
# named in messages; the gate is the declaration (served_here).
SERVED_RECURRENT_RELEASES = "0.33 and later"




def served_here() -> bool:
    """Whether the active patch set installs the composed recurrent path on this release
    (patches/recurrent.py): the gate, rather than the release's version."""
    return any(name.startswith(f"{composed.__name__}:") for name in release.patched)


def check_config(vllm_config) -> None:
    """Refuse, in one line, a model with recurrent layers the NPU path cannot serve here; name
    the served ones and how they run."""
    model = vllm_config.model_config
    recurrent = model and recurrent_layers(model)
    if not recurrent:
        return
    refusal = recurrent_refusal(vllm_config, recurrent)
    if refusal:
        raise NotImplementedError(f"{model.model}: {refusal}")
    logger.warning("ascend-patch: %s: %s", model.model, served_layers(model))


def recurrent_refusal(vllm_config, recurrent: str) -> str | None:
    """Why a model with recurrent layers cannot run here (one line), or None where it can."""
    model = vllm_config.model_config
    served = SERVED_RECURRENT.get(model.architecture)
    if served is None:
        kinds = ", ".join(f"{arch} ({kind})" for arch, kind in SERVED_RECURRENT.items())
        return (f"{model.architecture} has {recurrent}: ascend-patch serves recurrent layers of "
                f"{kinds} only")
    if not served_here():
        import vllm

        return (f"{model.architecture}'s {served} layers are served on vLLM "
                f"{SERVED_RECURRENT_RELEASES}, not {vllm.__version__}")
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

"""Build the tiny models locally: there is no model hub on these machines.

Each model is a real Hugging Face checkpoint directory (config, safetensors weights,
tokenizer) that vLLM and transformers load the normal way:

- a byte-level BPE tokenizer trained on text that ships with Python itself;
- random-weight ``LlamaForCausalLM`` and ``Qwen2ForCausalLM`` with grouped-query
  attention (4 query heads, 2 KV heads), head_dim 64, fp32; and a Llama with head_dim
  128, the fused NPU kernels' other head size;
- attention variants: a Llama with head_dim 96, and one with 80 for the torch-npu wheel replay
  (its rotary runs npu_rotary_mul: npu_mrope takes multiples of 32); Mistral with a sliding
  window on every layer (head_dim 128); Gemma 2 (alternating windows, soft-capped attention
  logits) and Gemma 3 (alternating windows, q/k norms; and five windowed layers to one global),
  all head_dim 256; a Mamba (refused);
- the mixture-of-experts families on the same attention: ``Qwen3MoeForCausalLM`` (8
  experts, top-2, renormalised), ``Qwen2MoeForCausalLM`` (8 experts, top-2, not
  renormalised, plus a gated shared expert), ``MixtralForCausalLM`` (8 experts, top-2) and
  ``Glm4MoeForCausalLM`` (DeepSeek-V3-style grouped sigmoid routing with a correction bias);
- weights re-drawn from N(0, 0.2) so greedy decoding does not collapse into one
  repeated token, which would make token-for-token comparisons meaningless.

    python -m ascend_patch.kit.tiny_models OUT_DIR   # writes OUT_DIR/tiny-llama, OUT_DIR/tiny-qwen2, ...

Deterministic: the same seed gives byte-identical weights, and an existing output
with the same recipe is reused.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import sys
from pathlib import Path

RECIPE = {
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "seed": 0,
    "init_std": 0.2,
}
_MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
        "decoder_sparse_step": 1, "mlp_only_layers": []}
_MLA = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128}
# name -> (architecture, config overrides on top of RECIPE)
MODELS = {
    "tiny-llama": ("LlamaForCausalLM", {}),
    "tiny-qwen2": ("Qwen2ForCausalLM", {}),
    "tiny-llama-hd128": ("LlamaForCausalLM", {"head_dim": 128}),
    "tiny-qwen3-moe": ("Qwen3MoeForCausalLM", {**_MOE, "norm_topk_prob": True}),
    "tiny-qwen2-moe": ("Qwen2MoeForCausalLM", {**_MOE, "norm_topk_prob": False,
                                               "shared_expert_intermediate_size": 256}),
    "tiny-mixtral": ("MixtralForCausalLM", {"num_local_experts": 8, "num_experts_per_tok": 2}),
    # GLM-4.5 routing, DeepSeek-V3 style: sigmoid scores, a score-correction bias that only
    # selects, 2 groups of which 1 is kept, renormalised and scaled by 2.5; a shared expert.
    "tiny-glm4-moe": ("Glm4MoeForCausalLM", {
        "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
        "n_shared_experts": 1, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 0,
        "routed_scaling_factor": 2.5, "norm_topk_prob": True}),
    # DeepSeek-V3 multi-head latent attention at the dimensions the NPU MLA kernels take (latent
    # 512, rope 64, nope and value 128): dense MLP in every layer, no query LoRA, plain rope.
    # Its kv_a norm weights are not all 1.0, so a fused MLA cache write that drops them (it
    # takes the norm over from vLLM's layer) changes the logits.
    "tiny-deepseek-v3": ("DeepseekV3ForCausalLM", {**_MLA, "num_attention_heads": 8,
                                                  "num_key_value_heads": 8, "q_lora_rank": None,
                                                  "first_k_dense_replace": 2,
                                                  "kv_a_layernorm_std": 0.3}),
    # ... and the full recipe: query LoRA, YaRN rotary with mscale, 4 heads (fewer than the ATB
    # MLA decode kernel takes), a dense first layer and a DeepSeek-V3-routed MoE layer.
    "tiny-deepseek-v3-moe": ("DeepseekV3ForCausalLM", {
        **_MLA, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 64,
        "first_k_dense_replace": 1, "n_routed_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 128, "n_shared_experts": 1, "n_group": 2, "topk_group": 1,
        "routed_scaling_factor": 2.5, "norm_topk_prob": True,
        # What DeepSeek-V3's own config.json says and vLLM reads (transformers implies them).
        "topk_method": "noaux_tc", "scoring_func": "sigmoid",
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                            "original_max_position_embeddings": 1024, "beta_fast": 32,
                            "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}}),
    # The same without renormalisation: sigmoid weights the NPU gating op cannot produce.
    "tiny-glm4-moe-unnormalised": ("Glm4MoeForCausalLM", {
        "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
        "n_shared_experts": 1, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 0,
        "routed_scaling_factor": 2.5, "norm_topk_prob": False}),
    # DeepSeek-V3 routing over 8 experts in 4 groups of 2, 2 groups kept: npu_moe_gating_top_k
    # needs more than 2 experts per group.
    "tiny-glm4-moe-pairs": ("Glm4MoeForCausalLM", {
        "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
        "n_shared_experts": 1, "n_group": 4, "topk_group": 2, "first_k_dense_replace": 0,
        "routed_scaling_factor": 2.5, "norm_topk_prob": True}),
    # Sigmoid weights without renormalisation and no grouping: vLLM routes that on its CUDA
    # top-k kernels, so it is refused.
    "tiny-glm4-moe-ungrouped-unnormalised": ("Glm4MoeForCausalLM", {
        "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
        "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 0,
        "routed_scaling_factor": 2.5, "norm_topk_prob": False}),
    # Head sizes other than the 64 and 128 of the fused prefill kernel.
    "tiny-llama-hd96": ("LlamaForCausalLM", {"head_dim": 96}),
    # ... and one npu_mrope does not take (multiples of 32): its rotary runs npu_rotary_mul.
    "tiny-llama-hd80": ("LlamaForCausalLM", {"head_dim": 80}),
    # Sliding windows shorter than the test prompts, so the windows cut. Mistral: every layer
    # windowed (vLLM frees the blocks that fall out of the window), head_dim 128.
    "tiny-mistral": ("MistralForCausalLM", {"head_dim": 128, "sliding_window": 100}),
    # Gemma 2: alternating windowed and global layers, attention logits soft-capped (and the
    # final logits), head_dim 256. Gemma ties the LM head to the embedding and scales the
    # embedding by sqrt(hidden_size): with the usual weights the scaled embedding outweighs
    # every (post-normalised) sublayer and the model just echoes its input, so it gets smaller
    # embedding weights ("embedding_std", not a config field).
    "tiny-gemma2": ("Gemma2ForCausalLM", {
        "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 64,
        "layer_types": ["sliding_attention", "full_attention"], "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0, "tie_word_embeddings": True, "embedding_std": 0.05}),
    # Gemma 3 (text): alternating layers without soft-capping, q/k norms, head_dim 256.
    "tiny-gemma3": ("Gemma3ForCausalLM", {
        "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 100,
        "layer_types": ["sliding_attention", "full_attention"], "tie_word_embeddings": True,
        "embedding_std": 0.05}),
    # Gemma 3's own pattern, five windowed layers to one global: with vLLM's hybrid KV-cache
    # manager one KV-cache group per layer of the pattern (five windowed, one full).
    "tiny-gemma3-5to1": ("Gemma3ForCausalLM", {
        "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 100, "num_hidden_layers": 6,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"], "tie_word_embeddings": True,
        "embedding_std": 0.05}),
    # State-space layers without attention (Mamba-1), which the NPU path refuses.
    "tiny-mamba": ("MambaForCausalLM", {}),
    # A Mamba-2 hybrid, Granite 4.0-H style (dense shared MLP, no position embedding, one SSM
    # group, state size 128): three Mamba-2 layers around one attention layer; SSD chunks of 32
    # tokens, so a test prompt spans several. Its state page outgrows a 128-token attention page,
    # as real hybrids' do, so vLLM raises the attention block to 384 tokens (three kernel
    # blocks). (With several groups HF's torch path normalises the gated output over all of
    # them, vLLM and HF's CUDA kernels per group.)
    "tiny-granite4": ("GraniteMoeHybridForCausalLM", {
        "num_hidden_layers": 4, "layer_types": ["mamba", "mamba", "attention", "mamba"],
        "num_local_experts": 0, "shared_intermediate_size": 512, "position_embedding_type": "nope",
        "mamba_n_heads": 8, "mamba_d_head": 64, "mamba_n_groups": 1, "mamba_d_state": 128,
        "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 32}),
    # Qwen3-Next: three gated-DeltaNet layers (2 key heads shared by 4 value heads, width-4
    # convolution) and one gated full-attention layer (partial rotary), every layer's MLP a
    # top-2-of-8 MoE with a gated shared expert.
    "tiny-qwen3-next": ("Qwen3NextForCausalLM", {
        **_MOE, "norm_topk_prob": True, "shared_expert_intermediate_size": 256,
        "num_hidden_layers": 4, "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
        "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4, "partial_rotary_factor": 0.25}),
}
# Architectures whose config class is not named after them.
CONFIG_CLASSES = {"Gemma3ForCausalLM": "Gemma3TextConfig"}
SPECIAL = {"bos": "<s>", "eos": "</s>", "pad": "<|endoftext|>", "unk": "<unk>"}


def corpus() -> list[str]:
    """Text that every Python installation has: the Zen of Python and some stdlib sources."""
    import argparse as argparse_mod
    import collections
    import contextlib
    import io
    import json as json_mod
    import textwrap

    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints the Zen
        import this
    zen = "".join(this.d.get(c, c) for c in this.s)
    return [zen] + [inspect.getsource(m) for m in (json_mod, argparse_mod, textwrap, collections)]


def _tokenizer(out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=SPECIAL["unk"]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=RECIPE["vocab_size"],
        special_tokens=list(SPECIAL.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=SPECIAL["bos"],
        eos_token=SPECIAL["eos"],
        pad_token=SPECIAL["pad"],
        unk_token=SPECIAL["unk"],
    )
    # A chat template, so the OpenAI chat endpoint can render conversations.
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant: {% endif %}"
    )
    fast.save_pretrained(out)
    return fast


def _model(out: Path, architecture: str, overrides: dict, tokenizer) -> None:
    import transformers

    common = dict(  # the overrides may replace any of these
        vocab_size=RECIPE["vocab_size"],
        hidden_size=RECIPE["hidden_size"],
        intermediate_size=RECIPE["intermediate_size"],
        num_hidden_layers=RECIPE["num_hidden_layers"],
        num_attention_heads=RECIPE["num_attention_heads"],
        num_key_value_heads=RECIPE["num_key_value_heads"],
        head_dim=RECIPE["head_dim"],
        max_position_embeddings=RECIPE["max_position_embeddings"],
        rms_norm_eps=RECIPE["rms_norm_eps"],
        rope_theta=RECIPE["rope_theta"],
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    common.update(overrides)
    embedding_std = common.pop("embedding_std", RECIPE["init_std"])
    kv_a_layernorm_std = common.pop("kv_a_layernorm_std", None)
    config_name = CONFIG_CLASSES.get(architecture, architecture.replace("ForCausalLM", "Config"))
    config = getattr(transformers, config_name)(**common)
    model = seeded_model(architecture, config, RECIPE["seed"], lambda name: None if "norm" in name
                         else embedding_std if "embed_tokens" in name else RECIPE["init_std"],
                         {"kv_a_layernorm": kv_a_layernorm_std} if kv_a_layernorm_std else {})
    model.save_pretrained(out, safe_serialization=True)
    model.generation_config.save_pretrained(out)


def seeded_model(architecture: str, config, seed: int, std_of, around_one: dict | None = None):
    """``transformers.<architecture>(config)`` in fp32 with every parameter drawn, in name order,
    from one generator seeded ``seed``: N(0, ``std_of(name)``), or where that is None ones, or
    1 + N(0, std) for the parameters whose names contain an ``around_one`` key (its std)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).to(torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            std = std_of(name)
            jitter = next((s for key, s in (around_one or {}).items() if key in name), None)
            if jitter is not None:
                param.copy_(1.0 + torch.randn(param.shape, generator=generator) * jitter)
            elif std is None:
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    return model


def build_recipes(root: Path, recipes: dict[str, list], make) -> dict[str, Path]:
    """``make(out, *recipe)`` each ``name: recipe`` into ``root / name``, unless the directory
    was built from the same recipe (its ``.recipe`` stamp)."""
    paths = {}
    for name, recipe in recipes.items():
        stamp = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]
        out = root / name
        paths[name] = out
        marker = out / ".recipe"
        if marker.is_file() and marker.read_text() == stamp:
            continue
        out.mkdir(parents=True, exist_ok=True)
        print(f"building {out} ({recipe[1]})", file=sys.stderr)
        make(out, *recipe)
        marker.write_text(stamp)
    return paths


def build(root: Path, names: list[str] | None = None) -> dict[str, Path]:
    """Build ``names`` (default: every model) under ``root``, reusing what is already built."""
    def make(out, recipe, architecture, overrides):
        _model(out, architecture, overrides, _tokenizer(out))

    return build_recipes(root, {name: [RECIPE, *MODELS[name]] for name in names or MODELS}, make)


def command_line(build_all, description: str, names: list[str] | None = None) -> int:
    """``python -m <module> OUT_DIR [--only NAME ...]``: build the models of ``build_all``
    (``names``: those it can build one by one) into OUT_DIR."""
    parser = argparse.ArgumentParser(description=description, allow_abbrev=False)
    parser.add_argument("out", type=Path, help="directory to write the models into")
    if names:
        parser.add_argument("--only", action="append", choices=names, metavar="NAME",
                            help=f"build only this model (repeatable): {', '.join(names)}")
    args = parser.parse_args()
    only = getattr(args, "only", None)
    for name, path in (build_all(args.out, only) if only else build_all(args.out)).items():
        print(f"{name}: {path}")
    return 0


def main() -> int:
    return command_line(build, __doc__.splitlines()[0], list(MODELS))


if __name__ == "__main__":
    sys.exit(main())

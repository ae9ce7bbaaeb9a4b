"""Encoder-only pooling models on the emulated NPU: XLM-RoBERTa (bge-m3 style) and BERT
embedders, a BERT sequence classifier and a BERT cross-encoder reranker, against HF transformers
pooled as vLLM pools them (ascend_patch/kit/pooling.py).

All engines share one driver process (in-process engine cores, one after another). Their
attention is vLLM's ``EncoderOnlyAttention`` (bidirectional, no KV cache), served by the Ascend
encoder backend on one ``npu_fusion_attention`` launch per layer and step.
"""

from __future__ import annotations

import pytest
import torch

from ascend_patch.kit import pooling, tiny_encoders
from tests.helpers.engine import MODELS_DIR, only_marked_tests, run_engine

# Words per text: about 10, 70, 150 and 300 tokens with the special tokens.
WORDS = [2, 12, 40, 80]
ENGINE = {"runner": "pooling", "max_model_len": 512, "max_num_seqs": 8,
          "max_num_batched_tokens": 2048, "gpu_memory_utilization": 0.9}
LAYERS = tiny_encoders.RECIPE["num_hidden_layers"]
# What the fused op leaves to rounding: fp32 is exact to float noise, half precision rounds the
# activations of every layer (cosine ≥ 0.999 is bge-m3's usual fp16 drift from fp32).
MIN_COSINE = {"float32": 0.9999, "bfloat16": 0.999, "float16": 0.999}
V0_20 = (("tiny-xlm-roberta", "float32"), ("tiny-bert-reranker", "float32"))
"""The engines the tests marked v0_20_features read (a v0_20-set release in CI): one embedder and
the reranker."""


@pytest.fixture(scope="module")
def encoders():
    return tiny_encoders.build(MODELS_DIR)


@pytest.fixture(scope="module")
def texts():
    return pooling.sentences(len(WORDS), WORDS)


@pytest.fixture(scope="module")
def runs(encoders, texts, tmp_path_factory, request):
    """One engine per model and dtype, in one driver process."""
    query, documents = texts[0], texts[1:]

    def engine(name, dtype, run):
        return {"model": str(encoders[name]), "kwargs": {**ENGINE, "dtype": dtype}, "runs": [run]}

    def prompts(name):
        return pooling.token_ids(encoders[name], texts)

    plan = {
        ("tiny-xlm-roberta", "float32"): {"kind": "embed", "prompts": prompts("tiny-xlm-roberta")},
        ("tiny-xlm-roberta", "bfloat16"): {"kind": "embed", "prompts": prompts("tiny-xlm-roberta")},
        ("tiny-bert", "float16"): {"kind": "embed", "prompts": prompts("tiny-bert")},
        ("tiny-bert-classifier", "float32"): {"kind": "classify",
                                              "prompts": prompts("tiny-bert-classifier")},
        ("tiny-bert-reranker", "float32"): {"kind": "score", "query": query,
                                            "documents": documents},
    }
    if only_marked_tests(request):
        plan = {key: plan[key] for key in V0_20}
    spec = {"engines": [engine(name, dtype, run) for (name, dtype), run in plan.items()]}
    result = run_engine(spec, tmp_path_factory.mktemp("pooling"), timeout=900)
    for key, engine in zip(plan, result["engines"]):
        assert "error" not in engine, (key, engine["error"])
    return {key: engine["runs"][0] for key, engine in zip(plan, result["engines"])}


def _assert_encoder_attention_only(run):
    """Each layer's attention was one npu_fusion_attention launch for the one step the batch
    took; nothing touched a KV cache or the decoder kernels."""
    assert run["launches"].get("fusion_attention") == LAYERS, run["launches"]
    for decoder_op in ("scatter_pa_kv_cache", "fused_infer_attention_score", "paged_attention"):
        assert decoder_op not in run["launches"], run["launches"]


@pytest.mark.parametrize(("model", "dtype"), [pytest.param("tiny-xlm-roberta", "float32",
                                                           marks=pytest.mark.v0_20_features),
                                              ("tiny-xlm-roberta", "bfloat16"),
                                              ("tiny-bert", "float16")])
def test_embeddings_equal_hf_cls_pooled_and_normalised(runs, encoders, texts, model, dtype):
    run = runs[(model, dtype)]
    oracle = pooling.hf_embeddings(encoders[model], pooling.token_ids(encoders[model], texts))
    found = torch.tensor(run["embeddings"])
    assert found.shape == oracle.shape
    torch.testing.assert_close(found.norm(dim=-1), torch.ones(len(texts)), atol=1e-3, rtol=0)
    cosines = pooling.cosines(found, oracle)
    assert bool((cosines >= MIN_COSINE[dtype]).all()), cosines.tolist()
    _assert_encoder_attention_only(run)


def test_classifier_probabilities_equal_hf(runs, encoders, texts):
    run = runs[("tiny-bert-classifier", "float32")]
    model = encoders["tiny-bert-classifier"]
    oracle = pooling.hf_class_probabilities(model, pooling.token_ids(model, texts))
    torch.testing.assert_close(torch.tensor(run["probabilities"]), oracle, atol=1e-5, rtol=0)
    _assert_encoder_attention_only(run)


@pytest.mark.v0_20_features
def test_cross_encoder_scores_are_the_sigmoid_of_hf_logits(runs, encoders, texts):
    run = runs[("tiny-bert-reranker", "float32")]
    logits = pooling.hf_cross_encoder_logits(encoders["tiny-bert-reranker"], texts[0], texts[1:])
    torch.testing.assert_close(torch.tensor(run["scores"]), logits.sigmoid(), atol=1e-5, rtol=0)
    _assert_encoder_attention_only(run)


@pytest.mark.v0_20_features
def test_the_tolerance_tells_bidirectional_from_causal_attention(encoders, texts):
    """The negative control of the cosine bound: the same model attending causally (as the decoder
    path would) lands below it."""
    from transformers import AutoModel

    model_dir = encoders["tiny-xlm-roberta"]
    prompts = pooling.token_ids(model_dir, texts)
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32)
    causal = []
    with torch.no_grad():
        for ids in prompts:
            n = len(ids)
            mask = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
            hidden = model(input_ids=torch.tensor([ids]), attention_mask=mask).last_hidden_state
            causal.append(hidden[0, 0])
    cosines = pooling.cosines(torch.nn.functional.normalize(torch.stack(causal), dim=-1),
                              pooling.hf_embeddings(model_dir, prompts))
    assert bool((cosines < MIN_COSINE["float32"]).all()), cosines.tolist()

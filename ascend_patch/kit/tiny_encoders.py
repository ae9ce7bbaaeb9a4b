"""Tiny encoder-only checkpoints, built locally: BERT and XLM-RoBERTa embedders, a classifier
and a cross-encoder, the shapes of the RAG workhorses (bge-m3, bge-reranker) at toy size.

Each is a real Hugging Face checkpoint directory that vLLM and transformers load the normal way:

- ``tiny-bert``: ``BertModel`` with a WordPiece tokenizer (``[CLS] A [SEP] B [SEP]``, token types);
- ``tiny-xlm-roberta``: ``XLMRobertaModel`` as bge-m3 ships it: a sentence-transformers pooling
  config (CLS token, normalised), ``<s> A </s></s> B </s>`` pairs, positions offset past the
  padding id (``pad_token_id`` 1: RoBERTa's first position id is 2);
- ``tiny-bert-classifier``: ``BertForSequenceClassification`` with 3 labels;
- ``tiny-bert-reranker``: ``BertForSequenceClassification`` with one label, a cross-encoder
  reranker (the pair's second text in token type 1).

4 heads of 64 (the NPU attention's usual head size), 2 layers, weights drawn from N(0, 0.05) with
unit LayerNorm gains: small enough that attention stays soft (every key weighs in, so attending
causally or across sequences moves the pooled output well past the tests' tolerance), large
enough that the layers change the embedding. Deterministic, reused when the recipe is unchanged.

    python -m ascend_patch.kit.tiny_encoders OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ascend_patch.kit import tiny_models

RECIPE = {
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 512,
    "seed": 0,
    "init_std": 0.05,
    # Real BERT and bge-m3 configs carry it; recent transformers no longer default it, and vLLM's
    # RoBERTa embedding reads it.
    "position_embedding_type": "absolute",
}
# name -> (architecture, tokenizer family, config overrides)
MODELS = {
    "tiny-bert": ("BertModel", "bert", {}),
    "tiny-xlm-roberta": ("XLMRobertaModel", "xlm-roberta", {}),
    "tiny-bert-classifier": ("BertForSequenceClassification", "bert", {"num_labels": 3}),
    "tiny-bert-reranker": ("BertForSequenceClassification", "bert", {"num_labels": 1}),
}
_CONFIGS = {"bert": "BertConfig", "xlm-roberta": "XLMRobertaConfig"}
# The special tokens in vocabulary order: XLM-RoBERTa's ids are fixed (<s> 0, <pad> 1, </s> 2).
_SPECIAL = {
    "bert": {"pad": "[PAD]", "unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"},
    "xlm-roberta": {"cls": "<s>", "pad": "<pad>", "sep": "</s>", "unk": "<unk>", "mask": "<mask>"},
}


def _tokenizer(out: Path, family: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    special = _SPECIAL[family]
    if family == "bert":
        tok = Tokenizer(models.WordPiece(unk_token=special["unk"]))
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(vocab_size=RECIPE["vocab_size"],
                                            special_tokens=list(special.values()),
                                            show_progress=False)
    else:
        tok = Tokenizer(models.BPE(unk_token=special["unk"]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=RECIPE["vocab_size"],
                                      special_tokens=list(special.values()),
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False)
    tok.train_from_iterator(tiny_models.corpus(), trainer)
    cls, sep = special["cls"], special["sep"]
    ids = {name: tok.token_to_id(token) for name, token in special.items()}
    # BERT marks the second text with token type 1; XLM-RoBERTa has one token type.
    pair = f"{cls} $A {sep} $B:1 {sep}:1" if family == "bert" else f"{cls} $A {sep} {sep} $B {sep}"
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}", pair=pair,
        special_tokens=[(cls, ids["cls"]), (sep, ids["sep"])])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, model_input_names=["input_ids", "token_type_ids", "attention_mask"]
        if family == "bert" else ["input_ids", "attention_mask"],
        **{f"{name}_token": token for name, token in special.items()})
    if family == "xlm-roberta":
        fast.bos_token, fast.eos_token = cls, sep
    fast.save_pretrained(out)
    return fast, ids


def _sentence_transformers_pooling(out: Path, hidden_size: int) -> None:
    """The sentence-transformers modules bge-m3 ships: CLS pooling, then normalisation."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"},
    ]
    (out / "modules.json").write_text(json.dumps(modules, indent=2))
    pooling = {"word_embedding_dimension": hidden_size, "pooling_mode_cls_token": True,
               "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False,
               "pooling_mode_mean_sqrt_len_tokens": False}
    (out / "1_Pooling").mkdir(exist_ok=True)
    (out / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2))
    (out / "2_Normalize").mkdir(exist_ok=True)


def _model(out: Path, architecture: str, family: str, overrides: dict) -> None:
    import transformers

    _, ids = _tokenizer(out, family)
    config = getattr(transformers, _CONFIGS[family])(
        vocab_size=RECIPE["vocab_size"],
        hidden_size=RECIPE["hidden_size"],
        intermediate_size=RECIPE["intermediate_size"],
        num_hidden_layers=RECIPE["num_hidden_layers"],
        num_attention_heads=RECIPE["num_attention_heads"],
        # RoBERTa offsets positions past the padding id, so it needs that many more rows.
        max_position_embeddings=RECIPE["max_position_embeddings"]
        + (ids["pad"] + 1 if family == "xlm-roberta" else 0),
        type_vocab_size=2 if family == "bert" else 1,
        position_embedding_type=RECIPE["position_embedding_type"],
        pad_token_id=ids["pad"],
        bos_token_id=ids["cls"],
        eos_token_id=ids["sep"],
        torch_dtype="float32",
        **overrides,
    )
    model = tiny_models.seeded_model(architecture, config, RECIPE["seed"], lambda name: None
                                     if "LayerNorm.weight" in name else RECIPE["init_std"])
    model.save_pretrained(out, safe_serialization=True)
    if architecture == "XLMRobertaModel":
        _sentence_transformers_pooling(out, RECIPE["hidden_size"])


def build(root: Path, names: list[str] | None = None) -> dict[str, Path]:
    """Build ``names`` (default: every model) under ``root``, reusing what is already built."""
    def make(out, recipe, architecture, family, overrides):
        _model(out, architecture, family, overrides)

    return tiny_models.build_recipes(root, {name: [RECIPE, *MODELS[name]] for name in names or MODELS},
                                     make)


if __name__ == "__main__":
    sys.exit(tiny_models.command_line(build, __doc__.splitlines()[0]))

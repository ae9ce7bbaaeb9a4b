"""HF transformers oracles for pooling models (embedders, classifiers, cross-encoders), pooled
the way vLLM pools them, and the comparisons the tests and ``verify`` make.

- embeddings: the encoder's last hidden state at the first token (``[CLS]`` / ``<s>``: vLLM's
  CLS pooling for BERT and XLM-RoBERTa, and what bge-m3's sentence-transformers config asks
  for), L2-normalised (vLLM's default activation for ``embed``);
- classification: the model's own head (pooler + classifier), softmax over the labels (vLLM's
  default activation for ``classify`` with more than one label);
- cross-encoder scores: the tokenizer's pair encoding of (query, document), the head's single
  logit, sigmoid (vLLM's ``score`` for one label).
"""

from __future__ import annotations

import importlib.util
import textwrap
from pathlib import Path

import torch


def sentences(count: int, words: list[int]) -> list[str]:
    """``count`` texts cut from a stdlib source, ``words[i % len(words)]`` words each."""
    text = textwrap.dedent(importlib.util.find_spec("email.message").loader.get_source("email.message"))
    pool = text.split()
    out, start = [], 0
    for i in range(count):
        n = words[i % len(words)]
        out.append(" ".join(pool[start : start + n]))
        start += n
    return out


def token_ids(model_dir: Path, texts: list[str]) -> list[list[int]]:
    """The texts as the model's tokenizer encodes them, special tokens included."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [tokenizer(text).input_ids for text in texts]


def _forward(model, ids: list[int]):
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        return model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids))


def hf_embeddings(model_dir: Path, prompts: list[list[int]]) -> torch.Tensor:
    """[prompts, hidden]: CLS-pooled, normalised, fp32."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32)
    rows = [_forward(model, ids).last_hidden_state[0, 0] for ids in prompts]
    return torch.nn.functional.normalize(torch.stack(rows), dim=-1)


def hf_class_probabilities(model_dir: Path, prompts: list[list[int]]) -> torch.Tensor:
    """[prompts, labels]: softmax of the sequence-classification logits, fp32."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32)
    return torch.stack([_forward(model, ids).logits[0] for ids in prompts]).softmax(dim=-1)


def hf_cross_encoder_logits(model_dir: Path, query: str, documents: list[str]) -> torch.Tensor:
    """[documents]: the single logit of (query, document) pairs, as the tokenizer pairs them."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32)
    logits = []
    with torch.no_grad():
        for document in documents:
            encoded = tokenizer(query, document, return_tensors="pt")
            logits.append(model(**encoded).logits[0, 0])
    return torch.stack(logits)


def cosines(vectors, oracle: torch.Tensor) -> torch.Tensor:
    """Row-wise cosine similarity of ``vectors`` (lists or a tensor) to ``oracle``."""
    found = torch.as_tensor(vectors, dtype=torch.float32)
    return torch.nn.functional.cosine_similarity(found, oracle, dim=-1)

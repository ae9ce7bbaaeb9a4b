"""Reference kernel of npu_top_k_top_p: it enforces the op's documented input contract, then
computes its documented output (the signature of the ``ascend_patch.npu.kernels.npu`` twin).

Contract source: [TOPKP] ``torch_npu-npu_top_k_top_p.md`` (Ascend/op-plugin at 517f2e7d, docs under
``docs/zh/custom_APIs/torch_npu/``) and the ``npu_top_k_top_p`` docstring in
``codegen/templates/_op_plugin_docs.py`` (algorithm; p and k may not both be None).
"""

import torch

from ascend_patch.npu.kernels import limits
from ascend_patch.npu.kernels.contracts import check_dims, check_dtype, check_tensor, require

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def top_k_top_p(logits, p=None, k=None):
    """Mask logits outside each row's top-k and then top-p set to -inf ([TOPKP] algorithm)."""
    op = "npu_top_k_top_p"
    require(p is not None or k is not None, op, "p/k", "at least one of p and k", "both None")
    check_tensor(op, "logits", logits)
    check_dims(op, "logits", logits, 2)  # [TOPKP] 维数支持 2 维
    check_dtype(op, "logits", logits, _FLOATS)
    rows, vocab = logits.shape
    if p is not None:
        check_tensor(op, "p", p)
        check_dims(op, "p", p, 1)
        # [TOPKP] p: 数据类型需要与 logits 一致, shape 与 logits 的第一维相同, 值域 [0, 1].
        require(p.dtype == logits.dtype, op, "p", f"{logits.dtype} like logits", p.dtype)
        require(p.numel() == rows, op, "p", f"{rows} entries (logits.shape[0])", p.numel())
        if rows:
            low, high = p.aminmax()
            require(0 <= low and high <= 1, op, "p", "within [0, 1]",
                    f"range [{float(low)}, {float(high)}]")
    if k is not None:
        check_tensor(op, "k", k)
        check_dims(op, "k", k, 1)
        # [TOPKP] k: int32, 值域 [1, 1024], 最大值 ≤ logits.size(1), shape 与 logits 的第一维相同.
        check_dtype(op, "k", k, (torch.int32,))
        require(k.numel() == rows, op, "k", f"{rows} entries (logits.shape[0])", k.numel())
        if rows:
            low, high = (int(v) for v in k.aminmax())
            require(1 <= low and high <= limits.TOP_K_MAX, op, "k", f"within [1, {limits.TOP_K_MAX}]",
                    f"range [{low}, {high}]")
            require(high <= vocab, op, "k", f"≤ vocab size {vocab}", high)

    # [TOPKP] 1: stable ascending sort; 2-4: drop values below the k-th largest; 5-8: softmax,
    # cumulative sum from the smallest, drop where it is ≤ 1 - p but keep the largest; 9: unsort.
    values, order = logits.sort(dim=-1, stable=True)
    if k is not None:
        threshold = values.gather(1, (vocab - k.long())[:, None])
        values = values.masked_fill(values < threshold, float("-inf"))
    if p is not None:
        cumulative = values.float().softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= (1 - p.float())[:, None]
        drop[:, -1] = False
        values = values.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, values)

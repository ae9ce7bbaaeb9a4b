"""Reference kernel of the gated delta rule's decode op, ``npu_recurrent_gated_delta_rule``:
enforces its documented input contract, then computes its documented output with the published
recurrence (:mod:`ascend_patch.npu.kernels.recurrence`).

Contract source: [RGDR] the ``npu_recurrent_gated_delta_rule`` docstring in the torch-npu 2.14.0
wheel's ``torch_npu/_op_plugin_docs.py`` and its schema in
``csrc/aten/npu_native_functions_by_codegen.yaml`` (state ``Tensor(a!)``, updated in place;
Atlas A2/A3). Each token ``t`` has a state slot ``ssm_state_indices[t]``: a sequence starts from
the slot of its ``num_accepted_tokens``-th token (its first without them) and every token writes
the state after it to its own slot.
"""

import torch

from ascend_patch.npu.kernels import limits, recurrence
from ascend_patch.npu.kernels.contracts import (
    check_dims,
    check_dtype,
    check_int_list,
    check_tensor,
    require,
)

_OP = "npu_recurrent_gated_delta_rule"


def recurrent_gated_delta_rule(query, key, value, state, *, beta=None, scale=None,
                               actual_seq_lengths=None, ssm_state_indices=None,
                               num_accepted_tokens=None, g=None, gk=None):
    """``o [T, Nv, Dv]`` (bf16) of the gated delta rule over packed sequences; ``state``
    ``[BlockNum, Nv, Dv, Dk]`` updated in place."""
    for name, tensor in (("query", query), ("key", key), ("value", value), ("state", state),
                         ("beta", beta)):
        check_tensor(_OP, name, tensor)
        check_dtype(_OP, name, tensor, (torch.bfloat16,))  # [RGDR] 数据类型支持bfloat16
    check_dims(_OP, "query", query, 3)  # [RGDR] (T, Nk, Dk)
    tokens, k_heads, k_dim = query.shape
    v_heads, v_dim = value.shape[1], value.shape[2]
    require(key.shape == query.shape, _OP, "key", f"shape {tuple(query.shape)} like query",
            tuple(key.shape))
    check_dims(_OP, "value", value, 3)  # [RGDR] (T, Nv, Dv)
    require(value.shape[0] == tokens, _OP, "value", f"{tokens} tokens like query", value.shape[0])
    require(state.dim() == 4 and tuple(state.shape[1:]) == (v_heads, v_dim, k_dim), _OP, "state",
            f"[BlockNum, {v_heads}, {v_dim}, {k_dim}] (BlockNum, Nv, Dv, Dk)", tuple(state.shape))
    require(tuple(beta.shape) == (tokens, v_heads), _OP, "beta", f"({tokens}, {v_heads})",
            tuple(beta.shape))
    require(v_heads % k_heads == 0, _OP, "value", f"a multiple of the {k_heads} key heads",
            v_heads)
    for name, size, high in (("Nk", k_heads, limits.RGDR_MAX_HEADS),
                             ("Nv", v_heads, limits.RGDR_MAX_HEADS),
                             ("Dk", k_dim, limits.RGDR_MAX_HEAD_DIM),
                             ("Dv", v_dim, limits.RGDR_MAX_HEAD_DIM)):
        require(size <= high, _OP, name, f"≤ {high}", size)  # [RGDR] 约束说明
    require(isinstance(scale, float), _OP, "scale", "a float (1/sqrt(Dk))", type(scale).__name__)
    require(gk is None, _OP, "gk", "None (not supported in this version)", "a tensor")
    if g is not None:
        check_tensor(_OP, "g", g)
        check_dtype(_OP, "g", g, (torch.float32,))  # [RGDR] g: float32, (T, Nv)
        require(tuple(g.shape) == (tokens, v_heads), _OP, "g", f"({tokens}, {v_heads})",
                tuple(g.shape))
    lengths = _int32_vector("actual_seq_lengths", actual_seq_lengths)
    require(all(1 <= n <= limits.RGDR_MAX_SEQ_LEN for n in lengths), _OP, "actual_seq_lengths",
            f"each in [1, {limits.RGDR_MAX_SEQ_LEN}]", lengths)
    require(sum(lengths) == tokens, _OP, "actual_seq_lengths", f"summing to T = {tokens}", lengths)
    slots = _int32_vector("ssm_state_indices", ssm_state_indices)
    require(len(slots) == tokens and all(0 <= s < state.shape[0] for s in slots), _OP,
            "ssm_state_indices", f"{tokens} slots in [0, {state.shape[0]})", slots)
    accepted = [1] * len(lengths) if num_accepted_tokens is None else _int32_vector(
        "num_accepted_tokens", num_accepted_tokens)
    require(len(accepted) == len(lengths) and all(1 <= a <= n for a, n in zip(accepted, lengths)),
            _OP, "num_accepted_tokens", "one per sequence in [1, its length]", accepted)

    gates = torch.zeros(tokens, v_heads) if g is None else g
    out = torch.empty_like(value)
    start = 0
    for length, first in zip(lengths, accepted):
        current = state[slots[start + first - 1]].float()
        for t in range(start, start + length):
            o, current = recurrence.gated_delta_step(query[t], key[t], value[t], gates[t], beta[t],
                                                     current, scale)
            out[t] = o.to(out.dtype)
            state[slots[t]] = current.to(state.dtype)
        start += length
    return out


def _int32_vector(name, tensor) -> list[int]:
    check_tensor(_OP, name, tensor)
    check_dtype(_OP, name, tensor, (torch.int32,))  # [RGDR] int32
    check_dims(_OP, name, tensor, 1)
    return check_int_list(_OP, name, tensor.tolist())

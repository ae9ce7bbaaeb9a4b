"""Block copies between the device KV cache and host memory (KV offload), in plain torch.

The contract is that of the block swap vLLM's offloading copies and vllm-ascend's compiled
``_C_ascend.swap_blocks`` take: ``src`` and ``dst`` index blocks on their first dimension and hold
blocks of one shape and dtype, each block one contiguous run of bytes; ``block_mapping`` is a host
int64 ``[n, 2]`` tensor of (source block, destination block) pairs. A destination named twice
would be written in an unspecified order, so the pairs name each destination once. On the NPU one
of the two tensors is on the device and the other in host memory; emulated, both are host tensors.
"""

import torch

from ascend_patch.npu.kernels.contracts import (
    check_dims,
    check_dtype,
    check_host,
    check_tensor,
    fail,
    require,
)

_OP = "swap_blocks"


def swap_blocks(src, dst, block_mapping):
    for arg, tensor in (("src", src), ("dst", dst)):
        check_tensor(_OP, arg, tensor)
        check_dims(_OP, arg, tensor, 2, 8)
        require(tensor[0].is_contiguous(), _OP, arg, "contiguous within each block",
                f"strides {tensor.stride()}")
    require(dst.dtype == src.dtype, _OP, "dst", f"of src's dtype {src.dtype}", dst.dtype)
    require(dst.shape[1:] == src.shape[1:], _OP, "dst", f"blocks of src's shape {tuple(src.shape[1:])}",
            tuple(dst.shape[1:]))
    check_tensor(_OP, "block_mapping", block_mapping)
    check_host(_OP, "block_mapping", block_mapping)
    check_dtype(_OP, "block_mapping", block_mapping, (torch.int64,))
    require(block_mapping.dim() == 2 and block_mapping.shape[1] == 2, _OP, "block_mapping",
            "[n, 2] (source, destination) pairs", tuple(block_mapping.shape))
    sources, destinations = block_mapping[:, 0], block_mapping[:, 1]
    for arg, ids, bound in (("source", sources, src.shape[0]), ("destination", destinations, dst.shape[0])):
        if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < bound):
            fail(_OP, f"block_mapping's {arg} blocks", f"in [0, {bound})", ids.tolist())
    if destinations.unique().numel() != destinations.numel():
        fail(_OP, "block_mapping's destination blocks", "distinct", destinations.tolist())
    dst[destinations] = src[sources]

"""The real kernels: thin calls of the documented torch_npu ops.

This is the only module in the project that touches torch_npu.

torch_npu is imported on the first call, never at import time: importing it initialises the NPU
runtime (and without the CANN toolkit it breaks ``import torch`` itself), so merely selecting this
backend must stay free. Each kernel keeps the signature of its ``reference`` twin; arguments go to
torch_npu under the names the op schemas use (``op_plugin/config/op_plugin_functions.yaml`` and the
ATB bindings in ``op_plugin/ops/atb/``), except the leading tensor of ops whose schema calls it
``self``, which goes positionally: the generated Python binding renames it ``input``.

The device-runtime queries at the end (probe, names, memory, seeding) live here for the same
reason: they are torch_npu calls; :mod:`ascend_patch.npu.device` and the loader reach the NPU through
them.
"""

import functools
import importlib
import importlib.util


@functools.cache
def _torch_npu():
    return importlib.import_module("torch_npu")


def scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping):
    # npu_scatter_pa_kv_cache rather than ATB _npu_reshape_and_cache: both write vLLM's ND
    # [num_blocks, block_size, KVH, D] caches, but this one has a torch_npu API doc stating its
    # contract (equal dtypes, int32/int64 slots in range, no duplicates) and is the cache write
    # vllm-ascend uses today. Its default cache_mode is "PA_NZ", so "Norm" (ND) is passed.
    _torch_npu().npu_scatter_pa_kv_cache(
        key=key, value=value, key_cache=key_cache, value_cache=value_cache,
        slot_mapping=slot_mapping, cache_mode="Norm",
    )


def fused_infer_attention_score(
    query,
    key,
    value,
    *,
    atten_mask=None,
    block_table=None,
    actual_seq_lengths=None,
    actual_seq_lengths_kv=None,
    num_heads,
    num_key_value_heads,
    scale,
    input_layout="TND",
    block_size=0,
    sparse_mode=0,
):
    # query, key, value positionally, as the documented prototype has them before its `*`.
    return _torch_npu().npu_fused_infer_attention_score(
        query, key, value,
        atten_mask=atten_mask, block_table=block_table,
        actual_seq_lengths=actual_seq_lengths, actual_seq_lengths_kv=actual_seq_lengths_kv,
        num_heads=num_heads, num_key_value_heads=num_key_value_heads, scale=scale,
        input_layout=input_layout, block_size=block_size, sparse_mode=sparse_mode,
    )


def paged_attention(query, key_cache, value_cache, num_kv_heads, num_heads, scale_value,
                    block_table, context_lens, out):
    _torch_npu()._npu_paged_attention(
        query=query, key_cache=key_cache, value_cache=value_cache, num_kv_heads=num_kv_heads,
        num_heads=num_heads, scale_value=scale_value, block_table=block_table,
        context_lens=context_lens, out=out,
    )


def rms_norm(self, gamma, epsilon=1e-6):
    return _torch_npu().npu_rms_norm(self, gamma=gamma, epsilon=epsilon)


def add_rms_norm(x1, x2, gamma, epsilon=1e-6):
    return _torch_npu().npu_add_rms_norm(x1=x1, x2=x2, gamma=gamma, epsilon=epsilon)


def swiglu(self, dim=-1):
    return _torch_npu().npu_swiglu(self, dim=dim)


def rotary_mul(self, r1, r2, rotary_mode="half"):
    return _torch_npu().npu_rotary_mul(self, r1, r2, rotary_mode=rotary_mode)


def top_k_top_p(logits, p=None, k=None):
    # By keyword: the positional order is (logits, p, k), easy to get backwards.
    return _torch_npu().npu_top_k_top_p(logits, p=p, k=k)


# --- device runtime -------------------------------------------------------------------------------


def installed() -> bool:
    """Whether torch_npu is installed at all (found, not imported)."""
    return importlib.util.find_spec("torch_npu") is not None


def probe() -> tuple[bool, str]:
    """``(usable, detail)``: whether torch_npu imports and sees at least one NPU."""
    if not installed():
        return False, "torch_npu is not installed"
    try:
        torch_npu = _torch_npu()
    except Exception as exc:  # a torch_npu without a matching CANN fails in many ways
        return False, f"import torch_npu failed: {exc!r}"
    count = torch_npu.npu.device_count() if torch_npu.npu.is_available() else 0
    if count == 0:
        return False, f"torch_npu {torch_npu.__version__} sees no NPU"
    return True, f"torch_npu {torch_npu.__version__} sees {count} NPU(s)"


def device_name(index: int) -> str:
    return _torch_npu().npu.get_device_name(index)


def device_uuid(index: int) -> str:
    return _torch_npu().npu.get_device_properties(index).uuid


def mem_get_info(index: int | None = None) -> tuple[int, int]:
    return _torch_npu().npu.mem_get_info(index)


def current_memory_usage(device=None) -> int:
    """Peak allocation since now, which is what is in use (vLLM's CUDA platform reads it so)."""
    npu = _torch_npu().npu
    npu.reset_peak_memory_stats(device)
    return npu.max_memory_allocated(device)


def set_device(device) -> None:
    _torch_npu().npu.set_device(device)


def manual_seed_all(seed: int) -> None:
    _torch_npu().npu.manual_seed_all(seed)


def num_compute_units(index: int) -> int:
    # The NPU's counterpart of CUDA's SM count is its cube-core count.
    return _torch_npu().npu.get_device_properties(index).cube_core_num


def cuda_api() -> dict:
    """The torch.cuda stream/event entry points vLLM's GPU runner calls, as torch.npu's."""
    npu = _torch_npu().npu
    return {
        "Stream": npu.Stream,
        "Event": npu.Event,
        "current_stream": npu.current_stream,
        "default_stream": npu.default_stream,
        "stream": npu.stream,
        "set_stream": npu.set_stream,
        "synchronize": npu.synchronize,
    }

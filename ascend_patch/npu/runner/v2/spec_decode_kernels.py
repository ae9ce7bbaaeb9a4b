"""Model Runner V2's speculative-decoding Triton kernels, for the NPU: plain torch.

MRV2 (``vllm/v1/worker/gpu/spec_decode/``) verifies drafts with a rejection sampler and drafts
with one speculator per method, each built of Triton kernels. Without triton-ascend the NPU runs
them as these functions, registered under their own names through vLLM's kernel registry
(``vllm.triton_utils.dispatcher.register_kernels``, from
``Platform.register_triton_kernel_overrides``), under the contract of
:mod:`ascend_patch.npu.runner.v2.input_kernels`: the kernel's parameters by name and in order
(``tl.constexpr`` ones as keyword defaults; the Triton launch options a call site passes,
``num_warps``/``num_stages``, as ignored trailing keywords); the grid ignored (each docstring says
which rows it covers); exactly the kernel's writes; no host read of a device value, no Python
loop over requests (the loops left run over draft steps or n-gram lengths, host constants).

Kernels each method reaches (vLLM 0.34; ``sd`` = ``v1/worker/gpu/spec_decode``):

- every method verifies with ``sd/rejection_sampler.py:RejectionSampler``:
  ``_gather_draft_sampled_kernel`` (every step), ``_flatten_sampled_kernel`` (logprobs),
  ``rejection_sampler_utils.py``'s ``_compute_local_logits_stats_kernel``,
  ``_rejection_kernel``, ``_resample_kernel``, ``_insert_resampled_kernel`` (every step), and
  with ``rejection_sample_method="block"`` ``_compute_cumulative_log_p_kernel`` and
  ``_compute_local_residual_mass_kernel`` (the latter only with draft logits); the runner's own
  ``input_batch._combine_sampled_and_draft_tokens_kernel``, ``_expand_idx_mapping_kernel``,
  ``_get_num_sampled_and_rejected_kernel`` and ``_post_update_kernel`` (in
  :mod:`~ascend_patch.npu.runner.v2.input_kernels`) and the sampler's kernels (in
  :mod:`~ascend_patch.npu.runner.v2.sample_kernels`, which ``Sampler.apply_sampling_params``
  runs on every logit);
- ``ngram`` / ``ngram_gpu`` (``sd/ngram/speculator.py:NgramGPUSpeculator``):
  ``_ngram_scan_kernel``, ``_ngram_finalize_kernel``. Its constructor also refuses to start
  unless ``vllm.v1.worker.gpu.spec_decode.ngram.speculator:HAS_TRITON``;
- ``draft_model`` (``sd/standalone_ar/speculator.py:StandaloneARSpeculator``, on
  ``sd/autoregressive/``): its ``_prepare_prefill_inputs_kernel``; draft sampling is
  ``sample/gumbel.py``'s ``_gumbel_sample_kernel`` + ``_gumbel_combine_kernel`` with a draft
  logits cache (probabilistic drafts) or ``greedy_argmax`` (torch); the drafter's block tables
  are a ``BlockTables`` (pointer-table kernels: the runner's ``NPUBlockTables`` replaces them);
- ``eagle`` / ``eagle3`` (``sd/eagle/speculator.py:EagleSpeculator``) and ``mtp``
  (``sd/mtp/speculator.py:MTPSpeculator``; DeepSeek's single MTP module) are
  ``sd/target_dependent_ar/speculator.py:TargetDependentARSpeculator``: its
  ``_prepare_prefill_inputs_kernel``, ``_prepare_decode_inputs_kernel``,
  ``_update_draft_inputs_kernel``, plus the same draft sampling. ``eagle/utils.py``,
  ``eagle3_utils.py``, ``spec_decode/utils.py``, ``speculator.py`` and ``autoregressive/`` launch
  no kernel of their own;
- ``mtp`` with several MTP modules and ``num_speculative_tokens`` > 1
  (``SpeculativeConfig.use_multi_module_mtp``: ``sd/multi_module_mtp/speculator.py``) adds six
  kernels of its own (``_prepare_input_buffers_kernel``,
  ``_prepare_input_hidden_states_and_embeddings_kernel``, ``_pad_trailing_draft_slots_kernel``,
  ``_cache_inputs_kernel``, ``_shift_input_ids_kernel``, ``_shift_input_embeds_kernel``): not
  implemented here, so that configuration is not served;
- batch-sharded sampling (refused on the NPU) shards the draft logits cache:
  ``sd/draft_logits.py``'s ``_assign_rows_kernel`` and ``_stale_drafts_kernel``, implemented
  here for completeness. Adaptive verification, the acceptance estimator, FLy, watermarking,
  dflash/dspark/suffix/xpress/gemma4 reach further kernels and are not served.

No kernel of these methods takes a device pointer table, so every one is registered; nothing
here replaces a method. The rejection kernels' FLy window (``FLY_WINDOW_SIZE`` > 0) and
watermark (``WATERMARK``) modes raise instead of computing.

Randomness is vLLM's: the acceptance test draws ``tl.rand`` at ``(seed, pos)`` (Triton's Philox,
4x64-10 for vLLM's int64 positions: :func:`philox_uniform`), and resampling draws ``gumbel.py``'s
murmur3 Gumbel noise (:mod:`~ascend_patch.npu.runner.v2.sample_kernels`). Reductions over vocab
blocks follow the sampling kernels' rules: a block's argmax is its first NaN, else its first
maximum, and maxima skip NaNs. Block verification's running joint ratio is computed as a scan
(fp64) where the kernel rounds each step in fp32.

vLLM 0.33 has the same kernels except: the five rejection kernels that read draft logits take no
``draft_logits_row_mapping_ptr``, ``_resample_kernel`` no ``SKIP_MASKED_BLOCKS``,
``_update_draft_inputs_kernel`` takes the model length as a host int (``max_model_len``, 0.34: the
device scalar ``max_model_len_ptr``), and ``draft_logits.py`` does not exist. These functions are
0.34's (``tests/kernels/test_mrv2_spec_decode_kernels.py`` checks each against a per-request
transcription of its kernel and vectors derived by hand).
"""

from __future__ import annotations

import torch

from ascend_patch.npu.runner.v2.input_kernels import _set_where, _token_requests
from ascend_patch.npu.runner.v2.sample_kernels import (_log1p_neg_stable, _nan_free_max,
                                                       murmur3_uniform32, murmur3_uniform64)

_MASK32 = 0xFFFFFFFF
# Triton's Philox4x64 constants (triton/language/random.py), used for 64-bit counters.
_PHILOX_KEY_A = 0x9E3779B97F4A7C15
_PHILOX_KEY_B = 0xBB67AE8584CAA73B
_PHILOX_ROUND_A = 0xD2E7470EE14C6C93
_PHILOX_ROUND_B = 0xCA5A826395121157
_TL_RAND_MIN = 4.6566127342e-10  # gumbel.py's _TL_RAND_MIN, the floor of tl_rand32's draw
_INT64_UNIFORM_SCALE = 1.0842020432385337e-19  # Triton's uint_to_uniform_float for 64 bits


def _kernel_named(name: str):
    """Give an implementation its kernel's name where two vLLM modules use the same one."""

    def rename(fn):
        fn.__name__ = name
        return fn

    return rename


# --- Triton's tl.rand ---------------------------------------------------------------------------

# A uint64 is held as (high, low) uint32 words in int64 tensors, so no product leaves int64.

def _mul32(a, b):
    """(high, low) words of the uint32 product ``a * b``: ``a`` times 16-bit halves of ``b``
    stays below 2**48."""
    upper = a * (b >> 16)
    lower = a * (b & 0xFFFF)
    return (upper + (lower >> 16)) >> 16, (((upper & 0xFFFF) << 16) + lower) & _MASK32


def _mulhilo64(constant: int, value):
    """High and low uint64 halves of ``constant * value`` (``value`` a word pair), by schoolbook
    multiplication of 32-bit words."""
    a1, a0 = constant >> 32, constant & _MASK32
    x1, x0 = value
    h00, l00 = _mul32(x0, a0)
    h10, l10 = _mul32(x0, a1)
    h01, l01 = _mul32(x1, a0)
    h11, l11 = _mul32(x1, a1)
    middle = h00 + l10 + l01
    top = l11 + h10 + h01 + (middle >> 32)
    return ((h11 + (top >> 32)) & _MASK32, top & _MASK32), (middle & _MASK32, l00)


def _add64(value, constant: int):
    high, low = value
    low = low + (constant & _MASK32)
    return (high + (constant >> 32) + (low >> 32)) & _MASK32, low & _MASK32


def _xor64(*values):
    high, low = values[0]
    for other_high, other_low in values[1:]:
        high, low = high ^ other_high, low ^ other_low
    return high, low


def philox4x64(seed: torch.Tensor, counter: torch.Tensor, rounds: int = 10):
    """Triton's ``philox`` for a 64-bit counter (``triton/language/random.py``): Philox4x64
    keyed (seed, 0) on the counter (counter, 0, 0, 0). Returns the four uint64 words as
    (high, low) pairs of int64 tensors."""
    def words(value):
        return (value >> 32) & _MASK32, value & _MASK32

    zero = (torch.zeros_like(counter), torch.zeros_like(counter))
    c0, c1, c2, c3 = words(counter), zero, zero, zero
    k0, k1 = words(seed.expand_as(counter)), zero
    for _ in range(rounds):
        high_b, low_b = _mulhilo64(_PHILOX_ROUND_B, c2)
        high_a, low_a = _mulhilo64(_PHILOX_ROUND_A, c0)
        c0, c1, c2, c3 = _xor64(high_b, c1, k0), low_b, _xor64(high_a, c3, k1), low_a
        k0, k1 = _add64(k0, _PHILOX_KEY_A), _add64(k1, _PHILOX_KEY_B)
    return c0, c1, c2, c3


def philox_uniform(seed: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """``tl.rand(seed, offset)`` for int64 seed and offset (the rejection kernel's, positions
    being int64): the first Philox4x64 word as int64, folded onto [0, 2**63) (``-x - 1`` for a
    negative ``x``, i.e. its complement), converted to fp32 and scaled by 2**-63 rounded."""
    (high, low), _, _, _ = philox4x64(seed.long(), offset.long())
    negative = high >= 1 << 31
    high = torch.where(negative, high ^ _MASK32, high)
    low = torch.where(negative, low ^ _MASK32, low)
    return ((high << 32) | low).float() * torch.tensor(_INT64_UNIFORM_SCALE, dtype=torch.float32)


# --- shared per-logit reductions ----------------------------------------------------------------

def _global_logsumexp(local_max: torch.Tensor, local_sumexp: torch.Tensor, blocks: int):
    """``_compute_global_logsumexp``: combine per-block maxima and summed exponentials."""
    maxes = local_max[..., :blocks].float()
    global_max = _nan_free_max(maxes, dim=-1)
    total = (local_sumexp[..., :blocks].float() * torch.exp(maxes - global_max[..., None])).sum(-1)
    return global_max + torch.log(total)


def _global_argmax(local_max: torch.Tensor, local_argmax: torch.Tensor, blocks: int):
    """``_compute_global_target_argmax`` / the insert kernel's choice: the token of the first
    block with the largest maximum, NaN maxima read as -inf."""
    maxes = local_max[..., :blocks]
    maxes = maxes.masked_fill(maxes.isnan(), float("-inf"))
    block = maxes.argmax(dim=-1, keepdim=True)
    return local_argmax[..., :blocks].gather(-1, block).squeeze(-1).long()


def _draft_rows(request: torch.Tensor, row_mapping) -> torch.Tensor:
    """``max(draft_logits_row(request, row_mapping), 0)``: a request's draft-logits row."""
    row = request.long()
    if row_mapping is not None:
        row = torch.where(row >= 0, row_mapping[row.clamp(min=0)].long(), -1)
    return row.clamp(min=0)


def _block_view(values: torch.Tensor, vocab_size: int, block_size: int) -> torch.Tensor:
    """``[rows, vocab]`` fp32 → ``[rows, blocks, block_size]``, padding lanes -inf as the
    kernels' masked loads leave them."""
    rows = values.shape[0]
    blocks = -(-vocab_size // block_size)
    lanes = values.new_full((rows, blocks * block_size), float("-inf"), dtype=values.dtype)
    lanes[:, :vocab_size] = values[:, :vocab_size]
    return lanes.view(rows, blocks, block_size)


def _block_argmax(lanes: torch.Tensor, block_size: int):
    """``tl.max(..., return_indices=True)`` per block: (token id, value), first NaN else first
    maximum."""
    index = lanes.argmax(dim=-1, keepdim=True)
    value = lanes.gather(-1, index).squeeze(-1)
    blocks = torch.arange(lanes.shape[1], device=lanes.device)
    return index.squeeze(-1) + blocks * block_size, value


def _max_and_sumexp(lanes: torch.Tensor):
    """``_compute_max_and_sumexp`` per block."""
    maximum = _nan_free_max(lanes, dim=-1)
    sumexp = torch.exp(lanes - maximum[..., None]).sum(-1)
    return maximum, torch.where(maximum > float("-inf"), sumexp, 0.0)


def _put(dest: torch.Tensor, index: torch.Tensor, values: torch.Tensor,
         written: torch.Tensor) -> None:
    """``dest.view(-1)[index] = values`` where ``written`` (the written indices distinct, as the
    kernels' are), the rest of ``dest`` untouched: unwritten lanes go to a spare slot, so they
    never meet a real write, and no arithmetic touches what ``dest`` held."""
    flat = dest.view(-1)
    spare = flat.shape[0]
    index = torch.where(written, index.long(), spare)
    staged = flat.new_zeros(spare + 1)
    staged.index_put_((index,), values.to(flat.dtype))
    hit = torch.zeros(spare + 1, dtype=torch.bool, device=flat.device)
    hit.index_put_((index,), torch.ones_like(index, dtype=torch.bool))
    flat.copy_(torch.where(hit[:spare], staged[:spare], flat))


def _write_rows(dest: torch.Tensor, rows: int, written: torch.Tensor, values: torch.Tensor):
    """``dest[r, :values.shape[1]] = values[r]`` for the written rows ``r < rows``."""
    target = dest[:rows, : values.shape[1]]
    target.copy_(torch.where(written[:, None], values.to(dest.dtype), target))


def _logits_at(logits: torch.Tensor, row: torch.Tensor, token: torch.Tensor, valid: torch.Tensor):
    """fp32 ``logits[row, token]`` where valid, else -inf (a masked load)."""
    token = token.clamp(0, logits.shape[-1] - 1)
    return torch.where(valid, logits[row, token].float(), float("-inf"))


def _step_logprobs(target_logits, target_local_max, target_local_sumexp, draft_logits,
                   draft_row_mapping, draft_local_max, draft_local_sumexp, logit, request, step,
                   token, valid, temp, blocks):
    """``_compute_global_logprobs_and_logsumexp`` for one token per entry of ``logit``: target
    and draft log-probabilities and log-sum-exps (draft: 0 and 0 without draft logits)."""
    target_lse = _global_logsumexp(target_local_max[logit], target_local_sumexp[logit], blocks)
    target = _logits_at(target_logits, logit, token, valid) - target_lse
    if draft_logits is None:
        zero = torch.zeros_like(target)
        return target, zero, target_lse, zero
    row = _draft_rows(request, draft_row_mapping)
    steps = draft_logits.shape[1]
    flat = draft_logits.view(draft_logits.shape[0] * steps, -1)
    draft_logit = _logits_at(flat, row * steps + step.clamp(max=steps - 1), token, valid) / temp
    draft_lse = _global_logsumexp(draft_local_max[logit], draft_local_sumexp[logit], blocks)
    return target, draft_logit - draft_lse, target_lse, draft_lse


def _request_steps(cu_num_logits: torch.Tensor, width: int, num_logits: int):
    """Per request ``r`` and draft step ``i < width``: its logit ``cu[r] + i`` (clamped), whether
    the step exists (``i < cu[r+1] - cu[r] - 1``), and the request's draft count."""
    start = cu_num_logits[:-1].long()
    num_drafts = cu_num_logits[1:].long() - start - 1
    step = torch.arange(width, device=start.device)
    logit = (start[:, None] + step).clamp(0, max(num_logits - 1, 0))
    return logit, step[None, :] < num_drafts[:, None], num_drafts


# --- rejection_sampler.py -----------------------------------------------------------------------

def _flatten_sampled_kernel(
    flat_sampled_ptr,
    sampled_ptr,
    sampled_stride,
    num_sampled_ptr,
    cu_num_logits_ptr,
    num_warps=None,
):
    """Request ``r`` (one per ``cu_num_logits`` interval): its ``num_sampled[r]`` sampled tokens
    to ``flat_sampled[cu_num_logits[r] + i]``."""
    num_reqs = cu_num_logits_ptr.shape[0] - 1
    if num_reqs == 0:
        return
    sampled = sampled_ptr[:num_reqs]
    column = torch.arange(sampled.shape[1], device=sampled.device)
    written = column[None, :] < num_sampled_ptr[:num_reqs, None]
    _put(flat_sampled_ptr, cu_num_logits_ptr[:num_reqs, None].long() + column, sampled, written)


def _gather_draft_sampled_kernel(
    draft_sampled_ptr,
    pos_ptr,
    input_ids_ptr,
    positions_ptr,
    logits_indices_ptr,
    expanded_idx_mapping_ptr,
    expanded_local_pos_ptr,
    prefill_len_ptr,
    num_logits,
    BLOCK_SIZE=None,
):
    """Logit ``l < num_logits``: the token and position of its input slot
    (``logits_indices[l]``), the token -1 for a draft slot (local position > 0) of a step that
    started inside the request's prefill (a placeholder, which verification rejects)."""
    if num_logits == 0:
        return
    token_index = logits_indices_ptr[:num_logits].long()
    token_id = input_ids_ptr[token_index]
    pos = positions_ptr[token_index]
    local_pos = expanded_local_pos_ptr[:num_logits]
    prefill_len = prefill_len_ptr[expanded_idx_mapping_ptr[:num_logits].long()]
    placeholder = (local_pos > 0) & (pos - local_pos < prefill_len)
    draft_sampled_ptr[:num_logits] = torch.where(placeholder, -1, token_id).to(
        draft_sampled_ptr.dtype)
    pos_ptr[:num_logits] = pos.to(pos_ptr.dtype)


# --- rejection_sampler_utils.py -----------------------------------------------------------------

def _compute_local_logits_stats_kernel(
    target_local_argmax_ptr,
    target_local_argmax_stride,
    target_local_max_ptr,
    target_local_max_stride,
    target_local_sumexp_ptr,
    target_local_sumexp_stride,
    draft_local_max_ptr,
    draft_local_max_stride,
    draft_local_sumexp_ptr,
    draft_local_sumexp_stride,
    target_logits_ptr,
    target_logits_stride,
    draft_logits_ptr,
    draft_logits_stride_0,
    draft_logits_stride_1,
    draft_logits_row_mapping_ptr,
    expanded_idx_mapping_ptr,
    expanded_local_pos_ptr,
    temp_ptr,
    vocab_size,
    num_logits,
    BLOCK_SIZE=8192,
    HAS_DRAFT_LOGITS=False,
):
    """Every logit ``l < num_logits`` but a bonus one (the last of its request: the next
    logit's local position is 0, or there is none), per ``BLOCK_SIZE`` vocab block: at
    temperature 0 the target's block argmax and max; otherwise the target's block max and
    summed exponentials and, with draft logits, the draft's (its cached row at step
    ``local_pos[l]``, divided by the temperature)."""
    if num_logits == 0:
        return
    device = target_logits_ptr.device
    following = torch.cat((expanded_local_pos_ptr[1:num_logits],
                           torch.zeros(1, dtype=expanded_local_pos_ptr.dtype, device=device)))
    computed = following != 0
    request = expanded_idx_mapping_ptr[:num_logits].long()
    temp = temp_ptr[request].float()
    greedy = temp == 0.0
    lanes = _block_view(target_logits_ptr[:num_logits].float(), vocab_size, BLOCK_SIZE)
    blocks = lanes.shape[1]

    token, value = _block_argmax(lanes, BLOCK_SIZE)
    _write_rows(target_local_argmax_ptr, num_logits, computed & greedy, token)
    maximum, sumexp = _max_and_sumexp(lanes)
    _write_rows(target_local_max_ptr, num_logits, computed,
                torch.where(greedy[:, None], value, maximum))
    sampling = computed & ~greedy
    _write_rows(target_local_sumexp_ptr, num_logits, sampling, sumexp)
    if not HAS_DRAFT_LOGITS:
        return
    row = _draft_rows(request, draft_logits_row_mapping_ptr)
    step = expanded_local_pos_ptr[:num_logits].long().clamp(0, draft_logits_ptr.shape[1] - 1)
    draft = draft_logits_ptr[row, step, :vocab_size].float() / temp[:, None]
    draft_max, draft_sumexp = _max_and_sumexp(_block_view(draft, vocab_size, BLOCK_SIZE))
    _write_rows(draft_local_max_ptr, num_logits, sampling, draft_max[:, :blocks])
    _write_rows(draft_local_sumexp_ptr, num_logits, sampling, draft_sumexp[:, :blocks])


def _compute_cumulative_log_p_kernel(
    cumulative_log_p_ptr,
    target_logits_ptr,
    target_logits_stride,
    target_local_max_ptr,
    target_local_max_stride,
    target_local_sumexp_ptr,
    target_local_sumexp_stride,
    draft_sampled_ptr,
    draft_logits_ptr,
    draft_logits_stride_0,
    draft_logits_stride_1,
    draft_logits_row_mapping_ptr,
    draft_local_max_ptr,
    draft_local_max_stride,
    draft_local_sumexp_ptr,
    draft_local_sumexp_stride,
    cu_num_logits_ptr,
    idx_mapping_ptr,
    temp_ptr,
    vocab_num_blocks,
    PADDED_VOCAB_NUM_BLOCKS=None,
    HAS_DRAFT_LOGITS=False,
    num_warps=None,
):
    """Block verification's running joint ratio: request ``r`` at temperature > 0, draft step
    ``i``: ``cumulative_log_p[cu[r] + i] = min(previous + log p(x) - log q(x), 0)`` over its
    drafts ``x`` (``draft_sampled`` one logit ahead), a -1 placeholder carrying the previous
    value (0 before the first step)."""
    num_reqs = cu_num_logits_ptr.shape[0] - 1
    num_logits = target_logits_ptr.shape[0]
    if num_reqs == 0 or num_logits == 0:
        return
    request = idx_mapping_ptr[:num_reqs].long()
    temp = temp_ptr[request].float()
    # A request has fewer drafts than the batch has logits: that bounds the steps on the host.
    logit, exists, _ = _request_steps(cu_num_logits_ptr[: num_reqs + 1], num_logits, num_logits)
    token = draft_sampled_ptr[(logit + 1).clamp(max=draft_sampled_ptr.shape[0] - 1)].long()
    valid = token >= 0
    steps = torch.arange(logit.shape[1], device=logit.device).expand_as(logit)
    target, draft, _, _ = _step_logprobs(
        target_logits_ptr, target_local_max_ptr, target_local_sumexp_ptr,
        draft_logits_ptr if HAS_DRAFT_LOGITS else None, draft_logits_row_mapping_ptr,
        draft_local_max_ptr, draft_local_sumexp_ptr, logit, request[:, None].expand_as(logit),
        steps, token, valid, temp[:, None], vocab_num_blocks)
    # The kernel's x_i = min(x_{i-1} + d_i, 0) from x = 0 is S_i - max(0, S_1..S_i) with S the
    # running sum of d (a placeholder adds 0): a scan, in fp64, where the kernel rounds each
    # step in fp32 (the two agree to fp32 rounding).
    increment = torch.where(valid & exists, target - draft, 0.0).double()
    running = increment.cumsum(dim=1)
    log_p = running - running.cummax(dim=1).values.clamp(min=0.0)
    written = exists & (temp != 0.0)[:, None]
    _put(cumulative_log_p_ptr, logit, log_p, written)


def _compute_local_residual_mass_kernel(
    local_residual_mass_ptr,
    local_residual_mass_stride,
    cumulative_log_p_ptr,
    target_logits_ptr,
    target_logits_stride,
    target_local_max_ptr,
    target_local_max_stride,
    target_local_sumexp_ptr,
    target_local_sumexp_stride,
    draft_logits_ptr,
    draft_logits_stride_0,
    draft_logits_stride_1,
    draft_logits_row_mapping_ptr,
    draft_local_max_ptr,
    draft_local_max_stride,
    draft_local_sumexp_ptr,
    draft_local_sumexp_stride,
    draft_sampled_ptr,
    expanded_idx_mapping_ptr,
    expanded_local_pos_ptr,
    temp_ptr,
    vocab_size,
    num_logits,
    vocab_num_blocks,
    BLOCK_SIZE=8192,
    PADDED_VOCAB_NUM_BLOCKS=None,
):
    """Block verification's residual mass per vocab block: logit ``l`` neither a request's
    first nor its bonus one, whose next draft is real and whose request samples:
    ``sum over the block of max(p * M_b(x) - M_s(x), 0)`` with ``p = exp(cumulative_log_p[l-1])``,
    ``M_b``/``M_s`` the target's and draft's distributions at ``l``."""
    if num_logits == 0:
        return
    device = target_logits_ptr.device
    local_pos = expanded_local_pos_ptr[:num_logits].long()
    following = torch.cat((expanded_local_pos_ptr[1:num_logits],
                           torch.zeros(1, dtype=expanded_local_pos_ptr.dtype, device=device)))
    logit = torch.arange(num_logits, device=device)
    next_draft = draft_sampled_ptr[(logit + 1).clamp(max=draft_sampled_ptr.shape[0] - 1)]
    request = expanded_idx_mapping_ptr[:num_logits].long()
    temp = temp_ptr[request].float()
    computed = (local_pos != 0) & (following != 0) & (next_draft >= 0) & (temp != 0.0)

    target_lse = _global_logsumexp(target_local_max_ptr[:num_logits],
                                   target_local_sumexp_ptr[:num_logits], vocab_num_blocks)
    target = target_logits_ptr[:num_logits, :vocab_size].float() - target_lse[:, None]
    row = _draft_rows(request, draft_logits_row_mapping_ptr)
    step = local_pos.clamp(0, draft_logits_ptr.shape[1] - 1)
    draft_lse = _global_logsumexp(draft_local_max_ptr[:num_logits],
                                  draft_local_sumexp_ptr[:num_logits], vocab_num_blocks)
    draft = (draft_logits_ptr[row, step, :vocab_size].float() / temp[:, None]
             - draft_lse[:, None])
    p = torch.exp(cumulative_log_p_ptr[(logit - 1).clamp(min=0)].float())
    partial = torch.clamp(p[:, None] * torch.exp(target) - torch.exp(draft), min=0.0)
    lanes = _block_view(partial, vocab_size, BLOCK_SIZE).nan_to_num(neginf=0.0)
    _write_rows(local_residual_mass_ptr, num_logits, computed, lanes.sum(-1))


def _rejection_kernel(
    sampled_ptr,
    sampled_stride,
    rejected_steps_ptr,
    target_rejected_logsumexp_ptr,
    draft_rejected_logsumexp_ptr,
    target_logits_ptr,
    target_logits_stride,
    target_local_argmax_ptr,
    target_local_argmax_stride,
    target_local_max_ptr,
    target_local_max_stride,
    target_local_sumexp_ptr,
    target_local_sumexp_stride,
    draft_sampled_ptr,
    draft_logits_ptr,
    draft_logits_stride_0,
    draft_logits_stride_1,
    draft_logits_row_mapping_ptr,
    draft_local_max_ptr,
    draft_local_max_stride,
    draft_local_sumexp_ptr,
    draft_local_sumexp_stride,
    cu_num_logits_ptr,
    idx_mapping_ptr,
    temp_ptr,
    seed_ptr,
    pos_ptr,
    synthetic_conditional_rates_ptr,
    cumulative_log_p_ptr,
    local_residual_mass_ptr,
    local_residual_mass_stride,
    fly_entropy_ptr,
    fly_entropy_threshold,
    vocab_num_blocks,
    PADDED_VOCAB_NUM_BLOCKS=None,
    HAS_DRAFT_LOGITS=False,
    SYNTHETIC_MODE=False,
    USE_BLOCK_VERIFICATION=False,
    FLY_WINDOW_SIZE=0,
    num_warps=None,
):
    """Request ``r`` (one per ``cu_num_logits`` interval) verifies its drafts (``draft_sampled``
    one logit ahead of each step's target logits) in order, with ``u = tl.rand(seed, pos)``
    (block verification: the seed mixed with the step):

    - temperature 0: accept while the draft is the target argmax; the first rejected step
      stores the argmax;
    - otherwise (Leviathan et al.): accept while ``log p(x) > log u + log q(x)`` (q one-hot
      without draft logits); synthetic mode accepts while ``u < rate[i]`` instead; a -1
      placeholder ends verification;
    - block verification (temperature > 0): the accepted length is one past the last step with
      ``u <= h`` (Sun et al.), every verified step storing its draft.

    Writes ``sampled[r, i]`` for every verified step (the draft, or the argmax that replaces a
    rejected greedy one), ``rejected_steps[r]`` = accepted length and the target and draft
    log-sum-exp at the rejected step (0 where none, and for greedy requests)."""
    if FLY_WINDOW_SIZE > 0:
        raise RuntimeError("ascend-patch: the FLy rejection window is not served on the NPU")
    num_reqs = cu_num_logits_ptr.shape[0] - 1
    num_logits = target_logits_ptr.shape[0]
    if num_reqs == 0:
        return
    device = target_logits_ptr.device
    width = sampled_ptr.shape[1] - 1
    request = idx_mapping_ptr[:num_reqs].long()
    temp = temp_ptr[request].float()
    greedy = (temp == 0.0)[:, None]
    seed = seed_ptr[request].long()
    logit, exists, num_drafts = _request_steps(cu_num_logits_ptr[: num_reqs + 1], width,
                                               num_logits)
    steps = torch.arange(width, device=device).expand_as(logit)
    draft = draft_sampled_ptr[(logit + 1).clamp(max=draft_sampled_ptr.shape[0] - 1)].long()
    valid = draft >= 0
    draft = draft.clamp(min=0)

    step_seed = seed[:, None] ^ (steps << 32) if USE_BLOCK_VERIFICATION else seed[:, None]
    u = philox_uniform(step_seed.expand_as(logit), pos_ptr[logit].long())
    u = torch.clamp(u, min=_TL_RAND_MIN)
    argmax = _global_argmax(target_local_max_ptr[logit], target_local_argmax_ptr[logit],
                            vocab_num_blocks)
    target, draft_logprob, target_lse, draft_lse = _step_logprobs(
        target_logits_ptr, target_local_max_ptr, target_local_sumexp_ptr,
        draft_logits_ptr if HAS_DRAFT_LOGITS else None, draft_logits_row_mapping_ptr,
        draft_local_max_ptr, draft_local_sumexp_ptr, logit, request[:, None].expand_as(logit),
        steps, draft, valid, temp[:, None], vocab_num_blocks)
    if SYNTHETIC_MODE:
        rates = synthetic_conditional_rates_ptr[:width].float()
        accepted = u < rates[None, :]
    else:
        accepted = torch.where(greedy, argmax == draft, target > torch.log(u) + draft_logprob)
    accepted = torch.where(greedy, accepted & valid, accepted)

    # A step is verified while every earlier one was accepted and (sampling) no draft so far
    # is a placeholder.
    passed = accepted & (greedy | valid)
    before = torch.cat((torch.ones_like(passed[:, :1]), passed[:, :-1]), dim=1).cumprod(dim=1)
    verified = exists & (greedy | valid) & before.bool()
    accepted_length = (verified & accepted).sum(dim=1)
    tokens = torch.where(greedy & ~accepted, argmax, draft)
    last_verified = (verified.sum(dim=1) - 1).clamp(min=0)[:, None]
    any_verified = verified.any(dim=1)
    target_rejected = torch.where(any_verified & ~greedy[:, 0],
                                  target_lse.gather(1, last_verified).squeeze(1), 0.0)
    draft_rejected = torch.where(any_verified & ~greedy[:, 0],
                                 draft_lse.gather(1, last_verified).squeeze(1), 0.0)

    if USE_BLOCK_VERIFICATION:
        block_verified = exists & valid.int().cumprod(dim=1).bool()
        ratio = torch.exp(cumulative_log_p_ptr[logit].float())
        next_index = (logit + 2).clamp(max=draft_sampled_ptr.shape[0] - 1)
        next_draft = torch.where(steps < num_drafts[:, None] - 1,
                                 draft_sampled_ptr[next_index].long(), -1)
        following = (logit + 1).clamp(max=num_logits - 1)
        if HAS_DRAFT_LOGITS:
            residual = local_residual_mass_ptr[following, :vocab_num_blocks].float().sum(-1)
        else:
            lse = _global_logsumexp(target_local_max_ptr[following],
                                    target_local_sumexp_ptr[following], vocab_num_blocks)
            m_b = torch.exp(_logits_at(target_logits_ptr, following, next_draft,
                                       torch.ones_like(valid)) - lse)
            residual = ratio * (1.0 - m_b)
        denominator = residual + 1.0 - ratio
        h = torch.where(denominator > 0.0, residual / denominator, 1.0)
        h = torch.where(next_draft >= 0, h, ratio)
        hits = block_verified & (u <= h)
        block_length = torch.where(hits, steps + 1, 0).amax(dim=1)
        sampling = ~greedy[:, 0]
        verified = torch.where(greedy, verified, block_verified)
        tokens = torch.where(greedy, tokens, draft)
        accepted_length = torch.where(sampling, block_length, accepted_length)
        rejected = (cu_num_logits_ptr[:num_reqs].long() + accepted_length).clamp(
            max=num_logits - 1)
        rejects = sampling & (accepted_length < num_drafts)
        target_rejected = torch.where(rejects, _global_logsumexp(
            target_local_max_ptr[rejected], target_local_sumexp_ptr[rejected],
            vocab_num_blocks), 0.0)
        draft_rejected = torch.zeros_like(target_rejected)
        if HAS_DRAFT_LOGITS:
            draft_rejected = torch.where(rejects, _global_logsumexp(
                draft_local_max_ptr[rejected], draft_local_sumexp_ptr[rejected],
                vocab_num_blocks), 0.0)

    rows = torch.arange(num_reqs, device=device)[:, None]
    _put(sampled_ptr, rows * sampled_stride + steps, tokens, verified)
    rejected_steps_ptr[:num_reqs] = accepted_length.to(rejected_steps_ptr.dtype)
    target_rejected_logsumexp_ptr[:num_reqs] = target_rejected.to(
        target_rejected_logsumexp_ptr.dtype)
    draft_rejected_logsumexp_ptr[:num_reqs] = draft_rejected.to(
        draft_rejected_logsumexp_ptr.dtype)


def _resample_kernel(
    resampled_local_argmax_ptr,
    resampled_local_argmax_stride,
    resampled_local_max_ptr,
    resampled_local_max_stride,
    target_logits_ptr,
    target_logits_stride,
    target_rejected_logsumexp_ptr,
    draft_logits_ptr,
    draft_logits_stride_0,
    draft_logits_stride_1,
    draft_logits_row_mapping_ptr,
    draft_rejected_logsumexp_ptr,
    rejected_step_ptr,
    cu_num_logits_ptr,
    expanded_idx_mapping_ptr,
    draft_sampled_ptr,
    temp_ptr,
    seed_ptr,
    pos_ptr,
    cumulative_log_p_ptr,
    contexts_ptr,
    contexts_stride,
    watermarking_ptr,
    watermarking_skip_mask_ptr,
    watermark_key_0,
    watermark_key_1,
    vocab_size,
    BLOCK_SIZE=1024,
    HAS_DRAFT_LOGITS=False,
    USE_FP64=False,
    USE_BLOCK_VERIFICATION=False,
    CONTEXT_WIDTH=1,
    WATERMARK=False,
    DEDUPLICATE_CONTEXTS=False,
    SKIP_MASKED_BLOCKS=False,
):
    """Request ``r`` whose token at its rejected step ``t = cu[r] + rejected_step[r]`` is drawn
    (temperature > 0, or ``t`` is its bonus logit): per ``BLOCK_SIZE`` vocab block, the argmax
    token and value of the residual logits plus Gumbel noise at ``(seed, pos[t], token)`` (no
    noise at temperature 0). The residual is the target logits at a bonus or placeholder step;
    with draft logits ``log max(p - q, 0)`` (``p`` scaled by the prefix ratio in block
    verification); one-hot drafts drop the rejected token. ``SKIP_MASKED_BLOCKS``: a block
    without a finite target logit yields (its first token, -inf)."""
    if WATERMARK:
        raise RuntimeError("ascend-patch: watermarked resampling is not served on the NPU")
    num_reqs = cu_num_logits_ptr.shape[0] - 1
    if num_reqs == 0:
        return
    device = target_logits_ptr.device
    resample_step = rejected_step_ptr[:num_reqs].long()
    start = cu_num_logits_ptr[:num_reqs].long()
    end = cu_num_logits_ptr[1 : num_reqs + 1].long()
    token_index = (start + resample_step).clamp(0, target_logits_ptr.shape[0] - 1)
    request = expanded_idx_mapping_ptr[token_index].long()
    valid_request = request >= 0
    slot = request.clamp(min=0)
    temp = torch.where(valid_request, temp_ptr[slot].float(), 0.0)
    is_bonus = start + resample_step == end - 1
    drawn = (temp != 0.0) | is_bonus
    rejected_draft = torch.where(
        is_bonus, 0, draft_sampled_ptr[(token_index + 1).clamp(
            max=draft_sampled_ptr.shape[0] - 1)].long())

    target = target_logits_ptr[token_index, :vocab_size].float()
    token = torch.arange(vocab_size, device=device)[None, :]
    plain = is_bonus | (rejected_draft < 0)
    if HAS_DRAFT_LOGITS:
        row = _draft_rows(request, draft_logits_row_mapping_ptr)
        step = resample_step.clamp(0, draft_logits_ptr.shape[1] - 1)
        draft = draft_logits_ptr[row, step, :vocab_size].float() / temp[:, None]
        target_log_probs = target - target_rejected_logsumexp_ptr[:num_reqs, None].float()
        if USE_BLOCK_VERIFICATION:
            previous = cumulative_log_p_ptr[(token_index - 1).clamp(min=0)].float()
            target_log_probs = target_log_probs + torch.where(resample_step > 0, previous, 0.0)[
                :, None]
        draft_log_probs = draft - draft_rejected_logsumexp_ptr[:num_reqs, None].float()
        ratio = torch.exp(draft_log_probs - target_log_probs)
        residual = torch.where(ratio < 1.0, target_log_probs + torch.log1p(-ratio),
                               float("-inf"))
    else:
        residual = torch.where(token != rejected_draft[:, None], target, float("-inf"))
    residual = torch.where(plain[:, None], target, residual)

    if USE_FP64:
        residual = residual.double()
    seed = torch.where(valid_request, seed_ptr[slot].long(), 0)[:, None]
    pos = pos_ptr[token_index].long()[:, None]
    if USE_FP64:
        noise = -torch.log(-torch.log(murmur3_uniform64(seed, pos, token)))
    else:
        noise = -torch.log(-_log1p_neg_stable(murmur3_uniform32(seed, pos, token)))
    sampling = (temp != 0.0)[:, None]
    noised = torch.where(sampling, residual + noise, residual)

    lanes = _block_view(noised, vocab_size, BLOCK_SIZE)
    token_id, value = _block_argmax(lanes, BLOCK_SIZE)
    if SKIP_MASKED_BLOCKS:
        masked = _nan_free_max(_block_view(target, vocab_size, BLOCK_SIZE), dim=-1) == float(
            "-inf")
        first = torch.arange(lanes.shape[1], device=device) * BLOCK_SIZE
        token_id = torch.where(masked, first, token_id)
        value = torch.where(masked, float("-inf"), value)
    _write_rows(resampled_local_argmax_ptr, num_reqs, drawn, token_id)
    _write_rows(resampled_local_max_ptr, num_reqs, drawn, value)


def _insert_resampled_kernel(
    sampled_ptr,
    sampled_stride,
    num_sampled_ptr,
    resampled_local_argmax_ptr,
    resampled_local_argmax_stride,
    resampled_local_max_ptr,
    resampled_local_max_stride,
    resample_num_blocks,
    cu_num_logits_ptr,
    expanded_idx_mapping_ptr,
    temp_ptr,
    PADDED_RESAMPLE_NUM_BLOCKS=None,
    num_warps=None,
):
    """Request ``r`` (one per ``cu_num_logits`` interval): ``num_sampled[r]`` grows by one, and
    unless it is greedy at a non-bonus step the token of its best resampled block (NaN maxima
    read as -inf) goes to ``sampled[r, num_sampled]`` (the old count)."""
    num_reqs = cu_num_logits_ptr.shape[0] - 1
    if num_reqs == 0:
        return
    num_sampled = num_sampled_ptr[:num_reqs].long()
    start = cu_num_logits_ptr[:num_reqs].long()
    end = cu_num_logits_ptr[1 : num_reqs + 1].long()
    token_index = start + num_sampled
    request = expanded_idx_mapping_ptr[
        token_index.clamp(0, expanded_idx_mapping_ptr.shape[0] - 1)].long()
    temp = temp_ptr[request.clamp(min=0)].float()
    inserted = (temp != 0.0) | (token_index == end - 1)
    num_sampled_ptr[:num_reqs] = (num_sampled + 1).to(num_sampled_ptr.dtype)
    token = _global_argmax(resampled_local_max_ptr[:num_reqs],
                           resampled_local_argmax_ptr[:num_reqs], resample_num_blocks)
    rows = torch.arange(num_reqs, device=num_sampled.device)
    _put(sampled_ptr, rows * sampled_stride + num_sampled, token, inserted)


# --- draft_logits.py (batch-sharded draft logits cache) -----------------------------------------

def _assign_rows_kernel(
    idx_mapping_ptr,
    shard_mapping_ptr,
    row_mapping_ptr,
    inverse_row_mapping_ptr,
    num_reqs,
    NUM_SHARDS=1,
    SHARD_IDX=0,
    BLOCK_SIZE=None,
):
    """Batch position ``b < num_reqs`` of request ``r``: owner rank ``b % NUM_SHARDS`` to
    ``shard_mapping[r]``; its row ``b // NUM_SHARDS`` to ``row_mapping[r]`` if this rank owns
    it (else -1), and ``r`` to ``inverse_row_mapping[row]``."""
    if num_reqs == 0:
        return
    request = idx_mapping_ptr[:num_reqs].long()
    position = torch.arange(num_reqs, device=request.device)
    owner = position % NUM_SHARDS
    row = position // NUM_SHARDS
    local = owner == SHARD_IDX
    shard_mapping_ptr[request] = owner.to(shard_mapping_ptr.dtype)
    row_mapping_ptr[request] = torch.where(local, row, -1).to(row_mapping_ptr.dtype)
    _put(inverse_row_mapping_ptr, row, request, local)


def _stale_drafts_kernel(
    stale_ptr,
    expanded_idx_mapping_ptr,
    expanded_local_pos_ptr,
    row_mapping_ptr,
    inverse_row_mapping_ptr,
    num_logits,
    BLOCK_SIZE=None,
):
    """Logit ``l < num_logits`` at a draft position (local position > 0) is stale when its
    request has no row here or its row was given to another request since."""
    if num_logits == 0:
        return
    request = expanded_idx_mapping_ptr[:num_logits].long()
    row = torch.where(request >= 0, row_mapping_ptr[request.clamp(min=0)].long(), -1)
    holder = torch.where(row >= 0, inverse_row_mapping_ptr[row.clamp(min=0)].long(), -1)
    stale = (expanded_local_pos_ptr[:num_logits] > 0) & ((row < 0) | (holder != request))
    stale_ptr[:num_logits] = stale


# --- ngram/speculator.py ------------------------------------------------------------------------

def _ngram_scan_kernel(
    token_ids_ptr,
    token_ids_stride,
    idx_mapping_ptr,
    total_len_ptr,
    num_sampled_ptr,
    scratch_ptr,
    scratch_stride,
    L,
    MIN_N=None,
    MAX_N=None,
    MAX_N_PO2=None,
    BLOCK_L=None,
    num_warps=None,
    num_stages=None,
):
    """Batch row ``b`` of request ``r``, per ``BLOCK_L`` block of start positions (``cdiv(L,
    BLOCK_L)`` blocks): the best match of the row's length-``n`` suffix (``MIN_N <= n <=
    MAX_N``) starting at a position ``p`` of the block, scored ``n * (L + 1) + p + 1`` (longest
    n, then rightmost p), 0 for none, for a row that sampled nothing or is shorter than
    ``MIN_N``, and for blocks past the last candidate."""
    num_reqs = idx_mapping_ptr.shape[0]
    if num_reqs == 0:
        return
    device = token_ids_ptr.device
    blocks = -(-L // BLOCK_L)
    request = idx_mapping_ptr.long()
    seq_len = total_len_ptr[request].long()[:, None]
    tokens = token_ids_ptr[request].long()  # [rows, width]
    width = tokens.shape[1]

    suffix_at = seq_len - MAX_N + torch.arange(MAX_N, device=device)[None, :]
    suffix = torch.where((suffix_at >= 0) & (suffix_at < seq_len),
                         tokens.gather(1, suffix_at.clamp(0, width - 1)), -1)
    pos = torch.arange(blocks * BLOCK_L, device=device)[None, :]
    best = torch.zeros(num_reqs, blocks * BLOCK_L, dtype=torch.int64, device=device)
    for n in range(MIN_N, MAX_N + 1):  # n-gram lengths, host constants
        match = pos <= seq_len - n - 1
        for j in range(n):
            token = tokens.gather(1, (pos + j).clamp(0, width - 1).expand(num_reqs, -1))
            match = match & (token == suffix[:, MAX_N - n + j : MAX_N - n + j + 1])
        best = torch.where(match, n * (L + 1) + pos + 1, best)
    block_best = best.view(num_reqs, blocks, BLOCK_L).amax(dim=-1)

    eligible = (num_sampled_ptr[:num_reqs] > 0)[:, None] & (seq_len >= MIN_N)
    block_start = torch.arange(blocks, device=device)[None, :] * BLOCK_L
    scanned = eligible & (block_start <= seq_len - MIN_N - 1)
    scratch = scratch_ptr.view(-1)[: num_reqs * scratch_stride].view(num_reqs, scratch_stride)
    scratch[:, :blocks] = torch.where(scanned, block_best, 0).to(scratch.dtype)


def _ngram_finalize_kernel(
    token_ids_ptr,
    token_ids_stride,
    idx_mapping_ptr,
    total_len_ptr,
    num_sampled_ptr,
    last_sampled_ptr,
    scratch_ptr,
    scratch_stride,
    drafts_ptr,
    L,
    N_BLOCKS,
    K=None,
    K_PO2=None,
    N_BLOCKS_PO2=None,
    num_warps=None,
    num_stages=None,
):
    """Batch row ``b`` of request ``r``: the best scan score over its ``N_BLOCKS`` blocks names
    the match (``n``, ``p``); its ``K`` drafts, ``drafts[b * K + k]``, are the tokens from
    ``p + n`` on (below the request's length), the last sampled token elsewhere and for a row
    without a match or without a sampled token."""
    num_reqs = idx_mapping_ptr.shape[0]
    if num_reqs == 0:
        return
    device = token_ids_ptr.device
    request = idx_mapping_ptr.long()
    scratch = scratch_ptr.view(-1)[: num_reqs * scratch_stride].view(num_reqs, scratch_stride)
    score = scratch[:, :N_BLOCKS].long().amax(dim=1)
    has_match = score > 0
    shifted = score - 1
    best_n = torch.where(has_match, shifted // (L + 1), 0)
    best_pos = torch.where(has_match, shifted - best_n * (L + 1), 0)
    draft_start = torch.where(has_match, best_pos + best_n, 0)[:, None]

    seq_len = total_len_ptr[request].long()[:, None]
    available = (seq_len - draft_start).clamp(min=0)
    write_ok = ((num_sampled_ptr[:num_reqs] > 0) & has_match)[:, None]
    k = torch.arange(K, device=device)[None, :]
    column = (draft_start + k).clamp(0, min(L, token_ids_ptr.shape[1]) - 1)
    gathered = token_ids_ptr[request[:, None], column].long()
    last = last_sampled_ptr[request].long()[:, None]
    drafts = torch.where((k < available) & write_ok, gathered, last)
    drafts_ptr.view(-1)[: num_reqs * K] = drafts.flatten().to(drafts_ptr.dtype)


# --- standalone_ar/speculator.py (draft_model) ----------------------------------------------------

@_kernel_named("_prepare_prefill_inputs_kernel")
def standalone_ar_prepare_prefill_inputs(
    target_input_ids_ptr,
    target_positions_ptr,
    last_sampled_ptr,
    idx_mapping_ptr,
    out_input_ids_ptr,
    out_positions_ptr,
    last_token_indices_ptr,
    out_query_start_loc_ptr,
    out_seq_lens_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    num_rejected_ptr,
    max_num_reqs,
    max_model_len,
    BLOCK_SIZE=None,
):
    """``standalone_ar``'s ``_prepare_prefill_inputs_kernel``: batch row ``i`` (request ``r``)
    takes ``query_len + 1`` output slots from ``out_start = query_start + i``: its accepted
    tokens (query less rejected), then the correction token ``last_sampled[r]``, then 0 for the
    rejected slots; positions count on from its first target position (clamped below
    ``max_model_len``). ``last_token_indices[i]`` is the correction slot,
    ``out_query_start_loc[i] = out_start``, ``out_seq_lens[i] = min(seq_len + 1,
    max_model_len)``; rows from ``num_reqs`` to ``max_num_reqs`` are padded (the end of the
    expanded tokens; 0)."""
    num_reqs = idx_mapping_ptr.shape[0]
    if num_reqs == 0:
        return
    device = target_input_ids_ptr.device
    query_start = query_start_loc_ptr[: num_reqs + 1].long()
    # Row i's query_len + 1 slots, [query_start[i] + i, query_start[i + 1] + i + 1), end where
    # row i + 1's begin: the expanded query start locations.
    out_start = query_start + torch.arange(num_reqs + 1, device=device)
    row, j, covered = _token_requests(out_start, num_reqs, out_input_ids_ptr.shape[0])
    num_valid = (query_start[1:] - query_start[:-1]
                 - num_rejected_ptr[:num_reqs].long())
    correction = last_sampled_ptr.view(-1)[idx_mapping_ptr.long()].int()  # [max_reqs, 1]
    source = (query_start[row] + j).clamp(0, target_input_ids_ptr.shape[0] - 1)
    token = torch.where(j < num_valid[row], target_input_ids_ptr[source].int(), 0)
    token = torch.where(j == num_valid[row], correction[row], token)
    first_position = target_positions_ptr[query_start[:-1].clamp(
        max=target_positions_ptr.shape[0] - 1)].long()
    position = torch.clamp(first_position[row] + j, max=max_model_len - 1)
    _set_where(out_input_ids_ptr, covered, token)
    _set_where(out_positions_ptr, covered, position)

    last_token_indices_ptr[:num_reqs] = (out_start[:-1] + num_valid).to(
        last_token_indices_ptr.dtype)
    out_query_start_loc_ptr[:num_reqs] = out_start[:-1].to(out_query_start_loc_ptr.dtype)
    out_seq_lens_ptr[:num_reqs] = torch.clamp(seq_lens_ptr[:num_reqs].long() + 1,
                                              max=max_model_len).to(out_seq_lens_ptr.dtype)
    out_query_start_loc_ptr[num_reqs : max_num_reqs + 1] = out_start[-1].to(
        out_query_start_loc_ptr.dtype)
    out_seq_lens_ptr[num_reqs:max_num_reqs] = 0
    last_token_indices_ptr[num_reqs:max_num_reqs] = 0


# --- target_dependent_ar/speculator.py (eagle, eagle3, mtp) ---------------------------------------

@_kernel_named("_prepare_prefill_inputs_kernel")
def target_dependent_ar_prepare_prefill_inputs(
    last_token_indices_ptr,
    draft_current_step_ptr,
    draft_input_ids_ptr,
    draft_positions_ptr,
    draft_query_start_loc_ptr,
    draft_seq_lens_ptr,
    target_input_ids_ptr,
    target_positions_ptr,
    idx_mapping_ptr,
    last_sampled_ptr,
    next_prefill_tokens_ptr,
    num_sampled_ptr,
    num_rejected_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    max_num_reqs,
    BLOCK_SIZE=None,
):
    """``target_dependent_ar``'s ``_prepare_prefill_inputs_kernel``: batch row ``i`` (request
    ``r``), query ``[qs, qs + n)`` with ``n`` = query length less rejected: the draft input ids
    are the target's shifted left by one, the last slot ``qs + n - 1`` (``last_token_indices``)
    taking the next token (``last_sampled[r]``, or ``next_prefill_tokens[r]`` for a chunked
    prefill that sampled nothing); positions copied; ``draft_query_start_loc[i] = qs``,
    ``draft_seq_lens[i] = seq_lens[i]``. The step counter is reset, and rows from ``num_reqs``
    padded (the last query's end; 0)."""
    num_reqs = idx_mapping_ptr.shape[0]
    if num_reqs == 0:
        return
    request = idx_mapping_ptr.long()
    query_start = query_start_loc_ptr[: num_reqs + 1].long()
    query_len = query_start[1:] - query_start[:-1] - num_rejected_ptr[:num_reqs].long()
    next_token = torch.where(num_sampled_ptr[:num_reqs] > 0,
                             last_sampled_ptr.view(-1)[request].int(),
                             next_prefill_tokens_ptr.view(-1)[request].int())
    row, j, covered = _token_requests(query_start, num_reqs, draft_input_ids_ptr.shape[0])
    in_query = covered & (j < query_len[row])
    source = (query_start[row] + j + 1).clamp(max=target_input_ids_ptr.shape[0] - 1)
    last = j == query_len[row] - 1
    shifted = torch.where(last, next_token[row], target_input_ids_ptr[source].int())
    _set_where(draft_input_ids_ptr, in_query, shifted)
    row, j, covered = _token_requests(query_start, num_reqs, draft_positions_ptr.shape[0])
    slot = torch.arange(draft_positions_ptr.shape[0], device=row.device)
    positions = target_positions_ptr[slot.clamp(max=target_positions_ptr.shape[0] - 1)]
    _set_where(draft_positions_ptr, covered & (j < query_len[row]), positions)

    last_token_indices_ptr[:num_reqs] = (query_start[:-1] + query_len - 1).to(
        last_token_indices_ptr.dtype)
    draft_query_start_loc_ptr[:num_reqs] = query_start[:-1].to(draft_query_start_loc_ptr.dtype)
    draft_seq_lens_ptr[:num_reqs] = seq_lens_ptr[:num_reqs].to(draft_seq_lens_ptr.dtype)
    draft_current_step_ptr.view(-1)[0] = 0
    draft_query_start_loc_ptr[num_reqs : max_num_reqs + 1] = query_start[-1].to(
        draft_query_start_loc_ptr.dtype)
    draft_seq_lens_ptr[num_reqs:max_num_reqs] = 0
    last_token_indices_ptr[num_reqs:max_num_reqs] = 0


def _prepare_decode_inputs_kernel(
    draft_tokens_ptr,
    draft_tokens_stride,
    target_seq_lens_ptr,
    num_rejected_ptr,
    input_ids_ptr,
    positions_ptr,
    sample_src_positions_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    max_model_len,
    max_num_reqs,
    BLOCK_SIZE=None,
    ADVANCE_DRAFT_POSITIONS=True,
):
    """First draft decode step, rows ``i < num_reqs`` (``draft_tokens`` is the ``[num_reqs]``
    view of each row's first draft): the draft is the next input id, the sampling position
    advances, ``seq_lens[i] = target seq_len - rejected`` (with ``ADVANCE_DRAFT_POSITIONS``:
    position and seq_len one further, clamped to the model length). ``query_start_loc`` becomes
    ``min(i, num_reqs)`` for ``i <= max_num_reqs`` and padded ``seq_lens`` 0."""
    num_reqs = draft_tokens_ptr.shape[0]
    device = draft_tokens_ptr.device
    slots = torch.arange(max_num_reqs + 1, device=device)
    query_start_loc_ptr[: max_num_reqs + 1] = slots.clamp(max=num_reqs).to(
        query_start_loc_ptr.dtype)
    seq_lens_ptr[num_reqs:max_num_reqs] = 0
    if num_reqs == 0:
        return
    input_ids_ptr[:num_reqs] = draft_tokens_ptr.to(input_ids_ptr.dtype)
    sample_src_positions_ptr[:num_reqs] += 1
    seq_len = target_seq_lens_ptr[:num_reqs].long() - num_rejected_ptr[:num_reqs].long()
    if ADVANCE_DRAFT_POSITIONS:
        positions_ptr[:num_reqs] = torch.clamp(positions_ptr[:num_reqs] + 1,
                                               max=max_model_len - 1)
        seq_len = torch.clamp(seq_len + 1, max=max_model_len)
    seq_lens_ptr[:num_reqs] = seq_len.to(seq_lens_ptr.dtype)


def _update_draft_inputs_kernel(
    output_draft_tokens_ptr,
    output_draft_tokens_stride,
    next_input_hidden_states_ptr,
    next_input_hidden_states_stride,
    input_ids_ptr,
    positions_ptr,
    sample_src_positions_ptr,
    seq_lens_ptr,
    draft_tokens_ptr,
    current_draft_step_ptr,
    hidden_states_ptr,
    hidden_states_stride,
    hidden_size,
    max_model_len_ptr,
    num_speculative_steps,
    BLOCK_SIZE=None,
    ADVANCE_DRAFT_POSITIONS=True,
):
    """Row ``i < num_reqs`` (``draft_tokens`` holds this step's ``[num_reqs]`` drafts): the
    draft goes to ``output_draft_tokens[i, step]`` (``step`` read on the device); unless this is
    the last step, it also becomes the next input id, the sampling position advances, the row's
    hidden state is the next input's, and (``ADVANCE_DRAFT_POSITIONS``) position and seq_len
    advance, clamped by the device scalar ``max_model_len``."""
    num_reqs = draft_tokens_ptr.shape[0]
    if num_reqs == 0:
        return
    device = draft_tokens_ptr.device
    rows = torch.arange(num_reqs, device=device)
    step = current_draft_step_ptr.view(-1)[:1].long()
    drafts = draft_tokens_ptr[:num_reqs]
    outputs = output_draft_tokens_ptr.view(-1)
    outputs.index_put_((rows * output_draft_tokens_stride + step,), drafts.to(outputs.dtype))
    more = step < num_speculative_steps - 1  # [1], on the device

    def advance(target: torch.Tensor, value: torch.Tensor) -> None:
        target.copy_(torch.where(more, value.to(target.dtype), target))

    advance(sample_src_positions_ptr[:num_reqs], sample_src_positions_ptr[:num_reqs] + 1)
    advance(input_ids_ptr[:num_reqs], drafts)
    hidden = next_input_hidden_states_ptr[:num_reqs, :hidden_size]
    hidden.copy_(torch.where(more[:, None], hidden_states_ptr[:num_reqs, :hidden_size].to(
        hidden.dtype), hidden))
    if ADVANCE_DRAFT_POSITIONS:
        max_model_len = max_model_len_ptr.view(-1)[:1].long()
        advance(positions_ptr[:num_reqs],
                torch.minimum(positions_ptr[:num_reqs].long() + 1, max_model_len - 1))
        advance(seq_lens_ptr[:num_reqs],
                torch.minimum(seq_lens_ptr[:num_reqs].long() + 1, max_model_len))


_SD = "vllm.v1.worker.gpu.spec_decode"

KERNELS = {
    f"{_SD}.rejection_sampler": (_flatten_sampled_kernel, _gather_draft_sampled_kernel),
    f"{_SD}.rejection_sampler_utils": (
        _compute_local_logits_stats_kernel,
        _compute_cumulative_log_p_kernel,
        _compute_local_residual_mass_kernel,
        _rejection_kernel,
        _resample_kernel,
        _insert_resampled_kernel,
    ),
    f"{_SD}.draft_logits": (_assign_rows_kernel, _stale_drafts_kernel),
    f"{_SD}.ngram.speculator": (_ngram_scan_kernel, _ngram_finalize_kernel),
    f"{_SD}.standalone_ar.speculator": (standalone_ar_prepare_prefill_inputs,),
    f"{_SD}.target_dependent_ar.speculator": (
        target_dependent_ar_prepare_prefill_inputs,
        _prepare_decode_inputs_kernel,
        _update_draft_inputs_kernel,
    ),
}
"""The kernels this module implements, by the vLLM module that defines each; each function's
``__name__`` is its kernel's (the two ``_prepare_prefill_inputs_kernel`` live here under their
method's name)."""

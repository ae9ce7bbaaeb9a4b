"""vLLM Model Runner V2's sampling Triton kernels, for the NPU: plain torch.

MRV2 (``vllm/v1/worker/gpu/``, the only runner from vLLM 0.34) samples with Triton kernels:
temperature, min-p, penalties, logit bias / allowed tokens / min-tokens, bad words, Gumbel-max
sampling, logprobs, prompt-logprob token ids, the grammar bitmask and the NaN counter. An NPU
without triton-ascend cannot launch them, so the platform registers these implementations through
vLLM's kernel registry (``vllm.triton_utils.dispatcher.register_kernels``, called from
``Platform.register_triton_kernel_overrides``), which launches them as ``kernel[grid](**kwargs)``.
Every function:

- takes the kernel's own parameters, by name and in order (``*_ptr`` is the tensor, the
  ``tl.constexpr`` parameters are keyword defaults);
- ignores the launch grid: the rows it covers are the tensors' (each docstring says which);
  a block size matters only where the kernel's output depends on it (``_gumbel_sample_kernel``
  writes one partial result per vocab block);
- writes exactly what the kernel writes and leaves the rest of each output alone;
- never reads a device value on the host (no ``item``, no ``tolist``, no data-dependent shapes)
  and has no Python loop over requests or vocab blocks, so a step keeps vLLM's host/device overlap.

Semantics are vLLM 0.34's (``v1/worker/gpu/sample/{gumbel,min_p,penalties,logit_bias,bad_words,
logprob,prompt_logprob}.py``, ``gpu/structured_outputs.py``, ``gpu/metrics/logits.py``). Their
parameters are 0.33's too except Gumbel sampling: 0.34's ``_gumbel_sample_kernel`` added
``logits_cache_row_mapping_ptr``, ``bias_ptr``, ``bias_stride`` and ``HAS_BIAS``, and
``_gumbel_combine_kernel`` is new (0.33 combines the blocks with ``argmax`` + ``gather``).
Where a Triton reduction is unspecified, torch's rule is used: a vocab block holding a NaN yields
its first NaN (Triton's ``tl.max(..., return_indices=True)`` depends on its reduction order there),
and row maxima skip NaNs (``tl.maximum`` without ``propagate_nan``). Where the kernel keeps a
vocab block in registers, these keep ``[rows, vocab]`` temporaries (Gumbel noise: int64 hash
words), the price of having no loop over rows. ``tests/kernels/test_mrv2_sample_kernels.py``
checks each against a per-row, per-block transliteration of its kernel and vectors derived by hand.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
# gumbel.py's _DRAFT_NOISE_SALT: a draft's Gumbel noise is drawn at pos + 2**30.
_DRAFT_NOISE_SALT = 1 << 30
_UINT64_DOMAIN = 0x9E3779B9


def _state_rows(mapping: torch.Tensor, rows: int) -> torch.Tensor:
    """The request-state slot of each of the first ``rows`` rows, as int64 indices."""
    return mapping[:rows].long()


def _scatter_mask(ids: torch.Tensor, valid: torch.Tensor, width: int) -> torch.Tensor:
    """``[rows, width]`` bool, True at ``ids[r, j]`` for the valid ``j``: invalid entries are sent
    to a spare column, so the shape never depends on how many are valid."""
    index = torch.where(valid, ids.long(), width)
    mask = torch.zeros(ids.shape[0], width + 1, dtype=torch.bool, device=ids.device)
    return mask.scatter_(1, index, True)[:, :width]


def _unpack_bits(packed: torch.Tensor, width: int) -> torch.Tensor:
    """Bit ``v % 32`` of word ``v // 32`` for ``v < width``: ``[rows, width]`` bool."""
    shifts = torch.arange(32, device=packed.device, dtype=torch.int64)
    bits = (packed.long()[:, :, None] >> shifts) & 1
    return bits.flatten(1)[:, :width].bool()


def _nan_free_max(values: torch.Tensor, dim: int) -> torch.Tensor:
    """Row maximum skipping NaNs (``tl.maximum`` / ``fmaxf``): -inf for an all-NaN row."""
    return values.masked_fill(values.isnan(), float("-inf")).amax(dim=dim)


def _write_rows(dest: torch.Tensor, index: tuple[torch.Tensor, ...], valid: torch.Tensor,
                values: torch.Tensor) -> None:
    """``dest[index[0][t], index[1][t], ...] = values[t]`` for the valid ``t`` only, without
    data-dependent shapes: an invalid ``t`` rewrites what the first valid ``t`` writes (or, with
    none valid, the first entry's own value), so no two writers of one place disagree."""
    first = valid.int().argmax().reshape(1)
    any_valid = valid.any().reshape(1)
    fallback = tuple(torch.where(any_valid, i.index_select(0, first), 0) for i in index)
    fallback_value = torch.where(any_valid[:, None], values.index_select(0, first),
                                 dest[fallback].to(values.dtype))
    index = tuple(torch.where(valid, i, f) for i, f in zip(index, fallback))
    values = torch.where(valid[:, None], values, fallback_value)
    dest.index_put_(index, values.to(dest.dtype))


# --- gumbel.py ----------------------------------------------------------------------------------

def _temperature_kernel(
    logits_ptr,
    logits_stride,
    expanded_idx_mapping_ptr,
    temperature_ptr,
    vocab_size,
    BLOCK_SIZE=8192,
):
    """Every row of ``logits`` divided in fp32 by its request's temperature, except rows whose
    temperature is 0 (greedy) or 1, which the kernel leaves unread."""
    rows = logits_ptr.shape[0]
    temperature = temperature_ptr[_state_rows(expanded_idx_mapping_ptr, rows)].float()
    skip = (temperature == 0.0) | (temperature == 1.0)
    logits = logits_ptr[:, :vocab_size]
    scaled = logits.float() / torch.where(skip, 1.0, temperature)[:, None]
    logits.copy_(torch.where(skip[:, None], logits, scaled.to(logits.dtype)))


def _mul32(value: torch.Tensor, constant: int) -> torch.Tensor:
    """``value * constant mod 2**32`` for ``value < 2**32`` in int64, by 16-bit halves of the
    constant so no product leaves int64's range."""
    low = value * (constant & 0xFFFF)
    high = ((value * (constant >> 16)) & 0xFFFF) << 16
    return (low + high) & _MASK32


def _rotl32(value: torch.Tensor, shift: int) -> torch.Tensor:
    return ((value << shift) | (value >> (32 - shift))) & _MASK32


def _murmur3_mix(h: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    key = _rotl32(_mul32(key, 0xCC9E2D51), 15)
    key = _mul32(key, 0x1B873593)
    h = _rotl32(h ^ key, 13)
    return (h * 5 + 0xE6546B64) & _MASK32


def _murmur3_fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def murmur3_hash32(seed: torch.Tensor, pos: torch.Tensor, offset: torch.Tensor,
                   domain: int = 0) -> torch.Tensor:
    """gumbel.py's ``murmur3_hash32`` (MurmurHash3_x86_32 of the words seed-low, seed-high, pos,
    offset, seeded with ``domain``) in int64 holding uint32 values: ``seed``/``pos`` are
    ``[rows, 1]`` int64, ``offset`` ``[1, vocab]``. The request-wide prefix is hashed per row."""
    h = torch.full_like(seed, domain)
    h = _murmur3_mix(h, seed & _MASK32)
    h = _murmur3_mix(h, (seed >> 32) & _MASK32)
    h = _murmur3_mix(h, pos & _MASK32)
    return _murmur3_fmix32(_murmur3_mix(h, offset & _MASK32) ^ 16)


def murmur3_uniform32(seed, pos, offset) -> torch.Tensor:
    """fp32 ``(hash + 0.5) * 2**-32`` from the hash's 16-bit halves, each converted exactly."""
    random32 = murmur3_hash32(seed, pos, offset)
    high = (random32 >> 16).float()
    low = (random32 & 0xFFFF).float()
    return high * 1.52587890625e-05 + (low + 0.5) * 2.3283064365386963e-10


def murmur3_uniform64(seed, pos, offset) -> torch.Tensor:
    """fp64 uniform from the top 53 of two hashes' 64 bits, kept below 1."""
    low = murmur3_hash32(seed, pos, offset)
    high = murmur3_hash32(seed, pos, offset, domain=_UINT64_DOMAIN)
    random53 = (high << 21) | (low >> 11)
    uniform = (random53.double() + 0.5) * 1.1102230246251565e-16
    return torch.where(uniform == 1.0, uniform - 1.1102230246251565e-16, uniform)


def _log1p_neg_stable(value: torch.Tensor) -> torch.Tensor:
    """``log(1 - value)`` in fp32: a degree-8 series below 0.25, the direct form above."""
    polynomial = torch.full_like(value, 1.0 / 8.0)
    for coefficient in (1.0 / 7.0, 1.0 / 6.0, 1.0 / 5.0, 1.0 / 4.0, 1.0 / 3.0, 1.0 / 2.0, 1.0):
        polynomial = coefficient + value * polynomial
    series = -value * polynomial
    direct = torch.log(torch.clamp(1.0 - value, min=5.960464477539063e-08))
    return torch.where(value < 0.25, series, direct)


def _gumbel_sample_kernel(
    local_argmax_ptr,
    local_argmax_stride,
    local_max_ptr,
    local_max_stride,
    logits_cache_ptr,
    logits_cache_stride_0,
    logits_cache_stride_1,
    logits_cache_col_ptr,
    logits_cache_source_ptr,
    logits_cache_source_stride,
    logits_cache_row_mapping_ptr,
    logits_ptr,
    logits_stride,
    bias_ptr,
    bias_stride,
    expanded_idx_mapping_ptr,
    seeds_ptr,
    pos_ptr,
    temp_ptr,
    vocab_size,
    BLOCK_SIZE=1024,
    IS_DRAFTING=False,
    APPLY_TEMPERATURE=True,
    USE_FP64=False,
    PER_TOKEN_COL=False,
    HAS_BIAS=False,
):
    """For every row of ``logits`` and every ``BLOCK_SIZE`` block of its vocab: the block's
    argmax token and value in ``local_argmax``/``local_max`` ``[rows, blocks]``, of
    ``(logits + bias) / T + Gumbel(murmur3(seed, pos, token))`` (T = the request's temperature,
    applied when ``APPLY_TEMPERATURE``), or of the plain logits where T = 0 or the row is padding
    (request slot < 0). With a logits cache, the row's logits before temperature (or the cache
    source's) go to ``logits_cache[row, col]`` and the column is mixed into the seed."""
    rows = logits_ptr.shape[0]
    device = logits_ptr.device
    blocks = -(-vocab_size // BLOCK_SIZE)
    padded = blocks * BLOCK_SIZE

    logits = logits_ptr[:, :vocab_size]
    if HAS_BIAS:
        # Rounded to the logits dtype, as `logits + bias` would be.
        logits = (logits.float() + bias_ptr[:rows, :vocab_size].float()).to(logits.dtype)
    logits = logits.float()

    request = _state_rows(expanded_idx_mapping_ptr, rows)
    valid = request >= 0
    slot = request.clamp(min=0)
    temp = torch.where(valid, temp_ptr[slot].float(), 0.0)
    seed = torch.where(valid, seeds_ptr[slot].long(), 0)

    if logits_cache_ptr is not None:
        col = (logits_cache_col_ptr[:rows] if PER_TOKEN_COL
               else logits_cache_col_ptr.reshape(-1)[:1].expand(rows)).long()
        cache_row = request
        if logits_cache_row_mapping_ptr is not None:
            cache_row = torch.where(valid, logits_cache_row_mapping_ptr[slot].long(), -1)
        cached = (logits if logits_cache_source_ptr is None
                  else logits_cache_source_ptr[:rows, :vocab_size])
        _write_rows(logits_cache_ptr[:, :, :vocab_size], (cache_row.clamp(min=0), col),
                    cache_row >= 0, cached)
        seed = seed ^ (col << 32)

    sampling = temp != 0.0
    if APPLY_TEMPERATURE:
        logits = logits / torch.where(sampling, temp, 1.0)[:, None]
    if USE_FP64:
        logits = logits.double()
    pos = pos_ptr[:rows].long()[:, None]
    if IS_DRAFTING:
        pos = pos + _DRAFT_NOISE_SALT
    token = torch.arange(vocab_size, device=device, dtype=torch.int64)[None, :]
    if USE_FP64:
        noise = -torch.log(-torch.log(murmur3_uniform64(seed[:, None], pos, token)))
    else:
        noise = -torch.log(-_log1p_neg_stable(murmur3_uniform32(seed[:, None], pos, token)))
    logits = torch.where(sampling[:, None], logits + noise, logits)

    # Padding lanes of the last block are -inf, as the kernel's masked load leaves them.
    lanes = logits.new_full((rows, padded), float("-inf"))
    lanes[:, :vocab_size] = logits
    lanes = lanes.view(rows, blocks, BLOCK_SIZE)
    index = lanes.argmax(dim=-1, keepdim=True)  # first NaN, else first maximum
    value = lanes.gather(-1, index).squeeze(-1)
    token_id = index.squeeze(-1) + torch.arange(blocks, device=device) * BLOCK_SIZE
    local_argmax_ptr[:rows, :blocks] = token_id.to(local_argmax_ptr.dtype)
    local_max_ptr[:rows, :blocks] = value.to(local_max_ptr.dtype)


def _gumbel_combine_kernel(
    local_argmax_ptr,
    local_argmax_stride,
    local_max_ptr,
    local_max_stride,
    sampled_ptr,
    num_blocks,
    PADDED_NUM_BLOCKS=None,
):
    """Every row of ``sampled``: the token of the winning block of ``local_max`` — its first NaN
    block if any, else its first maximum (``torch.argmax``'s rule, spelled out)."""
    rows = sampled_ptr.shape[0]
    values = local_max_ptr[:rows, :num_blocks]
    blocks = torch.arange(num_blocks, device=values.device)
    is_nan = values.isnan()
    first_nan = torch.where(is_nan, blocks, num_blocks).amin(dim=1)
    maximum = _nan_free_max(values, dim=1)
    first_max = torch.where(values == maximum[:, None], blocks, num_blocks).amin(dim=1)
    winner = torch.where(is_nan.any(dim=1), first_nan, first_max)
    sampled = local_argmax_ptr[:rows, :num_blocks].gather(1, winner[:, None]).squeeze(1)
    sampled_ptr.copy_(sampled.to(sampled_ptr.dtype))


# --- min_p.py -----------------------------------------------------------------------------------

def _min_p_kernel(
    logits_ptr,
    logits_stride,
    expanded_idx_mapping_ptr,
    min_p_ptr,
    vocab_size,
    BLOCK_SIZE=1024,
):
    """Every row of ``logits`` whose request has min_p > 0: logits below
    ``row max + log(min_p)`` become -inf."""
    rows = logits_ptr.shape[0]
    min_p = min_p_ptr[_state_rows(expanded_idx_mapping_ptr, rows)].float()
    logits = logits_ptr[:, :vocab_size]
    threshold = _nan_free_max(logits, dim=1).float() + torch.log(min_p)
    drop = (logits < threshold[:, None]) & (min_p != 0.0)[:, None]
    logits.masked_fill_(drop, float("-inf"))


# --- penalties.py -------------------------------------------------------------------------------

def _penalties_kernel(
    logits_ptr,
    logits_stride,
    expanded_idx_mapping_ptr,
    token_ids_ptr,
    expanded_local_pos_ptr,
    repetition_penalty_ptr,
    frequency_penalty_ptr,
    presence_penalty_ptr,
    prompt_bin_mask_ptr,
    prompt_bin_mask_stride,
    output_bin_counts_ptr,
    output_bin_counts_stride,
    vocab_size,
    BLOCK_SIZE=8192,
):
    """Every row of ``logits`` whose request uses a penalty: output counts are the request's
    ``output_bin_counts`` plus the draft tokens before this row (``token_ids`` at local positions
    1..pos of its request); repetition penalty on tokens in the prompt or output, then
    ``- frequency * count - presence * (count > 0)``."""
    rows = logits_ptr.shape[0]
    device = logits_ptr.device
    request = _state_rows(expanded_idx_mapping_ptr, rows)
    repetition = repetition_penalty_ptr[request]
    frequency = frequency_penalty_ptr[request]
    presence = presence_penalty_ptr[request]
    uses_penalty = (repetition != 1.0) | (frequency != 0.0) | (presence != 0.0)

    # Row t counts the tokens at rows start(t)+1..t: a running sum of one-hots over the rows,
    # minus its value at the request's first row (whose own token is not a draft).
    row = torch.arange(rows, device=device)
    local_pos = expanded_local_pos_ptr[:rows].long()
    start = row - local_pos
    token = token_ids_ptr[:rows].long()
    drafts = torch.zeros(rows, vocab_size, dtype=torch.int32, device=device)
    drafts.scatter_(1, token.clamp(0, vocab_size - 1)[:, None], (local_pos > 0).int()[:, None])
    drafts = drafts.cumsum(dim=0, dtype=torch.int32)
    drafts = drafts - drafts[start]
    counts = output_bin_counts_ptr[request, :vocab_size] + drafts
    in_output = counts > 0

    logits = logits_ptr[:, :vocab_size]
    penalised = logits.float()
    in_prompt = _unpack_bits(prompt_bin_mask_ptr[request], vocab_size)
    scale = torch.where(in_prompt | in_output, repetition[:, None].float(), 1.0)
    scaled = penalised * torch.where(penalised > 0, 1.0 / scale, scale)
    penalised = torch.where((repetition != 1.0)[:, None], scaled, penalised)
    penalised = penalised - frequency[:, None] * counts
    penalised = penalised - presence[:, None] * in_output
    logits.copy_(torch.where(uses_penalty[:, None], penalised.to(logits.dtype), logits))


def _bincount_kernel(
    expanded_idx_mapping_ptr,
    all_token_ids_ptr,
    all_token_ids_stride,
    prompt_len_ptr,
    prefill_len_ptr,
    prompt_bin_mask_ptr,
    prompt_bin_mask_stride,
    output_bin_counts_ptr,
    output_bin_counts_stride,
    BLOCK_SIZE=1024,
):
    """For every request slot in ``expanded_idx_mapping``: OR the bits of its prompt tokens
    (``all_token_ids[r, :prompt_len]``) into ``prompt_bin_mask[r]`` and add its prefilled output
    tokens (``[prompt_len, prefill_len)``) to ``output_bin_counts[r]``."""
    request = expanded_idx_mapping_ptr.long()
    device = request.device
    tokens = all_token_ids_ptr[request].long()
    position = torch.arange(tokens.shape[1], device=device)[None, :]
    prompt_len = prompt_len_ptr[request].long()[:, None]
    prefill_len = prefill_len_ptr[request].long()[:, None]

    words = prompt_bin_mask_ptr.shape[1]
    in_prompt = _scatter_mask(tokens.clamp(0, words * 32 - 1), position < prompt_len, words * 32)
    weights = torch.ones(32, dtype=torch.int64, device=device) << torch.arange(32, device=device)
    packed = (in_prompt.view(-1, words, 32).long() * weights).sum(dim=-1)
    packed = torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)
    # Repeated slots OR the same words, so their writes agree.
    prompt_bin_mask_ptr.index_copy_(0, request, prompt_bin_mask_ptr[request] | packed)

    vocab = output_bin_counts_ptr.shape[1]
    is_output = (position >= prompt_len) & (position < prefill_len)
    counted = torch.zeros(request.shape[0], vocab + 1, dtype=output_bin_counts_ptr.dtype,
                          device=device)
    counted.scatter_add_(1, torch.where(is_output, tokens.clamp(0, vocab - 1), vocab),
                         torch.ones_like(tokens, dtype=counted.dtype))
    output_bin_counts_ptr.index_put_((request,), counted[:, :vocab], accumulate=True)


# --- logit_bias.py ------------------------------------------------------------------------------

def _bias_kernel(
    logits_ptr,
    logits_stride,
    vocab_size,
    expanded_idx_mapping_ptr,
    num_allowed_token_ids_ptr,
    allowed_token_ids_ptr,
    allowed_token_ids_stride,
    num_logit_bias_ptr,
    bias_token_ids_ptr,
    bias_token_ids_stride,
    bias_ptr,
    bias_stride,
    pos_ptr,
    min_lens_ptr,
    num_stop_token_ids_ptr,
    restore_when_all_masked_ptr,
    stop_token_ids_ptr,
    stop_token_ids_stride,
    BLOCK_SIZE=1024,
    LOGITS_BLOCK_SIZE=8192,
    CHECK_ALL_MASKED_ROWS=False,
):
    """Every row of ``logits``, in the kernel's order: (1) with allowed token ids, every other
    logit becomes -inf; (2) the request's logit biases are added; (3) before the request reaches
    ``min_len`` (``pos + 1 < min_len``) its stop tokens become -inf — except, with
    ``CHECK_ALL_MASKED_ROWS`` and the request's ``restore_when_all_masked``, when that leaves no
    logit above -inf: then the stop tokens keep their finite logits."""
    rows = logits_ptr.shape[0]
    device = logits_ptr.device
    request = _state_rows(expanded_idx_mapping_ptr, rows)
    logits = logits_ptr[:, :vocab_size]

    def listed(ids: torch.Tensor, count: torch.Tensor):
        ids = ids[request]
        valid = torch.arange(ids.shape[1], device=device)[None, :] < count[request][:, None]
        return ids.long(), valid

    allowed_ids, allowed_valid = listed(allowed_token_ids_ptr, num_allowed_token_ids_ptr)
    allowed = _scatter_mask(allowed_ids, allowed_valid, vocab_size)
    has_allowed = (num_allowed_token_ids_ptr[request] > 0)[:, None]
    logits.masked_fill_(has_allowed & ~allowed, float("-inf"))

    bias_ids, bias_valid = listed(bias_token_ids_ptr, num_logit_bias_ptr)
    biased = _scatter_mask(bias_ids, bias_valid, vocab_size)
    bias = torch.zeros(rows, vocab_size + 1, dtype=torch.float32, device=device)
    bias.scatter_(1, torch.where(bias_valid, bias_ids, vocab_size), bias_ptr[request].float())
    with_bias = (logits.float() + bias[:, :vocab_size]).to(logits.dtype)
    logits.copy_(torch.where(biased, with_bias, logits))

    stop_ids, stop_valid = listed(stop_token_ids_ptr, num_stop_token_ids_ptr)
    before_min_len = pos_ptr[:rows].long() + 1 < min_lens_ptr[request].long()
    applies = (num_stop_token_ids_ptr[request] > 0) & before_min_len
    stop = _scatter_mask(stop_ids, stop_valid, vocab_size) & applies[:, None]
    kept = logits.clone() if CHECK_ALL_MASKED_ROWS else None
    logits.masked_fill_(stop, float("-inf"))
    if CHECK_ALL_MASKED_ROWS:
        restores = restore_when_all_masked_ptr[request] != 0
        all_masked = ~(logits > float("-inf")).any(dim=1)
        restore = stop & (restores & all_masked)[:, None] & kept.isfinite()
        logits.copy_(torch.where(restore, kept, logits))


# --- bad_words.py -------------------------------------------------------------------------------

def _bad_words_kernel(
    logits_ptr,
    logits_stride,
    expanded_idx_mapping_ptr,
    bad_word_token_ids_ptr,
    bad_word_token_ids_stride,
    bad_word_offsets_ptr,
    bad_word_offsets_stride,
    num_bad_words_ptr,
    all_token_ids_ptr,
    all_token_ids_stride,
    prompt_len_ptr,
    total_len_ptr,
    input_ids_ptr,
    expanded_local_pos_ptr,
):
    """Every row of ``logits`` and every bad word of its request (``bad_word_token_ids[r]``
    between consecutive ``bad_word_offsets[r]``, the first ``num_bad_words[r]`` words): when the
    word's prefix equals the tokens just before this row — the request's output tokens
    (``all_token_ids[r, prompt_len:]``) then this row's preceding drafts (``input_ids`` at local
    positions 1..pos) — the word's last token becomes -inf. Words are never empty in vLLM."""
    rows = logits_ptr.shape[0]
    device = logits_ptr.device
    request = _state_rows(expanded_idx_mapping_ptr, rows)
    offsets = bad_word_offsets_ptr[request].long()  # [rows, words + 1]
    words = offsets.shape[1] - 1
    num_words = num_bad_words_ptr[request].long()[:, None]
    local_pos = expanded_local_pos_ptr[:rows].long()[:, None]
    prompt_len = prompt_len_ptr[request].long()[:, None]
    output_len = total_len_ptr[request].long()[:, None] - prompt_len
    effective_len = output_len + local_pos
    first_row = torch.arange(rows, device=device)[:, None] - local_pos

    word = torch.arange(words, device=device)[None, :]
    start, end = offsets[:, :-1], offsets[:, 1:]
    prefix_len = end - start - 1
    checked = (word < num_words) & (prefix_len <= effective_len)

    # Each flattened bad-word token j belongs to word w(j) at index j - start[w]; offsets past
    # the request's words are stale, so they are pushed to the end before the search.
    flat = bad_word_token_ids_ptr[request].long()  # [rows, tokens]
    j = torch.arange(flat.shape[1], device=device)[None, :].expand(rows, -1).contiguous()
    bounds = torch.where(word < num_words, end, torch.iinfo(torch.int64).max).contiguous()
    owner = torch.searchsorted(bounds, j, right=True).clamp(max=words - 1)
    index = j - start.gather(1, owner)
    in_prefix = (owner < num_words) & (index >= 0) & (index < prefix_len.gather(1, owner))
    actual_pos = effective_len - prefix_len.gather(1, owner) + index
    from_drafts = actual_pos >= output_len
    draft_row = (first_row + actual_pos - output_len + 1).clamp(0, input_ids_ptr.shape[0] - 1)
    output_col = (prompt_len + actual_pos).clamp(0, all_token_ids_ptr.shape[1] - 1)
    actual = torch.where(from_drafts, input_ids_ptr[draft_row].long(),
                         all_token_ids_ptr[request[:, None], output_col].long())
    mismatch = (in_prefix & (flat != actual)).int()
    mismatches = torch.zeros(rows, words, dtype=torch.int32, device=device)
    mismatches.scatter_add_(1, owner, mismatch)
    matched = checked & (mismatches == 0)

    last_token = flat.gather(1, (end - 1).clamp(0, flat.shape[1] - 1))
    banned = _scatter_mask(last_token, matched, logits_ptr.shape[1])
    logits_ptr.masked_fill_(banned, float("-inf"))


# --- logprob.py ---------------------------------------------------------------------------------

def _topk_log_softmax_kernel(
    output_ptr,
    logits_ptr,
    logits_stride,
    topk_ids_ptr,
    topk_ids_stride,
    topk,
    vocab_size,
    BLOCK_SIZE=1024,
    TOPK_BLOCK_SIZE=None,
):
    """Every row of ``logits``: the fp32 log-softmax at its ``topk`` ids, into ``output``
    (``[rows, topk]``, row-major)."""
    rows = logits_ptr.shape[0]
    logits = logits_ptr[:, :vocab_size]
    maximum = _nan_free_max(logits, dim=1).float()[:, None]
    lse = torch.log(torch.exp(logits.float() - maximum).sum(dim=1, keepdim=True))
    picked = logits_ptr.gather(1, topk_ids_ptr[:rows, :topk].long()).float()
    output_ptr.view(-1)[: rows * topk] = (picked - maximum - lse).flatten()


def _ranks_kernel(
    output_ptr,
    logits_ptr,
    logits_stride,
    token_ids_ptr,
    vocab_size,
    BLOCK_SIZE=8192,
):
    """Every row of ``logits``: how many logits are >= the one of its token (ties count)."""
    rows = logits_ptr.shape[0]
    logits = logits_ptr[:, :vocab_size]
    chosen = logits_ptr.gather(1, token_ids_ptr[:rows].long()[:, None])
    output_ptr[:rows] = (logits >= chosen).sum(dim=1).to(output_ptr.dtype)


def _fill_logprob_token_ids_kernel(
    out_token_ids_ptr,
    out_token_ids_stride,
    out_valid_mask_ptr,
    out_valid_mask_stride,
    sampled_token_ids_ptr,
    topk_indices_ptr,
    topk_indices_stride,
    expanded_idx_mapping_ptr,
    num_per_req_token_ids_ptr,
    per_req_token_ids_ptr,
    per_req_token_ids_stride,
    NUM_TOPK=0,
    PADDED_COLS=None,
):
    """Every row of ``out_token_ids [rows, 1 + cols]``: column 0 the sampled token, then the
    request's own logprob token ids when it has some, else the row's ``NUM_TOPK`` top-k ids;
    ``out_valid_mask`` is set where a token was written."""
    rows = out_token_ids_ptr.shape[0]
    cols = out_token_ids_ptr.shape[1] - 1
    device = out_token_ids_ptr.device
    request = _state_rows(expanded_idx_mapping_ptr, rows)
    num_custom = num_per_req_token_ids_ptr[request].long()[:, None]

    def padded(source: torch.Tensor) -> torch.Tensor:
        source = source[:, :cols].long()
        return torch.nn.functional.pad(source, (0, cols - source.shape[1]))

    custom = padded(per_req_token_ids_ptr[request])
    topk = (padded(topk_indices_ptr[:rows, :NUM_TOPK]) if NUM_TOPK
            else torch.zeros(rows, cols, dtype=torch.int64, device=device))
    tokens = torch.where(num_custom > 0, custom, topk)
    col = torch.arange(cols, device=device)[None, :]
    valid = col < torch.where(num_custom > 0, num_custom, NUM_TOPK)

    out_token_ids_ptr[:, 0] = sampled_token_ids_ptr[:rows].to(out_token_ids_ptr.dtype)
    out_valid_mask_ptr[:rows, 0] = True
    body = out_token_ids_ptr[:, 1:]
    body.copy_(torch.where(valid, tokens.to(body.dtype), body))
    out_valid_mask_ptr[:rows, 1:cols + 1] |= valid


# --- prompt_logprob.py --------------------------------------------------------------------------

def _prompt_logprobs_token_ids_kernel(
    prompt_logprobs_token_ids_ptr,
    query_start_loc_ptr,
    idx_mapping_ptr,
    num_computed_tokens_ptr,
    all_token_ids_ptr,
    all_token_ids_stride,
    BLOCK_SIZE=1024,
):
    """Every scheduled token of every request in ``idx_mapping``: the token after it,
    ``all_token_ids[r, num_computed_tokens + 1 + i]``, at its place in the batch. Tokens past the
    last request's query are left alone."""
    out = prompt_logprobs_token_ids_ptr
    num_reqs = idx_mapping_ptr.shape[0]
    device = out.device
    starts = query_start_loc_ptr[: num_reqs + 1].long()
    token = torch.arange(out.shape[0], device=device)
    owner = (torch.searchsorted(starts[1:].contiguous(), token, right=True)
             .clamp(max=max(num_reqs - 1, 0)))
    covered = (token >= starts[0]) & (token < starts[-1])
    request = idx_mapping_ptr.long()[owner]
    position = num_computed_tokens_ptr[request].long() + 1 + token - starts[owner]
    # The kernel addresses the flat buffer: a position past a row's end reads the next row.
    flat = (request * all_token_ids_stride + position).clamp(0, all_token_ids_ptr.numel() - 1)
    values = all_token_ids_ptr.reshape(-1)[flat]
    out.copy_(torch.where(covered, values.to(out.dtype), out))


# --- structured_outputs.py ----------------------------------------------------------------------

def _apply_grammar_bitmask_kernel(
    logits_ptr,
    logits_stride,
    logits_indices_ptr,
    cu_num_logits_ptr,
    bitmask_ptr,
    bitmask_stride,
    vocab_size,
    MASK_STRIDE=1,
    BLOCK_SIZE=8192,
):
    """Every row of ``bitmask``: its entry of ``logits_indices`` names (request, position); the
    logits row ``cu_num_logits[request] + position``, if the request has that many logits, gets
    -inf wherever the mask's bit is 0."""
    masks = bitmask_ptr.shape[0]
    rows = logits_ptr.shape[0]
    mapping = logits_indices_ptr[:masks].long()
    request = mapping // MASK_STRIDE
    position = mapping % MASK_STRIDE
    first = cu_num_logits_ptr[request].long()
    active = position < cu_num_logits_ptr[request + 1].long() - first
    target = torch.where(active, first + position, rows)
    disallowed = ~_unpack_bits(bitmask_ptr, min(vocab_size, bitmask_ptr.shape[1] * 32))
    blocked = torch.zeros(rows + 1, vocab_size, dtype=torch.bool, device=logits_ptr.device)
    blocked[:, : disallowed.shape[1]].index_copy_(0, target, disallowed)
    logits_ptr[:, :vocab_size].masked_fill_(blocked[:rows], float("-inf"))


# --- metrics/logits.py --------------------------------------------------------------------------

def _num_nans_kernel(
    logits_ptr,
    logits_stride,
    num_nans_ptr,
    vocab_size,
    BLOCK_SIZE=8192,
):
    """Every row of ``logits``: its number of NaNs, into ``num_nans``."""
    rows = logits_ptr.shape[0]
    counts = logits_ptr[:, :vocab_size].isnan().sum(dim=1)
    num_nans_ptr[:rows] = counts.to(num_nans_ptr.dtype)


KERNELS = {
    "vllm.v1.worker.gpu.sample.gumbel": (
        _temperature_kernel,
        _gumbel_sample_kernel,
        _gumbel_combine_kernel,
    ),
    "vllm.v1.worker.gpu.sample.min_p": (_min_p_kernel,),
    "vllm.v1.worker.gpu.sample.penalties": (_penalties_kernel, _bincount_kernel),
    "vllm.v1.worker.gpu.sample.logit_bias": (_bias_kernel,),
    "vllm.v1.worker.gpu.sample.bad_words": (_bad_words_kernel,),
    "vllm.v1.worker.gpu.sample.logprob": (
        _topk_log_softmax_kernel,
        _ranks_kernel,
        _fill_logprob_token_ids_kernel,
    ),
    "vllm.v1.worker.gpu.sample.prompt_logprob": (_prompt_logprobs_token_ids_kernel,),
    "vllm.v1.worker.gpu.structured_outputs": (_apply_grammar_bitmask_kernel,),
    "vllm.v1.worker.gpu.metrics.logits": (_num_nans_kernel,),
}
"""The kernels this module implements, by the vLLM module that defines each (under the same
name). ``greedy_argmax`` (0.34) needs none: it runs ``argmax`` in torch for non-CUDA tensors."""

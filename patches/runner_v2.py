"""Model Runner V2 (``vllm/v1/worker/gpu/``) on the NPU: what the v0_34 set changes and relies on.

vLLM 0.34 removed the V1 runner; ``gpu_worker.Worker`` always builds MRV2's ``GPUModelRunner``,
which prepares inputs and samples with Triton kernels. The NPU serves it without Triton:

- the worker's Triton gate is opened (every kernel MRV2 reaches on the served paths runs a
  registered torch implementation, :mod:`ascend_patch.npu.runner.v2.kernels`);
- UVA is declared unavailable, so MRV2 stages host data with explicit copies (``NonUvaBuffer``):
  on a real NPU ``is_uva_available()`` is true and ``UvaBuffer`` would ask for a device view of
  pinned host memory, which only CUDA, ROCm and XPU give;
- the block tables' two pointer-table kernels are replaced by methods that read the tensors
  the pointers address;
- the NPU worker builds ``NPUModelRunnerV2`` through ``Worker._make_model_runner``, vLLM's
  documented override point.
"""

from ascend_patch.overlay.declarations import Patch
from ascend_patch.patches._declare import contract

RUNNER_V2 = "ascend_patch.npu.runner.v2.model_runner:NPUModelRunnerV2"
_GPU = "vllm.v1.worker.gpu"
_MRV2 = "vllm/v1/worker/gpu/model_runner.py: Model Runner V2, which NPUModelRunnerV2 subclasses"
_BLOCK_TABLES = "ascend_patch.npu.runner.v2.block_tables:NPUBlockTablesMixin"
_NO_TRITON_ASCEND = "triton-ascend runs MRV2's kernels on every Ascend SoC vLLM serves"

# MRV2's Triton kernels that run a torch implementation (module under vllm/v1/worker/gpu/ -> our
# module under ascend_patch/npu/runner/v2/, then each kernel's parameters in vLLM 0.34). Declared
# with their parameters, so a release that changes one fails verification at `import vllm`.
_KERNELS = {
    "input_batch": ("input_kernels", {
        "_prepare_prefill_inputs_kernel":
            '(input_ids_ptr, next_prefill_tokens_ptr, next_prefill_tokens_stride, num_lookahead, '
            'idx_mapping_ptr, query_start_loc_ptr, all_token_ids_ptr, all_token_ids_stride, '
            'prefill_lens_ptr, num_computed_tokens_ptr, BLOCK_SIZE, LOOKAHEAD_BLOCK)',
        "_prepare_pos_seq_lens_kernel":
            '(pos_ptr, seq_lens_ptr, idx_mapping_ptr, query_start_loc_ptr, num_computed_tokens_ptr, '
            'max_num_reqs, BLOCK_SIZE)',
        "_combine_sampled_and_draft_tokens_kernel":
            '(input_ids_ptr, idx_mapping_ptr, last_sampled_tokens_ptr, query_start_loc_ptr, '
            'seq_lens_ptr, prefill_len_ptr, draft_tokens_ptr, draft_tokens_stride, cu_num_logits_ptr, '
            'logits_indices_ptr, BLOCK_SIZE, NUM_NEW_SAMPLED_TOKENS=...)',
        "_get_num_sampled_and_rejected_kernel":
            '(num_sampled_ptr, num_rejected_ptr, seq_lens_ptr, cu_num_logits_ptr, idx_mapping_ptr, '
            'prefill_len_ptr)',
        "_post_update_kernel":
            '(idx_mapping_ptr, num_computed_tokens_ptr, last_sampled_tokens_ptr, '
            'output_bin_counts_ptr, output_bin_counts_stride, sampled_tokens_ptr, '
            'sampled_tokens_stride, num_sampled_ptr, num_rejected_ptr, query_start_loc_ptr, '
            'all_token_ids_ptr, all_token_ids_stride, total_len_ptr, draft_tokens_ptr, '
            'draft_tokens_out_ptr, num_draft_tokens)',
        "_post_update_num_computed_tokens_kernel":
            '(idx_mapping_ptr, num_computed_tokens_ptr, query_start_loc_ptr)',
        "_expand_idx_mapping_kernel":
            '(idx_mapping_ptr, expanded_idx_mapping_ptr, expanded_local_pos_ptr, cu_num_logits_ptr, '
            'BLOCK_SIZE)',
    }),
    "model_states.mamba_hybrid": ("input_kernels", {
        "_scatter_num_accepted_kernel": "(idx_mapping_ptr, num_sampled_ptr, num_accepted_ptr)",
        "_fill_num_accepted_kernel": "(idx_mapping_ptr, num_accepted_ptr, num_sampled)",
    }),
    "buffer_utils": ("input_kernels", {
        "_apply_write_kernel":
            '(output_ptr, output_stride, write_indices_ptr, write_starts_ptr, write_contents_ptr, '
            'write_cu_lens_ptr, write_group_ids_ptr, BLOCK_SIZE, MULTI_GROUP)',
    }),
    "mm.rope": ("input_kernels", {
        "_prepare_rope_positions_kernel":
            '(positions_ptr, positions_stride, prefill_positions_ptr, prefill_positions_stride0, '
            'prefill_positions_stride1, prefill_delta_ptr, idx_mapping_ptr, query_start_loc_ptr, '
            'prefill_lens_ptr, num_computed_tokens_ptr, BLOCK_SIZE, NUM_DIMS)',
    }),
    "sample.gumbel": ("sample_kernels", {
        "_temperature_kernel":
            '(logits_ptr, logits_stride, expanded_idx_mapping_ptr, temperature_ptr, vocab_size, '
            'BLOCK_SIZE)',
        "_gumbel_sample_kernel":
            '(local_argmax_ptr, local_argmax_stride, local_max_ptr, local_max_stride, '
            'logits_cache_ptr, logits_cache_stride_0, logits_cache_stride_1, logits_cache_col_ptr, '
            'logits_cache_source_ptr, logits_cache_source_stride, logits_cache_row_mapping_ptr, '
            'logits_ptr, logits_stride, bias_ptr, bias_stride, expanded_idx_mapping_ptr, seeds_ptr, '
            'pos_ptr, temp_ptr, vocab_size, BLOCK_SIZE, IS_DRAFTING, APPLY_TEMPERATURE, USE_FP64, '
            'PER_TOKEN_COL, HAS_BIAS)',
        "_gumbel_combine_kernel":
            '(local_argmax_ptr, local_argmax_stride, local_max_ptr, local_max_stride, sampled_ptr, '
            'num_blocks, PADDED_NUM_BLOCKS)',
    }),
    "sample.min_p": ("sample_kernels", {
        "_min_p_kernel":
            '(logits_ptr, logits_stride, expanded_idx_mapping_ptr, min_p_ptr, vocab_size, BLOCK_SIZE)',
    }),
    "sample.penalties": ("sample_kernels", {
        "_penalties_kernel":
            '(logits_ptr, logits_stride, expanded_idx_mapping_ptr, token_ids_ptr, '
            'expanded_local_pos_ptr, repetition_penalty_ptr, frequency_penalty_ptr, '
            'presence_penalty_ptr, prompt_bin_mask_ptr, prompt_bin_mask_stride, '
            'output_bin_counts_ptr, output_bin_counts_stride, vocab_size, BLOCK_SIZE)',
        "_bincount_kernel":
            '(expanded_idx_mapping_ptr, all_token_ids_ptr, all_token_ids_stride, prompt_len_ptr, '
            'prefill_len_ptr, prompt_bin_mask_ptr, prompt_bin_mask_stride, output_bin_counts_ptr, '
            'output_bin_counts_stride, BLOCK_SIZE)',
    }),
    "sample.logit_bias": ("sample_kernels", {
        "_bias_kernel":
            '(logits_ptr, logits_stride, vocab_size, expanded_idx_mapping_ptr, '
            'num_allowed_token_ids_ptr, allowed_token_ids_ptr, allowed_token_ids_stride, '
            'num_logit_bias_ptr, bias_token_ids_ptr, bias_token_ids_stride, bias_ptr, bias_stride, '
            'pos_ptr, min_lens_ptr, num_stop_token_ids_ptr, restore_when_all_masked_ptr, '
            'stop_token_ids_ptr, stop_token_ids_stride, BLOCK_SIZE, LOGITS_BLOCK_SIZE, '
            'CHECK_ALL_MASKED_ROWS)',
    }),
    "sample.bad_words": ("sample_kernels", {
        "_bad_words_kernel":
            '(logits_ptr, logits_stride, expanded_idx_mapping_ptr, bad_word_token_ids_ptr, '
            'bad_word_token_ids_stride, bad_word_offsets_ptr, bad_word_offsets_stride, '
            'num_bad_words_ptr, all_token_ids_ptr, all_token_ids_stride, prompt_len_ptr, '
            'total_len_ptr, input_ids_ptr, expanded_local_pos_ptr)',
    }),
    "sample.logprob": ("sample_kernels", {
        "_topk_log_softmax_kernel":
            '(output_ptr, logits_ptr, logits_stride, topk_ids_ptr, topk_ids_stride, topk, vocab_size, '
            'BLOCK_SIZE, TOPK_BLOCK_SIZE)',
        "_ranks_kernel":
            '(output_ptr, logits_ptr, logits_stride, token_ids_ptr, vocab_size, BLOCK_SIZE)',
        "_fill_logprob_token_ids_kernel":
            '(out_token_ids_ptr, out_token_ids_stride, out_valid_mask_ptr, out_valid_mask_stride, '
            'sampled_token_ids_ptr, topk_indices_ptr, topk_indices_stride, expanded_idx_mapping_ptr, '
            'num_per_req_token_ids_ptr, per_req_token_ids_ptr, per_req_token_ids_stride, NUM_TOPK, '
            'PADDED_COLS)',
    }),
    "sample.prompt_logprob": ("sample_kernels", {
        "_prompt_logprobs_token_ids_kernel":
            '(prompt_logprobs_token_ids_ptr, query_start_loc_ptr, idx_mapping_ptr, '
            'num_computed_tokens_ptr, all_token_ids_ptr, all_token_ids_stride, BLOCK_SIZE)',
    }),
    "structured_outputs": ("sample_kernels", {
        "_apply_grammar_bitmask_kernel":
            '(logits_ptr, logits_stride, logits_indices_ptr, cu_num_logits_ptr, bitmask_ptr, '
            'bitmask_stride, vocab_size, MASK_STRIDE, BLOCK_SIZE)',
    }),
    "metrics.logits": ("sample_kernels", {
        "_num_nans_kernel":
            '(logits_ptr, logits_stride, num_nans_ptr, vocab_size, BLOCK_SIZE)',
    }),
    "spec_decode.rejection_sampler": ("spec_decode_kernels", {
        "_flatten_sampled_kernel":
            '(flat_sampled_ptr, sampled_ptr, sampled_stride, num_sampled_ptr, cu_num_logits_ptr)',
        "_gather_draft_sampled_kernel":
            '(draft_sampled_ptr, pos_ptr, input_ids_ptr, positions_ptr, logits_indices_ptr, '
            'expanded_idx_mapping_ptr, expanded_local_pos_ptr, prefill_len_ptr, num_logits, '
            'BLOCK_SIZE)',
    }),
    "spec_decode.rejection_sampler_utils": ("spec_decode_kernels", {
        "_compute_local_logits_stats_kernel":
            '(target_local_argmax_ptr, target_local_argmax_stride, target_local_max_ptr, '
            'target_local_max_stride, target_local_sumexp_ptr, target_local_sumexp_stride, '
            'draft_local_max_ptr, draft_local_max_stride, draft_local_sumexp_ptr, '
            'draft_local_sumexp_stride, target_logits_ptr, target_logits_stride, draft_logits_ptr, '
            'draft_logits_stride_0, draft_logits_stride_1, draft_logits_row_mapping_ptr, '
            'expanded_idx_mapping_ptr, expanded_local_pos_ptr, temp_ptr, vocab_size, num_logits, '
            'BLOCK_SIZE, HAS_DRAFT_LOGITS)',
        "_compute_cumulative_log_p_kernel":
            '(cumulative_log_p_ptr, target_logits_ptr, target_logits_stride, target_local_max_ptr, '
            'target_local_max_stride, target_local_sumexp_ptr, target_local_sumexp_stride, '
            'draft_sampled_ptr, draft_logits_ptr, draft_logits_stride_0, draft_logits_stride_1, '
            'draft_logits_row_mapping_ptr, draft_local_max_ptr, draft_local_max_stride, '
            'draft_local_sumexp_ptr, draft_local_sumexp_stride, cu_num_logits_ptr, idx_mapping_ptr, '
            'temp_ptr, vocab_num_blocks, PADDED_VOCAB_NUM_BLOCKS, HAS_DRAFT_LOGITS)',
        "_compute_local_residual_mass_kernel":
            '(local_residual_mass_ptr, local_residual_mass_stride, cumulative_log_p_ptr, '
            'target_logits_ptr, target_logits_stride, target_local_max_ptr, target_local_max_stride, '
            'target_local_sumexp_ptr, target_local_sumexp_stride, draft_logits_ptr, '
            'draft_logits_stride_0, draft_logits_stride_1, draft_logits_row_mapping_ptr, '
            'draft_local_max_ptr, draft_local_max_stride, draft_local_sumexp_ptr, '
            'draft_local_sumexp_stride, draft_sampled_ptr, expanded_idx_mapping_ptr, '
            'expanded_local_pos_ptr, temp_ptr, vocab_size, num_logits, vocab_num_blocks, BLOCK_SIZE, '
            'PADDED_VOCAB_NUM_BLOCKS)',
        "_rejection_kernel":
            '(sampled_ptr, sampled_stride, rejected_steps_ptr, target_rejected_logsumexp_ptr, '
            'draft_rejected_logsumexp_ptr, target_logits_ptr, target_logits_stride, '
            'target_local_argmax_ptr, target_local_argmax_stride, target_local_max_ptr, '
            'target_local_max_stride, target_local_sumexp_ptr, target_local_sumexp_stride, '
            'draft_sampled_ptr, draft_logits_ptr, draft_logits_stride_0, draft_logits_stride_1, '
            'draft_logits_row_mapping_ptr, draft_local_max_ptr, draft_local_max_stride, '
            'draft_local_sumexp_ptr, draft_local_sumexp_stride, cu_num_logits_ptr, idx_mapping_ptr, '
            'temp_ptr, seed_ptr, pos_ptr, synthetic_conditional_rates_ptr, cumulative_log_p_ptr, '
            'local_residual_mass_ptr, local_residual_mass_stride, fly_entropy_ptr, '
            'fly_entropy_threshold, vocab_num_blocks, PADDED_VOCAB_NUM_BLOCKS, HAS_DRAFT_LOGITS, '
            'SYNTHETIC_MODE, USE_BLOCK_VERIFICATION, FLY_WINDOW_SIZE)',
        "_resample_kernel":
            '(resampled_local_argmax_ptr, resampled_local_argmax_stride, resampled_local_max_ptr, '
            'resampled_local_max_stride, target_logits_ptr, target_logits_stride, '
            'target_rejected_logsumexp_ptr, draft_logits_ptr, draft_logits_stride_0, '
            'draft_logits_stride_1, draft_logits_row_mapping_ptr, draft_rejected_logsumexp_ptr, '
            'rejected_step_ptr, cu_num_logits_ptr, expanded_idx_mapping_ptr, draft_sampled_ptr, '
            'temp_ptr, seed_ptr, pos_ptr, cumulative_log_p_ptr, contexts_ptr, contexts_stride, '
            'watermarking_ptr, watermarking_skip_mask_ptr, watermark_key_0, watermark_key_1, '
            'vocab_size, BLOCK_SIZE, HAS_DRAFT_LOGITS, USE_FP64, USE_BLOCK_VERIFICATION, '
            'CONTEXT_WIDTH, WATERMARK, DEDUPLICATE_CONTEXTS, SKIP_MASKED_BLOCKS)',
        "_insert_resampled_kernel":
            '(sampled_ptr, sampled_stride, num_sampled_ptr, resampled_local_argmax_ptr, '
            'resampled_local_argmax_stride, resampled_local_max_ptr, resampled_local_max_stride, '
            'resample_num_blocks, cu_num_logits_ptr, expanded_idx_mapping_ptr, temp_ptr, '
            'PADDED_RESAMPLE_NUM_BLOCKS)',
    }),
    "spec_decode.draft_logits": ("spec_decode_kernels", {
        "_assign_rows_kernel":
            '(idx_mapping_ptr, shard_mapping_ptr, row_mapping_ptr, inverse_row_mapping_ptr, '
            'num_reqs, NUM_SHARDS, SHARD_IDX, BLOCK_SIZE)',
        "_stale_drafts_kernel":
            '(stale_ptr, expanded_idx_mapping_ptr, expanded_local_pos_ptr, row_mapping_ptr, '
            'inverse_row_mapping_ptr, num_logits, BLOCK_SIZE)',
    }),
    "spec_decode.ngram.speculator": ("spec_decode_kernels", {
        "_ngram_scan_kernel":
            '(token_ids_ptr, token_ids_stride, idx_mapping_ptr, total_len_ptr, num_sampled_ptr, '
            'scratch_ptr, scratch_stride, L, MIN_N, MAX_N, MAX_N_PO2, BLOCK_L)',
        "_ngram_finalize_kernel":
            '(token_ids_ptr, token_ids_stride, idx_mapping_ptr, total_len_ptr, num_sampled_ptr, '
            'last_sampled_ptr, scratch_ptr, scratch_stride, drafts_ptr, L, N_BLOCKS, K, K_PO2, '
            'N_BLOCKS_PO2)',
    }),
    "spec_decode.standalone_ar.speculator": ("spec_decode_kernels", {
        "_prepare_prefill_inputs_kernel":
            '(target_input_ids_ptr, target_positions_ptr, last_sampled_ptr, idx_mapping_ptr, '
            'out_input_ids_ptr, out_positions_ptr, last_token_indices_ptr, out_query_start_loc_ptr, '
            'out_seq_lens_ptr, query_start_loc_ptr, seq_lens_ptr, num_rejected_ptr, max_num_reqs, '
            'max_model_len, BLOCK_SIZE)',
    }),
    "spec_decode.target_dependent_ar.speculator": ("spec_decode_kernels", {
        "_prepare_prefill_inputs_kernel":
            '(last_token_indices_ptr, draft_current_step_ptr, draft_input_ids_ptr, '
            'draft_positions_ptr, draft_query_start_loc_ptr, draft_seq_lens_ptr, '
            'target_input_ids_ptr, target_positions_ptr, idx_mapping_ptr, last_sampled_ptr, '
            'next_prefill_tokens_ptr, num_sampled_ptr, num_rejected_ptr, query_start_loc_ptr, '
            'seq_lens_ptr, max_num_reqs, BLOCK_SIZE)',
        "_prepare_decode_inputs_kernel":
            '(draft_tokens_ptr, draft_tokens_stride, target_seq_lens_ptr, num_rejected_ptr, '
            'input_ids_ptr, positions_ptr, sample_src_positions_ptr, query_start_loc_ptr, '
            'seq_lens_ptr, max_model_len, max_num_reqs, BLOCK_SIZE, ADVANCE_DRAFT_POSITIONS)',
        "_update_draft_inputs_kernel":
            '(output_draft_tokens_ptr, output_draft_tokens_stride, next_input_hidden_states_ptr, '
            'next_input_hidden_states_stride, input_ids_ptr, positions_ptr, sample_src_positions_ptr, '
            'seq_lens_ptr, draft_tokens_ptr, current_draft_step_ptr, hidden_states_ptr, '
            'hidden_states_stride, hidden_size, max_model_len_ptr, num_speculative_steps, BLOCK_SIZE, '
            'ADVANCE_DRAFT_POSITIONS)',
    }),
}

# Implementations whose attribute differs from the kernel's name: two speculators each define a
# `_prepare_prefill_inputs_kernel` (and so does input_batch), one module holds both here.
_IMPLEMENTED_AS = {
    ("spec_decode.standalone_ar.speculator", "_prepare_prefill_inputs_kernel"):
        "standalone_ar_prepare_prefill_inputs",
    ("spec_decode.target_dependent_ar.speculator", "_prepare_prefill_inputs_kernel"):
        "target_dependent_ar_prepare_prefill_inputs",
}

_KERNEL_REGISTRY = ("vllm/triton_utils/dispatcher.py: register_kernels, asked by "
                    "Platform.register_triton_kernel_overrides before any worker code runs, "
                    "rebinds the kernel wherever it is bound")

KERNELS = [
    contract(f"{_GPU}.{module}:{kernel}", signature,
             "run its torch implementation (same parameters) through vLLM's kernel registry",
             implementation=f"ascend_patch.npu.runner.v2.{ours}:"
                            f"{_IMPLEMENTED_AS.get((module, kernel), kernel)}",
             upstream=f"vllm/v1/worker/gpu/{module.replace('.', '/')}.py: a Triton kernel, which "
                      "the NPU cannot launch without triton-ascend; " + _KERNEL_REGISTRY,
             remove_when=_NO_TRITON_ASCEND)
    for module, (ours, kernels) in _KERNELS.items() for kernel, signature in kernels.items()
]

RUNNER = [
    *KERNELS,
    Patch(
        "vllm.v1.worker.gpu_worker:HAS_TRITON",
        reason="open MRV2's Triton gate: every kernel it reaches on the served paths runs a "
               "registered torch implementation, so the worker needs no Triton",
        replacement="ascend_patch.npu.runner.v2.kernels:triton_gate",
        upstream="vllm/v1/worker/gpu_worker.py (0.34): Worker.__init__ raises \"vLLM's model "
                 "runner requires Triton.\" unless HAS_TRITON or the platform claims the "
                 "standalone CPU runner, whose config checks refuse speculative decoding",
        remove_when="vLLM gates on the kernels a platform registered instead of on Triton",
        rebind=False,  # only the worker's gate: every other HAS_TRITON keeps its value
    ),
    Patch(
        f"{_GPU}.spec_decode.ngram.speculator:HAS_TRITON",
        reason="open the n-gram speculator's Triton gate: its scan and finalize kernels run "
               "registered torch implementations",
        replacement="ascend_patch.npu.runner.v2.kernels:triton_gate",
        upstream="vllm/v1/worker/gpu/spec_decode/ngram/speculator.py: NgramGPUSpeculator "
                 "raises \"ngram_gpu speculative decoding requires Triton.\" unless HAS_TRITON",
        remove_when="vLLM gates on the kernels a platform registered instead of on Triton",
        rebind=False,  # only the speculator's gate
    ),
    Patch(
        "vllm.triton_utils.importing:TritonPlaceholder.__init__",
        reason="MRV2's host code sizes its launches with triton.next_power_of_2, which vLLM's "
               "stand-in for a missing Triton lacks",
        signature=("(self)",),
        wrapper="ascend_patch.npu.runner.v2.kernels:complete_triton_placeholder",
        upstream="vllm/triton_utils/importing.py: TritonPlaceholder defines cdiv but not "
                 "next_power_of_2 (31 calls in vllm/v1/worker/gpu/)",
        remove_when="vLLM's TritonPlaceholder defines next_power_of_2",
    ),
    Patch(
        "vllm.utils.platform_utils:is_uva_available",
        reason="MRV2 stages host data with explicit copies (NonUvaBuffer): the NPU cannot read "
               "pinned host memory from a kernel without triton-ascend",
        replacement="ascend_patch.npu.runner.v2.kernels:no_uva",  # no signature: a functools.cache
        upstream="vllm/utils/platform_utils.py: UVA whenever pinned memory is available, which it "
                 "is on an NPU; UvaBuffer then asks get_accelerator_view_from_cpu_tensor, which "
                 "raises for anything but CUDA, ROCm and XPU",
        remove_when="torch_npu gives a device view of pinned host memory that torch ops can read",
    ),
    Patch(
        f"{_GPU}.block_table:BlockTables",
        reason="gather block-table rows and compute slot mappings in torch: vLLM's kernels take "
               "tables of raw device pointers, which the kernel registry cannot stand in for",
        replacement="ascend_patch.npu.runner.v2.block_tables:npu_block_tables",
        implementation=_BLOCK_TABLES,
        upstream="vllm/v1/worker/gpu/block_table.py: _gather_block_tables_kernel and "
                 "_compute_slot_mappings_kernel read uint64 pointer tables (_make_ptr_tensor)",
        remove_when=_NO_TRITON_ASCEND,
    ),
    Patch(
        "vllm.v1.sample.ops.topk_topp_sampler:apply_top_k_top_p",
        reason="mask top-k/top-p through npu_top_k_top_p (k ≤ 1024, and its top-p-only form), "
               "vLLM's sort for the rest",
        signature=("(logits, k, p, has_topp_only_rows=...)",),
        replacement="ascend_patch.npu.runner.v2.sampler:npu_apply_top_k_top_p",
        upstream="vllm/v1/sample/ops/topk_topp_sampler.py: Triton when it imports (found broken "
                 "on Ascend for batches of 8 or more, vllm-project/vllm-ascend#12731), else a "
                 "full-vocabulary sort; MRV2's Sampler and SamplingStates call it by name",
        remove_when="vLLM dispatches top-k/top-p to a platform implementation",
    ),
    Patch(
        f"{_GPU}.sample.sampler:Sampler._sample_random",
        reason="sample an all-greedy batch without top-k/top-p with one argmax instead of the "
               "torch Gumbel kernels' per-token noise (the same tokens)",
        signature=("(self, processed_logits, expanded_idx_mapping, idx_mapping_np, pos, top_k, top_p, "
                   "has_topp_only_rows, use_fused_sampler)",),
        wrapper="ascend_patch.npu.runner.v2.sampler:greedy_batches_take_argmax",
        upstream="vllm/v1/worker/gpu/sample/sampler.py: every batch goes through gumbel_sample, whose "
                 "Triton kernel skips greedy rows' noise; without Triton each row pays for it",
        remove_when=_NO_TRITON_ASCEND,
    ),
    Patch(
        f"{_GPU}.spec_decode.rejection_sampler:RejectionSampler._verify",
        reason="verify an all-greedy batch's drafts with one argmax over its processed logits "
               "instead of the torch rejection kernels' per-row statistics and Philox noise (the "
               "same tokens)",
        signature=("(self, logits, draft_logits, draft_sampled, pos, cu_num_logits, idx_mapping, "
                   "idx_mapping_np, expanded_idx_mapping, expanded_local_pos, "
                   "seq_lens_upper_bound_np)",),
        wrapper="ascend_patch.npu.runner.v2.sampler:greedy_verification_takes_argmax",
        upstream="vllm/v1/worker/gpu/spec_decode/rejection_sampler_utils.py: rejection_sample "
                 "launches the same Triton kernels for every batch, whose greedy rows skip the "
                 "noise on the device; without Triton each row pays for it",
        remove_when=_NO_TRITON_ASCEND,
    ),
    Patch(
        f"{_GPU}.sample.states:SamplingStates.get_top_k_top_p",
        reason="hand the top-k/top-p mask the host copy of k, so it routes rows between "
               "npu_top_k_top_p (k ≤ 1024) and vLLM's sort without a per-step device sync",
        signature=("(self, expanded_idx_mapping, idx_mapping_np, vocab_size)",),
        wrapper="ascend_patch.npu.runner.v2.sampler:attach_host_top_k",
        upstream="vllm/v1/worker/gpu/sample/states.py: the k tensor is gathered on the device from "
                 "top_k.np's copy; the host values never reach apply_top_k_top_p",
        remove_when="vLLM dispatches top-k/top-p to a platform implementation that is given the "
                    "host sampling parameters",
    ),
    Patch(
        f"{_GPU}.cudagraph_utils:CudaGraphManager.run_fullgraph",
        reason="renew the captured host-parameter launches of a FULL graph (paged attention's "
               "context lengths, FIA's query ends and KV lengths) with the attention metadata "
               "last built for their layers before each replay, the target's and the drafter's",
        signature=("(self, desc)",),
        wrapper="ascend_patch.npu.runner.v2.graphs:renew_before_replay",
        upstream="vllm/v1/worker/gpu/cudagraph_utils.py: run_fullgraph replays outside "
                 "set_forward_context; a CUDA graph reads device lengths and needs no renewal",
        remove_when="the Ascend attention kernels take device-side lengths",
    ),
    Patch(
        f"{_GPU}.cudagraph_utils:CudaGraphManager.capture",
        reason="keep a weak list of the process's graph managers, the target's and each "
               "speculator's, whose graphs the engine reports count",
        # No signature: torch.inference_mode's decorator shows (*args, **kwargs) at runtime, and
        # the wrapper hands every argument on untouched.
        wrapper="ascend_patch.npu.runner.v2.graphs:register_manager",
        upstream="vllm/v1/worker/gpu/cudagraph_utils.py: the managers are the runner's and its "
                 "speculator's attributes, under names that differ per speculator",
        remove_when="never while the emulated NPU exists",
    ),
    Patch(
        f"{_GPU}.spec_decode.speculator:DraftModelSpeculator._build_attn_metadata",
        reason="file each draft step's attention metadata for the drafter's FULL graph replayed "
               "next (its launches' host parameters are renewed from it)",
        signature=("(self, num_reqs, batch_desc, query_start_loc_np, seq_lens_cpu_upper_bound, "
                   "step, causal=..., dcp_local_seq_lens=..., slot_mappings=...)",),
        wrapper="ascend_patch.npu.runner.v2.graphs:record_drafter_metadata",
        upstream="vllm/v1/worker/gpu/spec_decode/speculator.py: the draft steps' metadata "
                 "reaches only set_forward_context; their graphs replay outside it",
        remove_when="the Ascend attention kernels take device-side lengths",
    ),
    Patch(
        f"{_GPU}.model_states.prompt_embeds:PromptEmbedsState.apply",
        reason="overlay prompt embeddings with torch ops: vLLM's kernel finds each request's "
               "embeddings through a table of device pointers",
        signature=("(self, input_batch, num_computed_tokens, inputs_embeds)",),
        replacement="ascend_patch.npu.runner.v2.input_kernels:npu_prompt_embeds",
        implementation="ascend_patch.npu.runner.v2.input_kernels:apply_prompt_embeds",
        upstream="vllm/v1/worker/gpu/model_states/prompt_embeds.py: _apply_prompt_embeds_kernel "
                 "reads embeds_ptrs/mask_ptrs, uint64 pointer tables",
        remove_when=_NO_TRITON_ASCEND,
    ),
    *(contract(f"{_GPU}.block_table:BlockTables.{name}", signature,
               "NPUBlockTables overrides it with the same arguments", implementation=_BLOCK_TABLES,
               upstream="vllm/v1/worker/gpu/block_table.py", remove_when=_NO_TRITON_ASCEND)
      for name, signature in (
          ("gather_block_tables",
           "(self, idx_mapping, num_reqs_padded, out=..., out_ptrs=..., num_computed_tokens=...)"),
          ("compute_slot_mappings",
           "(self, idx_mapping, query_start_loc, positions, num_tokens_padded, out=...)"),
          ("apply_staged_writes", "(self)"))),
    contract("vllm.v1.worker.gpu_worker:Worker._make_model_runner", "(self)",
             "NPUWorker builds NPUModelRunnerV2 through it",
             implementation="ascend_patch.npu.runner.worker:NPUWorker",
             upstream="vllm/v1/worker/gpu_worker.py: \"Construct the platform's model runner; "
                      "subclasses override this\""),
    contract(f"{_GPU}.model_runner:GPUModelRunner.load_model", None,
             "NPUModelRunnerV2 reports the attention and routing paths and charges the loaded "
             "weights to the emulated HBM", implementation=RUNNER_V2, upstream=_MRV2,
             remove_when="never while the emulated NPU exists"),
    contract(f"{_GPU}.model_runner:GPUModelRunner.profile_run", "(self, randomize_inputs=...)",
             "NPUModelRunnerV2 measures the profiling pass's activations", implementation=RUNNER_V2,
             upstream=_MRV2, remove_when="never while the emulated NPU exists"),
    contract(f"{_GPU}.model_runner:GPUModelRunner._dummy_run", None,
             "NPUModelRunnerV2 marks its dummy passes, whose attention over all-PAD slots the "
             "backend keeps out of the KV cache beyond the null block", implementation=RUNNER_V2,
             upstream=_MRV2 + " (unlike the V1 runner's warm-up, a dummy pass builds attention "
                              "metadata, every slot PAD)",
             remove_when="never while the NPU's KV write takes no PAD slots"),
    contract(f"{_GPU}.model_runner:GPUModelRunner._init_kv_zero_meta", "(self)",
             "NPUModelRunnerV2 zeroes new KV blocks in the Ascend layouts (block pages, MLA "
             "latent/rope planes)", implementation=RUNNER_V2,
             upstream=_MRV2 + " (KVBlockZeroer is a Triton kernel over [blocks, ...] caches, "
                              "addressed by raw pointers)",
             remove_when="vLLM zeroes blocks through the attention backend"),
]

GRAPH_DEVICE_API = [
    *(Patch(
        f"torch.cuda:{name}",
        reason=reason,
        replacement=f"ascend_patch.npu.runner.v2.graphs:{factory}",
        upstream="vllm/v1/worker/gpu/cudagraph_utils.py: CudaGraphManager.capture calls "
                 "torch.cuda.CUDAGraph() and torch.cuda.graph(...) directly",
        remove_when="vLLM captures graphs through the platform (torch.accelerator graphs)",
        rebind=False,  # torch's own modules keep their references
    ) for name, factory, reason in (
        ("CUDAGraph", "npu_graph_class", "MRV2's FULL graphs are the device runtime's NPUGraph"),
        ("graph", "npu_graph_capture", "capture MRV2's FULL graphs on the device runtime, "
                                       "collecting the launches each replay renews"))),
]
"""torch.cuda's graph API, which MRV2's graph manager calls directly (torch targets, beside the set's
other device-API stand-ins)."""

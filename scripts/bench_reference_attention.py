"""Throughput of the reference attention kernels on a realistic emulated batch (CPU).

The emulated engine runs every attention layer through these kernels, so their speed bounds the
emulator's. This prints milliseconds per call (one layer) and query tokens per second for:

- decode: 32 sequences, one token each, over ~512 cached tokens;
- mixed: those 32 decodes plus two 256-token chunks behind 512-token prefixes and one fresh
  512-token prefill, in one ``fused_infer_attention_score`` call;
- the same decode batch through ``paged_attention``.

Layout: 8 query heads, 2 KV heads, head dim 128, block size 128. float32 is not benchmarked: the
attention ops take float16/bfloat16 only, and the reference enforces that.

    .venv/bin/python scripts/bench_reference_attention.py [--iters N] [--threads N]
"""

import argparse
import math
import time

import torch

from ascend_patch.npu import kernels

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 8, 2, 128, 128
CAUSAL_MASK = torch.ones(2048, 2048, dtype=torch.int8).triu(1)


def build_batch(q_lens, kv_lens, dtype, generator):
    """A paged cache holding every sequence's context, with a random block placement."""
    per_seq = [math.ceil(n / BLOCK_SIZE) for n in kv_lens]
    num_blocks = sum(per_seq)
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    key_cache = torch.randn(shape, generator=generator).to(dtype)
    value_cache = torch.randn(shape, generator=generator).to(dtype)
    block_table = torch.zeros(len(kv_lens), max(per_seq), dtype=torch.int32)
    order = torch.randperm(num_blocks, generator=generator).to(torch.int32)
    taken = 0
    for row, count in enumerate(per_seq):
        block_table[row, :count] = order[taken:taken + count]
        taken += count
    query = torch.randn(sum(q_lens), HEADS, HEAD_DIM, generator=generator).to(dtype)
    return query, key_cache, value_cache, block_table


def timed(fn, iters):
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters


def main():
    kernels.use("reference")
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    generator = torch.Generator().manual_seed(0)
    decode_kv = torch.randint(448, 577, (32,), generator=generator).tolist()
    batches = {
        "decode": ([1] * 32, decode_kv),
        "mixed": ([1] * 32 + [256, 256, 512], decode_kv + [768, 768, 512]),
    }
    print(f"reference attention, {HEADS} heads / {KV_HEADS} KV heads, head dim {HEAD_DIM}, "
          f"block {BLOCK_SIZE}, {args.threads} CPU threads, {args.iters} iterations")
    print(f"{'case':<32}{'dtype':<10}{'tokens':>7}{'ms/call':>10}{'tokens/s':>12}")
    for dtype in (torch.bfloat16, torch.float16):
        for case, (q_lens, kv_lens) in batches.items():
            query, key_cache, value_cache, block_table = build_batch(q_lens, kv_lens, dtype,
                                                                    generator)
            num_blocks = key_cache.shape[0]
            q_ends = torch.tensor(q_lens).cumsum(0).tolist()

            def fused():
                kernels.fused_infer_attention_score(
                    query, key_cache.view(num_blocks, BLOCK_SIZE, -1),
                    value_cache.view(num_blocks, BLOCK_SIZE, -1), atten_mask=CAUSAL_MASK,
                    block_table=block_table,
                    actual_seq_lengths=q_ends,
                    actual_seq_lengths_kv=kv_lens, num_heads=HEADS, num_key_value_heads=KV_HEADS,
                    scale=HEAD_DIM**-0.5, input_layout="TND", block_size=BLOCK_SIZE, sparse_mode=3,
                )

            report(f"fused_infer_attention {case}", dtype, sum(q_lens), timed(fused, args.iters))

        query, key_cache, value_cache, block_table = build_batch([1] * 32, decode_kv, dtype,
                                                                generator)
        out = torch.empty_like(query)
        context_lens = torch.tensor(decode_kv, dtype=torch.int32)

        def paged():
            kernels.paged_attention(query, key_cache, value_cache, KV_HEADS, HEADS,
                                    HEAD_DIM**-0.5, block_table, context_lens, out)

        report("paged_attention decode", dtype, 32, timed(paged, args.iters))


def report(case, dtype, tokens, seconds):
    name = str(dtype).removeprefix("torch.")
    print(f"{case:<32}{name:<10}{tokens:>7}{seconds * 1e3:>10.2f}{tokens / seconds:>12.0f}")


if __name__ == "__main__":
    main()

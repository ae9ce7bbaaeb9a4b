"""Run stock vLLM's offline ``LLM`` in a fresh interpreter and report what it produced.

The engine tests start this script with ``ASCEND_PATCH=emulate`` in the environment:
the overlay reaches the process through the installed ``.pth``, exactly as it would
for a user's script, and nothing here imports the overlay before vLLM (the engine helpers it
shares with ``ascend-patch verify``, :mod:`ascend_patch.kit.engine`, import it in their calls).

    python tests/engine_driver.py SPEC.json   ->   one JSON line on stdout

SPEC: {"engines": [{"model": DIR, "kwargs": {...LLM kwargs}, "runs": [RUN, ...]}]}
RUN, by "kind":
  "generate" (default)  {"prompts": [[token ids], ...], "sampling": [{...SamplingParams}, ...]}
                        and optionally "adapters": [LoRA adapter directory or null, ...] per prompt
                        and "images": [synthetic image seed or null, ...] per prompt (a
                        vision-language model's image, ascend_patch.kit.tiny_vl.image)
  "chat"                {"conversations": [[message, ...], ...], "sampling": [...], "chat": {...}}
                        (``chat`` holds extra ``LLM.chat`` keyword arguments)
  "beam_search"         {"prompts": [[token ids], ...], "beam": {...BeamSearchParams}}
  "embed", "classify"   {"prompts": [[token ids], ...]}: a pooling model's vectors ("embeddings",
                        "probabilities"), per prompt
  "score"               {"query": TEXT, "documents": [TEXT, ...]}: a cross-encoder's "scores"
  "sleep"               {"level": 1 or 2}: ``LLM.sleep``; reports the emulated HBM's books (bytes by
                        what holds them) before ("books_before") and after ("books")
  "wake_up"             {"tags": [...] or absent}: ``LLM.wake_up``; reports the books after ("books")
  "zero_offloaded_kv"   zeroes every block the NPU offloading worker holds in host memory (the
                        negative control of the KV offload tests; an in-process engine only), or
                        with "planes": ["rope"] (or "latent") only those planes of MLA layers
  "stale_drafter_inputs" replaces the V1 runner's EAGLE drafter's input buffers (token ids,
                        positions, hidden states) by copies: vLLM writes each later step's
                        inputs into the copies, which eager drafter passes read, while the
                        drafter's replayed PIECEWISE graphs still read the captured buffers (the
                        negative control of the drafter-graph tests; an in-process engine only)
A sampling dict may carry "structured_outputs": {...StructuredOutputsParams}. One sampling
dict applies to every prompt, a list pairs them one by one. A run with "layer_launches": true also
reports the device launches per decoder-layer call, op by op, as scripts/bench_engine.py counts
them (:mod:`ascend_patch.kit.launches`; an in-process engine only).

Each run reports the kernel-seam launch counts for the whole run, what kinds of batch the
fused attention launches served ("fused_batches", see ``_fused_batches``) and, per prompt, the
generated token ids of the first completion ("tokens") and, when the sampling asks
for ``logprobs``, each one's log-probability ("logprobs"), the number of prompt tokens
served from the prefix cache, and "outputs": the prompt's token ids and prompt logprobs
and every completion with its tokens, text, finish reason and logprobs (per position a
list of [token id, logprob, rank]). A beam-search run reports its sequences instead.
An engine that keeps stats (``"disable_log_stats": false``) also reports, per run, vLLM's own
speculative-decoding counters ("spec_decode": drafts, draft_tokens, accepted_tokens and
accepted_per_position, vLLM's accepted drafts by draft position), and a run with "counters":
[metric names] how much each of those vLLM counters grew during it ("counters").
Each run also reports the graph replays ("graph_replays", by padded size, by model and by model
and size: ascend_patch.kit.engine.measured); each engine its vLLM-settled cudagraph mode, async
scheduling, capture sizes and the graphs it captured. An engine spec with
``"stale_host_params": true`` runs with the graphs' host-parameter updates left out (the negative
control of the graph tests), with a layer name's part (e.g. "layers.1.") only those of the layers
whose name holds it; one with ``"stale_recurrent_state": true`` runs
Mamba-2 and gated-DeltaNet decode steps (composed) that never advance their state (the negative
control of the recurrent tests); one with ``"stale_lora_slots": true`` has the LoRA wrapper put
each step's adapter slots into new tensors instead of its fixed buffers (eager steps read them, a
replayed graph still the capture's: the negative control of the LoRA graph tests).
An engine whose workers run in processes of their own (``tensor_parallel_size`` > 1 with the "mp"
executor) also reports, per run and rank, the graph replays and task updates of that rank's worker
("ranks"). Every engine reports, per rank, the kernel-seam launches its graphs of the smallest
captured size hold, by runtime mode and op ("captured_ops": [{"FULL": {op: n}, "PIECEWISE": ...}],
on the emulated graph; PIECEWISE counts every piece of that size).
Each engine also reports what ascend-patch logged while it started and ran ("log").
An engine spec's "env" holds environment variables set while that engine starts (e.g. the DP
rank variables of vLLM's offline data-parallel example); vLLM caches its environment once an
engine core has started, so only engines before the first that starts can be given one.
A run that raises ends the driver with the traceback, unless SPEC has "report_errors": true:
then the run reports {"error": "Type: message"} and the engine goes on to the next run.
With "record_seam": true in SPEC, the report also holds "seam_calls": every distinct kernel-seam
call of the whole run, engine start-up and graph capture included (``kernels.record_calls``).
Every uninitialized tensor the driver's process allocates (``torch.empty``) holds NaN (integers
their maximum; torch's deterministic mode): a read of bytes nobody wrote (vLLM's padded rows, the
null block) shows up as NaN instead of passing by the luck of what memory held.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from ascend_patch.kit import engine  # noqa: E402  (imports nothing of vLLM's or the overlay's)


def _books() -> dict[str, int]:
    from vllm.platforms import current_platform

    return current_platform.runtime().in_use_by_kind()


def _run(llm, run: dict) -> dict:
    kind = run.get("kind", "generate")
    if kind == "sleep":
        before = _books()
        llm.sleep(level=run["level"])
        return {"books_before": before, "books": _books()}
    if kind == "wake_up":
        llm.wake_up(tags=run.get("tags"))
        return {"books": _books()}
    if kind == "zero_offloaded_kv":
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        worker = get_kv_transfer_group().connector_worker.worker
        for host, plane in zip(worker.host_tensors, worker.planes):
            if plane in run.get("planes", (plane,)):
                host.zero_()
        return {}
    if kind == "stale_drafter_inputs":
        drafter = _runner(llm).drafter
        for name in ("input_ids", "positions", "hidden_states"):
            setattr(drafter, name, getattr(drafter, name).clone())
        return {}
    if kind == "beam_search":
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import BeamSearchParams

        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in run["prompts"]]
        outputs = llm.beam_search(prompts, BeamSearchParams(**run["beam"]))
        return {"beams": [[{"tokens": list(s.tokens), "cum_logprob": s.cum_logprob, "text": s.text}
                           for s in o.sequences] for o in outputs]}
    if kind in ("embed", "classify"):
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in run["prompts"]]
        if kind == "embed":
            return {"embeddings": [o.outputs.embedding for o in llm.embed(prompts, use_tqdm=False)]}
        return {"probabilities": [o.outputs.probs for o in llm.classify(prompts, use_tqdm=False)]}
    if kind == "score":
        outputs = llm.score(run["query"], run["documents"], use_tqdm=False)
        return {"scores": [o.outputs.score for o in outputs]}
    if kind == "chat":
        params = engine.paired_params(run["sampling"], len(run["conversations"]))
        outputs = llm.chat(run["conversations"], params, use_tqdm=False, **run.get("chat", {}))
    else:
        outputs = engine.generate(llm, run["prompts"], run["sampling"], run.get("adapters"),
                                  run.get("images"))
    return engine.request_outputs(outputs)


def _run_engine(spec: dict, report_errors: bool) -> dict:
    from ascend_patch.npu.compilation import acl_graph

    from ascend_patch.npu.kernels import recurrence
    from ascend_patch.npu.lora import punica

    reissue, steps = acl_graph._reissue, (recurrence.ssm_step, recurrence.gated_delta_step)
    refresh_slots = punica.refresh_slots
    if spec.get("stale_lora_slots"):
        punica.refresh_slots = _fresh_lora_slots
    stale = spec.get("stale_host_params")
    if stale:
        def _reissue(graphs, stream, update, params, buffer):
            if stale is not True and stale not in update.key:  # another kernel's: kept
                reissue(graphs, stream, update, params, buffer)

        acl_graph._reissue = _reissue
    if spec.get("stale_recurrent_state"):  # each decode step's output, its state never advanced
        recurrence.ssm_step, recurrence.gated_delta_step = (
            lambda *args, step=step: (step(*args)[0], args[5]) for step in steps)
    try:
        with engine.ascend_patch_log() as log:
            result = _generate(spec, report_errors)
    finally:
        acl_graph._reissue = reissue
        recurrence.ssm_step, recurrence.gated_delta_step = steps
        punica.refresh_slots = refresh_slots
    return {**result, "log": log}


def _fresh_lora_slots(wrapper) -> None:
    import torch

    from ascend_patch.npu.kernels.composed import slot_rows, slot_weights_

    wrapper._token_slots_int32 = wrapper._token_lora_indices.int()
    weights = torch.empty_like(wrapper._token_weights)
    slot_weights_(weights, wrapper._token_lora_indices, wrapper._slots)
    wrapper._token_weights = weights
    wrapper._token_rows = slot_rows(wrapper._token_lora_indices)
    wrapper._request_rows = slot_rows(wrapper._sampler_indices)


def _generate(spec: dict, report_errors: bool) -> dict:
    saved = {name: os.environ.get(name) for name in spec.get("env", {})}
    os.environ.update(spec.get("env", {}))
    earlier = frozenset(map(id, _graph_owners()))
    try:
        llm, result = engine.start(spec["model"], **spec.get("kwargs", {}))
    except Exception as exc:  # reported, so tests can assert on configuration errors
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value
    workers = llm.llm_engine.vllm_config.parallel_config.world_size > 1
    ranks = llm.collective_rpc(_worker_graphs) if workers else [_worker_graphs(None, earlier)]
    result["captured_ops"] = [rank["captured_ops"] for rank in ranks]
    result["runs"] = []
    for run in spec["runs"]:
        ranks_before = llm.collective_rpc(_worker_graphs) if workers else None
        before = engine.spec_decode_counts(llm)
        counters = engine.counter_values(llm, run.get("counters", []))
        with engine.measured() as measured, _layer_launches(llm, run) as layer_launches:
            try:
                report = _run(llm, run)
            except Exception as exc:
                if not report_errors:
                    raise
                # e.g. a rejected request: the next run shows whether the engine survived it
                traceback.print_exc()
                report = {"error": f"{type(exc).__name__}: {exc}"}
        if before is not None:  # the process's counters: this run's share
            after = engine.spec_decode_counts(llm)
            measured["spec_decode"] = engine.spec_decode_counts_since(before, after)
        if layer_launches is not None:
            measured["layer_launches"] = layer_launches
        if counters:
            after = engine.counter_values(llm, counters)
            measured["counters"] = {name: after[name] - counters[name] for name in counters}
        if workers:
            measured["ranks"] = [_since(b, a) for b, a in
                                 zip(ranks_before, llm.collective_rpc(_worker_graphs))]
        result["runs"].append({**report, **measured})
    engine.shutdown(llm)
    return result


def _graph_owners() -> list:
    """What holds this process's captured graphs: the ``NPUGraphWrapper``s (V1's FULL graphs,
    PIECEWISE pieces on both runners) and Model Runner V2's graph managers (its FULL graphs)."""
    from ascend_patch.npu.compilation.acl_graph import NPUGraphWrapper
    from ascend_patch.npu.runner.v2 import graphs

    return [*NPUGraphWrapper._all_instances, *graphs.managers]


def _captured_graphs(owner) -> list[tuple[str, int, object]]:
    """(runtime mode, token count, graph) of every graph ``owner`` captured."""
    from ascend_patch.npu.compilation.acl_graph import NPUGraphWrapper

    if isinstance(owner, NPUGraphWrapper):
        return [(owner.runtime_mode.name, entry.batch_descriptor.num_tokens, entry.cudagraph)
                for entry in owner.concrete_cudagraph_entries.values() if entry.cudagraph]
    return [(desc.cg_mode.name, desc.num_tokens, graph) for desc, graph in owner.graphs.items()]


def _worker_graphs(_worker=None, earlier: frozenset = frozenset()) -> dict:
    """In a worker's process (through ``collective_rpc``, or this one): its graph counters so far,
    and the seam ops its graphs of the smallest captured size hold, by runtime mode (PIECEWISE:
    the pieces' together), on the emulated graph; graph owners whose ids are in ``earlier`` (those
    of this process's earlier engines) left out."""
    from collections import Counter

    from ascend_patch.npu.compilation.acl_graph import NPUGraphWrapper

    captured = {}
    for owner in _graph_owners():
        if id(owner) in earlier:
            continue
        entries = _captured_graphs(owner)
        if entries:
            smallest = min(num_tokens for _, num_tokens, _ in entries)
            for mode, num_tokens, graph in entries:
                if num_tokens == smallest:
                    captured.setdefault(mode, {}).setdefault(smallest, []).append(graph)
    ops = {mode: Counter(launch[4] for graph in by_size[min(by_size)]
                         for launch in getattr(graph, "_launches", []) if launch[4])
           for mode, by_size in captured.items()}
    replays = Counter()
    for (_, size), n in NPUGraphWrapper.replays.items():
        replays[size] += n
    return {"replays": dict(replays), "task_updates": NPUGraphWrapper.task_updates,
            "captured_ops": {mode: dict(counts) for mode, counts in ops.items()}}


def _since(before: dict, after: dict) -> dict:
    by_size = {size: n - before["replays"].get(size, 0) for size, n in after["replays"].items()}
    return {"graph_replays": sum(by_size.values()),
            "task_updates": after["task_updates"] - before["task_updates"],
            "graph_replays_by_size": {str(size): n for size, n in sorted(by_size.items()) if n}}


def _runner(llm):
    """The model runner of an in-process engine."""
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


@contextlib.contextmanager
def _layer_launches(llm, run: dict):
    """Launches per decoder-layer call while the run runs, or None when not asked for."""
    if not run.get("layer_launches"):
        yield None
        return
    from ascend_patch.kit import launches
    from ascend_patch.npu import kernels

    with launches.per_layer_call(_runner(llm).get_model().model.layers, kernels) as counts:
        yield counts


@contextlib.contextmanager
def _seam_records(enabled: bool):
    """Every distinct kernel-seam call of the whole driver run (``kernels.record_calls``), engine
    start-up and graph capture included, or None when not asked for."""
    if not enabled:
        yield None
        return
    from vllm.platforms import current_platform

    current_platform.device_type  # noqa: B018 - resolving the platform binds the kernel backend
    from ascend_patch.npu import kernels

    with kernels.record_calls() as records:
        yield records


def main() -> int:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    from vllm import LLM  # noqa: F401 - vLLM first (the overlay comes in through its .pth), then
    engine.freeze_heap()  # its modules stay out of every collection its engines' start-ups run
    import torch

    torch.use_deterministic_algorithms(True, warn_only=True)  # fills torch.empty with NaN
    with _seam_records(spec.get("record_seam", False)) as records:
        results = [_run_engine(one, spec.get("report_errors", False)) for one in spec["engines"]]
    from vllm.platforms import current_platform

    report = {
        "platform": type(current_platform).__name__,
        "vllm_C_imported": any(m == "vllm._C" or m.startswith("vllm._C.") for m in sys.modules),
        "engines": results,
    }
    if records is not None:
        report["seam_calls"] = list(records.values())
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

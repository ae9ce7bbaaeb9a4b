"""The checks of ``ascend-patch verify``, one engine per model family, each against a CPU oracle.

Runs in the process that activated the overlay (``ASCEND_PATCH=npu``, or ``emulate`` for
``--emulate``): every family starts one in-process engine on its tiny local model, runs its
requests, shuts the engine down, then scores what each of its checks needs. A check passes when
the kernels it is about ran (the seam's launch counts) and the tokens track HF transformers on
the CPU within the tolerance the engine tests use (:mod:`ascend_patch.kit.oracle`). What each
check proves is :data:`ascend_patch.kit.record.CHECKS`.
"""

from __future__ import annotations

import functools
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from ascend_patch.kit import engine, oracle, quantized_models

LAYERS = 2  # every tiny model's decoder layers (ascend_patch.kit.tiny_models.RECIPE)
ENGINE = {"max_model_len": 512, "max_num_seqs": 8, "gpu_memory_utilization": 0.5,
          "enable_prefix_caching": True, "enable_chunked_prefill": True,
          "max_num_batched_tokens": 64, "enforce_eager": True}
# Lengths: shorter than, across and several 128-token KV blocks; the longer ones prefill in
# 64-token chunks beside the decodes of the shorter ones.
LENGTHS = [3, 17, 129, 300]
MAX_TOKENS = 16
GREEDY = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
TOP_K = 5
SAMPLED = [{"temperature": 0.8, "top_k": TOP_K, "max_tokens": MAX_TOKENS, "ignore_eos": True, "seed": seed}
           for seed in (3, 4)]
STANDARD_ATTENTION = ("fused_infer_attention_score", "paged_attention")
# The tiny models (ascend_patch.kit.tiny_models) the families run; the W8A8 checkpoint is built
# from tiny-qwen2 (w8a8_checkpoint).
TINY_MODELS = ("tiny-llama", "tiny-deepseek-v3-moe", "tiny-qwen3-moe", "tiny-qwen2")
# What the record keeps of each run (everything its checks read).
RUN_KEYS = ("tokens", "cached", "launches", "fused_batches", "graph_replays", "graph_replays_by_size")


@dataclass
class Result:
    name: str
    family: str
    model: str
    dtype: str
    verdict: str
    detail: str
    numbers: dict = field(default_factory=dict)
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"name": self.name, "family": self.family, "model": self.model, "dtype": self.dtype,
                "verdict": self.verdict, "detail": self.detail, "numbers": self.numbers,
                "seconds": round(self.seconds, 2)}


class Failed(Exception):
    """A check's condition does not hold; the message says which, in one line."""


def require(condition: bool, message: str) -> None:
    if not condition:
        raise Failed(message)


@dataclass
class Run:
    """What one batch of requests produced and launched."""
    prompts: list[list[int]]
    report: dict

    @property
    def tokens(self) -> list[list[int]]:
        return self.report["tokens"]

    @property
    def launches(self) -> dict:
        return self.report["launches"]


@dataclass
class Family:
    """One engine and the checks scored on its runs."""
    name: str
    model: str
    dtype: str
    kwargs: dict
    requests: Callable[[Path], list[tuple[list[list[int]], list[dict]]]]
    checks: dict[str, Callable]  # check name -> fn(family state) -> (detail, numbers)
    devices: int = 1


@dataclass
class State:
    """A family's engine facts and runs, with the oracle scores its checks share."""
    model_dir: Path
    dtype: str
    facts: dict
    runs: list[Run]
    cache: dict = field(default_factory=dict)

    def scored(self, key: str, compute: Callable[[], oracle.Tracking]) -> oracle.Tracking:
        if key not in self.cache:
            self.cache[key] = compute()
        return self.cache[key]


def _tracked(tracking: oracle.Tracking, numbers: dict | None = None) -> tuple[str, dict]:
    require(tracking.ok, tracking.message)
    return tracking.message, {**(numbers or {}), **tracking.numbers}


def _greedy_tracking(state: State, index: int) -> oracle.Tracking:
    run = state.runs[index]
    return state.scored(f"greedy-{index}", lambda: oracle.precision_tracking(
        state.model_dir, run.prompts, run.tokens, state.dtype))


def _fused_everywhere(run: Run) -> None:
    launches = run.launches
    writes = launches.get("scatter_pa_kv_cache", 0)
    fused = launches.get("fused_infer_attention_score", 0) + launches.get("paged_attention", 0)
    require(writes > 0 and fused == writes,
            f"{fused} fused attention launches for {writes} cache writes: some layer-steps ran composed")


# -- dense: tiny Llama, fp16, eager ------------------------------------------------------------

def _dense_requests(model_dir: Path):
    prompts = oracle.prompt_token_ids(model_dir, LENGTHS)
    # Two whole blocks of the longest prompt (cached by the first run), each with its own suffix.
    shared = [prompts[-1][:256] + p[:8] for p in prompts]
    return [(prompts, [GREEDY]), (shared, [GREEDY]), (prompts[1:3], SAMPLED), (prompts[1:3], SAMPLED)]


def _fused_kernel(op: str, missing: str):
    """The check that the dense run's ``op`` launched, every layer-step fused, tokens tracking HF."""
    def check(state: State):
        run = state.runs[0]
        _fused_everywhere(run)
        launches = run.launches.get(op, 0)
        require(launches > 0, missing)
        return _tracked(_greedy_tracking(state, 0), {f"{op}_launches": launches})
    return check


def _chunked_prefill(state: State):
    batches = state.runs[0].report["fused_batches"]
    require(batches.get("with_context", 0) > 0, "no prompt chunk attended behind its computed part")
    require(batches.get("mixed", 0) > 0, "no launch held decode rows beside a prefill chunk")
    return _tracked(_greedy_tracking(state, 0), {"launches_with_context": batches["with_context"],
                                                 "mixed_launches": batches["mixed"]})


def _prefix_cache(state: State):
    run = state.runs[1]
    blocks = 256 // state.facts["block_size"] * state.facts["block_size"]
    require(run.report["cached"] == [blocks] * len(run.prompts),
            f"prompt tokens served from the cache: {run.report['cached']}, expected {blocks} each")
    _fused_everywhere(run)
    require(run.report["fused_batches"].get("with_context", 0) > 0, "no suffix attended behind a cached prefix")
    return _tracked(_greedy_tracking(state, 1), {"cached_tokens": sum(run.report["cached"])})


def _sampler(state: State):
    first, again = state.runs[2], state.runs[3]
    require(first.tokens == again.tokens, "a seeded request did not repeat")
    require(first.tokens[0] != first.tokens[1], "two seeds sampled the same tokens")
    require(first.launches.get("top_k_top_p", 0) > 0, "no npu_top_k_top_p launch")
    tracking = oracle.precision_tracking(state.model_dir, first.prompts, first.tokens, state.dtype, top_k=TOP_K)
    return _tracked(tracking, {"top_k_top_p_launches": first.launches["top_k_top_p"]})


# -- graphs: tiny Llama, bf16, FULL_DECODE_ONLY ------------------------------------------------

GRAPH_LENGTHS = [3, 17, 129, 40, 7]
# Decode batches shrink 5 -> 1 as requests finish: sizes 5 and 3 replay the graphs of 8 and 4.
GRAPH_TOKENS = [6, 9, 12, 3, 14]


def _graph_requests(model_dir: Path):
    prompts = oracle.prompt_token_ids(model_dir, GRAPH_LENGTHS)
    return [(prompts, [{**GREEDY, "max_tokens": n} for n in GRAPH_TOKENS])]


def _graphs(state: State):
    run = state.runs[0]
    require(state.facts["cudagraph_mode"] == "FULL_DECODE_ONLY",
            f"vLLM settled graph mode {state.facts['cudagraph_mode']}")
    require(state.facts["graph_captures"] > 0, "no graph was captured")
    replays = run.report["graph_replays"]
    require(replays > 0, "no decode step replayed a graph")
    # Every replay re-issues each layer's paged attention with the step's context lengths.
    updates = run.launches.get("paged_attention_workspace", 0)
    require(updates == LAYERS * replays, f"{updates} paged-attention updates for {replays} replays of {LAYERS} layers")
    return _tracked(_greedy_tracking(state, 0), {
        "graph_captures": state.facts["graph_captures"], "graph_replays": replays,
        "replays_by_size": run.report["graph_replays_by_size"]})


# -- MLA and grouped routing: tiny DeepSeek-V3 (query LoRA, YaRN, an MoE layer), bf16 ----------

def _routed_requests(model_dir: Path):
    prompts = oracle.prompt_token_ids(model_dir, [3, 17, 129, 200])
    return [(prompts, [GREEDY]), (prompts, [GREEDY])]  # the second served from the prefix cache


def _routed_tracking(state: State) -> oracle.Tracking:
    """Both runs against HF fp32 and bf16 (MLA's 512-wide latent products round in bf16 as much
    in HF as here; routed models may flip a router tie in 1 token in 20)."""
    prompts = [p for run in state.runs for p in run.prompts]
    tokens = [t for run in state.runs for t in run.tokens]
    return state.scored("routed", lambda: oracle.hf_logit_tracking(
        state.model_dir, prompts, tokens, routed=True, bf16_oracle=True))


def _mla(state: State):
    numbers = {}
    for index, run in enumerate(state.runs):
        launches = run.launches
        decodes = launches.get("multi_head_latent_attention", 0)
        prefills = launches.get("fused_infer_attention_score_mla", 0)
        require(decodes > 0, "no atb.npu_multi_head_latent_attention launch")
        require(prefills > 0, "no MLA npu_fused_infer_attention_score launch")
        require(not any(launches.get(op) for op in STANDARD_ATTENTION), "standard attention ran on an MLA model")
        numbers[f"run{index}"] = {"mla_decode_launches": decodes, "mla_prefill_launches": prefills}
    cached = sum(state.runs[1].report["cached"])
    require(cached > 0, "the second run was not served from the prefix cache")
    return _tracked(_routed_tracking(state), {**numbers, "cached_tokens": cached})


def _moe_ops(launches: dict, gating: str) -> dict:
    routed = launches.get("moe_init_routing_v2", 0)
    require(launches.get(gating, 0) > 0, f"no npu_{gating} launch")
    require(routed == launches[gating] == launches.get("moe_token_unpermute", 0) > 0,
            f"routing, dispatch and combine launches differ: {launches}")
    require(launches.get("grouped_matmul", 0) == 2 * routed, "not two grouped matmuls per dispatch")
    return {gating: launches[gating], "grouped_matmul": launches["grouped_matmul"]}


def _moe_grouped_routing(state: State):
    return _tracked(_routed_tracking(state), _moe_ops(state.runs[0].launches, "moe_gating_top_k"))


# -- MoE: tiny Qwen3-MoE, bf16 -------------------------------------------------------------------

def _moe(state: State):
    numbers = _moe_ops(state.runs[0].launches, "moe_gating_top_k_softmax_v2")
    run = state.runs[0]
    return _tracked(oracle.hf_logit_tracking(state.model_dir, run.prompts, run.tokens, routed=True), numbers)


# -- W8A8: an AscendV1 checkpoint of the tiny Qwen2, bf16 --------------------------------------

W8A8_LENGTHS = [3, 17, 40]


def _w8a8_requests(model_dir: Path):
    return [(oracle.prompt_token_ids(model_dir, W8A8_LENGTHS), [{**GREEDY, "max_tokens": 10}])]


def _w8a8(state: State, float_dir: Path):
    import torch

    run = state.runs[0]
    launches = run.launches
    for op in ("quant_matmul", "quantize", "dynamic_quant"):
        require(launches.get(op, 0) > 0, f"no npu_{op} launch")
    sequences = [p + t for p, t in zip(run.prompts, run.tokens)]
    oracles = [oracle.dequantized_logits(float_dir, state.model_dir, sequences),
               oracle.dequantized_logits(float_dir, state.model_dir, sequences, torch.bfloat16)]
    # An int8 step moved by a bf16 rounding flips more near-ties than a float model: 3 in 4 exact.
    tracking = oracle.logit_tracking(oracles, run.prompts, run.tokens, min_exact=0.75)
    return _tracked(tracking, {op: launches[op] for op in ("quant_matmul", "quantize", "dynamic_quant")})


def w8a8_checkpoint(models: dict[str, Path], out: Path) -> Path:
    """The AscendV1 checkpoint the w8a8 check loads: every layer type, calibrated on two prompts."""
    qwen2 = models["tiny-qwen2"]
    calibration = oracle.prompt_token_ids(qwen2, [64, 64])
    return quantized_models.ascend_v1(qwen2, out / "tiny-qwen2-w8a8", quantized_models.mixed_types, calibration)


# -- KV offload to host memory: tiny Llama, fp16, an 8-block device cache ------------------------

OFFLOAD_PROMPTS, OFFLOAD_LENGTH = 4, 300


def _offload_requests(model_dir: Path):
    """Four prompts (3 blocks each with their tokens: 12 > 8), four others that evict all of their
    blocks from the device, then the first four again: their full blocks can only come from host."""
    prompts = oracle.prompt_token_ids(model_dir, [OFFLOAD_LENGTH] * 2 * OFFLOAD_PROMPTS)
    first, second = prompts[:OFFLOAD_PROMPTS], prompts[OFFLOAD_PROMPTS:]
    return [(first, [GREEDY]), (second, [GREEDY]), (first, [GREEDY])]


def _offload(state: State):
    again = state.runs[2]
    block = state.facts["block_size"]
    expected = (OFFLOAD_LENGTH - 1) // block * block
    require(again.report["cached"] == [expected] * OFFLOAD_PROMPTS,
            f"prompt tokens served after eviction: {again.report['cached']}, expected {expected} each from host memory")
    stores = state.runs[0].launches.get("swap_blocks", 0)
    loads = again.launches.get("swap_blocks", 0)
    require(stores > 0 and loads > 0, f"block copies: {stores} while storing, {loads} while loading")
    return _tracked(_greedy_tracking(state, 2), {"cached_tokens": sum(again.report["cached"]),
                                                 "store_copies": stores, "load_copies": loads})


# -- TP: tiny Llama over two devices, bf16 ---------------------------------------------------------

def _tp(state: State):
    run = state.runs[0]
    return _tracked(oracle.hf_logit_tracking(state.model_dir, run.prompts, run.tokens))


def families(models: dict[str, Path]) -> list[Family]:
    """Every family, in the order verify runs them; ``models`` maps each family's model name to
    its directory."""
    w8a8 = functools.partial(_w8a8, float_dir=models["tiny-qwen2"])
    return [
        Family("dense", "tiny-llama", "float16", {}, _dense_requests, {
            "fia-attention": _fused_kernel("fused_infer_attention_score",
                                           "no npu_fused_infer_attention_score launch"),
            "paged-attention": _fused_kernel("paged_attention",
                                             "no _npu_paged_attention launch: no decode-only batch ran fused"),
            "chunked-prefill": _chunked_prefill, "prefix-cache": _prefix_cache, "sampler": _sampler}),
        Family("graphs", "tiny-llama", "bfloat16",
               {"enforce_eager": False, "compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY"}},
               _graph_requests, {"graphs": _graphs}),
        Family("mla", "tiny-deepseek-v3-moe", "bfloat16", {}, _routed_requests,
               {"mla": _mla, "moe-grouped-routing": _moe_grouped_routing}),
        Family("moe", "tiny-qwen3-moe", "bfloat16", {}, _routed_requests, {"moe": _moe}),
        Family("w8a8", "tiny-qwen2-w8a8", "bfloat16", {"quantization": "ascend"}, _w8a8_requests,
               {"w8a8": w8a8}),
        Family("offload", "tiny-llama", "float16",
               {"kv_offloading_size": 0.02, "num_gpu_blocks_override": 8}, _offload_requests,
               {"kv-offload": _offload}),
        Family("tp", "tiny-llama", "bfloat16",
               {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"},
               lambda model_dir: [(oracle.prompt_token_ids(model_dir, GRAPH_LENGTHS), [GREEDY])],
               {"tp": _tp}, devices=2),
    ]


def run(family: Family, model_dir: Path, devices: int, facts: dict) -> Iterator[Result]:
    """Start the family's engine, run its requests, then score each of its checks. ``facts``
    receives the family's timing, what vLLM settled, what each run launched and what
    ascend-patch logged."""
    def result(name, verdict, detail, numbers=None, seconds=0.0):
        return Result(name, family.name, family.model, family.dtype, verdict, detail, numbers or {}, seconds)

    if devices < family.devices:
        for name in family.checks:
            yield result(name, "skipped", f"needs {family.devices} devices, {devices} visible")
        return
    started = time.perf_counter()
    runs = []
    try:
        with engine.ascend_patch_log() as facts["log"]:
            requests = family.requests(model_dir)
            llm, settled = engine.start(str(model_dir), dtype=family.dtype, **{**ENGINE, **family.kwargs})
            facts.update(settled, startup_seconds=round(time.perf_counter() - started, 2))
            for prompts, sampling in requests:
                with engine.measured() as measured:
                    outputs = engine.generate(llm, prompts, sampling)
                report = engine.request_outputs(outputs)
                del report["outputs"]
                runs.append(Run(prompts, {**report, **measured}))
            engine.shutdown(llm)
    except Exception as exc:  # the engine did not run: every check of the family says why
        traceback.print_exc()
        for name in family.checks:
            yield result(name, "error", f"{family.name} engine: {type(exc).__name__}: {exc}".splitlines()[0])
        return
    facts["seconds"] = round(time.perf_counter() - started, 2)
    # The tokens too: anyone with the tiny models can score a record again on their CPU.
    facts["runs"] = [{key: run.report[key] for key in RUN_KEYS} for run in runs]
    state = State(model_dir, family.dtype, facts, runs)
    for name, check in family.checks.items():
        begun = time.perf_counter()
        try:
            detail, numbers = check(state)
            verdict = "pass"
        except Failed as failure:
            verdict, detail, numbers = "fail", str(failure), {}
        except Exception as exc:
            traceback.print_exc()
            verdict, detail, numbers = "error", f"{type(exc).__name__}: {exc}".splitlines()[0], {}
        yield result(name, verdict, detail, numbers, time.perf_counter() - begun)


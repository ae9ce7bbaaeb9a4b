"""Speculative decoding on the tiny models, per method against the same engine without it
(emulated: proxies of NPU cost counted on the emulated NPU, no NPU figures).

Per engine, over one greedy batch (4 requests, eager):

- accepted drafts per draft step and vLLM's mean acceptance length (1 + that: the tokens a
  request gains per verification), from vLLM's own counters;
- target forward passes per generated token (batch passes, so 1 / batch without speculation
  once every request decodes) and the drafter's forward passes per generated token;
- device launches per generated token, counted as ``scripts/bench_engine.py`` counts them
  (:mod:`ascend_patch.kit.launches`: each kernel-seam call and each other aten op writing device
  memory is one launch) inside the target model's forward and logits, the drafter model's
  forward and logits, the sampler and the rejection sampler (a logits processor the drafter
  shares with the target counts with the target). Not counted: the runner's own input
  preparation (the same with and without speculation, but for the EAGLE/MTP input kernels, a few
  launches per step), and the n-gram drafter, which runs on the host.

Methods: ``ngram`` and ``draft_model`` (the target as its own draft: every draft accepted) on the
tiny Llama; ``eagle`` with the shifted EAGLE head on its one-layer target (drafts predicted by
``ascend_patch.kit.tiny_drafts.shifted_drafts``); ``eagle3`` with a random head on the tiny Llama
(almost every draft rejected); DeepSeek ``mtp`` on the tiny DeepSeek-V3 with its random MTP layer,
and on the one-layer DeepSeek-V3 whose MTP layer is that layer shifted (drafts predicted by
``shifted_drafts(..., mtp=True)``).

    .venv/bin/python scripts/bench_spec_decode.py [--tokens 32] [--k 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / ".cache" / "models"

# Runs in a fresh interpreter on the emulated NPU: every engine of SPEC, one after the other.
CHILD = """
import json, sys
from vllm import LLM  # vLLM first: the overlay comes in through its .pth
from ascend_patch.kit import engine
from ascend_patch.kit.launches import Launches
from ascend_patch.npu import kernels

spec = json.load(open(sys.argv[1]))
engine.freeze_heap()
results = {}
for name, config in spec["engines"].items():
    llm, _ = engine.start(config["model"], **config["kwargs"])
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    target = runner.get_model()
    # The V1 runner's drafter, Model Runner V2's speculator (the n-gram ones have no model).
    proposer = getattr(runner, "drafter", None) or getattr(runner, "speculator", None)
    drafter = getattr(proposer, "model", None)
    def with_logits(model):  # the model and the logits processors its compute_logits calls
        return [model, *(m for m in model.modules() if type(m).__name__ == "LogitsProcessor")]
    watched = {"target": with_logits(target), "sampling": [runner.sampler]}
    if getattr(runner, "rejection_sampler", None) is not None:
        watched["sampling"].append(runner.rejection_sampler)
    if drafter is not None:
        # a module the drafter shares with the target (a logits processor) counts with the target
        watched["drafter"] = [m for m in with_logits(drafter) if m not in watched["target"]]
    mode = Launches()
    depth, owner, launches = [0], [None], {part: 0 for part in watched}
    passes = {"target": 0, "drafter": 0}

    class Called:  # MRV2's samplers are plain objects: called through the runner's attribute
        def __init__(self, wrapped, call):
            self.wrapped, self.call = wrapped, call
        def __call__(self, *args, **kwargs):
            return self.call(*args, **kwargs)
        def __getattr__(self, name):
            return getattr(self.wrapped, name)

    def watch(part, module, top):
        # Wrap the instance's forward, not hooks: vLLM's torch.compile decorator replaces some
        # models' __call__ (DeepSeek's MTP head) with one that skips the module hooks.
        forward = getattr(module, "forward", None) or module.__call__
        def counted(*args, **kwargs):
            if depth[0] == 0:
                owner[0], mode.active = part, True
                before[0] = sum(mode.seam.values()) + sum(mode.aten.values())
            depth[0] += 1
            if top:
                passes[part] += 1
            try:
                return forward(*args, **kwargs)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    mode.active = False
                    launches[owner[0]] += (sum(mode.seam.values()) + sum(mode.aten.values())
                                           - before[0])
        if hasattr(module, "forward"):
            module.forward = counted
        else:
            for name in ("sampler", "rejection_sampler"):
                if getattr(runner, name, None) is module:
                    setattr(runner, name, Called(module, counted))

    before = [0]
    for part, modules in watched.items():
        for index, module in enumerate(dict.fromkeys(modules)):
            watch(part, module, index == 0 and part in passes)
    counts_before = engine.spec_decode_counts(llm)
    with kernels.swapped(mode.counting), mode:
        outputs = engine.generate(llm, config["prompts"], [config["sampling"]])
    counts = engine.spec_decode_counts_since(counts_before, engine.spec_decode_counts(llm))
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    results[name] = {"generated": generated, "passes": passes, "launches": launches,
                     "spec_decode": counts, "tokens": [list(o.outputs[0].token_ids) for o in outputs]}
    engine.shutdown(llm)
print(json.dumps(results))
"""


def _engines(tokens: int, k: int) -> dict[str, dict]:
    from ascend_patch.kit import tiny_drafts, tiny_models
    from ascend_patch.kit.oracle import prompt_token_ids

    models = {**tiny_models.build(MODELS), **tiny_drafts.build(MODELS)}
    base = {"dtype": "float32", "max_model_len": 512, "max_num_seqs": 4, "enforce_eager": True,
            "disable_log_stats": False, "gpu_memory_utilization": 0.3}
    sampling = {"temperature": 0.0, "max_tokens": tokens, "ignore_eos": True}

    def prompts(model):
        text, repeated, other, short = prompt_token_ids(model, [14, 6, 12, 8])
        return [text, repeated * 3, other, short * 2]  # two with repeats, for the n-gram drafter

    def spec(method, **config):
        return {**base, "speculative_config": {"method": method, "num_speculative_tokens": k,
                                               **config}}

    llama, shifted, deepseek, shifted_mtp = (
        str(models[name]) for name in ("tiny-llama", "tiny-llama-shifted", "tiny-deepseek-v3-mtp",
                                       "tiny-deepseek-v3-shifted-mtp"))
    table = {  # name -> (target, engine kwargs, the engine without speculation it is set against)
        "tiny-llama, no speculation": (llama, base, None),
        "ngram": (llama, spec("ngram", prompt_lookup_min=1, prompt_lookup_max=3),
                  "tiny-llama, no speculation"),
        "draft_model (self)": (llama, spec("draft_model", model=llama), "tiny-llama, no speculation"),
        "eagle3 (random head)": (llama, spec("eagle3", model=str(models["tiny-llama-eagle3"])),
                                 "tiny-llama, no speculation"),
        "shifted Llama, no speculation": (shifted, base, None),
        "eagle (shifted head)": (shifted, spec("eagle", model=str(models["tiny-llama-shifted-eagle"])),
                                 "shifted Llama, no speculation"),
        "DeepSeek-V3, no speculation": (deepseek, base, None),
        "mtp": (deepseek, spec("mtp"), "DeepSeek-V3, no speculation"),
        "shifted DeepSeek-V3, no spec.": (shifted_mtp, base, None),
        "mtp (shifted MTP layer)": (shifted_mtp, spec("mtp"), "shifted DeepSeek-V3, no spec."),
    }
    return {name: {"model": model, "kwargs": kwargs, "prompts": prompts(model),
                   "sampling": sampling, "against": against}
            for name, (model, kwargs, against) in table.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens per request")
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    args = parser.parse_args()
    engines = _engines(args.tokens, args.k)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASCEND_PATCH")}
    env.update(ASCEND_PATCH="emulate", ASCEND_PATCH_EMULATED_HBM="1GiB",
               VLLM_ENABLE_V1_MULTIPROCESSING="0")
    with tempfile.TemporaryDirectory() as tmp:
        spec_file = Path(tmp) / "spec.json"
        spec_file.write_text(json.dumps({"engines": engines}))
        proc = subprocess.run([sys.executable, "-c", CHILD, str(spec_file)], env=env, cwd=tmp,
                              capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"benchmark child failed:\n{proc.stderr[-4000:]}")
    results = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])

    print(f"speculative decoding, k = {args.k}, 4 requests x {args.tokens} greedy tokens, fp32, eager "
          "(emulated NPU: counts, not NPU speed)")
    header = (f"{'engine':32} {'accepted/step':>13} {'mean acc. len':>13} {'target passes/tok':>17} "
              f"{'drafter passes/tok':>18} {'launches/tok':>12} {'(target':>8} {'drafter':>8} "
              f"{'sampling)':>9} {'tokens as without':>17}")
    print(header)
    for name, run in results.items():
        generated, counts = run["generated"], run["spec_decode"]
        drafted = counts["drafts"]
        accepted = f"{counts['accepted_tokens'] / drafted:13.2f}" if drafted else f"{'-':>13}"
        length = f"{1 + counts['accepted_tokens'] / drafted:13.2f}" if drafted else f"{'-':>13}"
        launches = run["launches"]
        against = engines[name]["against"]
        same = "-" if against is None else (
            "yes" if run["tokens"] == results[against]["tokens"] else "NO")
        print(f"{name:32} {accepted} {length} {run['passes']['target'] / generated:17.3f} "
              f"{run['passes']['drafter'] / generated:18.3f} {sum(launches.values()) / generated:12.1f} "
              f"{launches['target'] / generated:8.1f} {launches.get('drafter', 0) / generated:8.1f} "
              f"{launches['sampling'] / generated:9.1f} {same:>17}")
        if drafted:
            print(f"{'':32} accepted by position {counts['accepted_per_position']} of {drafted} "
                  f"draft steps ({counts['draft_tokens']} drafts)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Data parallelism on the emulated NPU: every DP rank is an engine of its own, its workers join
vLLM's DP and expert groups over gloo (HCCL on the NPU), and each rank's greedy tokens must equal
HF transformers for the prompts that rank was given.

- MoE, vLLM's offline data-parallel example (each rank an ``LLM`` with its own prompts and the
  ``VLLM_DP_*`` variables) with ``enable_expert_parallel``: each rank holds half the experts, so its
  tokens equal HF only if the expert group's all-to-all manager gathered every rank's tokens and
  summed the experts' outputs back. Rank 1 gets one short request and rank 0 three long ones: rank 1
  then runs vLLM's dummy batches so that rank 0's collectives have a partner.
- The same in bf16, where ACL graphs are on by default: tokens track HF's logits (the project's
  bf16 check, routed ties allowed); the same run eager gave identical tokens when this was written.
- Dense, ``vllm serve --data-parallel-size 2``: vLLM's API server balances the requests over the
  two engines, and both serve some.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ascend_patch.kit.oracle import hf_greedy, prompt_token_ids
from tests.helpers.engine import assert_tracks_hf_logits, only_marked_tests
from tests.helpers.process import ROOT, clean_env, free_port
from tests.test_serve import serving

# At most 4 sequences and 512 tokens a step: the prompts fit, and vLLM's profiling run and graph
# capture sizes (1, 2, 4) stay that small.
ENGINE = {"dtype": "float32", "max_model_len": 512, "max_num_seqs": 4, "max_num_batched_tokens": 512,
          "gpu_memory_utilization": 0.9}
# The offline example's engines run their EngineCore in a process of its own (the DP engine core,
# which runs the dummy batches); the emulated HBM is per process.
EMULATED = {"ASCEND_PATCH": "emulate", "ASCEND_PATCH_EMULATED_HBM": "512MiB",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
# Rank 0: three prompts, 16 tokens each; rank 1: one prompt, 4 tokens, then idle.
SHARES = [([5, 33, 140], 16), ([260], 4)]


def _greedy(max_tokens: int) -> dict:
    return {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True}


@pytest.mark.v0_20_features
@pytest.mark.parametrize(("visible", "assigned", "local_rank", "ordinal"), [
    (None, None, 1, 1),  # no shard in the config (older releases narrow the variable instead)
    (None, [2, 3], 1, 3),  # DP rank 1 of TP=2 on one host: physical NPUs 2 and 3
    ("4,5,6,7", [6, 7], 0, 2),  # physical 6 is the third visible NPU
])
def test_a_dp_rank_s_worker_runs_on_its_own_npu(monkeypatch, visible, assigned, local_rank, ordinal):
    """vLLM 0.24+ hands each DP rank's engine its physical devices in the config and applies them
    only in the CUDA worker; the emulated NPU runs on the CPU whatever the index, so the index
    itself is what is checked."""
    from types import SimpleNamespace

    import vllm.platforms.interface as interface

    from ascend_patch.npu.runner.worker import device_index

    if visible is None:
        monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", visible)
    monkeypatch.setattr(interface, "_assigned_physical_gpu_ids", None)
    config = SimpleNamespace(assigned_physical_gpu_ids=assigned)
    assert device_index(config, local_rank) == ordinal


# The offline example's engines, in the order both ranks' drivers start them (each DP group needs
# both ranks): fp32 (rank 0's driver first has an all2all backend refused at configuration), then
# bf16 with default graphs. One driver per rank runs both, so each rank imports vLLM once; a
# v0_20-set release (tests marked v0_20_features only) leaves the bf16 one out. (vLLM refuses
# offline DP for dense models: dense DP is the server's, below.)
MOE, MOE_GRAPHS = "float32", "bfloat16"


def _names(marked_only: bool) -> list:
    return [MOE] if marked_only else [MOE, MOE_GRAPHS]


def _offline_dp(model: Path, names: list, tmp: Path) -> dict:
    """vLLM's offline DP example on ``model`` in each dtype of ``names``: two drivers, one per DP
    rank, at once; each engine's DP group on a master port of its own."""
    ports = {name: free_port() for name in names}
    shares = [(prompt_token_ids(model, lengths), max_tokens) for lengths, max_tokens in SHARES]
    procs = []
    for rank in range(len(SHARES)):
        engines = []
        for name in names:
            rank_env = {"VLLM_DP_SIZE": "2", "VLLM_DP_RANK": str(rank), "VLLM_DP_RANK_LOCAL": str(rank),
                        "VLLM_DP_MASTER_IP": "127.0.0.1", "VLLM_DP_MASTER_PORT": str(ports[name])}
            kwargs = {**ENGINE, "dtype": name, "enable_expert_parallel": True}
            prompts, max_tokens = shares[rank]
            if name == MOE and rank == 0:  # refused at configuration, before any engine core starts
                engines.append({"model": str(model), "env": rank_env, "runs": [],
                                "kwargs": {**kwargs, "all2all_backend": "deepep_low_latency"}})
            engines.append({"model": str(model), "kwargs": kwargs, "env": rank_env,
                            "runs": [{"prompts": prompts, "sampling": [_greedy(max_tokens)]}]})
        spec = tmp / f"rank{rank}.json"
        spec.write_text(json.dumps({"engines": engines}))
        log = tmp / f"rank{rank}.log"
        with open(log, "w") as stderr:
            procs.append((subprocess.Popen(
                [sys.executable, str(ROOT / "tests" / "engine_driver.py"), str(spec)],
                env=clean_env(**EMULATED), stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=tmp,
            ), log))
    reports = []
    try:
        for proc, log in procs:
            stdout, _ = proc.communicate(timeout=1800)
            assert proc.returncode == 0, f"DP rank driver failed:\n{log.read_text()[-6000:]}"
            reports.append(json.loads([line for line in stdout.splitlines() if line.startswith("{")][-1]))
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    runs = {}
    for name in names:
        refused = [reports[0]["engines"].pop(0)] if name == MOE else []
        runs[name] = {"model": model, "shares": shares, "refused": refused,
                      "engines": [report["engines"].pop(0) for report in reports]}
    return runs


@pytest.fixture(scope="module")
def offline(request, tiny_models, tmp_path_factory):
    """fp32 (graphs off by default): tokens exactly HF's. bf16, where FULL_DECODE_ONLY
    ACL graphs are on by default: every rank captures, and the idle rank's dummy batches and the
    busy rank's decode steps replay at the padded size both agree on."""
    names = _names(only_marked_tests(request))
    return _offline_dp(tiny_models["tiny-qwen3-moe"], names, tmp_path_factory.mktemp("dp"))


def _rank_tokens(run: dict, rank: int) -> list[list[int]]:
    engine = run["engines"][rank]
    assert "error" not in engine, engine["error"]
    return engine["runs"][0]["tokens"]


@pytest.mark.slow
@pytest.mark.v0_20_features
@pytest.mark.parametrize("rank", [0, 1])
def test_moe_data_parallel_with_expert_parallel_equals_hf(offline, rank):
    run = offline[MOE]
    prompts, max_tokens = run["shares"][rank]
    assert _rank_tokens(run, rank) == hf_greedy(run["model"], prompts, max_tokens)


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1])
def test_moe_data_parallel_with_default_graphs_tracks_hf(offline, rank):
    run = offline[MOE_GRAPHS]
    engine = run["engines"][rank]
    assert any("ACL graphs (FULL_DECODE_ONLY): capturing" in line for line in engine["log"]), engine["log"]
    prompts, _ = run["shares"][rank]
    assert_tracks_hf_logits(run["model"], prompts, _rank_tokens(run, rank), routed=True)


@pytest.mark.slow
@pytest.mark.v0_20_features
def test_an_all2all_backend_of_cuda_kernels_is_refused_in_one_line(offline):
    [refused] = offline[MOE]["refused"]
    error = refused["error"]
    message = ("--all2all-backend deepep_low_latency is not supported on Ascend by ascend-patch "
               "(a CUDA/ROCm kernel): data-parallel MoE runs on allgather_reducescatter")
    assert message in error and "\n" not in error, error


# --- vllm serve --data-parallel-size 2 -------------------------------------------------------

SERVED_NAME = "tiny"


@pytest.fixture(scope="module")
def dp_server(tiny_models, tmp_path_factory):
    model = tiny_models["tiny-llama"]
    port = free_port()
    log_path = tmp_path_factory.mktemp("serve_dp") / "server.log"
    command = [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model), "--host", "127.0.0.1",
        "--port", str(port), "--served-model-name", SERVED_NAME, "--dtype", "float32",
        "--max-model-len", "512", "--gpu-memory-utilization", "0.9", "--data-parallel-size", "2",
        # One API server (vLLM defaults to one per DP rank) and each engine's worker in its engine
        # core's process: two fewer interpreters importing vLLM, the same two DP engines.
        "--api-server-count", "1", "--distributed-executor-backend", "uni",
        "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
    ]
    with serving(command, port, log_path) as (_, base):
        yield {"base": base, "model": model}


def _completion(base: str, prompt: list[int], max_tokens: int) -> list[int]:
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    request = urllib.request.Request(f"{base}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.load(response)["choices"][0]["token_ids"]


def _requests_served_by_engine(base: str) -> dict[str, float]:
    """vLLM's finished-request counter per engine (its Prometheus ``engine`` label)."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as response:
        text = response.read().decode()
    served: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:request_success_total{"):
            engine = line.split('engine="', 1)[1].split('"', 1)[0]
            served[engine] = served.get(engine, 0.0) + float(line.rsplit(" ", 1)[1])
    return served


@pytest.mark.slow
@pytest.mark.v0_20_features
def test_serve_with_data_parallel_size_2_equals_hf(dp_server):
    prompts = prompt_token_ids(dp_server["model"], [5, 33, 70, 140, 200, 260])
    with ThreadPoolExecutor(len(prompts)) as pool:  # at once, so both engines get some
        tokens = list(pool.map(lambda prompt: _completion(dp_server["base"], prompt, 12), prompts))
    assert tokens == hf_greedy(dp_server["model"], prompts, 12)
    served = _requests_served_by_engine(dp_server["base"])
    assert sorted(served) == ["0", "1"] and sum(served.values()) == len(prompts), served
    assert min(served.values()) > 0, f"one engine served every request: {served}"

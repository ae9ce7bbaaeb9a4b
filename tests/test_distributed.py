"""Tensor and pipeline parallelism across spawned workers, and Ray, on the emulated NPU.

Each worker is a fresh interpreter that gets the overlay from the installed ``.pth``;
gloo stands in for HCCL. Greedy outputs must equal HF transformers (and so TP=1).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from ascend_patch.kit.oracle import hf_greedy, prompt_token_ids
from tests.helpers.engine import run_engine
from tests.helpers.lora import MOE_ADAPTERS, adapters, merged_greedy
from tests.helpers.process import ROOT, clean_env, free_port, run_python

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True}
ENGINE = {"dtype": "float32", "max_model_len": 512, "gpu_memory_utilization": 0.9}
EMULATED = {"ASCEND_PATCH": "emulate", "ASCEND_PATCH_EMULATED_HBM": "512MiB"}


@pytest.fixture(scope="module")
def llama(tiny_models):
    return tiny_models["tiny-llama"]


PROMPT_LENGTHS = [5, 33, 140, 260]


@pytest.fixture(scope="module")
def prompts(llama):
    return prompt_token_ids(llama, PROMPT_LENGTHS)


@pytest.fixture(scope="module")
def oracle(llama, prompts):
    return hf_greedy(llama, prompts, GREEDY["max_tokens"])


def _tokens(engine: dict) -> list[list[int]]:
    assert "error" not in engine, engine.get("error")
    return engine["runs"][0]["tokens"]


MP = {"distributed_executor_backend": "mp"}
MOE_LORA = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 16}
# (model, parallel configuration): each spawns two workers. Dense TP=2 is inside the MoE
# model's (its attention layers split their heads over the ranks as Llama's do), and the bf16
# Llama's TP=2 with graphs in tests/test_graph.py.
PARALLEL = {
    "llama pp2": ("tiny-llama", {"pipeline_parallel_size": 2}),
    "moe tp2": ("tiny-glm4-moe", {"tensor_parallel_size": 2}),
    "moe tp2-ep2": ("tiny-glm4-moe", {"tensor_parallel_size": 2, "enable_expert_parallel": True}),
    # The target as its own draft (split over the ranks like the target), k = 3.
    "llama tp2 self-draft": ("tiny-llama", {"tensor_parallel_size": 2, "disable_log_stats": False,
                                            "speculative_config": {"method": "draft_model",
                                                                   "num_speculative_tokens": 3}}),
    # Qwen3-MoE serving two adapters (attention and every expert) and the base model in one
    # batch: each rank's experts add the deltas of their intermediate shard. (With EP as well it
    # passes too, by hand: one more engine, ~45 CPU-seconds, over the CI budget.)
    "moe lora tp2": ("tiny-qwen3-moe", {"tensor_parallel_size": 2, **MOE_LORA}),
}


def _kwargs(tiny_models, model: str, parallel: dict) -> dict:
    speculative = parallel.get("speculative_config")
    if speculative:
        parallel = {**parallel, "speculative_config": {**speculative,
                                                       "model": str(tiny_models[model])}}
    return {**ENGINE, **MP, **parallel}


def _parallel_spec(tiny_models) -> dict:
    """The multiprocess engines one after another in one driver process."""
    prompts = prompt_token_ids(tiny_models["tiny-llama"], PROMPT_LENGTHS)
    moe_adapters = [path and str(path) for _, path in adapters(MOE_ADAPTERS)]
    return {"engines": [{"model": str(tiny_models[model]),
                         "kwargs": _kwargs(tiny_models, model, parallel),
                         "runs": [{"prompts": prompts, "sampling": [GREEDY],
                                   **({"adapters": moe_adapters} if "enable_lora" in parallel else {})}]}
                        for model, parallel in PARALLEL.values()]}


@pytest.fixture(scope="module")
def parallel_runs(tiny_models, tmp_path_factory):
    result = run_engine(_parallel_spec(tiny_models), tmp_path_factory.mktemp("parallel"),
                        env=clean_env(**EMULATED), timeout=1200)
    return dict(zip(PARALLEL, result["engines"]))


def test_pipeline_parallelism_equals_hf(parallel_runs, oracle):
    assert _tokens(parallel_runs["llama pp2"]) == oracle


def test_speculative_decoding_with_tensor_parallelism_equals_hf(parallel_runs, oracle):
    """TP=2 with the target as its own draft: HF's greedy tokens (so TP=1's, tests/test_engine.py
    and tests/test_spec_decode.py), every draft accepted (the drafter's attention over each
    rank's heads sees exactly the accepted tokens)."""
    engine = parallel_runs["llama tp2 self-draft"]
    assert _tokens(engine) == oracle
    counts = engine["runs"][0]["spec_decode"]
    assert counts["drafts"] > 0 and counts["accepted_tokens"] == counts["draft_tokens"]


@pytest.mark.parametrize("name", ["moe tp2", "moe tp2-ep2"])
def test_moe_parallelism_equals_hf(tiny_models, prompts, parallel_runs, name):
    """GLM-4.5's MoE layers (grouped sigmoid routing, a shared expert): TP splits every
    expert's intermediate size, EP gives each rank half the experts; vLLM's reduction over
    the device group sums the partial outputs. HF is TP=1 (and the single-device run equals
    it in tests/test_moe.py)."""
    model = tiny_models[PARALLEL[name][0]]
    assert _tokens(parallel_runs[name]) == hf_greedy(model, prompts, GREEDY["max_tokens"])


def test_moe_lora_with_tensor_parallelism_equals_hf_merged(tiny_models, prompts, parallel_runs,
                                                           tmp_path):
    """fp32, two adapters and the base model in one batch: each prompt's greedy tokens equal HF
    transformers with its adapter merged into the weights by hand (so the single-device engine's,
    tests/test_moe.py, whose control shows a dropped expert delta fails there); the adapters
    change HF's output, so a dropped delta fails here too."""
    base = tiny_models["tiny-qwen3-moe"]
    expected = merged_greedy(base, adapters(MOE_ADAPTERS), prompts, GREEDY["max_tokens"], tmp_path)
    plain = hf_greedy(base, prompts, GREEDY["max_tokens"])
    assert [row == same for row, same in zip(expected, plain)] == [
        adapter is None for adapter in MOE_ADAPTERS]
    assert _tokens(parallel_runs["moe lora tp2"]) == expected


# Two adapters and the base model in one batch, per prompt the adapter's name or None.
LORA_ADAPTERS = ("tiny-llama-lora-a", None, "tiny-llama-lora-b", "tiny-llama-lora-a")
# fp16: the merged QKV and gate/up slices take npu_batch_gather_matmul_ at their per-rank widths
# too (QKV 128/64/64 of 256 columns, gate/up 256 of 512), o_proj/down_proj the plain path.
LORA = {**ENGINE, "dtype": "float16", "enable_lora": True, "max_loras": 2, "max_lora_rank": 16}


def _lora_spec(tiny_models) -> tuple[dict, dict]:
    """The same mixed LoRA batch on TP=2 (vLLM's column-parallel LoRA layers slice B by output
    shard, QKV by head group, the row-parallel ones A by input shard: each rank's wrapper sees
    only its slices) and on one device, one driver process; and the adapters."""
    from ascend_patch.kit import tiny_adapters
    from tests.helpers.engine import MODELS_DIR

    llama = tiny_models["tiny-llama"]
    adapters = tiny_adapters.build(MODELS_DIR, [name for name in LORA_ADAPTERS if name])
    run = {"prompts": prompt_token_ids(llama, PROMPT_LENGTHS), "sampling": [GREEDY],
           "adapters": [name and str(adapters[name]) for name in LORA_ADAPTERS]}
    return {"engines": [
        {"model": str(llama), "kwargs": {**LORA, **MP, "tensor_parallel_size": 2}, "runs": [run]},
        {"model": str(llama), "kwargs": LORA, "runs": [run]},
    ]}, adapters


def engine_specs(tiny_models, items=None) -> list[dict]:
    """The drivers' specs, started ahead of the module (tests/helpers/prefetch.py)."""
    return [_parallel_spec(tiny_models), _lora_spec(tiny_models)[0]]


@pytest.fixture(scope="module")
def lora_runs(tiny_models, tmp_path_factory):
    spec, adapters = _lora_spec(tiny_models)
    tp2, tp1 = run_engine(spec, tmp_path_factory.mktemp("lora"), env=clean_env(**EMULATED),
                          timeout=1200)["engines"]
    return adapters, _tokens(tp2), _tokens(tp1)


def test_lora_tensor_parallelism_equals_one_device_and_tracks_hf_with_merged_weights(
        lora_runs, llama, prompts, oracle, tmp_path):
    """TP=2 with two adapters and the base model mixed in one fp16 batch: token for token the
    single-device engine's output, and each row tracks HF transformers (fp32) on the checkpoint
    with its adapter merged into the weights by hand; each adapter changes HF's greedy output, so
    a dropped delta fails. (fp32 single-device equality with HF: tests/test_engine.py.)"""
    from ascend_patch.kit import tiny_adapters
    from tests.helpers.engine import assert_tracks_hf_logits

    adapters, tp2, tp1 = lora_runs
    assert tp2 == tp1
    for name in dict.fromkeys(LORA_ADAPTERS):
        rows = [row for row, adapter in enumerate(LORA_ADAPTERS) if adapter == name]
        model = llama
        if name is not None:
            model = tiny_adapters.merged(adapters[name], tmp_path / name)
            merged = hf_greedy(model, [prompts[row] for row in rows], GREEDY["max_tokens"])
            assert merged != [oracle[row] for row in rows], f"{name} changes nothing"
        assert_tracks_hf_logits(model, [prompts[row] for row in rows], [tp2[row] for row in rows])


def test_a_worker_without_the_overlay_fails_clearly(llama, prompts, tmp_path):
    """Disable the overlay in the spawned workers only: multiprocessing children run the
    sitecustomize below, which undoes the .pth bootstrap and sets ASCEND_PATCH=off."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(
        """
        import os, sys
        if any("multiprocessing" in arg for arg in sys.argv):
            os.environ["ASCEND_PATCH"] = "off"
            sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "PostImportFinder"]
        """
    ))
    env = clean_env(**EMULATED, PYTHONPATH=str(site))
    spec = {"engines": [{"model": str(llama), "kwargs": {**ENGINE, "tensor_parallel_size": 2,
                                                         "distributed_executor_backend": "mp"},
                         "runs": [{"prompts": prompts, "sampling": [GREEDY]}]}]}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "engine_driver.py"), _write(tmp_path, spec)],
        env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )
    output = proc.stdout + proc.stderr
    assert "ascend-patch is not active in this vLLM process" in output
    assert "ASCEND_PATCH=off" in output
    if proc.returncode == 0:  # the driver reports engine errors instead of raising
        assert "error" in json.loads(proc.stdout.strip().splitlines()[-1])["engines"][0]


def _write(tmp_path: Path, spec: dict) -> str:
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    return str(path)


# --- collectives -----------------------------------------------------------------------------

COLLECTIVES = """
import json, os, sys
import torch, torch.distributed as dist
import torch.multiprocessing as mp

def check(rank, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from vllm.platforms import current_platform
    from ascend_patch.npu.distributed.communicator import NPUCommunicator
    dist.init_process_group(current_platform.dist_backend, rank=rank, world_size=2)
    comm = NPUCommunicator(dist.new_group(backend="gloo"), torch.device("cpu"),
                           dist.new_group(backend=current_platform.dist_backend), "tp:0")
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * rank
    out = {}
    r = x.clone(); comm.all_reduce(r); out["all_reduce"] = r.tolist()
    out["all_gather_0"] = comm.all_gather(x, 0).tolist()
    out["all_gather_-1"] = comm.all_gather(x, -1).tolist()
    out["reduce_scatter"] = comm.reduce_scatter(torch.arange(4.0) + rank, 0).tolist()
    g = comm.gather(x, dst=0, dim=0); out["gather"] = None if g is None else g.tolist()
    out["broadcast"] = comm.broadcast(x.clone(), src=1).tolist()
    if rank == 0:
        comm.send(x, dst=1)
    else:
        out["recv"] = comm.recv(x.shape, x.dtype, src=0).tolist()
    mine = torch.full((rank + 1, 2), float(rank))
    out["all_gatherv"] = comm.all_gatherv(mine, 0, sizes=[1, 2]).tolist()
    out["reduce_scatterv"] = comm.reduce_scatterv(torch.arange(3.0) + rank, 0, sizes=[1, 2]).tolist()
    results[rank] = out
    dist.destroy_process_group()

if __name__ == "__main__":
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(check, args=(int(sys.argv[1]), results), nprocs=2)
        print(json.dumps([results[0], results[1]]))
"""


def test_every_collective_across_two_gloo_ranks(tmp_path):
    script = tmp_path / "collectives.py"
    script.write_text(COLLECTIVES)
    proc = subprocess.run([sys.executable, str(script), str(free_port())], env=clean_env(**EMULATED),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r0, r1 = json.loads(proc.stdout.strip().splitlines()[-1])
    x0 = [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    x1 = [[10.0, 11.0, 12.0], [13.0, 14.0, 15.0]]
    for r in (r0, r1):
        assert r["all_reduce"] == [[10.0, 12.0, 14.0], [16.0, 18.0, 20.0]]
        assert r["all_gather_0"] == x0 + x1
        assert r["all_gather_-1"] == [a + b for a, b in zip(x0, x1)]
        assert r["broadcast"] == x1
        assert r["all_gatherv"] == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
    # arange(4) + rank summed = [1, 3, 5, 7]: rank 0 keeps the first half.
    assert (r0["reduce_scatter"], r1["reduce_scatter"]) == ([1.0, 3.0], [5.0, 7.0])
    assert (r0["gather"], r1["gather"]) == (x0 + x1, None)
    assert r1["recv"] == x0
    assert (r0["reduce_scatterv"], r1["reduce_scatterv"]) == ([1.0], [3.0, 5.0])


# --- Ray ---------------------------------------------------------------------------------------


def _session_pids(sid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            # After "pid (comm)": state ppid pgrp session. Zombies are dead already; they
            # wait for a reaper that a container's init may not be.
            if int(fields[3]) == sid and fields[0] != "Z":
                pids.append(int(entry.name))
    return pids


def _ray_answers(address: str) -> bool:
    try:
        probe = run_python("import ray; ray.init(address=%r); ray.shutdown()" % address,
                           env=clean_env(RAY_ADDRESS=address), timeout=60)
    except subprocess.TimeoutExpired:
        return False
    return probe.returncode == 0


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """A local Ray head on loopback with two NPU resources; every process it starts lives
    in one new session, and is stopped by PID afterwards."""
    port = free_port()
    ray = str(Path(sys.executable).with_name("ray"))
    # Ray's socket paths must stay under 107 bytes (AF_UNIX): a short directory in /tmp,
    # removed afterwards, rather than one under the workspace's pytest temp tree.
    temp = Path(tempfile.mkdtemp(prefix="aray", dir="/tmp"))
    env = clean_env(**EMULATED, RAY_USAGE_STATS_ENABLED="0")
    log = open(temp / "ray.log", "w")
    head = subprocess.Popen(
        [ray, "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(port),
         "--num-cpus", "4", "--resources", '{"NPU": 2}', "--include-dashboard", "false",
         "--disable-usage-stats", "--temp-dir", str(temp)],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while not _ray_answers(address):
        if head.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"ray head did not start:\n{(temp / 'ray.log').read_text()[-3000:]}")
        time.sleep(2)
    try:
        yield address
    finally:
        # The head stops the processes it started, in a few seconds; a SIGTERM to each of them at
        # once leaves the GCS server and the monitor running until the grace period ends.
        head.terminate()
        deadline = time.monotonic() + 30
        while _session_pids(head.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        for pid in _session_pids(head.pid):
            os.kill(pid, signal.SIGKILL)
        head.wait(timeout=30)
        log.close()
        shutil.copy(temp / "ray.log", tmp_path_factory.mktemp("ray-log") / "ray.log")
        shutil.rmtree(temp, ignore_errors=True)
        assert _session_pids(head.pid) == [], "Ray processes left behind"


def test_ray_tensor_parallel_equals_hf(llama, prompts, oracle, tmp_path, ray_cluster):
    env = clean_env(**EMULATED, RAY_ADDRESS=ray_cluster)
    spec = {"engines": [{"model": str(llama), "runs": [{"prompts": prompts, "sampling": [GREEDY]}],
                         "kwargs": {**ENGINE, "tensor_parallel_size": 2, "distributed_executor_backend": "ray"}}]}
    assert _tokens(run_engine(spec, tmp_path, env=env)["engines"][0]) == oracle

"""The real CLI: ``vllm serve`` on the emulated NPU, with vLLM's multiprocess engine.

The server process, the EngineCore it spawns and the worker all get the overlay from
the installed ``.pth`` (``ASCEND_PATCH=emulate`` in the environment); nothing in the
launch command mentions ascend-patch. The ``openai`` client checks completions and
chat completions, streamed and not, tool calls (Hermes parser, a tool-aware chat
template), that a rejected request leaves the server working, then a bounded load of
200 requests at concurrency 16, every greedy output against HF transformers. A second server,
with n-gram speculation, reports vLLM's speculative-decoding counters on /metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ascend_patch.kit.oracle import hf_greedy, prompt_token_ids
from tests.helpers.process import clean_env, free_port

pytestmark = pytest.mark.slow

STARTUP_TIMEOUT = 300
SERVED_NAME = "tiny"
TOOL_TEMPLATE = Path(__file__).with_name("tool_chat_template.jinja")


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    model = tiny_models["tiny-llama"]
    port = free_port()
    log_path = tmp_path_factory.mktemp("serve") / "server.log"
    vllm_cli = str(Path(sys.executable).with_name("vllm"))
    command = [
        vllm_cli, "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
        "--served-model-name", SERVED_NAME, "--dtype", "float32", "--max-model-len", "1024",
        "--max-num-seqs", "16", "--gpu-memory-utilization", "0.9",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--chat-template", str(TOOL_TEMPLATE),
    ]
    with serving(command, port, log_path) as (proc, base):
        yield {"base": base, "model": model, "proc": proc, "log": log_path}


@contextlib.contextmanager
def serving(command: list[str], port: int, log_path: Path):
    """``vllm serve`` on the emulated NPU in a process group of its own: healthy on entry, gone
    on exit."""
    env = clean_env(ASCEND_PATCH="emulate", ASCEND_PATCH_EMULATED_HBM="512MiB")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, base, log_path)
        yield proc, base
    finally:
        _stop(proc)


def _wait_healthy(proc: subprocess.Popen, base: str, log_path: Path) -> None:
    import urllib.request

    deadline = time.monotonic() + STARTUP_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"vllm serve exited with {proc.returncode}:\n{log_path.read_text()[-5000:]}")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(1)
    pytest.fail(f"vllm serve not healthy after {STARTUP_TIMEOUT}s:\n{log_path.read_text()[-5000:]}")


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group by PID, escalate after 60 s, leave nothing."""
    pgid = proc.pid  # start_new_session: the server leads its own group
    if _group_alive(pgid):
        os.killpg(pgid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(pgid, signal.SIGKILL)
        proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.5)
    if _group_alive(pgid):
        os.killpg(pgid, signal.SIGKILL)


def _client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server['base']}/v1", api_key="unused")


def test_completions_streamed_and_unstreamed_equal_hf(server):
    prompts = prompt_token_ids(server["model"], [5, 40, 130])
    expected = hf_greedy(server["model"], prompts, 16)
    client = _client(server)
    for prompt, want in zip(prompts, expected):
        extra = {"return_token_ids": True, "ignore_eos": True}
        full = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=16,
                                         temperature=0, extra_body=extra)
        assert full.choices[0].token_ids == want
        streamed = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=16,
                                             temperature=0, stream=True, extra_body={"ignore_eos": True})
        assert "".join(chunk.choices[0].text for chunk in streamed) == full.choices[0].text


def test_chat_completions_streamed_and_unstreamed_equal_hf(server):
    import json
    import urllib.request

    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "What does json.dumps do?"}]
    # The prompt exactly as the server renders it (chat template + tokenizer), from its own
    # /tokenize endpoint; the continuation then comes from HF.
    request = urllib.request.Request(
        f"{server['base']}/tokenize",
        data=json.dumps({"model": SERVED_NAME, "messages": messages, "add_generation_prompt": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        prompt = json.load(response)["tokens"]
    tokenizer = AutoTokenizer.from_pretrained(server["model"])
    want = tokenizer.decode(hf_greedy(server["model"], [prompt], 12)[0], skip_special_tokens=True)
    client = _client(server)
    extra = {"ignore_eos": True}
    full = client.chat.completions.create(model=SERVED_NAME, messages=messages, max_tokens=12,
                                          temperature=0, extra_body=extra)
    assert full.choices[0].message.content == want
    streamed = client.chat.completions.create(model=SERVED_NAME, messages=messages, max_tokens=12,
                                              temperature=0, stream=True, extra_body=extra)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == want


WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
         "additionalProperties": False}
# strict: the arguments must follow the schema (without it vLLM constrains only the call envelope)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER,
                                           "strict": True}},
         {"type": "function", "function": {"name": "get_time", "description": "Clock", "parameters": CLOCK,
                                           "strict": True}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
TOOL_MESSAGES = [{"role": "user", "content": "Weather in Oslo?"}]


def _whitespace_bias(model) -> dict[str, int]:
    """Forbid the tokens that are only whitespace. The tool-call grammar lets JSON carry any
    whitespace, which a random-weight model otherwise pads until max_tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    return {str(t): -100 for t in range(len(tokenizer)) if tokenizer.decode([t]).isspace()}


def _check_call(call, name: str | None = None) -> None:
    import jsonschema

    assert call.type == "function"
    assert call.function.name in SCHEMAS and name in (None, call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_the_chat_template_renders_the_tools(server):
    import urllib.request

    from transformers import AutoTokenizer

    request = urllib.request.Request(
        f"{server['base']}/tokenize",
        data=json.dumps({"model": SERVED_NAME, "messages": TOOL_MESSAGES, "tools": TOOLS,
                         "add_generation_prompt": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        tokens = json.load(response)["tokens"]
    prompt = AutoTokenizer.from_pretrained(server["model"]).decode(tokens)
    for tool in TOOLS:
        assert json.dumps(tool["function"]["parameters"]) in prompt
    assert prompt.endswith("<s>user: Weather in Oslo?</s><s>assistant: ")


@pytest.mark.parametrize("stream", [False, True], ids=["full", "streamed"])
def test_a_named_tool_choice_returns_a_call_that_follows_the_schema(server, stream):
    client = _client(server)
    choice = {"type": "function", "function": {"name": "get_weather"}}
    response = client.chat.completions.create(
        model=SERVED_NAME, messages=TOOL_MESSAGES, tools=TOOLS, tool_choice=choice, max_tokens=120,
        temperature=0, logit_bias=_whitespace_bias(server["model"]), stream=stream)
    if not stream:
        (call,) = response.choices[0].message.tool_calls
        _check_call(call, "get_weather")
        return
    deltas = [c.choices[0].delta.tool_calls[0] for c in response if c.choices and c.choices[0].delta.tool_calls]
    assert {d.index for d in deltas} == {0}
    names = [d.function.name for d in deltas if d.function and d.function.name]
    arguments = "".join(d.function.arguments or "" for d in deltas if d.function)
    assert names == ["get_weather"]
    import jsonschema

    jsonschema.validate(json.loads(arguments), WEATHER)


def test_a_required_tool_choice_returns_one_of_the_tools(server):
    response = _client(server).chat.completions.create(
        model=SERVED_NAME, messages=TOOL_MESSAGES, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_tokens=120, temperature=0,
        logit_bias=_whitespace_bias(server["model"]))
    (call,) = response.choices[0].message.tool_calls
    _check_call(call)


def test_a_rejected_request_leaves_the_server_working(server):
    import openai

    client = _client(server)
    # The structured-output backend's refusal of this pattern, not any other 400.
    with pytest.raises(openai.BadRequestError, match=r'invalid regex "\[a-c"'):
        client.completions.create(model=SERVED_NAME, prompt="x", max_tokens=4,
                                  extra_body={"structured_outputs": {"regex": "[a-c"}})
    prompt = prompt_token_ids(server["model"], [20])[0]
    response = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=8, temperature=0,
                                         extra_body={"return_token_ids": True, "ignore_eos": True})
    assert response.choices[0].token_ids == hf_greedy(server["model"], [prompt], 8)[0]


def test_load_200_requests_at_concurrency_16(server):
    """Mixed prompt and output lengths; zero errors; every greedy output equals HF."""
    lengths = [3, 11, 24, 57, 90, 128, 150, 260]
    prompts = prompt_token_ids(server["model"], lengths)
    combos = [(i, n) for i in range(len(prompts)) for n in (4, 9, 16, 25, 32)]  # 40 distinct
    oracle = {}
    for n in sorted({n for _, n in combos}):
        for i, tokens in enumerate(hf_greedy(server["model"], prompts, n)):
            oracle[(i, n)] = tokens
    jobs = [combos[k % len(combos)] for k in range(200)]

    async def run_all():
        from openai import AsyncOpenAI

        client = AsyncOpenAI(base_url=f"{server['base']}/v1", api_key="unused", max_retries=0)
        limit = asyncio.Semaphore(16)

        async def one(job):
            async with limit:
                i, n = job
                response = await client.completions.create(
                    model=SERVED_NAME, prompt=prompts[i], max_tokens=n, temperature=0,
                    extra_body={"return_token_ids": True, "ignore_eos": True})
                return job, response.choices[0].token_ids

        try:
            return await asyncio.wait_for(asyncio.gather(*(one(j) for j in jobs)), timeout=600)
        finally:
            await client.close()

    start = time.monotonic()
    results = asyncio.run(run_all())
    elapsed = time.monotonic() - start
    assert len(results) == 200
    mismatches = [job for job, tokens in results if tokens != oracle[job]]
    assert mismatches == [], f"{len(mismatches)} outputs differ from HF (first: {mismatches[:3]})"
    print(f"200 requests at concurrency 16 in {elapsed:.1f} s (emulated NPU, CPU)")


def test_the_engine_processes_carry_the_overlay(server):
    log = server["log"].read_text()
    assert "(EngineCore" in log, "the multiprocess engine ran in its own process"
    assert "Setting kv cache block size to 128 for CUSTOM backend" in log


def test_every_process_announces_the_overlay_once_at_info(server):
    """The activation line, through vLLM's logger, in the API server (vLLM labels it
    MainProcess) and in the EngineCore it spawned: once each."""
    import re

    from ascend_patch import __version__

    from tests.helpers.patch_sets import installed

    release = installed()
    line = (f"ascend-patch {__version__} active: vLLM {release.vllm}, patch set {release.patch_set}, "
            f"mode emulate, runner {release.runner}")
    announced = re.findall(r"^\((\w+) pid=(\d+)\) INFO [^\]]*\] " + re.escape(line) + "$",
                           server["log"].read_text(), re.MULTILINE)
    assert sorted(name for name, _ in announced) == ["EngineCore", "MainProcess"], announced  # the API server is main
    assert len({pid for _, pid in announced}) == 2


SPEC_TOKENS = 3
SPEC_DECODE_COUNTERS = ("drafts", "draft_tokens", "accepted_tokens")


def _spec_decode_metrics(base: str) -> dict:
    """vLLM's speculative-decoding counters on the server's /metrics (Prometheus text), summed
    over engines: the three totals, and the accepted drafts by position."""
    import re
    import urllib.request

    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as response:
        text = response.read().decode()
    counts = {**dict.fromkeys(SPEC_DECODE_COUNTERS, 0.0), "accepted_per_position": {}}
    pattern = re.compile(r"^vllm:spec_decode_num_(\w+?)_total(?:\{(.*)\})? (\S+)$")
    for line in text.splitlines():
        match = pattern.match(line)
        if match is None:
            continue
        name, labels, value = match.group(1), match.group(2) or "", float(match.group(3))
        if name == "accepted_tokens_per_pos":
            position = int(re.search(r'position="(\d+)"', labels).group(1))
            per_position = counts["accepted_per_position"]
            per_position[position] = per_position.get(position, 0.0) + value
        elif name in counts:
            counts[name] += value
    per_position = counts["accepted_per_position"]
    counts["accepted_per_position"] = [per_position[p] for p in sorted(per_position)]
    return counts


def test_speculative_decoding_serves_exact_tokens_and_reports_its_metrics(tiny_models, tmp_path):
    """``vllm serve`` with n-gram speculation (its own server): greedy completions equal HF, and
    /metrics carries vLLM's speculative-decoding counters, consistent with each other (the
    accepted drafts by position add up to the accepted drafts and never grow with the position)."""
    model = tiny_models["tiny-llama"]
    port = free_port()
    speculative = {"method": "ngram", "num_speculative_tokens": SPEC_TOKENS,
                   "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    command = [
        str(Path(sys.executable).with_name("vllm")), "serve", str(model), "--host", "127.0.0.1",
        "--port", str(port), "--served-model-name", SERVED_NAME, "--dtype", "float32",
        "--max-model-len", "256", "--max-num-seqs", "4", "--gpu-memory-utilization", "0.9",
        "--speculative-config", json.dumps(speculative),
    ]
    log_path = tmp_path / "server.log"
    env = clean_env(ASCEND_PATCH="emulate", ASCEND_PATCH_EMULATED_HBM="512MiB")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, base, log_path)
        text, repeated = prompt_token_ids(model, [14, 6])
        prompts = [text, repeated * 3]  # the second repeats its n-grams: drafts from the start
        expected = hf_greedy(model, prompts, 20)
        client = _client({"base": base})
        for prompt, want in zip(prompts, expected):
            completion = client.completions.create(
                model=SERVED_NAME, prompt=prompt, max_tokens=20, temperature=0,
                extra_body={"return_token_ids": True, "ignore_eos": True})
            assert completion.choices[0].token_ids == want
        # The server records a step's stats after it hands out the step's outputs: read until
        # two readings a second apart agree.
        deadline, previous = time.monotonic() + 30, None
        counts = _spec_decode_metrics(base)
        while (counts != previous or counts["drafts"] == 0) and time.monotonic() < deadline:
            time.sleep(1)
            previous, counts = counts, _spec_decode_metrics(base)
    finally:
        _stop(proc)
    per_position = counts["accepted_per_position"]
    print("served spec-decode counters:", counts,
          "mean acceptance length:", 1 + counts["accepted_tokens"] / max(counts["drafts"], 1))
    assert counts["drafts"] > 0
    assert counts["drafts"] <= counts["draft_tokens"] <= SPEC_TOKENS * counts["drafts"]
    assert counts["accepted_tokens"] < counts["draft_tokens"]
    assert len(per_position) == SPEC_TOKENS
    assert sum(per_position) == counts["accepted_tokens"]
    assert per_position == sorted(per_position, reverse=True)

"""Shared fixtures: fresh interpreters with a controlled ASCEND_PATCH* environment.

Most loader tests run in a subprocess, because what they test is what happens
when a *fresh* interpreter imports vLLM through the installed ``.pth`` file.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import socket
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def vllm_package_dir() -> Path:
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations, "vLLM must be installed"
    return Path(next(iter(spec.submodule_search_locations))).resolve()


def clean_env(**overrides: str) -> dict[str, str]:
    """This process's environment without any ASCEND_PATCH* setting, plus overrides."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASCEND_PATCH")}
    env.update(overrides)
    return env


def free_port() -> int:
    """A loopback TCP port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_python(
    code: str,
    *,
    env: dict[str, str] | None = None,
    args: list[str] | None = None,
    timeout: float = 300,
    python: str = sys.executable,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess:
    argv = [python, *(args or []), "-c", textwrap.dedent(code)]
    return subprocess.run(
        argv,
        env=env if env is not None else clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd or ROOT,
    )


def run_json(code: str, **kwargs) -> dict:
    """Run ``code``, which must print one JSON document last; fail with its stderr."""
    proc = run_python(code, **kwargs)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def ascend_patch_lines(stderr: str) -> list[str]:
    """The lines of stderr that come from ascend-patch."""
    return [line for line in stderr.splitlines() if "ascend-patch" in line or "ascend_patch" in line]


@functools.cache
def _pypi_problem() -> str | None:
    try:
        urllib.request.urlopen("https://pypi.org/simple/vllm/", timeout=10).close()
    except OSError as exc:
        return f"PyPI is unreachable ({getattr(exc, 'reason', exc)})"
    return None


def require_pypi(what: str) -> None:
    """Skip when PyPI cannot be reached, except in CI (``CI=true``), where the network is
    part of the contract and a silent skip would hide that a claim went unchecked."""
    problem = _pypi_problem()
    if problem is None:
        return
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{problem}: {what} needs it, and CI must not skip it")
    pytest.skip(f"{problem}: {what} needs it")


@pytest.fixture(scope="session")
def vllm_dir() -> Path:
    return vllm_package_dir()


# --- engine tests: tiny local models, the HF oracle, and the engine driver --------------------

def for_installed_vllm(declarations) -> list:
    """The declarations of a patch set that apply to the installed vLLM (their own sub-range
    admits it), as the loader selects them."""
    from importlib.metadata import version

    from packaging.version import Version

    from ascend_patch.overlay.declarations import applies_to

    release = Version(Version(version("vllm")).base_version)
    return [d for d in declarations if applies_to(d, release)]


MODELS_DIR = ROOT / ".cache" / "models"


@pytest.fixture(scope="session")
def tiny_models() -> dict[str, Path]:
    """The tiny Llama and Qwen2 checkpoints, built locally (there is no model hub)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import make_tiny_models
    finally:
        sys.path.pop(0)
    return make_tiny_models.build(MODELS_DIR)


def prompt_token_ids(model_dir: Path, lengths: list[int]) -> list[list[int]]:
    """Prompts of the given token lengths, cut from text the tokenizer was not trained on."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = textwrap.dedent(importlib.util.find_spec("email.message").loader.get_source("email.message"))
    ids = tokenizer(text).input_ids
    prompts, start = [], 0
    for length in lengths:
        prompts.append(ids[start : start + length])
        start += length
    return prompts


def hf_model(model_dir: Path, dtype=None, **config):
    """The Hugging Face model (fp32 unless ``dtype``; ``config`` overrides config fields).
    Soft-capped attention logits (Gemma 2) need the eager attention: transformers' SDPA path
    silently drops the soft-cap."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if getattr(AutoConfig.from_pretrained(model_dir), "attn_logit_softcapping", None):
        config.setdefault("attn_implementation", "eager")
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype or torch.float32, **config)


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Hugging Face transformers greedy decoding, fp32: the independent oracle."""
    import torch

    model = hf_model(model_dir)
    model.generation_config.eos_token_id = None
    outputs = []
    with torch.no_grad():
        for ids in prompts:
            # An explicit all-ones mask: otherwise HF masks every prompt token that equals
            # the pad id, which chat prompts (with <s>/</s> inside) contain.
            input_ids = torch.tensor([ids])
            out = model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                max_new_tokens=max_new_tokens, pad_token_id=0,
            )
            outputs.append(out[0, len(ids):].tolist())
    return outputs


def hf_logits(model_dir: Path, sequences: list[list[int]], dtype: str = "float32") -> list:
    """Next-token logits (as fp32) at every position of each sequence (teacher forcing), from
    the model run in ``dtype``."""
    import torch

    model = hf_model(model_dir, getattr(torch, dtype))
    with torch.no_grad():
        return [model(torch.tensor([seq])).logits[0].float() for seq in sequences]


def assert_greedy_equals_hf(engine: dict, model_dir: Path, prompts: list[list[int]], max_tokens: int) -> None:
    """An fp32 engine's two greedy runs of ``prompts`` (the second served from the prefix cache)
    equal HF transformers token for token."""
    assert "error" not in engine, engine.get("error")
    oracle = hf_greedy(model_dir, prompts, max_tokens)
    first, cached = engine["runs"]
    assert first["tokens"] == oracle
    assert cached["tokens"] == oracle, "served from the prefix cache"
    assert sum(cached["cached"]) > 0


def assert_tracks_hf_logits(model_dir: Path, prompts: list[list[int]], generated: list[list[int]],
                            min_exact: float = 0.9, routed: bool = False,
                            bf16_oracle: bool = False) -> None:
    """Reduced-precision greedy output against the fp32 HF oracle: exact equality is
    meaningless (a bf16 rounding can flip a near-tie and the sequences part), so every
    token the engine chose, on the engine's own sequence, must be HF's argmax or within
    bf16 rounding of it (8 significant bits of the top logit), and most must be exact.

    ``routed`` (mixture-of-experts models): a bf16 rounding anywhere in a token's context
    can also flip a router's near-tie between two experts, a discrete change of the hidden
    state that no logit tolerance bounds, and HF run in bf16 flips other ties than the
    engine. So a token may also match an independent bf16 run (HF's own), and at most 1 in
    20 tokens may match neither; a wrong expert path (weights, scaling, shared expert,
    combine) misses on most tokens. The expert path's own bf16 numerics, routing held
    fixed, are checked tightly in tests/kernels/test_moe_ops.py.

    ``bf16_oracle``: a token may also match the independent bf16 run, but none may miss
    both oracles; for models whose bf16 rounding alone (HF's as much as ours) moves some
    logits further than the tolerance, e.g. MLA's 512-wide latent products.
    """
    sequences = [p + t for p, t in zip(prompts, generated)]
    oracles = [hf_logits(model_dir, sequences)]
    if routed or bf16_oracle:
        oracles.append(hf_logits(model_dir, sequences, "bfloat16"))
    assert_tracks_logits(oracles, prompts, generated, min_exact, routed)


def assert_tracks_logits(oracles: list[list], prompts: list[list[int]], generated: list[list[int]],
                         min_exact: float = 0.9, routed: bool = False) -> None:
    """The check of :func:`assert_tracks_hf_logits` against given oracles: per oracle, the
    next-token logits at every position of each prompt + generated sequence."""
    exact = total = 0
    misses = []
    for n, (prompt, tokens) in enumerate(zip(prompts, generated)):
        for i, token in enumerate(tokens):
            rows = [oracle[n][len(prompt) - 1 + i].float() for oracle in oracles]
            if not any(float(row[token]) >= float(row.max()) - 0.05 * (abs(float(row.max())) + 1)
                       for row in rows):
                misses.append((n, i, [round(float(row[token]) - float(row.max()), 3) for row in rows]))
            exact += int(any(token == int(row.argmax()) for row in rows))
            total += 1
    allowed = total // 20 if routed else 0
    assert len(misses) <= allowed, f"{len(misses)} of {total} tokens beyond bf16 rounding: {misses}"
    assert total and exact / total >= min_exact, f"{exact}/{total} tokens are an oracle's argmax"


def run_engine(spec: dict, tmp_path: Path, env: dict[str, str] | None = None, timeout: float = 600,
               python: str = sys.executable) -> dict:
    """Run tests/engine_driver.py on ``spec`` in a fresh interpreter (emulated NPU) of ``python``'s
    environment."""
    spec_file = tmp_path / f"engine-spec-{len(list(tmp_path.glob('engine-spec-*')))}.json"
    spec_file.write_text(json.dumps(spec))
    environment = env or clean_env(ASCEND_PATCH="emulate", ASCEND_PATCH_EMULATED_HBM="512MiB")
    proc = subprocess.run(
        [python, str(ROOT / "tests" / "engine_driver.py"), str(spec_file)],
        env=environment,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, f"engine driver failed:\n{proc.stderr[-6000:]}"
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, f"engine driver printed no result:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1])

"""The demo's unchanged user script: stock vLLM's ``LLM(...).generate(...)``.

Nothing here mentions ascend-patch; the ``.pth`` loader selects the NPU platform
when ``vllm`` is imported. Run by ``scripts/demo.sh``. It lives in a file, not a
heredoc, because vLLM's engine core is a spawned process on the NPU platform
and spawn re-imports the parent's ``__main__`` from its file.

    python scripts/demo_generate.py MODEL_DIR [--check]

``--check`` (the demo's tiny model) scores the generated token ids against HF transformers
running the same weights in fp32, as the engine tests do (``ascend_patch.kit.oracle``).
"""

import sys

from vllm import LLM, SamplingParams
from vllm.platforms import current_platform

if __name__ == "__main__":
    llm = LLM(model=sys.argv[1], max_model_len=512, seed=0)
    prompts = ["The Zen of Python says", "import json\n", "def main():"]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24))
    print(f"\nplatform: {type(current_platform).__name__} ({current_platform.get_device_name(0)})")
    for output in outputs:
        print(f"{output.prompt!r} -> {output.outputs[0].text!r}")
        print(f"    token ids: {list(output.outputs[0].token_ids)}")
    if "--check" in sys.argv[2:]:
        from ascend_patch.kit import oracle

        dtype = str(llm.llm_engine.model_config.dtype).removeprefix("torch.")
        tracking = oracle.precision_tracking(
            sys.argv[1], [list(o.prompt_token_ids) for o in outputs],
            [list(o.outputs[0].token_ids) for o in outputs], dtype)
        print(f"\nThe text is noise because the tiny model's weights are random (there is no model hub "
              f"here).\nWhat says the engine is right: its token ids, scored against HF transformers on "
              f"the same weights (fp32, teacher-forced: each token is HF's best, or short of it by no "
              f"more than {dtype} rounding explains):\n    {'PASS' if tracking.ok else 'FAIL'}: "
              f"{tracking.message}")
        sys.exit(0 if tracking.ok else 1)

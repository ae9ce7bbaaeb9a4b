"""The demo's unchanged user script: stock vLLM's ``LLM(...).generate(...)``.

Nothing here mentions ascend-patch; the ``.pth`` loader selects the NPU platform
when ``vllm`` is imported. Run by ``scripts/demo.sh``. It lives in a file, not a
heredoc, because vLLM's engine core is a spawned process on the NPU platform
and spawn re-imports the parent's ``__main__`` from its file.

    python scripts/demo_generate.py MODEL_DIR
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

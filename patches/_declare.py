"""The helpers the area modules declare with (:func:`cite`, :func:`contract`,
:func:`platform_hook`): neutral, so no area imports another to build a contract."""

from ascend_patch.overlay.declarations import Contract

PLATFORM = "ascend_patch.npu.platform:NPUPlatform"

_PLATFORM_API = "vllm/platforms/interface.py: the out-of-tree platform interface"
KEEP = "never: vLLM's own extension point; the contract only guards its signature"


def cite(upstream: str, pr: str | None) -> str:
    """The upstream text naming the PR behind it (``owner/repo#number``), where one is known."""
    return upstream if pr is None else f"{upstream}; {pr}"


def platform_hook(name: str, signature: str, reason: str, pr: str | None = None) -> Contract:
    """A hook of vLLM's platform interface that NPUPlatform overrides."""
    return Contract(
        f"vllm.platforms.interface:Platform.{name}",
        reason=reason,
        signature=(signature,),
        upstream=cite(_PLATFORM_API, pr),
        remove_when=KEEP,
        implementation=PLATFORM,
    )


def contract(target: str, signature: str | tuple[str, ...] | None, reason: str, *,
             implementation: str, upstream: str, remove_when: str = KEEP,
             vllm: str | None = None, pr: str | None = None) -> Contract:
    """A contract; a single signature may be given bare."""
    if isinstance(signature, str):
        signature = (signature,)
    return Contract(target, reason=reason, signature=signature, upstream=cite(upstream, pr),
                    remove_when=remove_when, implementation=implementation, vllm=vllm)

"""The layer ops of the kernel seam under torch.compile: traced as opaque torch ops (as torch_npu's
are), so a compiled graph calls the seam at run time, where each op's contract is checked.

PIECEWISE graphs compile the layers between attention with vLLM's eager backend and no guards
(``guard_filter_fn``), as here: what a compiled piece launches is what its graph module calls.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.usefixtures("reference_kernels")

HEAD = 64


def _layer(x, residual, gamma, gate_up, positions, cos_sin_cache):
    """The seam calls of a decoder layer outside attention, as the NPU custom ops make them."""
    from ascend_patch.npu import kernels

    y, _, summed = kernels.add_rms_norm(x, residual, gamma, 1e-6)
    q, k = kernels.mrope(positions, y, y, cos_sin_cache, HEAD, "half")
    normed = kernels.rms_norm(q + k, gamma, 1e-6)[0]
    cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
    cos, sin = torch.cat((cos, cos), -1)[None, :, None], torch.cat((sin, sin), -1)[None, :, None]
    rotated = kernels.rotary_mul(normed.view(1, -1, 2, HEAD), cos, sin, "half")
    return rotated.view(normed.shape) + kernels.swiglu(gate_up, dim=-1), summed


def _inputs(tokens=5, dtype=torch.bfloat16, cos_sin_scale=1.0):
    generator = torch.Generator().manual_seed(0)
    angles = torch.rand(32, HEAD // 2, generator=generator) * 6.28
    cos_sin_cache = (torch.cat((angles.cos(), angles.sin()), -1) * cos_sin_scale).to(dtype)
    return (torch.randn(tokens, 2 * HEAD, generator=generator).to(dtype),
            torch.randn(tokens, 2 * HEAD, generator=generator).to(dtype),
            torch.rand(2 * HEAD, generator=generator).to(dtype),
            torch.randn(tokens, 4 * HEAD, generator=generator).to(dtype),
            torch.randint(0, 32, (tokens,), generator=generator), cos_sin_cache)


def _compiled():
    graphs = []

    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module

    options = {"guard_filter_fn": torch.compiler.skip_all_guards_unsafe}
    return torch.compile(_layer, backend=backend, fullgraph=True, dynamic=True, options=options), graphs


def test_compiled_layers_launch_the_seam_ops_and_give_their_outputs():
    from ascend_patch.npu import kernels

    compiled, graphs = _compiled()
    inputs = _inputs()
    compiled(*inputs)  # traced here
    ((graph,),) = [graphs]
    targets = [str(node.target) for node in graph.graph.nodes if node.op == "call_function"]
    traced = sorted(t.removeprefix("ascend_patch_emulated.").removesuffix(".default")
                    for t in targets if t.startswith("ascend_patch_emulated."))
    assert traced == ["add_rms_norm", "mrope", "rms_norm", "rotary_mul", "swiglu"], targets
    with kernels.count_launches() as launches:
        got = compiled(*_inputs(tokens=7))  # another token count, the same graph (dynamic)
    assert len(graphs) == 1
    assert launches == {"add_rms_norm": 1, "mrope": 1, "rms_norm": 1, "rotary_mul": 1, "swiglu": 1}
    for out, expected in zip(got, _layer(*_inputs(tokens=7))):
        torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_compiled_layers_check_each_ops_contract_when_they_run():
    """Tracing runs the fake kernels only; the value checks run at the call: cos/sin outside
    [-1, 1] breaks npu_rotary_mul's contract in the compiled function as in eager mode."""
    from ascend_patch.npu.kernels import KernelContractError

    compiled, _ = _compiled()
    compiled(*_inputs())
    with pytest.raises(KernelContractError, match="npu_rotary_mul: r1 must be within \\[-1, 1\\]"):
        compiled(*_inputs(cos_sin_scale=2.0))


# torch_npu's layer ops as the dispatcher holds them (the schemas' argument names, which the
# real path binds by keyword), with kernels that only shape their outputs: what tracing sees.
_NPU_SCHEMAS = {
    "npu_rms_norm": ("(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)", "rms_norm"),
    "npu_add_rms_norm": ("(Tensor x1, Tensor x2, Tensor gamma, float epsilon=1e-06) "
                         "-> (Tensor, Tensor, Tensor)", "add_rms_norm"),
    "npu_swiglu": ("(Tensor self, int dim=-1) -> Tensor", "swiglu"),
    "npu_rotary_mul": ("(Tensor self, Tensor r1, Tensor r2, str rotary_mode='half') -> Tensor",
                       "rotary_mul"),
    "npu_mrope": ("(Tensor positions, Tensor query, Tensor key, Tensor cos_sin_cache, int head_size, "
                  "*, int[]? mrope_section=None, str? rotary_mode='half', str? cache_mode='default') "
                  "-> (Tensor, Tensor)", "mrope"),
}


@pytest.fixture(scope="module")
def npu_ops():
    import types

    from ascend_patch.npu import kernels

    module = types.ModuleType("torch_npu")
    for name, (schema, seam) in _NPU_SCHEMAS.items():
        shape = kernels._TRACED[seam][1]
        if seam == "mrope":  # the seam's fake kernel takes the reference's arguments only
            shape = (lambda fake: lambda positions, query, key, cos_sin_cache, head_size, **_: fake(
                positions, query, key, cos_sin_cache, head_size))(shape)
        torch.library.define(f"npu_stand_in::{name}", schema)
        torch.library.impl(f"npu_stand_in::{name}", "CompositeExplicitAutograd", shape)
        torch.library.register_fake(f"npu_stand_in::{name}", shape)
        setattr(module, name, getattr(torch.ops.npu_stand_in, name))
    return module


def test_the_real_paths_layer_ops_trace_as_torch_npus_ops(npu_ops, monkeypatch):
    """On the NPU the seam's layer ops are the torch_npu ops themselves: a compiled piece calls
    them, tracing reaches torch_npu without importing it again (an import cannot be traced)."""
    import sys

    from ascend_patch.npu import kernels

    monkeypatch.setitem(sys.modules, "torch_npu", npu_ops)
    kernels.use("npu")
    try:
        compiled, graphs = _compiled()
        compiled(*_inputs())
    finally:
        kernels.use("reference")
    ((graph,),) = [graphs]
    targets = sorted(str(node.target) for node in graph.graph.nodes if node.op == "call_function"
                     and str(node.target).startswith("npu_stand_in."))
    assert targets == [f"npu_stand_in.{name}" for name in sorted(_NPU_SCHEMAS)], targets

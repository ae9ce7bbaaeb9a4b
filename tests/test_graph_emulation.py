"""The emulated NPU graph has teeth: a replay re-executes exactly what the capture recorded, so
what a real graph gets wrong (a buffer not refreshed, a host argument not re-issued, a host sync,
an allocation the pool does not own, a shape change) fails here too. And the capture sizes keep
within the NPU's stream budget (vllm-ascend's formula) for a 36-layer model.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import hypothesis.strategies as st
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings

from ascend_patch.npu import device, kernels
from ascend_patch.npu.compilation import acl_graph
from ascend_patch.npu.emulation import graph as eg
from ascend_patch.npu.compilation.acl_graph import sample_sizes
from tests.helpers.process import clean_env, run_json

# These tests run the emulated NPU's kernels, bound as its platform binds them (the seam fails
# closed until then); the seam as bound before any capture: a capture swaps recording wrappers in
# and must put exactly these back.
kernels.use("reference")
BOUND = {name: getattr(kernels, name) for name in kernels.OPS}
W = torch.randn(16, 16, generator=torch.Generator().manual_seed(0))
GAMMA = torch.rand(16, generator=torch.Generator().manual_seed(1)) + 0.5


def _layer(x):
    return kernels.rms_norm(torch.relu(x @ W), GAMMA, 1e-6)[0] + 1


def _oracle(x):
    return F.rms_norm(torch.relu(x @ W), (16,), GAMMA, 1e-6) + 1


def _capture(fn, *args):
    graph = eg.NPUGraph()
    with eg.graph(graph):
        out = fn(*args)
    return graph, out


def test_a_replay_recomputes_the_captured_work_from_the_refreshed_buffer():
    buffer = torch.randn(4, 16)
    graph, out = _capture(_layer, buffer)
    fresh = torch.randn(4, 16)
    buffer.copy_(fresh)
    graph.replay()
    torch.testing.assert_close(out, _oracle(fresh))
    assert all(getattr(kernels, name) is BOUND[name] for name in kernels.OPS), "the seam is restored"


def test_a_missed_buffer_copy_replays_the_captured_inputs():
    buffer = torch.randn(4, 16)
    graph, out = _capture(_layer, buffer)
    captured = _oracle(buffer)
    new_input = torch.randn(4, 16)  # handed to nobody: the graph reads its own buffer
    graph.replay()
    torch.testing.assert_close(out, captured)
    assert not torch.allclose(out, _oracle(new_input))


@pytest.mark.parametrize(("inside", "message"), [
    (lambda x: x.sum().item(), "Tensor.item()"),
    (lambda x: x.tolist(), "Tensor.tolist()"),
    (lambda x: x.cpu(), "Tensor.cpu()"),
    (lambda x: bool(x[0, 0] > 0), "aten._local_scalar_dense"),
    (lambda x: torch.nonzero(x > 0), "aten.nonzero"),
    (lambda x: x[x > 0], "host sync"),
    (lambda x: x + torch.tensor([1.0] * 16), "allocation outside the graph pool"),
    (lambda x: x.clone().resize_(8, 16), "shape change"),
], ids=["item", "tolist", "cpu", "bool", "nonzero", "boolean-index", "host-data", "resize"])
def test_what_an_npu_graph_cannot_hold_raises_during_capture(inside, message):
    x = torch.randn(4, 16)
    with pytest.raises(eg.GraphCaptureError, match=message.replace("(", r"\(").replace(")", r"\)")):
        with eg.graph(eg.NPUGraph()):
            inside(_layer(x))
    assert not eg.is_capturing()
    assert all(getattr(kernels, name) is BOUND[name] for name in kernels.OPS), "the seam is restored"


def test_an_integer_index_is_a_captured_gather_that_replays_on_the_refreshed_indices():
    """``table[positions]`` (a rotary cache read, say) gathers on the device: captured, and a
    replay reads the positions the buffer holds then. A boolean mask stays a host sync (above)."""
    table, positions = torch.randn(16, 4), torch.tensor([3, 1, 7])
    graph, out = _capture(lambda p: table[p] * 2, positions)
    positions.copy_(torch.tensor([0, 15, 2]))
    graph.replay()
    torch.testing.assert_close(out, table[torch.tensor([0, 15, 2])] * 2)


def _paged_case():
    """One decode step of 2 sequences over a [4 blocks, 128] bf16 cache."""
    generator = torch.Generator().manual_seed(2)
    cache = torch.randn(2, 4, 128, 2, 64, generator=generator).to(torch.bfloat16)
    query = torch.randn(2, 8, 64, generator=generator).to(torch.bfloat16)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    return query, cache[0], cache[1], table, torch.empty_like(query)


def _paged(query, keys, values, table, lengths, out, workspace=None):
    """``lengths``: the host context lengths (built before a capture: host data made inside one
    would count as an allocation outside the pool)."""
    kernels.paged_attention(query, keys, values, 2, 8, 0.125, table, lengths, out, workspace=workspace)


def _lengths(*values):
    return torch.tensor(values, dtype=torch.int32)


def test_host_arguments_are_captured_by_value_and_renewed_by_a_task_update():
    query, keys, values, table, out = _paged_case()
    graph, event, captured = eg.NPUGraph(), eg.ExternalEvent(), _lengths(5, 130)
    with eg.graph(graph):
        stream = eg.current_stream()
        event.wait(stream)
        event.reset(stream)
        eg.graph_task_group_begin(stream)
        _paged(query, keys, values, table, captured, out)
        handle = eg.graph_task_group_end(stream)

    expected = {}
    for lengths in ((5, 130), (77, 256)):
        _paged(query, keys, values, table, _lengths(*lengths), out)
        expected[lengths] = out.clone()

    captured.copy_(_lengths(77, 256))  # the host tensor changes; the graph kept its values
    event.record()
    graph.replay()
    torch.testing.assert_close(out, expected[(5, 130)])

    eg.graph_task_update_begin(eg.Stream(), handle)
    _paged(query, keys, values, table, _lengths(77, 256), out, workspace=torch.empty(0, dtype=torch.uint8))
    eg.graph_task_update_end()
    event.record()
    graph.replay()
    torch.testing.assert_close(out, expected[(77, 256)])


def test_a_replay_waits_for_the_event_its_update_records():
    query, keys, values, table, out = _paged_case()
    graph, event, lengths = eg.NPUGraph(), eg.ExternalEvent(), _lengths(5, 9)
    with eg.graph(graph):
        event.wait(eg.current_stream())
        event.reset(eg.current_stream())
        _paged(query, keys, values, table, lengths, out)
    with pytest.raises(eg.GraphReplayError, match="wait here forever"):
        graph.replay()
    event.record()
    graph.replay()
    with pytest.raises(eg.GraphReplayError, match="wait here forever"):
        graph.replay()  # the captured reset cleared the record


def test_a_wait_keeps_the_event_set_until_a_reset():
    """torch_npu's ExternalEvent: a wait does not clear the flag, reset() does. A graph that
    captures the wait alone passes its next replay's wait on the previous record: the record
    that step's update issues lands on an event still set, which the emulation reports."""
    query, keys, values, table, out = _paged_case()
    graph, event, lengths = eg.NPUGraph(), eg.ExternalEvent(), _lengths(5, 9)
    with eg.graph(graph):
        event.wait(eg.current_stream())
        _paged(query, keys, values, table, lengths, out)
    event.record()
    graph.replay()
    event.record()
    with pytest.raises(eg.GraphReplayError, match="recorded twice without a reset"):
        graph.replay()
    event.reset()
    event.record()
    graph.replay()


def test_captured_host_parameter_launches_replay_each_steps_values(monkeypatch):
    """The NPU graph wrapper's protocol: acl_graph.launch captures a paged-attention launch behind
    an ExternalEvent wait and reset; before each replay renew_host_params re-issues it with the
    step's context lengths and records the event. Every replay computes its own step's attention,
    and every wait has a record of its own (capture the wait without the reset and the second
    replay fails: it could pass on the first step's record)."""
    runtime = device.runtime(emulated=True)
    monkeypatch.setattr(acl_graph, "current_platform", SimpleNamespace(runtime=lambda: runtime))
    query, keys, values, table, out = _paged_case()

    def issue(lengths, workspace):
        _paged(query, keys, values, table, lengths, out, workspace)

    def workspace(lengths):
        return kernels.paged_attention_workspace(query, keys, values, 2, 8, 0.125, table,
                                                 lengths, out)

    graph, captured = eg.NPUGraph(), _lengths(5, 9)
    with acl_graph._collect_host_param_launches() as updates, eg.graph(graph):
        acl_graph.launch("layer", captured, issue, workspace)
    stream = eg.Stream()
    for lengths in ((5, 130), (77, 256), (1, 2)):
        acl_graph.renew_host_params(eg, stream, updates, {"layer": _lengths(*lengths)})
        graph.replay()
        replayed = out.clone()
        _paged(query, keys, values, table, _lengths(*lengths), out)
        torch.testing.assert_close(replayed, out)


def test_a_task_update_reissues_exactly_the_captured_launches():
    query, keys, values, table, out = _paged_case()
    graph, lengths = eg.NPUGraph(), _lengths(5, 9)
    with eg.graph(graph):
        eg.graph_task_group_begin()
        _paged(query, keys, values, table, lengths, out)
        handle = eg.graph_task_group_end()
    eg.graph_task_update_begin(eg.Stream(), handle)
    with pytest.raises(eg.GraphReplayError, match="re-issued rms_norm, but the task group captured paged_attention"):
        kernels.rms_norm(query, torch.ones(64, dtype=torch.bfloat16))
    with pytest.raises(eg.GraphReplayError, match="re-issued 0 of its task group's 1"):
        eg.graph_task_update_end()
    with pytest.raises(eg.GraphCaptureError, match="kernel launches only"):
        with eg.graph(eg.NPUGraph()):
            eg.graph_task_group_begin()
            query + 1
            eg.graph_task_group_end()


def test_a_workspace_query_in_a_capture_is_an_allocation_not_a_replayed_launch():
    """``_npu_paged_attention_get_workspace`` sizes and allocates on the host: a replay does not
    run it again (with the capture's host arguments it could refuse the replay's device data)."""
    query, keys, values, table, out = _paged_case()
    graph, lengths = eg.NPUGraph(), _lengths(5, 9)
    with eg.graph(graph):
        workspace = kernels.paged_attention_workspace(query, keys, values, 2, 8, 0.125, table,
                                                      lengths, out)
        _paged(query, keys, values, table, lengths, out, workspace)
    assert [launch[4] for launch in graph._launches] == ["paged_attention"]


def test_the_workspace_a_captured_launch_is_given_meets_the_kernel_contract():
    query, keys, values, table, out = _paged_case()
    lengths = _lengths(5, 9)
    workspace = kernels.paged_attention_workspace(query, keys, values, 2, 8, 0.125, table, lengths, out)
    assert workspace.dtype == torch.uint8 and workspace.dim() == 1
    with pytest.raises(kernels.KernelContractError, match="workspace must be uint8"):
        _paged(query, keys, values, table, lengths, out, workspace=torch.empty(4))
    with pytest.raises(kernels.KernelContractError, match="context_lens must be in"):
        kernels.paged_attention_workspace(query, keys, values, 2, 8, 0.125, table, _lengths(0, 9), out)


def test_graphs_sharing_a_pool_hold_the_largest_graphs_memory():
    """The device overlays the graphs of one pool (they never replay together): the emulated
    HBM books charge the pool its largest graph, not the sum."""
    books = device.runtime(emulated=True)
    before = books.memory_allocated()
    pool = books.graphs().graph_pool_handle()
    sizes = []
    for rows in (64, 8, 32):
        graph = eg.NPUGraph()
        with eg.graph(graph, pool=pool):
            _layer(torch.randn(rows, 16))
        sizes.append(graph.nbytes)
    assert sizes[0] > sizes[2] > sizes[1] > 0
    assert books.memory_allocated() - before == sizes[0] == pool.nbytes


def test_sampled_sizes_keep_the_smallest_and_largest_evenly():
    sizes = [1, 2, 4, *range(8, 257, 8)]
    # 35 sizes, 34 gaps in 5 steps of 6.8: indices 0, 7, 14, 20, 27, 34 (worked out by hand)
    assert sample_sizes(sizes, 6) == [1, 40, 96, 144, 200, 256]
    assert sample_sizes(sizes, 1) == [256]
    assert sample_sizes(sizes, 100) == sizes


@settings(max_examples=60, deadline=None)
@given(count=st.integers(2, 60), data=st.data())
def test_sampled_sizes_are_spread_evenly(count, data):
    """Evenly: ``keep`` sizes whose positions in the list step by the same count, give or take
    one (the steps round (count - 1) / (keep - 1)), from the first to the last."""
    sizes = sorted(data.draw(st.sets(st.integers(1, 1024), min_size=count, max_size=count)))
    keep = data.draw(st.integers(2, count))
    kept = sample_sizes(sizes, keep)
    positions = [sizes.index(size) for size in kept]
    assert len(kept) == keep and positions[0] == 0 and positions[-1] == count - 1
    step = (count - 1) / (keep - 1)
    assert {b - a for a, b in zip(positions, positions[1:])} <= {math.floor(step), math.ceil(step)}


_STREAM_BUDGET = """
import json
import os
from vllm.engine.arg_utils import EngineArgs

def sizes(**kwargs):
    args = EngineArgs(model={model!r}, dtype="bfloat16", max_model_len=1024, max_num_seqs=256,
                      hf_overrides={{"num_hidden_layers": 36}}, **kwargs)
    config = args.create_engine_config()
    return [config.compilation_config.cudagraph_mode.name,
            config.compilation_config.cudagraph_capture_sizes]

compiled = {{"mode": 3, "cudagraph_mode": "PIECEWISE"}}
result = {{
    "candidates": sizes(compilation_config={{"mode": 3, "cudagraph_mode": "PIECEWISE",
                                            "cudagraph_capture_sizes": list(range(1, 513))}}),
    "default": sizes(compilation_config=compiled),
    "tp2": sizes(compilation_config=compiled, tensor_parallel_size=2),
    "full": sizes(),
    "lora": sizes(compilation_config=compiled, enable_lora=True, max_loras=2),
}}
os.environ["HCCL_OP_EXPANSION_MODE"] = "AIV"
result["tp2 aiv"] = sizes(compilation_config=compiled, tensor_parallel_size=2)
print(json.dumps(result))
"""


def test_capture_sizes_respect_the_stream_budget_for_a_36_layer_model(tiny_models):
    """vllm-ascend's budget (utils.update_aclgraph_sizes, releases/v0.20.2rc): 1800 streams; a
    PIECEWISE size takes num_hidden_layers + 1 graphs; in HCCL's default expansion each
    communication group costs 40 streams and a size takes 1 + 2 x groups times its graphs; with
    HCCL_OP_EXPANSION_MODE=AIV a dense model's size takes 1 + groups times, and its all-reduces
    hold that many graphs' streams more. With LoRA (max_loras 2) vLLM captures each size twice,
    without adapters and with max_loras + 1 active. FULL decode graphs are one graph per size, bounded
    instead by the null block's 128 padding slots."""
    env = clean_env(ASCEND_PATCH="emulate", HCCL_OP_EXPANSION_MODE="")
    result = run_json(_STREAM_BUDGET.format(model=str(tiny_models["tiny-llama"])), env=env)
    graphs = 36 + 1
    assert len(result["candidates"][1]) == math.floor(1800 / graphs) == 48
    for name, budget in (("default", math.floor(1800 / graphs)),
                         ("tp2", math.floor((1800 - 40) / graphs / 3)),
                         ("lora", math.floor(1800 / graphs / 2)),
                         ("tp2 aiv", math.floor((1800 - 2 * graphs) / graphs / 2))):
        mode, kept = result[name]
        assert mode == "PIECEWISE" and len(kept) == budget, (name, kept)
        assert kept[0] == 1 and kept[-1] == 512, "the smallest and largest sizes are kept"
    mode, full = result["full"]
    assert mode == "FULL_DECODE_ONLY" and full == [1, 2, 4, *range(8, 129, 8)], full

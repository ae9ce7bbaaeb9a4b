"""The loader against the real vLLM, in fresh interpreters, through the installed ``.pth``.

Nothing here imports ``ascend_patch`` explicitly before vLLM: the overlay must
arrive by itself, exactly as it does for ``vllm serve``.
"""

from __future__ import annotations

import concurrent.futures
import io
import json
import textwrap
import tokenize
from importlib.metadata import entry_points, version
from pathlib import Path

import pytest

from ascend_patch.overlay import matrix
from ascend_patch.overlay.decision import decide
from ascend_patch.overlay.source import SourceTree
from tests.helpers.patch_sets import installed, matrix_up_to_installed
from tests.helpers.process import ascend_patch_lines, clean_env, mirror, run_json, run_python

INSTALLED = installed()

# Imports every target module and reports, per target, whether the live object is
# still vLLM's own (defined in a vLLM file, not wrapped).
STOCK_REPORT = """
import importlib, inspect, json, os, sys
import wrapt
bootstrapped = "ascend_patch" in sys.modules
import vllm
from ascend_patch.overlay import loader
from ascend_patch.overlay import matrix
from ascend_patch.overlay.declarations import applies_to
from packaging.version import Version
release = Version(Version(vllm.__version__).base_version)
patch_set = importlib.import_module(f"ascend_patch.patches.{matrix.load().select(str(release)).patch_set.name}")
targets, values = {}, {}
for p in (p for p in patch_set.PATCHES if applies_to(p, release)):
    owner = importlib.import_module(p.module)
    *path, attr = p.qualname.split(".")
    for name in path:
        owner = getattr(owner, name)
    raw = inspect.getattr_static(owner, attr)  # through the MRO: a replaced class's mixin defines it
    func = raw.fget if isinstance(raw, property) else getattr(raw, "__func__", raw)  # classmethod
    # vLLM wraps some of its own functions (functools.wraps: tracing's @instrument, its
    # @contextmanager); walk those down to the code, but any wrapt wrapper or ascend_patch
    # object is ours.
    ours = False
    while True:
        wrapper = isinstance(func, wrapt.FunctionWrapper)
        ours = ours or wrapper or (getattr(func, "__module__", "") or "").startswith("ascend_patch")
        if wrapper or not hasattr(func, "__wrapped__"):
            break
        func = func.__wrapped__
    if not (wrapper or inspect.isfunction(func) or inspect.isclass(func)):
        values[p.target] = repr(raw)  # a value (a module flag, a dataclass field's default)
        continue
    code = getattr(func, "__code__", None)
    targets[p.target] = {
        "wrapped": ours,
        "file": os.path.realpath(code.co_filename if code else inspect.getsourcefile(func)),
        "qualname": getattr(func, "__qualname__", None),
    }
from vllm.platforms import current_platform
act = loader.current()
print(json.dumps({
    "bootstrapped": bootstrapped,
    "targets": targets,
    "values": values,
    "platform": type(current_platform).__name__,
    "state": act.state if act else None,
    "reason": act.reason if act else None,
    "applied": loader.REGISTRY.applied_targets(),
    "vllm_dir": os.path.realpath(os.path.dirname(vllm.__file__)),
}))
"""


def assert_stock(report: dict, vllm_dir: Path) -> None:
    assert report["platform"] == "UnspecifiedPlatform", "stock vLLM on this CPU-only box"
    assert report["applied"] == []
    for target, live in report["targets"].items():
        assert not live["wrapped"], target
        assert live["file"] and live["file"].startswith(str(vllm_dir)), target
        assert live["qualname"] == target.partition(":")[2], target


def test_emulate_through_the_pth_without_importing_ascend_patch():
    result = run_json(
        """
        import json, sys
        before = sorted(m for m in sys.modules if m.startswith("ascend_patch"))
        from vllm.platforms import current_platform
        import torch
        print(json.dumps({
            "before": before,
            "cls": type(current_platform).__name__,
            "device": str(torch.device(current_platform.device_type)),
            "group_device": str(torch.device(f"{current_platform.device_name}:0")),
            "oot": current_platform.is_out_of_tree(),
            "ray": current_platform.ray_device_key,
            "env_var": current_platform.device_control_env_var,
            "dist": current_platform.dist_backend,
            "kernels": __import__("ascend_patch.npu.kernels").npu.kernels.active_backend(),
        }))
        """,
        env=clean_env(ASCEND_PATCH="emulate"),
    )
    assert result["before"] == ["ascend_patch"], "only the stdlib bootstrap at start: the package's __init__"
    assert result["cls"] == "EmulatedNPUPlatform"
    assert result["device"] == "cpu" and result["group_device"] == "cpu:0"
    assert result["oot"] is True
    assert (result["ray"], result["env_var"], result["dist"]) == ("NPU", "ASCEND_RT_VISIBLE_DEVICES", "gloo")
    assert result["kernels"] == "reference", "the emulated NPU runs the contract-checking kernels"


def test_npu_platform_class_attributes():
    from vllm.platforms.interface import PlatformEnum

    from ascend_patch.npu.platform import NPUPlatform

    assert [NPUPlatform.device_name, NPUPlatform.device_type, NPUPlatform.ray_device_key,
            NPUPlatform.device_control_env_var, NPUPlatform.dist_backend, NPUPlatform._enum] == [
        "npu", "npu", "NPU", "ASCEND_RT_VISIBLE_DEVICES", "hccl", PlatformEnum.OOT]


def test_spawned_children_are_patched_too(tmp_path):
    script = tmp_path / "spawn_child.py"
    script.write_text(textwrap.dedent(
        """
        import json, multiprocessing as mp

        def child(queue):
            from vllm.platforms import current_platform
            queue.put(type(current_platform).__name__)

        if __name__ == "__main__":
            ctx = mp.get_context("spawn")
            queue = ctx.Queue()
            proc = ctx.Process(target=child, args=(queue,))
            proc.start()
            name = queue.get(timeout=120)
            proc.join(60)
            print(json.dumps({"child": name, "exitcode": proc.exitcode}))
        """
    ))
    result = run_json(
        f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')",
        env=clean_env(ASCEND_PATCH="emulate"),
    )
    assert result == {"child": "EmulatedNPUPlatform", "exitcode": 0}


@pytest.mark.parametrize("mode", ["off", "auto"])
def test_off_and_auto_without_npu_leave_vllm_stock(mode, vllm_dir):
    proc = run_python(STOCK_REPORT, env=clean_env(ASCEND_PATCH=mode))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.splitlines()[-1])
    assert_stock(report, vllm_dir)
    assert ascend_patch_lines(proc.stderr) == [], "no NPU is the normal case: nothing to say"
    if mode == "off":
        assert report["bootstrapped"] is False, "ASCEND_PATCH=off stops the .pth before anything"
        assert report["state"] is None
    else:
        assert report["state"] == "inert"
        assert "no NPU" in report["reason"] and "torch_npu is not installed" in report["reason"]


def test_the_stock_report_sees_the_overlay_where_it_is_active():
    """The report the stock checks rely on is not blind: with the overlay active it marks
    exactly the wrapped and replaced targets as ours."""
    report = run_json(STOCK_REPORT, env=clean_env(ASCEND_PATCH="emulate"))
    patches = INSTALLED.patches
    changed = {p.target for p in patches if p.kind in ("wrap", "replace")}
    # a contract on a member of a class the overlay replaced reads the replacement's member
    replaced_classes = {p.target for p in patches if p.kind == "replace"}
    changed |= {p.target for p in patches if p.target.rpartition(".")[0] in replaced_classes}
    replaced_values = changed & set(report["values"])
    assert {t for t, live in report["targets"].items() if live["wrapped"]} == changed - replaced_values
    # A replaced value (a module's Triton flag) is seen as a value other than stock vLLM's.
    stock = run_json(STOCK_REPORT, env=clean_env(ASCEND_PATCH="off"))["values"]
    assert all(report["values"][t] != stock[t] for t in replaced_values), (report["values"], stock)


def test_revert_restores_every_original_by_identity():
    result = run_json(
        """
        import importlib, json
        import vllm
        from ascend_patch.overlay import loader
        # Importing the target modules applies their patches (verified at `import vllm`);
        # resolving the platform also points torch's device APIs at the emulated NPU.
        for p in loader.current().patches:
            importlib.import_module(p.module)
        from vllm.platforms import current_platform
        import os
        entries = loader.REGISTRY.entries()
        changed = sorted(t for t, owner, attr, original in entries if vars(owner).get(attr) is not original)
        forced = {name: os.environ[name] for name in loader.REGISTRY.environment()}
        before = loader.REGISTRY.environment()
        restored = loader.deactivate()
        identical = [t for t, owner, attr, original in entries if vars(owner).get(attr) is original]
        print(json.dumps({
            "applied": sorted(t for t, *_ in entries),
            "changed_while_active": changed,
            "restored": sorted(restored),
            "identical_after_revert": sorted(identical),
            "forced": forced,
            "env_after_revert": {name: os.environ.get(name) for name in before},
            "env_before": before,
        }))
        """,
        env=clean_env(ASCEND_PATCH="emulate"),
    )
    wrapped = {p.target for p in INSTALLED.patches if p.kind != "contract"}
    assert wrapped <= set(result["applied"])
    device_apis = set(result["applied"]) - wrapped
    assert device_apis and all(t.startswith(("torch:", "torch.cuda:", "torch.accelerator:")) for t in device_apis)
    assert result["changed_while_active"] == result["applied"]
    settings = {f"vllm.envs:{name}" for name in result["forced"]}
    assert sorted(result["restored"]) == sorted([*result["applied"], *settings])
    assert result["identical_after_revert"] == result["applied"]
    # The forced vLLM settings are registry entries too, restored like attributes.
    # The V1 runner's releases also force V1 (from 0.34 Model Runner V2 is the only runner).
    v1 = {"VLLM_USE_V2_MODEL_RUNNER": "0"} if INSTALLED.runner == "V1" else {}
    assert result["forced"] == {**v1, "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    assert result["env_after_revert"] == result["env_before"]


def test_second_trigger_applies_nothing_twice():
    result = run_json(
        """
        import json
        from vllm.platforms import current_platform
        import vllm.platforms as platforms
        from vllm.plugins import load_general_plugins
        from ascend_patch.overlay import loader
        first = platforms.resolve_current_platform_cls_qualname
        before = loader.REGISTRY.entries()
        load_general_plugins()
        loader.general_plugin()
        second = platforms.resolve_current_platform_cls_qualname
        print(json.dumps({
            "same": first is second,
            "single_wrap": not hasattr(second.__wrapped__, "__wrapped__"),
            "unchanged": [(t, o) for t, _, _, o in before] == [(t, o) for t, _, _, o in loader.REGISTRY.entries()],
            "applied": loader.REGISTRY.applied_targets(),
            "trigger": loader.current().trigger,
        }))
        """,
        env=clean_env(ASCEND_PATCH="emulate"),
    )
    assert result["same"] and result["single_wrap"]
    assert result["unchanged"] is True
    assert "vllm.platforms:resolve_current_platform_cls_qualname" in result["applied"]
    assert result["trigger"] == "import vllm"


def test_general_plugin_entry_point_is_registered():
    plugins = {f"{e.name}={e.value}" for e in entry_points(group="vllm.general_plugins")}
    assert "ascend_patch=ascend_patch.overlay.loader:general_plugin" in plugins


# --- fault injection -------------------------------------------------------------------------


def _add_parameter(path: Path, lineno: int) -> None:
    """Give the function defined at ``lineno`` one extra, defaulted parameter, so vLLM
    still runs but its signature no longer matches the declaration."""
    source = path.read_text()
    tokens = [
        t for t in tokenize.generate_tokens(io.StringIO(source).readline)
        if t.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT)
    ]
    start = next(i for i, t in enumerate(tokens) if t.start[0] >= lineno and t.string == "def")
    depth, anchor_index = 0, None
    for index in range(start, len(tokens)):
        text = tokens[index].string
        if text == "(":
            depth += 1
        elif text == ")":
            depth -= 1
            if depth == 0:
                anchor_index = anchor_index or index
                break
        elif text == "**" and depth == 1:
            anchor_index = index  # parameters may not follow **kwargs
    anchor, previous = tokens[anchor_index], tokens[anchor_index - 1].string
    if tokens[anchor_index].string == "**":
        insert = "ascend_patch_fault=None, "
    elif previous in ("(", ","):
        insert = "ascend_patch_fault=None"
    else:
        insert = ", ascend_patch_fault=None"
    lines = source.splitlines(keepends=True)
    row, col = anchor.start
    lines[row - 1] = lines[row - 1][:col] + insert + lines[row - 1][col:]
    path.write_text("".join(lines))


INJECTABLE = [p for p in INSTALLED.patches if p.signature is not None]


def _inject(patch, vllm_dir: Path, root: Path) -> str:
    """A copy of vLLM under ``root`` whose target gained a parameter; its new signature."""
    tree = SourceTree(vllm_dir)
    copy = mirror(vllm_dir, root / "vllm", tree.module_path(patch.module))
    _add_parameter(copy, tree.lookup(patch.module, patch.qualname).lineno)
    return SourceTree(root / "vllm").lookup(patch.module, patch.qualname).signature


@pytest.mark.parametrize("patch", INJECTABLE, ids=[p.target for p in INJECTABLE])
def test_fault_injection_fails_verification_naming_the_target(patch, vllm_dir, tmp_path):
    """Every target: a copy of vLLM whose target gained a parameter fails the decision the
    loader makes at ``import vllm`` (decide(), in-process), on that target alone."""
    faulty = _inject(patch, vllm_dir, tmp_path)
    assert faulty not in patch.signature and "ascend_patch_fault=..." in faulty
    decision = decide(version("vllm"), SourceTree(tmp_path / "vllm"), matrix.load())
    assert decision.checked.name == INSTALLED.patch_set and not decision.would_activate
    assert [s.describe() for s in decision.failed] == [
        f"{patch.target}: expected {patch.expected()}, found {faulty}"]


# Loader end to end in fresh interpreters, for a few targets (a module function, a method
# near the middle of the set, the last one): each imports vLLM, about ten seconds.
END_TO_END = [INJECTABLE[0], INJECTABLE[len(INJECTABLE) // 2], INJECTABLE[-1]]

# `import vllm` refused, then what the loader decided and what it left patched.
REFUSAL_REPORT = """
import importlib.util, json, os
try:
    import vllm
    refused = None
except Exception as exc:
    refused = [type(exc).__name__, str(exc)]
from ascend_patch.overlay import loader
act = loader.plan("test")
print(json.dumps({
    "refused": refused,
    "state": act.state,
    "reason": act.reason,
    "applied": loader.REGISTRY.applied_targets(),
    "environment": loader.REGISTRY.environment(),
    "vllm_dir": os.path.realpath(next(iter(importlib.util.find_spec("vllm").submodule_search_locations))),
}))
"""


@pytest.fixture(scope="module")
def injected(vllm_dir, tmp_path_factory):
    """The copies are parsed here, one after another: CPython 3.11's ast module keeps its
    recursion bookkeeping per interpreter, so ast.parse in two threads at once can fail
    with "AST constructor recursion depth mismatch"; the interpreters run two at a time."""
    roots = {p.target: tmp_path_factory.mktemp("fault") for p in END_TO_END}
    faulty = {p.target: _inject(p, vllm_dir, roots[p.target]) for p in END_TO_END}
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futures = {target: pool.submit(run_python, REFUSAL_REPORT,
                                       env=clean_env(ASCEND_PATCH="emulate", PYTHONPATH=str(root)))
                   for target, root in roots.items()}
        return {target: (roots[target], (faulty[target], future.result())) for target, future in futures.items()}


@pytest.mark.parametrize("patch", END_TO_END, ids=[p.target for p in END_TO_END])
def test_fault_injection_refuses_import_patches_nothing_and_names_the_target(patch, injected):
    root, (faulty, proc) = injected[patch.target]
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report["vllm_dir"] == str(root / "vllm"), "the injected copy is what got imported"
    kind, message = report["refused"]
    assert kind == "AscendPatchError"
    assert message.splitlines()[0].startswith(
        f"ascend-patch: cannot activate in emulate mode: vLLM {INSTALLED.vllm} does not match patch set "
        f"{INSTALLED.patch_set}: 1 of ")
    assert report["state"] == "inert"
    assert report["applied"] == [] and report["environment"] == {}, "nothing patched, nothing forced"
    assert f"{patch.target}: expected {patch.expected()}, found {faulty}" in report["reason"]
    assert "1 of" in report["reason"] and "nothing was patched" in report["reason"]


def test_the_refusal_is_three_lines_and_no_traceback(injected):
    """Asked for (ASCEND_PATCH=emulate) and impossible (a target of the set differs):
    `import vllm` fails in three lines (cause, fix, details), and no stock vLLM runs on."""
    root, _ = injected[END_TO_END[0].target]
    proc = run_python("import vllm\nprint('stock vLLM went on')",
                      env=clean_env(ASCEND_PATCH="emulate", PYTHONPATH=str(root)))
    assert proc.returncode == 1 and "stock vLLM went on" not in proc.stdout
    assert "Traceback" not in proc.stderr
    cause, fix, details = ascend_patch_lines(proc.stderr)
    assert cause.startswith(f"ascend-patch: cannot activate in emulate mode: vLLM {INSTALLED.vllm} does not "
                            f"match patch set {INSTALLED.patch_set}: 1 of ") and cause.endswith("targets differ; nothing was patched")
    table = matrix.load()
    assert fix == (f"ascend-patch: fix: install a vLLM release this ascend-patch serves (pip install "
                   f"'vllm{table.served_range()}'), upgrade ascend-patch, or set ASCEND_PATCH=off for stock vLLM")
    assert details == "ascend-patch: details: ascend-patch doctor --targets"
    assert proc.stderr.strip().splitlines()[-3:] == [cause, fix, details], "the last thing on screen"


# --- bad environments ------------------------------------------------------------------------


def _pass_and_pip_still_work(env: dict[str, str]) -> None:
    assert run_python("pass", env=env).returncode == 0
    assert run_python("pass", env=env).stderr == ""
    pip = run_python("import runpy, sys; sys.argv = ['pip', '--version']; runpy.run_module('pip', run_name='__main__')", env=env)
    assert pip.returncode == 0 and "pip" in pip.stdout and pip.stderr == ""


IMPORT_AND_REPORT = """
import json
from vllm.platforms import current_platform
print(json.dumps(type(current_platform).__name__))
"""


def _refused(proc, cause: str) -> list[str]:
    """``import vllm`` failed in the three lines of a refusal, the first naming ``cause``."""
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = ascend_patch_lines(proc.stderr)
    assert len(lines) == 3, proc.stderr[-3000:]
    assert lines[0].startswith("ascend-patch: cannot activate in ") and cause in lines[0], lines[0]
    assert lines[1].startswith("ascend-patch: fix: ") and "ASCEND_PATCH" in lines[1]
    assert lines[2].startswith("ascend-patch: details: ascend-patch ")
    return lines


def test_malformed_matrix_refuses_in_an_asked_for_mode(tmp_path):
    bad = tmp_path / "matrix.yaml"
    bad.write_text("schema: 1\npatch_sets:\n  v0_29: {vllm: '>=0.29', summary: x}\nversions: {}\n")
    env = clean_env(ASCEND_PATCH="emulate", ASCEND_PATCH_MATRIX=str(bad))
    _pass_and_pip_still_work(env)
    lines = _refused(run_python(IMPORT_AND_REPORT, env=env),
                     f"{bad}: patch_sets.v0_29.vllm: '>=0.29' must be exactly '>=LOW,<HIGH'")
    assert "unset ASCEND_PATCH_MATRIX" in lines[1] and lines[2].endswith("ascend-patch doctor")


def test_an_older_vllm_is_refused_with_the_releases_that_work():
    env = clean_env(ASCEND_PATCH="emulate", ASCEND_PATCH_VLLM_VERSION="0.11.0")
    _pass_and_pip_still_work(env)
    lines = _refused(run_python(IMPORT_AND_REPORT, env=env), "vLLM 0.11.0 is older than every patch set")
    assert f"pip install 'vllm{matrix.load().served_range()}'" in lines[1]
    assert lines[2] == "ascend-patch: details: ascend-patch probe 0.11.0"


def test_auto_without_an_npu_stays_silent_and_stock_whatever_the_release():
    proc = run_python(IMPORT_AND_REPORT, env=clean_env(ASCEND_PATCH_VLLM_VERSION="0.11.0"))
    assert proc.returncode == 0 and json.loads(proc.stdout) == "UnspecifiedPlatform"
    assert ascend_patch_lines(proc.stderr) == []


def test_newer_vllm_version_uses_the_newest_set_with_one_warning(tmp_path):
    table, newest = matrix_up_to_installed(tmp_path)
    env = clean_env(ASCEND_PATCH="emulate", ASCEND_PATCH_MATRIX=table,
                    ASCEND_PATCH_VLLM_VERSION=f"{newest.upper}.dev3+gabc")
    proc = run_python(IMPORT_AND_REPORT, env=env)
    assert proc.returncode == 0 and json.loads(proc.stdout) == "EmulatedNPUPlatform"
    lines = ascend_patch_lines(proc.stderr)
    assert len(lines) == 1 and f"newer than every patch set; trying the newest, {newest.name}" in lines[0]


def test_strict_mode_turns_deviations_into_errors(tmp_path):
    table, newest = matrix_up_to_installed(tmp_path)
    env = clean_env(ASCEND_PATCH="emulate", ASCEND_PATCH_VLLM_VERSION=str(newest.upper), ASCEND_PATCH_STRICT="1",
                    ASCEND_PATCH_MATRIX=table)
    _pass_and_pip_still_work(env)
    proc = run_python(IMPORT_AND_REPORT, env=env)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ascend-patch: vLLM {newest.upper} is newer than every patch set")
    assert last.endswith("(ASCEND_PATCH_STRICT=1)")


def test_forced_npu_without_torch_npu_fails_clearly():
    env = clean_env(ASCEND_PATCH="npu")
    _pass_and_pip_still_work(env)
    lines = _refused(run_python(IMPORT_AND_REPORT, env=env),
                     "npu mode: ASCEND_PATCH=npu but no NPU is usable: torch_npu is not installed")
    assert "ASCEND_PATCH=emulate" in lines[1]
    retry = run_python(
        "import sys\ntry:\n import vllm\nexcept Exception:\n pass\nimport vllm.platforms\n"
        "from vllm.platforms import current_platform\n",
        env=env,
    )
    assert retry.returncode != 0, "a retried import must not come back unpatched"


def test_bad_mode_value_is_an_error():
    proc = run_python(IMPORT_AND_REPORT, env=clean_env(ASCEND_PATCH="emulat"))
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "ascend-patch: ASCEND_PATCH='emulat' is not a mode; expected one of auto, npu, emulate, off")


def _fake_vllm_ascend(tmp_path: Path) -> Path:
    dist = tmp_path / "vllm_ascend-0.23.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-ascend\nVersion: 0.23.0\n")
    return tmp_path


def test_vllm_ascend_present_keeps_the_overlay_out_of_its_way(tmp_path):
    env = clean_env(ASCEND_PATCH="auto", PYTHONPATH=str(_fake_vllm_ascend(tmp_path)))
    _pass_and_pip_still_work(env)
    proc = run_python(IMPORT_AND_REPORT, env=env)
    assert proc.returncode == 0 and json.loads(proc.stdout) == "UnspecifiedPlatform"
    lines = ascend_patch_lines(proc.stderr)
    assert len(lines) == 1
    assert "vllm-ascend 0.23.0 is installed" in lines[0] and "ascend-patch stays inert" in lines[0]


def test_forced_mode_takes_over_from_vllm_ascend_with_a_warning(tmp_path):
    env = clean_env(ASCEND_PATCH="emulate", PYTHONPATH=str(_fake_vllm_ascend(tmp_path)))
    proc = run_python(IMPORT_AND_REPORT, env=env)
    assert proc.returncode == 0 and json.loads(proc.stdout) == "EmulatedNPUPlatform"
    lines = ascend_patch_lines(proc.stderr)
    assert len(lines) == 1 and "ascend-patch takes over because ASCEND_PATCH=emulate" in lines[0]


def test_loaded_too_late_refuses(tmp_path):
    """A process whose platform was resolved before the overlay loaded (no .pth) must
    not swap platforms under modules that already hold the stock one; emulate was asked
    for, so that is a refusal, not a silent stock vLLM."""
    result = run_json(
        """
        import json
        import os
        from vllm.platforms import current_platform   # resolved stock: ASCEND_PATCH=off here
        import vllm.platforms
        os.environ["ASCEND_PATCH"] = "emulate"
        from ascend_patch.overlay import loader
        from ascend_patch.overlay.registry import REGISTRY

        def settings():  # what the overlay would force, and the mode the user asked for
            return {k: v for k, v in os.environ.items() if k.startswith(("VLLM_", "ASCEND_PATCH"))}

        before = settings()
        try:
            loader.activate("test")
        except loader.AscendPatchError as exc:
            refusal = str(exc).splitlines()
        print(json.dumps({"refusal": refusal, "before": before, "after": settings(),
                          "changed": REGISTRY.applied_targets(),
                          "platform": type(vllm.platforms._current_platform).__name__}))
        """,
        env=clean_env(ASCEND_PATCH="off"),
    )
    cause, fix, _ = result["refusal"]
    assert "already resolved its platform to UnspecifiedPlatform" in cause
    assert "install ascend-patch with pip" in fix
    # What the refused process itself holds afterwards: nothing forced, nothing changed.
    assert result["after"] == result["before"] and result["before"]["ASCEND_PATCH"] == "emulate"
    assert result["changed"] == [] and result["platform"] == "UnspecifiedPlatform"

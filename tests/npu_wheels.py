"""The real torch-npu wheels, read without installing them (a torch_npu without CANN breaks
``import torch``): a download cache, and each wheel's op schemas and meta kernels loaded into a
private torch library on CPU torch.

    python -m tests.npu_wheels     fill the cache with the wheel of every torch_npu the matrix names

**The cache** lives outside the checkout (``$ASCEND_PATCH_WHEEL_CACHE``, default
``~/.cache/ascend-patch-ci/torch-npu``), so CI runs on one machine download each wheel once. A wheel
is the cp311 manylinux x86_64 one; it is fetched from the index's simple API, checked against the
sha256 the index lists, and re-checked against that sha256 whenever it is reused.

**A loaded wheel** (:func:`load`) defines, in the namespaces ``npu_v<version>`` and ``atb_v<version>``:

- every op of ``torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml`` (its ``custom`` and
  ``symint`` entries: the schemas torch_npu registers under ``torch.ops.npu``);
- the ATB ops' schemas, from ``torch_npu/lib/libop_plugin_atb.so``: the strings its
  ``TORCH_LIBRARY_FRAGMENT(atb)`` passes to ``m.def`` (torch-npu 2.13 and later build the shorter
  ones in code from 16-byte pieces, which :func:`_built_strings` puts back together; each must
  parse as a schema and name its arguments as ``AtbOpsInterface.h`` in the wheel declares them);
- the meta kernels of ``op_plugin/meta/_meta_registrations.py`` and
  ``op_plugin/atb/_atb_meta_registrations.py``, executed unchanged. Their imports are met so:
  ``torch`` is the real torch seen through a view whose ``torch.ops.npu``/``torch.ops.atb`` are the
  private namespaces; ``torch.library`` gives a ``Library`` that registers into those namespaces
  (``aten`` Meta kernels are dropped: they would replace CPU torch's own) and the legacy ``impl``;
  and the three torch_npu modules they import are small stand-ins: ``ErrCode``/``ops_error`` (the
  error-code suffix of messages, left empty), ``get_cann_version`` (which raises: there is no
  CANN to ask), ``get_soc_version`` (the code of :data:`SOC`, an Atlas A2 chip, read from the
  wheel's ``NpuVariables.h``: the meta kernels ask it only whether to warn about Ascend950), and ``torch_npu`` itself, holding the wheel's own dtype
  codes (its ``TORCH_NPU_DTYPE_TO_STRING_MAP``).

**A stand-in torch_npu** (:func:`stand_in`) binds each name as the wheel does: ``_exports.py``
sets every ``torch.ops.npu.<name>`` as ``torch_npu.<name>`` and ``utils/custom_ops.py`` rebinds
them the same way (read from the file; any other binding is refused), and ``op_plugin/atb/
_atb_ops.py`` makes each ``API_LIST`` name ``torch.ops.atb.<name>`` on torch_npu and each
``ATB_API_LIST`` name one on ``torch_npu.atb``. So a call binds through the dispatcher exactly
as the real one does: by the schema's own argument names (``self``, not torchgen's ``input``).
"""

from __future__ import annotations

import ast
import builtins
import functools
import hashlib
import json
import os
import re
import struct
import sys
import tempfile
import time
import types
import urllib.request
import zipfile
from pathlib import Path

import torch
import yaml

CACHE = Path(os.environ.get("ASCEND_PATCH_WHEEL_CACHE")
             or Path.home() / ".cache" / "ascend-patch-ci" / "torch-npu").expanduser()
INDEX = "https://pypi.org/simple"
WHEEL_TAG = "cp311-cp311-manylinux_2_28_x86_64"

_YAML = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"
_META = "torch_npu/op_plugin/meta/_meta_registrations.py"
_ATB_META = "torch_npu/op_plugin/atb/_atb_meta_registrations.py"
_ATB_OPS = "torch_npu/op_plugin/atb/_atb_ops.py"
_ATB_SO = "torch_npu/lib/libop_plugin_atb.so"
_ATB_HEADER = "torch_npu/include/third_party/op-plugin/op_plugin/include/AtbOpsInterface.h"
_CUSTOM_OPS = "torch_npu/utils/custom_ops.py"
_SOC_HEADER = "torch_npu/include/torch_npu/csrc/core/npu/NpuVariables.h"
# The SoC the stand-in reports: Atlas A2, the product npu_fusion_attention's docs list.
SOC = "Ascend910B1"
DOCS = "torch_npu/_op_plugin_docs.py"


class WheelError(RuntimeError):
    """The wheel cannot be had or does not hold what this module reads."""


def matrix_versions() -> list[str]:
    """Every torch_npu release compat_matrix.yaml names, oldest first."""
    from packaging.version import Version

    from ascend_patch.overlay import matrix

    return sorted({entry.torch_npu for entry in matrix.load().versions.values()}, key=Version)


# --- the cache ------------------------------------------------------------------------------------


def _note(message: str) -> None:
    print(f"torch-npu wheels: {message}", file=sys.stderr, flush=True)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@functools.cache
def _index_files() -> dict[str, dict]:
    """The torch-npu files the index lists (PEP 691 JSON), by file name."""
    request = urllib.request.Request(f"{INDEX}/torch-npu/",
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return {f["filename"]: f for f in json.load(response)["files"]}


def fetch(version: str, cache: Path = CACHE) -> Path:
    """The cached wheel of torch_npu ``version``, downloaded first if it is missing or its sha256
    differs from the index's. Raises :class:`WheelError` when it cannot be had."""
    name = f"torch_npu-{version}-{WHEEL_TAG}.whl"
    path = cache / name
    try:
        listed = _index_files().get(name)
    except OSError as exc:
        raise WheelError(f"cannot read the torch-npu index at {INDEX}: {exc}") from None
    if listed is None:
        raise WheelError(f"the index lists no {name}")
    expected = listed["hashes"]["sha256"]
    if path.exists():
        if _sha256(path) == expected:
            return path
        _note(f"{name} in the cache does not match the index's sha256; downloading it again")
    cache.mkdir(parents=True, exist_ok=True)
    size = listed.get("size")
    _note(f"downloading {name} ({size / 1e6:.1f} MB) into {cache}" if size else f"downloading {name}")
    start, received, digest = time.monotonic(), 0, hashlib.sha256()
    with tempfile.NamedTemporaryFile(dir=cache, prefix=".part-", delete=False) as part:
        try:
            with urllib.request.urlopen(listed["url"], timeout=60) as response:
                for chunk in iter(lambda: response.read(1 << 20), b""):
                    part.write(chunk)
                    digest.update(chunk)
                    received += len(chunk)
                    if received % (10 << 20) < len(chunk):
                        _note(f"  {name}: {received / 1e6:.0f} MB")
        except OSError as exc:
            os.unlink(part.name)
            raise WheelError(f"downloading {name} broke off after {received} bytes: {exc}") from None
    if digest.hexdigest() != expected:
        os.unlink(part.name)
        raise WheelError(f"{name}: sha256 {digest.hexdigest()}, the index says {expected}")
    os.replace(part.name, path)
    _note(f"{name}: {received / 1e6:.1f} MB in {time.monotonic() - start:.1f} s, sha256 checked")
    return path


# --- the ATB schemas ------------------------------------------------------------------------------


def _sections(elf: bytes) -> dict[str, tuple[int, int, int]]:
    """ELF64 section name -> (virtual address, file offset, size)."""
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    entsize, count, names_index = struct.unpack_from("<HHH", elf, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", elf, shoff + i * entsize) for i in range(count)]
    names_offset = headers[names_index][4]

    def name(offset):
        return elf[names_offset + offset: elf.index(b"\0", names_offset + offset)].decode()

    return {name(h[0]): (h[3], h[4], h[5]) for h in headers}


# The instructions GCC emits to fill a std::string from 16-byte constants: movdqa xmmN,
# [rip+disp32]; movups [base+disp], xmmN; movabs r64, imm64; mov [base+disp], r64; mov byte,
# word, dword [base+disp], imm. Each store goes to one base register (the new buffer).
_BUILD_STEP = re.compile(rb"""
    (?P<load>\x66\x0f\x6f[\x05\x0d\x15\x1d\x25\x2d\x35\x3d].{4})
  | (?P<movups>\x0f\x11[\x00-\xbf])
  | (?P<movabs>[\x48\x49][\xb8-\xbf].{8})
  | (?P<qword>[\x48\x4c]\x89[\x00-\xbf])
  | (?P<imm>\x66?[\xc6\xc7][\x00-\x07\x40-\x47\x80-\x87])
""", re.DOTALL | re.VERBOSE)


def _displacement(code: bytes, at: int, modrm: int) -> tuple[int, int] | None:
    """(disp, length of the disp bytes) of a [reg+disp] memory operand, None for any other."""
    mod, rm = modrm >> 6, modrm & 7
    if rm == 4 or (mod == 0 and rm == 5):  # SIB or RIP-relative: not a buffer store
        return None
    if mod == 0:
        return 0, 0
    if mod == 1:
        return struct.unpack_from("<b", code, at)[0], 1
    return struct.unpack_from("<i", code, at)[0], 4


def _built_strings(elf: bytes, prefixes: tuple[bytes, ...], window: int = 700) -> list[str]:
    """The strings the code builds from 16-byte constants of ``.rodata.cst16`` whose first
    piece starts with one of ``prefixes``: each store of the run that follows is replayed into
    a buffer until every byte before its NUL is written."""
    sections = _sections(elf)
    text_address, text_offset, text_size = sections[".text"]
    pool_address, pool_offset, pool_size = sections[".rodata.cst16"]
    code = elf[text_offset: text_offset + text_size]
    pool = elf[pool_offset: pool_offset + pool_size]

    def piece(position: int, length: int) -> bytes | None:
        disp, = struct.unpack_from("<i", code, position + 4)
        target = text_address + position + length + disp - pool_address
        return pool[target: target + 16] if 0 <= target <= pool_size - 16 else None

    starts = [m.start() for m in re.finditer(rb"\x66\x0f\x6f[\x05\x0d\x15\x1d\x25\x2d\x35\x3d]", code)
              if (p := piece(m.start(), 8)) and p.startswith(prefixes)]
    found = []
    for start in starts:
        registers, buffer, base = {}, {}, None
        position = start
        for match in _BUILD_STEP.finditer(code, start, start + window):
            if match.start() < position:
                continue
            kind, at = match.lastgroup, match.start()
            position = match.end()
            if kind == "load":
                registers[f"x{(code[at + 3] >> 3) & 7}"] = piece(at, 8)
                continue
            if kind == "movabs":
                register = f"r{(code[at + 1] - 0xb8) + (8 if code[at] == 0x49 else 0)}"
                registers[register] = code[at + 2: at + 10]
                continue
            prefix = 1 if code[at] == 0x66 else 0
            modrm = code[match.end() - 1]
            operand = _displacement(code, match.end(), modrm)
            if operand is None:
                continue
            disp, disp_length = operand
            position = match.end() + disp_length
            if base is None:
                base = modrm & 7
            if modrm & 7 != base:
                continue
            if kind == "movups":
                value = registers.get(f"x{(modrm >> 3) & 7}")
            elif kind == "qword":
                value = registers.get(f"r{((modrm >> 3) & 7) + (8 if code[at] == 0x4c else 0)}")
            else:  # mov imm8/16/32 to memory
                width = 1 if code[at + prefix] == 0xc6 else (2 if prefix else 4)
                value = code[position: position + width]
                position += width
            if value is not None:
                buffer.update(zip(range(disp, disp + len(value)), value))
                text = _complete(buffer)
                if text is not None:
                    found.append(text)
                    break
    return found


def _complete(buffer: dict[int, int]) -> str | None:
    """The NUL-terminated string the buffer holds once every byte before its NUL is written."""
    length = 0
    while length in buffer and buffer[length] != 0:
        length += 1
    return bytes(buffer[i] for i in range(length)).decode("ascii", "replace") \
        if buffer.get(length) == 0 else None


_SCHEMA_TEXT = re.compile(rb"[A-Za-z_][\w.]*\(.*\) -> .+")


def atb_schemas(so: bytes, header: str) -> dict[str, str]:
    """Every ATB op schema (``name.overload`` -> text) the library defines: the whole strings in
    its read-only data, then the ones built in code. A built one counts only if it parses and
    its arguments are the ones ``AtbOpsInterface.h`` declares for that function, in order."""
    schemas = {}
    for piece in so.split(b"\0"):
        if b") -> " in piece and _SCHEMA_TEXT.fullmatch(piece):
            text = piece.decode()
            try:
                torch._C.parse_schema(text)
            except RuntimeError:  # joined 16-byte pieces of built strings, not one schema
                continue
            schemas.setdefault(text.partition("(")[0], text)
    declared = {name: re.findall(r"(\w+)\s*(?:,|$)", params.replace("\n", " "))
                for name, params in re.findall(r"\b(\w+)\(([^;{]*?)\);", header)}
    for text in _built_strings(so, (b"_npu_", b"npu_")):
        try:
            schema = torch._C.parse_schema(text)
        except RuntimeError:
            continue
        name = schema.name + (f".{schema.overload_name}" if schema.overload_name else "")
        arguments = [argument.name for argument in schema.arguments]
        cxx_name = re.sub(r"\W", "_", name.removesuffix(".default"))
        if declared.get(cxx_name) == arguments:
            schemas.setdefault(name, text)
    return schemas


# --- a wheel's library ----------------------------------------------------------------------------


class _TorchView(types.ModuleType):
    """torch, with ``torch.ops.npu``/``torch.ops.atb`` the wheel's private namespaces."""

    def __init__(self, namespaces: dict[str, str]):
        super().__init__("torch")
        self.ops = types.SimpleNamespace(**{name: getattr(torch.ops, private)
                                            for name, private in namespaces.items()})

    def __getattr__(self, name):
        return getattr(torch, name)


class NpuRuntimeUnavailable(RuntimeError):
    """A meta kernel asked for the CANN version or SoC, which only the NPU runtime knows."""


def _unavailable(name: str):
    def query(*args, **kwargs):
        raise NpuRuntimeUnavailable(f"{name}() needs the NPU runtime")

    return query


class _Dropped:
    """The ``aten`` Meta kernels a meta file registers: not registered."""

    def __init__(self, *args, **kwargs):
        pass

    def impl(self, *args, **kwargs):
        pass


class TorchNpuWheel:
    """One torch-npu wheel's schemas and meta kernels, defined into private namespaces."""

    def __init__(self, version: str, path: Path):
        self.version, self.path = version, path
        suffix = re.sub(r"\W", "_", version)
        self.namespaces = {"npu": f"npu_v{suffix}", "atb": f"atb_v{suffix}"}
        with zipfile.ZipFile(path) as wheel:
            self._files = {name: wheel.read(name) for name in (
                _YAML, _META, _ATB_META, _ATB_OPS, _ATB_SO, _ATB_HEADER, _CUSTOM_OPS, DOCS,
                _SOC_HEADER)}
        self.undefinable = {}  # schema name -> why CPU torch's parser refused it
        self.meta_skipped = []  # meta kernels of ops the wheel defines nowhere
        self._libraries = []
        self.schemas = self._define("npu", self._yaml_schemas())
        self.atb_schemas = self._define("atb", atb_schemas(self._files[_ATB_SO],
                                                           self.text(_ATB_HEADER)))
        self.meta = self._run_meta(_META) | self._run_meta(_ATB_META)

    def text(self, member: str) -> str:
        return self._files[member].decode()

    def _yaml_schemas(self) -> dict[str, str]:
        data = yaml.load(self._files[_YAML], Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        return {entry["func"].partition("(")[0]: entry["func"]
                for section in ("custom", "symint") for entry in data.get(section) or []
                if isinstance(entry, dict) and "func" in entry}

    def _define(self, namespace: str, schemas: dict[str, str]) -> dict[str, str]:
        library = torch.library.Library(self.namespaces[namespace], "DEF")
        self._libraries.append(library)  # a library's definitions live as long as it does
        defined = {}
        for name, schema in schemas.items():
            try:
                library.define(schema)
            except RuntimeError as exc:
                self.undefinable[name] = str(exc).strip().splitlines()[0]
                continue
            defined[name] = schema
        return defined

    def _run_meta(self, member: str) -> set[str]:
        """Execute a meta file; returns the ops it registered a Meta kernel for."""
        wheel, registered = self, set()

        class Library(torch.library.Library):
            def __init__(self, namespace, kind, dispatch_key=""):
                super().__init__(wheel.namespaces[namespace], kind, dispatch_key)
                wheel._libraries.append(self)

            def impl(self, name, fn, dispatch_key="", **kwargs):
                defined = wheel.schemas if self.ns == wheel.namespaces["npu"] else wheel.atb_schemas
                if name not in defined and f"{name}.default" not in defined:
                    wheel.meta_skipped.append(name)
                    return None
                registered.add(name)
                return super().impl(name, fn, dispatch_key, **kwargs)

        def library(namespace, kind, dispatch_key=""):
            return _Dropped() if namespace == "aten" else Library(namespace, kind, dispatch_key)

        def impl(lib, name, dispatch_key=""):  # the legacy torch.library.impl the files use
            def register(fn):
                lib.impl(name, fn, dispatch_key)
                return fn
            return register

        torch_npu = types.ModuleType("torch_npu")
        view = _TorchView(self.namespaces)
        error_codes = types.SimpleNamespace(
            ErrCode=types.SimpleNamespace(**{code: code for code in (
                "SUCCESS", "PARAM", "TYPE", "VALUE", "PTR", "INTERNAL", "MEMORY", "NOT_SUPPORT",
                "NOT_FOUND", "UNAVAIL", "SYSCALL", "TIMEOUT", "PERMISSION", "ACL", "HCCL", "GE",
                "EXCEPT")}),
            ops_error=lambda code: "")
        stand_ins = {
            "torch": view,
            "torch.library": types.SimpleNamespace(Library=library, impl=impl),
            "torch_npu": torch_npu,
            "torch_npu.utils._error_code": error_codes,
            "torch_npu.npu.utils":
                types.SimpleNamespace(get_cann_version=_unavailable("get_cann_version")),
            "torch_npu.npu._backends":
                types.SimpleNamespace(get_soc_version=lambda: wheel.soc_version(SOC)),
        }

        def imports(name, globals=None, locals=None, fromlist=(), level=0):
            if name in stand_ins and (fromlist or "." not in name):
                return stand_ins[name]
            if name == "torch" or name.startswith("torch_npu"):
                raise ImportError(f"{member} imports {name}, which has no stand-in here")
            return builtins.__import__(name, globals, locals, fromlist, level)

        namespace = {"__builtins__": {**vars(builtins), "__import__": imports},
                     "__name__": member.removesuffix(".py").replace("/", ".")}
        exec(compile(self._files[member], f"torch_npu-{self.version}/{member}", "exec"), namespace)
        for code, name in namespace.get("TORCH_NPU_DTYPE_TO_STRING_MAP", {}).items():
            setattr(torch_npu, name.removeprefix("torch_npu."), code)
        return registered

    def soc_version(self, name: str) -> int:
        """``c10_npu::SocVersion::<name>`` as the wheel's NpuVariables.h numbers it."""
        code = None
        for member in re.findall(r"(\w+)(?:\s*=\s*(-?\d+))?\s*,", self.text(_SOC_HEADER)
                                 .partition("enum class SocVersion {")[2].partition("};")[0]):
            code = int(member[1]) if member[1] else code + 1
            if member[0] == name:
                return code
        raise WheelError(f"torch_npu {self.version}'s {_SOC_HEADER} has no SocVersion::{name}")

    def op(self, name: str):
        """``torch.ops.npu.<name>`` of this wheel (an OpOverloadPacket)."""
        return getattr(getattr(torch.ops, self.namespaces["npu"]), name)

    def schema(self, name: str) -> torch._C.FunctionSchema:
        return self.op(name).default._schema


@functools.cache
def load(version: str) -> TorchNpuWheel:
    """The wheel of torch_npu ``version``, fetched into the cache if need be, loaded once per
    process."""
    return TorchNpuWheel(version, fetch(version))


# --- the stand-in torch_npu -----------------------------------------------------------------------


def _string_list(source: str, name: str) -> list[str]:
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return [ast.literal_eval(element) for element in node.value.elts]
    raise WheelError(f"{_ATB_OPS} defines no {name}")


def _rebindings(source: str) -> dict[str, str]:
    """``torch_npu.<name> = <expression>`` of custom_ops.py, as text."""
    bindings = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Attribute) and getattr(target.value, "id", None) == "torch_npu":
                bindings[target.attr] = ast.unparse(node.value)
    return bindings


def stand_in(wheel: TorchNpuWheel) -> types.ModuleType:
    """A torch_npu module whose ops are bound as the wheel binds them (see the module doc)."""
    npu_ops = getattr(torch.ops, wheel.namespaces["npu"])
    atb_ops = getattr(torch.ops, wheel.namespaces["atb"])
    for name, expression in _rebindings(wheel.text(_CUSTOM_OPS)).items():
        if expression != f"torch.ops.npu.{name}":
            raise WheelError(f"torch_npu {wheel.version} binds torch_npu.{name} = {expression}, "
                             "which this stand-in does not model")
    atb_source = wheel.text(_ATB_OPS)
    module = types.ModuleType("torch_npu")
    module.__version__ = wheel.version
    for name in {schema.partition(".")[0] for schema in wheel.schemas}:
        setattr(module, name, getattr(npu_ops, name))
    defined_atb = {schema.partition(".")[0] for schema in wheel.atb_schemas}
    for name in _string_list(atb_source, "API_LIST"):
        if name in defined_atb:
            setattr(module, name, getattr(atb_ops, name))
    module.atb = types.ModuleType("torch_npu.atb")
    for name in _string_list(atb_source, "ATB_API_LIST"):
        if name in defined_atb:
            setattr(module.atb, name, getattr(atb_ops, name))
    return module


def main() -> int:
    try:
        for version in matrix_versions():
            path = fetch(version)
            _note(f"torch_npu {version}: {path} ({path.stat().st_size / 1e6:.1f} MB)")
    except WheelError as exc:
        _note(f"error: {exc}")
        return 1
    total = sum(p.stat().st_size for p in CACHE.glob("*.whl"))
    _note(f"cache {CACHE}: {total / 1e6:.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())

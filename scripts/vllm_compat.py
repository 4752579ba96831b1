"""Check kvloop's use of vLLM against the source of each supported vLLM release (`make vllm-compat`).

For every release in ``kvloop.common.vllm_compat.SUPPORTED_VLLM`` the official wheel is fetched from the
package registry (``pip download vllm==X --no-deps``, cached under ``.cache/vllm-wheels/X``) and read
as source: nothing is installed or imported. Against each release's source this checks:

* every ``from vllm... import NAME`` in kvloop's code (also inside functions and TYPE_CHECKING blocks)
  names a module that exists and defines NAME;
* every kvloop class that subclasses a vLLM class: each method it overrides still exists in the vLLM
  class (or its vLLM bases) and kvloop's override accepts vLLM's parameters (same positional names
  in order, vLLM's keyword-only ones, kvloop's additions defaulted); every ``self.X`` / ``super().X``
  it uses that kvloop does not define is defined by the vLLM classes;
* every vLLM function kvloop imports keeps a signature compatible with the first supported release's
  (its parameters, in order, with the same kinds; new ones defaulted); so do the constructors kvloop
  calls up to;
* the vLLM attributes kvloop patches or reads on objects it does not subclass (``PATCHED`` below).

A difference between releases that kvloop handles by version (an adapter) is declared in
``VERSION_SPECIFIC``: the symbol is required in the releases named there only.

``--source RELEASE=DIR`` checks an unpacked vLLM tree (the folder holding ``vllm/``) instead of that
release's wheel (the tests point it at a doctored copy). Exit 0: every release passes; 1: a problem
(each printed on one line); 2: a wheel could not be fetched.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# kvloop's folders, as the package-dir mapping in pyproject.toml imports them.
KVLOOP_DIRS = {"agents": "kvloop.agents", "clients": "kvloop.clients", "common": "kvloop.common"}

# vLLM attributes kvloop reads or replaces on classes or objects it does not subclass.
PATCHED: tuple[str, ...] = (
    # agents/connector/idle.py wraps the engine loop and the scheduler's has_requests
    "vllm.v1.engine.core:EngineCoreProc.run_busy_loop",
    "vllm.v1.engine.core:EngineCoreProc.process_input_queue_block",
    "vllm.v1.engine.core:EngineCore.scheduler",
    "vllm.v1.engine.core:EngineCoreProc.input_queue",
    "vllm.v1.core.sched.scheduler:Scheduler.has_requests",
    "vllm.v1.core.sched.scheduler:Scheduler.has_unfinished_requests",
    "vllm.v1.core.sched.scheduler:Scheduler.finished_req_ids",
    "vllm.v1.core.sched.scheduler:Scheduler.requests",
    "vllm.v1.core.sched.scheduler:Scheduler.get_kv_connector",
    "vllm.v1.engine:EngineCoreRequestType.WAKEUP",
    # agents/vllm_main.py runs vLLM's CLI
    "vllm.entrypoints.cli.main:main",
    # agents/connector/host/pool.py: the pool's handshake is this engine's, its own fields replaced
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata:NixlHandshakePayload.compatibility_hash",
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata:NixlHandshakePayload.agent_metadata_bytes",
    *(
        f"vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata:NixlAgentMetadata.{name}"
        for name in (
            "engine_id",
            "agent_metadata",
            "kv_caches_base_addr",
            "device_id",
            "num_blocks",
            "block_lens",
            "block_strides",
            "region_num_blocks",
            "region_mem_types",
        )
    ),
)

# Symbols present in some supported releases only; kvloop picks its adapter by the installed version.
# "module:Class.attr" -> the releases that have it.
VERSION_SPECIFIC: dict[str, tuple[str, ...]] = {
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata:RemoteMeta.registration_generation": (
        "0.33.0",
    ),
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler:NixlBaseConnectorScheduler"
    "._registration_generation": ("0.33.0",),
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker:NixlPullConnectorWorker"
    "._remote_registration_generations": ("0.33.0",),
    # the host retention pool's descriptors, in each release's form (agents/connector/compat.py)
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker:NixlBaseConnectorWorker._stack_descs": (
        "0.32.0",
    ),
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker:NixlBaseConnectorWorker"
    "._pack_strided_descs": ("0.33.0",),
    # sleep mode: the connector's worker ends its host-pool copies before vLLM deregisters the KV cache
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker:NixlBaseConnectorWorker"
    ".unregister_kv_caches": ("0.33.0",),
}


# vLLM methods kvloop re-implements instead of calling (its copy follows their body): each release's
# body must be the first release's, statement for statement, or kvloop's copy needs porting.
MIRRORED: tuple[str, ...] = (
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker:NixlPullConnectorWorker._get_new_notifs",
)

# kv_transfer_params keys kvloop writes for vLLM to read: the module that reads each, per release.
PARAM_KEYS: dict[str, tuple[str, tuple[str, ...]]] = {
    "remote_registration_generation": (
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata",
        ("0.33.0",),
    ),
}


# --------------------------------------------------------------------------- vLLM source


class Source:
    """A vLLM release's Python source: a wheel (read in place) or an unpacked tree."""

    def __init__(self, release: str, path: Path) -> None:
        self.release = release
        self.path = path
        self._zip = zipfile.ZipFile(path) if path.is_file() else None
        self._names = set(self._zip.namelist()) if self._zip else None
        self._trees: dict[str, ast.Module | None] = {}

    def _file(self, module: str) -> str | None:
        base = module.replace(".", "/")
        for rel in (f"{base}.py", f"{base}/__init__.py"):
            if self._names is not None:
                if rel in self._names:
                    return rel
            elif (self.path / rel).is_file():
                return rel
        return None

    def is_package(self, module: str) -> bool:
        rel = self._file(module)
        return rel is not None and rel.endswith("__init__.py")

    def tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            rel = self._file(module)
            if rel is None:
                self._trees[module] = None
            else:
                text = self._zip.read(rel).decode() if self._zip else (self.path / rel).read_text()
                self._trees[module] = ast.parse(text, filename=rel)
        return self._trees[module]


@dataclass
class ClassInfo:
    module: str
    name: str
    node: ast.ClassDef
    methods: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = field(default_factory=dict)
    attrs: set[str] = field(default_factory=set)  # class-level names and self.X assignments
    bases: list[ClassInfo] = field(default_factory=list)

    def lookup_method(self, name: str) -> tuple[ClassInfo, ast.FunctionDef | ast.AsyncFunctionDef] | None:
        for cls in self.mro():
            if name in cls.methods:
                return cls, cls.methods[name]
        return None

    def defines(self, name: str) -> bool:
        return any(name in c.methods or name in c.attrs for c in self.mro())

    def mro(self) -> list[ClassInfo]:
        out: list[ClassInfo] = []
        stack = [self]
        while stack:
            c = stack.pop(0)
            if all(c is not o for o in out):
                out.append(c)
                stack.extend(c.bases)
        return out


def _self_targets(fn: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(fn):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets = [node.target]
        for t in targets:
            for sub in ast.walk(t):
                if (
                    isinstance(sub, ast.Attribute)
                    and isinstance(sub.value, ast.Name)
                    and sub.value.id == "self"
                ):
                    names.add(sub.attr)
    return names


def class_info(module: str, node: ast.ClassDef) -> ClassInfo:
    info = ClassInfo(module, node.name, node)
    for item in node.body:
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
            info.methods[item.name] = item
            info.attrs |= _self_targets(item)
        elif isinstance(item, ast.Assign):
            info.attrs |= {t.id for t in item.targets if isinstance(t, ast.Name)}
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            info.attrs.add(item.target.id)
    return info


class Resolver:
    """Finds names in a vLLM release's modules, following re-exports and base classes."""

    def __init__(self, source: Source) -> None:
        self.source = source
        self._classes: dict[tuple[str, str], ClassInfo | None] = {}

    def find(self, module: str, name: str, depth: int = 0) -> tuple[str, ast.AST] | None:
        """The (module, definition node) ``name`` is bound to in ``module``, or None."""
        if depth > 8:
            return None
        tree = self.source.tree(module)
        if tree is None:
            return None
        for node in _top_level(tree):
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
                return module, node
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == name for t in node.targets
            ):
                return module, node
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and node.target.id == name
            ):
                return module, node
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        target = _absolute(module, node, self.source.is_package(module))
                        found = self.find(target, alias.name, depth + 1)
                        if found is not None:
                            return found
                        if self.source.tree(f"{target}.{alias.name}") is not None:
                            return f"{target}.{alias.name}", ast.Module(body=[], type_ignores=[])
                        return None
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname == name:
                        return alias.name, ast.Module(body=[], type_ignores=[])
        if self.source.tree(f"{module}.{name}") is not None:  # a submodule
            return f"{module}.{name}", ast.Module(body=[], type_ignores=[])
        return None

    def cls(self, module: str, name: str) -> ClassInfo | None:
        key = (module, name)
        if key not in self._classes:
            self._classes[key] = None
            found = self.find(module, name)
            if found is not None and isinstance(found[1], ast.ClassDef):
                mod, node = found
                info = class_info(mod, node)
                self._classes[key] = info
                for base in node.bases:
                    base_name = _dotted(base)
                    if base_name is None:
                        continue
                    head, _, rest = base_name.partition(".")
                    if rest:  # module.Class
                        resolved = self.find(mod, head)
                        base_info = self.cls(resolved[0], rest) if resolved else None
                    else:
                        resolved = self.find(mod, head)
                        base_info = (
                            self.cls(resolved[0], head)
                            if resolved and isinstance(resolved[1], ast.ClassDef)
                            else None
                        )
                    if base_info is not None:
                        info.bases.append(base_info)
        return self._classes[key]


def _top_level(tree: ast.Module) -> list[ast.stmt]:
    """Module-level statements, including those inside top-level if/try blocks."""
    out: list[ast.stmt] = []
    stack = list(tree.body)
    while stack:
        node = stack.pop(0)
        out.append(node)
        if isinstance(node, ast.If | ast.Try):
            stack.extend(node.body)
            stack.extend(node.orelse)
            if isinstance(node, ast.Try):
                for h in node.handlers:
                    stack.extend(h.body)
                stack.extend(node.finalbody)
    return out


def _absolute(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    keep = len(parts) - node.level + (1 if is_package else 0)
    base = ".".join(parts[:keep])
    return f"{base}.{node.module}" if node.module else base


def _dotted(expr: ast.expr) -> str | None:
    if isinstance(expr, ast.Name):
        return expr.id
    if isinstance(expr, ast.Attribute):
        head = _dotted(expr.value)
        return f"{head}.{expr.attr}" if head else None
    if isinstance(expr, ast.Subscript):  # Generic[T] and the like
        return _dotted(expr.value)
    return None


# --------------------------------------------------------------------------- signatures


@dataclass(frozen=True)
class Param:
    name: str
    kind: str  # "pos" (positional or keyword), "posonly", "kwonly", "var", "varkw"
    default: bool


def signature(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[Param]:
    a = fn.args
    positional = [*a.posonlyargs, *a.args]
    defaults = [False] * (len(positional) - len(a.defaults)) + [True] * len(a.defaults)
    out = [
        Param(p.arg, "posonly" if i < len(a.posonlyargs) else "pos", d)
        for i, (p, d) in enumerate(zip(positional, defaults, strict=True))
    ]
    if a.vararg:
        out.append(Param(a.vararg.arg, "var", True))
    out += [Param(p.arg, "kwonly", d is not None) for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True)]
    if a.kwarg:
        out.append(Param(a.kwarg.arg, "varkw", True))
    decorators = {_dotted(d) for d in fn.decorator_list}
    if "staticmethod" not in decorators and out and out[0].name in ("self", "cls"):
        out = out[1:]
    return out


def _fmt(params: list[Param]) -> str:
    return (
        "("
        + ", ".join(p.name + ("=..." if p.default and p.kind in ("pos", "kwonly") else "") for p in params)
        + ")"
    )


def accepts(caller: list[Param], callee: list[Param]) -> str | None:
    """Why a function with signature ``callee`` cannot be called as ``caller`` is (None: it can).

    ``caller``: what the other side passes/declares (vLLM's method when kvloop overrides it; the first
    release's signature when kvloop calls a vLLM function)."""
    has_var = any(p.kind == "var" for p in callee)
    has_varkw = any(p.kind == "varkw" for p in callee)
    callee_pos = [p for p in callee if p.kind in ("pos", "posonly")]
    caller_pos = [p for p in caller if p.kind in ("pos", "posonly")]
    for i, p in enumerate(caller_pos):
        if i < len(callee_pos):
            if callee_pos[i].name != p.name and p.kind != "posonly":
                return f"parameter {i + 1} is {callee_pos[i].name!r}, not {p.name!r}"
        elif not has_var:
            return f"no parameter {p.name!r}"
    for q in callee_pos[len(caller_pos) :]:
        if not q.default:
            return f"new required parameter {q.name!r}"
    caller_kw = {p.name for p in caller if p.kind == "kwonly"}
    callee_names = {p.name for p in callee if p.kind in ("pos", "kwonly")}
    for name in caller_kw - callee_names:
        if not has_varkw:
            return f"no keyword parameter {name!r}"
    for q in callee:
        if q.kind == "kwonly" and not q.default and q.name not in caller_kw:
            return f"new required keyword parameter {q.name!r}"
    if any(p.kind == "var" for p in caller) and not has_var:
        return "no *args"
    if any(p.kind == "varkw" for p in caller) and not has_varkw:
        return "no **kwargs"
    return None


# --------------------------------------------------------------------------- kvloop's use of vLLM


@dataclass
class Use:
    where: str  # file:line in kvloop
    module: str
    name: str


@dataclass
class Subclass:
    where: str
    info: ClassInfo  # kvloop's class (bases not resolved)
    vllm_bases: list[tuple[str, str]]  # (module, name) of its vLLM bases
    kvloop_bases: list[str]  # names of its kvloop bases (same package)
    self_uses: dict[str, str]  # attribute -> where (self.X and super().X in its methods)
    super_inits: list[str]  # where it calls a vLLM base's __init__
    super_uses: dict[str, str] = field(default_factory=dict)  # super().X -> where


@dataclass
class KvloopUse:
    imports: list[Use] = field(default_factory=list)
    subclasses: dict[str, Subclass] = field(default_factory=dict)  # "module.Class" -> ...


def kvloop_module(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([KVLOOP_DIRS[parts[0]], *parts[1:]])


def scan_kvloop(dirs: list[Path]) -> KvloopUse:
    use = KvloopUse()
    typed_uses: list[tuple[Path, ast.Module]] = []
    by_attr: dict[Path, dict[str, Subclass]] = {}
    for folder in dirs:
        for path in sorted(folder.rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            rel = path.relative_to(ROOT)
            module = kvloop_module(path)
            imported: dict[str, tuple[str, str]] = {}  # local name -> (vllm module, name)
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.ImportFrom)
                    and (node.module or "").split(".")[0] == "vllm"
                    and not node.level
                ):
                    for alias in node.names:
                        use.imports.append(Use(f"{rel}:{node.lineno}", node.module or "", alias.name))
                        imported[alias.asname or alias.name] = (node.module or "", alias.name)
            for node in tree.body:
                if not isinstance(node, ast.ClassDef):
                    continue
                vllm_bases = [
                    imported[b.id] for b in node.bases if isinstance(b, ast.Name) and b.id in imported
                ]
                kvloop_bases = [b.id for b in node.bases if isinstance(b, ast.Name) and b.id not in imported]
                if not vllm_bases and not kvloop_bases:
                    continue
                info = class_info(module, node)
                self_uses: dict[str, str] = {}
                super_uses: dict[str, str] = {}
                super_inits: list[str] = []
                for fn in info.methods.values():
                    for sub in ast.walk(fn):
                        if isinstance(sub, ast.Attribute):
                            if isinstance(sub.value, ast.Name) and sub.value.id == "self":
                                self_uses.setdefault(sub.attr, f"{rel}:{sub.lineno}")
                            elif (
                                isinstance(sub.value, ast.Call)
                                and isinstance(sub.value.func, ast.Name)
                                and sub.value.func.id == "super"
                            ):
                                self_uses.setdefault(sub.attr, f"{rel}:{sub.lineno}")
                                super_uses.setdefault(sub.attr, f"{rel}:{sub.lineno}")
                                if sub.attr == "__init__":
                                    super_inits.append(f"{rel}:{sub.lineno}")
                            elif (
                                sub.attr == "__init__"
                                and isinstance(sub.value, ast.Name)
                                and sub.value.id in imported
                            ):
                                super_inits.append(f"{rel}:{sub.lineno}")
                use.subclasses[f"{module}.{node.name}"] = Subclass(
                    f"{rel}:{node.lineno}", info, vllm_bases, kvloop_bases, self_uses, super_inits, super_uses
                )
            typed_uses.append((rel, tree))
    # Other code that holds one of those classes' objects (a parameter annotated with the class, an
    # attribute set from one, or a local name bound to either): what it reads there counts as the
    # class's use.
    by_name = {qual.rsplit(".", 1)[1]: sub for qual, sub in use.subclasses.items()}
    for rel, tree in typed_uses:
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            holders: dict[str, Subclass] = {}
            for arg in [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]:
                typed = _annotation_name(arg.annotation)
                if typed in by_name:
                    holders[arg.arg] = by_name[typed]
            attrs = by_attr.get(rel, {})
            # Local aliases (``w = self.worker``, ``loosely_typed: Any = worker``), chains included.
            bindings = [
                (stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target], stmt.value)
                for stmt in ast.walk(fn)
                if isinstance(stmt, ast.Assign | ast.AnnAssign) and stmt.value is not None
            ]
            grown = True
            while grown:
                grown = False
                for targets, value in bindings:
                    holder = _held(value, holders, attrs)
                    for target in targets:
                        if holder is not None and isinstance(target, ast.Name) and target.id not in holders:
                            holders[target.id] = holder
                            grown = True
            for sub in ast.walk(fn):
                if not isinstance(sub, ast.Attribute):
                    continue
                holder = _held(sub.value, holders, attrs)
                if holder is not None:
                    holder.self_uses.setdefault(sub.attr, f"{rel}:{sub.lineno}")
            if fn.name == "__init__":
                for stmt in ast.walk(fn):
                    if (
                        isinstance(stmt, ast.Assign)
                        and isinstance(stmt.value, ast.Name)
                        and stmt.value.id in holders
                    ):
                        for t in stmt.targets:
                            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name):
                                by_attr.setdefault(rel, {})[t.attr] = holders[stmt.value.id]
    return use


def _held(expr: ast.expr, holders: dict[str, Subclass], attrs: dict[str, Subclass]) -> Subclass | None:
    """The kvloop subclass whose object ``expr`` is: a name bound to one, or ``self.X`` set from one."""
    if isinstance(expr, ast.Name):
        return holders.get(expr.id)
    if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name) and expr.value.id == "self":
        return attrs.get(expr.attr)
    return None


def _annotation_name(annotation: ast.expr | None) -> str | None:
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        return annotation.value.strip("'\"").split("[")[0].split(".")[-1]
    dotted = _dotted(annotation) if annotation is not None else None
    return dotted.split(".")[-1] if dotted else None


# --------------------------------------------------------------------------- the check


def _required_in(symbol: str, release: str) -> bool:
    releases = VERSION_SPECIFIC.get(symbol)
    return releases is None or release in releases


def check_release(source: Source, use: KvloopUse, reference: Resolver | None) -> tuple[list[str], int]:
    """Problems with ``source`` (one line each) and how many symbols were checked."""
    r = Resolver(source)
    problems: list[str] = []
    checked = 0
    rel = source.release

    for imp in use.imports:
        checked += 1
        found = r.find(imp.module, imp.name)
        if found is None:
            if source.tree(imp.module) is None and source.tree(f"{imp.module}.{imp.name}") is None:
                problems.append(f"{imp.where}: module {imp.module} does not exist in vLLM {rel}")
            else:
                problems.append(f"{imp.where}: {imp.module} has no {imp.name} in vLLM {rel}")
            continue
        if reference is None or not isinstance(found[1], ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        ref = reference.find(imp.module, imp.name)
        if ref is not None and isinstance(ref[1], ast.FunctionDef | ast.AsyncFunctionDef):
            why = accepts(signature(ref[1]), signature(found[1]))
            if why:
                problems.append(
                    f"{imp.where}: {imp.module}.{imp.name}{_fmt(signature(found[1]))} in vLLM {rel}: {why}"
                )

    def vllm_classes(sub: Subclass) -> list[ClassInfo]:
        out = []
        for module, name in sub.vllm_bases:
            info = r.cls(module, name)
            if info is not None:
                out.append(info)
        for base in sub.kvloop_bases:
            parent = use.subclasses.get(f"{sub.info.module}.{base}")
            if parent is not None:
                out += vllm_classes(parent)
        return out

    def kvloop_defines(sub: Subclass, name: str) -> bool:
        if name in sub.info.methods or name in sub.info.attrs:
            return True
        return any(
            kvloop_defines(use.subclasses[f"{sub.info.module}.{b}"], name)
            for b in sub.kvloop_bases
            if f"{sub.info.module}.{b}" in use.subclasses
        )

    for qualname, sub in use.subclasses.items():
        bases = vllm_classes(sub)
        if not bases:
            continue

        def version_specific(name: str, bases: list[ClassInfo] = bases) -> tuple[str, ...] | None:
            """The releases that have ``name`` if VERSION_SPECIFIC lists it for one of these classes."""
            classes = {c.name for b in bases for c in b.mro()}
            for symbol, releases in VERSION_SPECIFIC.items():
                cls, _, attr = symbol.partition(":")[2].partition(".")
                if attr == name and cls in classes:
                    return releases
            return None

        for name, fn in sub.info.methods.items():
            if name.startswith("__") and name != "__init__":
                continue
            owner = next((b.lookup_method(name) for b in bases if b.lookup_method(name)), None)
            if name == "__init__":
                continue  # kvloop's constructors take their own arguments; their calls up are checked
            if owner is None:
                ref_owner = None
                if reference is not None:
                    ref_bases = [c for m, n in sub.vllm_bases if (c := reference.cls(m, n)) is not None]
                    ref_owner = next(
                        (b.lookup_method(name) for b in ref_bases if b.lookup_method(name)), None
                    )
                if ref_owner is not None and _required_in(
                    f"{ref_owner[0].module}:{ref_owner[0].name}.{name}", rel
                ):
                    problems.append(
                        f"{sub.where}: {qualname}.{name} overrides {ref_owner[0].name}.{name}, "
                        f"which vLLM {rel} no longer has"
                    )
                continue
            checked += 1
            why = accepts(signature(owner[1]), signature(fn))
            if why:
                problems.append(
                    f"{sub.where}: {qualname}.{name}{_fmt(signature(fn))} does not override "
                    f"{owner[0].name}.{name}{_fmt(signature(owner[1]))} of vLLM {rel}: {why}"
                )

        # What kvloop's overrides call up to must exist, whatever the baseline says.
        for name, where in sorted(sub.super_uses.items()):
            if name.startswith("__") or not sub.vllm_bases:
                continue
            checked += 1
            if not any(b.lookup_method(name) for b in bases):
                releases = version_specific(name)
                if releases is not None and rel not in releases:
                    continue
                problems.append(f"{where}: {qualname} calls super().{name}, which vLLM {rel} lacks")

        for name, where in sorted(sub.self_uses.items()):
            if name.startswith("__") and name != "__init__":
                continue
            if name != "__init__" and kvloop_defines(sub, name):
                continue
            checked += 1
            if not any(b.defines(name) for b in bases):
                releases = version_specific(name)
                if releases is not None and rel not in releases:
                    continue
                problems.append(f"{where}: {qualname} uses {name}, which its vLLM bases lack in vLLM {rel}")

        if reference is not None and sub.super_inits:
            for module, name in sub.vllm_bases:
                now, ref = r.cls(module, name), reference.cls(module, name)
                if now is None or ref is None:
                    continue
                a, b = now.lookup_method("__init__"), ref.lookup_method("__init__")
                if a is None or b is None:
                    continue
                checked += 1
                why = accepts(signature(b[1]), signature(a[1]))
                if why:
                    problems.append(f"{sub.super_inits[0]}: {name}.__init__ in vLLM {rel}: {why}")

    for symbol in PATCHED:
        if not _required_in(symbol, rel):
            continue
        checked += 1
        module, _, dotted = symbol.partition(":")
        head, _, attr = dotted.partition(".")
        if not attr:
            if r.find(module, head) is None:
                problems.append(f"kvloop patches or calls {module}.{head}, which vLLM {rel} lacks")
            continue
        info = r.cls(module, head)
        if info is None or not info.defines(attr):
            problems.append(f"kvloop uses {head}.{attr} ({module}), which vLLM {rel} lacks")

    if reference is not None:
        for symbol in MIRRORED:
            module, _, dotted = symbol.partition(":")
            head, _, attr = dotted.partition(".")
            now, ref = r.cls(module, head), reference.cls(module, head)
            a = now.lookup_method(attr) if now else None
            b = ref.lookup_method(attr) if ref else None
            checked += 1
            if a is None or b is None:
                problems.append(f"kvloop mirrors {head}.{attr}, which vLLM {rel} lacks")
            elif ast.dump(a[1]) != ast.dump(b[1]):
                problems.append(f"kvloop mirrors {head}.{attr} ({module}), whose body vLLM {rel} changed")

    for key, (module, releases) in PARAM_KEYS.items():
        if rel not in releases:
            continue
        checked += 1
        tree = source.tree(module)
        if tree is None or not any(isinstance(n, ast.Constant) and n.value == key for n in ast.walk(tree)):
            problems.append(
                f"kvloop passes kv_transfer_params[{key!r}]; {module} of vLLM {rel} never reads it"
            )

    for symbol, releases in VERSION_SPECIFIC.items():
        if rel not in releases:
            continue
        checked += 1
        module, _, dotted = symbol.partition(":")
        head, _, attr = dotted.partition(".")
        info = r.cls(module, head)
        if info is None or not info.defines(attr):
            problems.append(f"kvloop's adapter for vLLM {rel} uses {head}.{attr} ({module}), which it lacks")
    return problems, checked


def fetch_wheel(release: str, cache: Path, pip: list[str]) -> Path:
    folder = cache / release
    wheels = sorted(folder.glob(f"vllm-{release}-*.whl"))
    if wheels:
        return wheels[0]
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [
        *pip,
        "download",
        f"vllm=={release}",
        "--no-deps",
        "--only-binary",
        ":all:",
        "-q",
        "-d",
        str(folder),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(folder.glob(f"vllm-{release}-*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no wheel"]
        raise RuntimeError(f"pip download vllm=={release} failed: {tail[0]}")
    return wheels[0]


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT))
    from common.vllm_compat import SUPPORTED_VLLM

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=ROOT / ".cache" / "vllm-wheels")
    parser.add_argument(
        "--source", action="append", default=[], metavar="RELEASE=DIR", help="check DIR as that release"
    )
    parser.add_argument("--release", action="append", default=[], help="only these releases")
    args = parser.parse_args(argv)

    overrides = dict(s.split("=", 1) for s in args.source)
    releases = args.release or list(SUPPORTED_VLLM)
    pip = [sys.executable, "-m", "pip"]
    use = scan_kvloop([ROOT / d for d in KVLOOP_DIRS])
    failed = False
    reference: Resolver | None = None
    for release in releases:
        if release in overrides:
            source = Source(release, Path(overrides[release]))
        else:
            try:
                source = Source(release, fetch_wheel(release, args.cache, pip))
            except RuntimeError as exc:
                print(f"vllm-compat: {exc}", file=sys.stderr)
                return 2
        problems, checked = check_release(source, use, reference)
        if reference is None:
            reference = Resolver(source)  # the first release's signatures are the baseline
        if problems:
            failed = True
            for p in problems:
                print(f"vllm-compat: {p}")
            print(f"vLLM {release} ({source.path.name}): {len(problems)} problem(s) in {checked} checks")
        else:
            print(f"vLLM {release} ({source.path.name}): {checked} symbols and signatures match")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

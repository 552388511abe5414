#!/usr/bin/env python3
"""No import circles between the modules of a library crate.

A module that uses another module that uses it back (directly, or around a longer circle) can
be read only together with it: the circle is one module in two files. This check builds, for
each library crate, the graph of which module names which (`crate::a::b`, `super::x`,
`self::x` and bare `x::` paths to a submodule, in non-test code), leaves out the edges between
a module and its own parent or children (a parent declares and re-exports its children; a child
may use what its parent holds), and fails on every circle that is left, printing each with the
lines that make it. Comments, doc links, test files (`tests.rs`, `tests/`) and `#[cfg(test)]`
modules are skipped.
"""
import pathlib
import re
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from check_store_floor import code_lines  # noqa: E402  (the non-test lines of a file)

ROOT = pathlib.Path(__file__).resolve().parent.parent
CRATES = ["crates/reason-code", "crates/retry-layer", "crates/idempotency-layer"]


def module_of(src, path):
    rel = path.relative_to(src).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] in ("lib", "mod"):
        parts = parts[:-1]
    return tuple(parts)


PATH = re.compile(r"\b((?:crate|super|self)(?:::\w+)+|\w+(?:::\w+)+)")


def resolve(module, path, modules):
    """The module of this crate that `path` (as written in `module`) names, if any."""
    parts = path.split("::")
    if parts[0] == "crate":
        base, rest = (), parts[1:]
    elif parts[0] in ("super", "self"):
        base = module
        while parts and parts[0] in ("super", "self"):
            if parts[0] == "super":
                base = base[:-1]
            parts = parts[1:]
        rest = parts
    else:
        # A bare path names a submodule of this module, or nothing of ours.
        if module + (parts[0],) not in modules:
            return None
        base, rest = module, parts
    best = None
    for i in range(len(rest) + 1):
        candidate = base + tuple(rest[:i])
        if candidate in modules:
            best = candidate
        else:
            break
    return best


def related(a, b):
    return a[: len(b)] == b or b[: len(a)] == a


def cycles(graph):
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, on, stack, out = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def name(crate, m):
    return crate.split("/")[-1].replace("-", "_") + ("::" + "::".join(m) if m else "")


failed = False
for crate in CRATES:
    src = ROOT / crate / "src"
    files = [p for p in src.rglob("*.rs") if p.name != "tests.rs" and "tests" not in p.relative_to(src).parts[:-1]]
    modules = {module_of(src, p) for p in files}
    graph = {}
    for p in files:
        m = module_of(src, p)
        for n, code in code_lines(p):
            for path in PATH.findall(code):
                target = resolve(m, path, modules)
                if target is None or related(m, target):
                    continue
                graph.setdefault(m, {}).setdefault(target, []).append(f"{p.relative_to(ROOT)}:{n}")
    for comp in cycles(graph):
        failed = True
        print(f"import circle in {crate}: " + " <-> ".join(name(crate, m) for m in comp))
        for a in comp:
            for b in comp:
                if b in graph.get(a, {}):
                    where = graph[a][b]
                    print(f"  {name(crate, a)} uses {name(crate, b)}: {', '.join(where[:3])}"
                          + (f" (+{len(where) - 3})" if len(where) > 3 else ""))
if failed:
    sys.exit(1)
print("no import circles between the library crates' modules")

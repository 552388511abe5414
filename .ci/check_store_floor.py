#!/usr/bin/env python3
"""The store floor imports nothing from the layer.

`crates/idempotency-layer/src/store/` is the trait every store implements and the stores
themselves: it must compile, and make sense, without the middleware above it (the model is
tower-sessions-core's `SessionStore`). This check fails when a non-test line under `store/`
names a module of the layer: a `crate::` path other than `crate::store` (and the crate's
root-level `BoxError`), or a `super::super` path that climbs out of `store/`.
Comments and doc links are not code and are skipped, as are test files (`tests.rs`) and
`#[cfg(test)] mod` blocks, which may build requests with the layer's helpers.
"""
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
STORE = ROOT / "crates/idempotency-layer/src/store"
ALLOWED = re.compile(r"crate::(store\b)")
PATH = re.compile(r"\bcrate::\w+")

def code_lines(path):
    """(number, line) of the non-test code lines of `path`."""
    lines = path.read_text().split("\n")
    skip_depth = None  # brace depth at which a #[cfg(test)] module started
    depth = 0
    pending_test = False
    for n, line in enumerate(lines, 1):
        stripped = line.strip()
        code = re.sub(r"//.*", "", line)
        if skip_depth is None:
            if stripped.startswith("#[cfg(") and "test" in stripped and "not(test" not in stripped:
                pending_test = True
            elif pending_test and re.match(r"(pub(\([^)]*\))? )?mod \w+ \{", stripped):
                skip_depth = depth
                pending_test = False
            elif pending_test and not stripped.startswith("#["):
                pending_test = False
            if skip_depth is None and not stripped.startswith("//"):
                yield n, code
        depth += code.count("{") - code.count("}")
        if skip_depth is not None and depth <= skip_depth:
            skip_depth = None

def main():
    bad = []
    for path in sorted(STORE.rglob("*.rs")):
        if path.name == "tests.rs":
            continue
        for n, code in code_lines(path):
            for m in PATH.finditer(code):
                if not ALLOWED.match(m.group(0)):
                    bad.append(f"{path.relative_to(ROOT)}:{n}: {code.strip()}")
            if "super::super" in code:
                bad.append(f"{path.relative_to(ROOT)}:{n}: {code.strip()}")
    if bad:
        print("the store floor (src/store/) must not import from the layer's modules:")
        print("\n".join(bad))
        print("move what both need into store/, or the layer's code out of it")
        return 1
    files = len(list(STORE.rglob("*.rs")))
    print(f"store floor: {files} files, no import from the layer")
    return 0

if __name__ == "__main__":
    sys.exit(main())

"""Fails when a locked dependency declares a newer rust-version than the workspace's.

Reads `cargo metadata --format-version 1 --locked --all-features` on standard input. No Rust
toolchain but the installed one can be fetched here, so the declared MSRV is checked against
what every package in the locked graph (every target, dev-dependencies included) says it needs.
"""
import json
import sys


def version(text):
    parts = [int(part) for part in text.split(".")]
    return tuple(parts + [0] * (3 - len(parts)))


meta = json.load(sys.stdin)
members = set(meta["workspace_members"])
resolved = {node["id"] for node in meta["resolve"]["nodes"]}
ours = {p["rust_version"] for p in meta["packages"] if p["id"] in members and p.get("rust_version")}
if len(ours) != 1:
    sys.exit(f"workspace members declare rust-version {sorted(ours)}: declare one, in [workspace.package]")
msrv = ours.pop()
newer = sorted(
    (version(p["rust_version"]), p["name"], p["version"])
    for p in meta["packages"]
    if p["id"] in resolved and p["id"] not in members and p.get("rust_version")
    and version(p["rust_version"]) > version(msrv)
)
if newer:
    for need, name, ver in newer:
        print(f"{name} {ver} needs Rust {'.'.join(map(str, need))}", file=sys.stderr)
    sys.exit(f"rust-version {msrv} is not true: raise it, or pin the packages above to older versions")
print(f"rust-version {msrv}: every locked dependency builds with it (as declared)")

#!/usr/bin/env python3
"""Import circles among one crate's top-level modules (issue 32: "no import circle among the
server's modules beyond a documented pair inside the data path").

A module M depends on N when any file of M (src/M.rs or src/M/**) names `crate::N` (in a `use`
or a path) or, in a submodule, `super::` of a top-level N... only `crate::` paths are counted,
which is how the crates name each other's modules. Prints every strongly connected component
of more than one module, with the edges inside it and the files that make each edge, and
exits 1 when there is one beyond the pairs allowed with --allow A,B.

    scripts/module-cycles.py crates/server/src [--allow worker,fold ...]
"""
import argparse
import pathlib
import re
import sys
from collections import defaultdict


def module_of(src: pathlib.Path, f: pathlib.Path) -> str:
    rel = f.relative_to(src)
    top = rel.parts[0]
    return top[:-3] if top.endswith(".rs") else top


def edges(src: pathlib.Path):
    out = defaultdict(lambda: defaultdict(set))
    mods = set()
    for f in src.rglob("*.rs"):
        m = module_of(src, f)
        if m in ("lib", "main"):
            m = "lib"
        mods.add(m)
    pat = re.compile(r"crate::([a-z_][a-z0-9_]*)")
    group = re.compile(r"use crate::\{([^;]*)\};", re.S)
    for f in src.rglob("*.rs"):
        m = module_of(src, f)
        m = "lib" if m in ("lib", "main") else m
        text = f.read_text()
        # Strip comments (// and //!) so docs that name a module do not count.
        text = re.sub(r"//[^\n]*", "", text)
        names = set(pat.findall(text))
        for g in group.findall(text):
            names.update(re.findall(r"(?:^|[{,\s])([a-z_][a-z0-9_]*)(?=::|\s*[,}]|$)", g))
        for n in names:
            if n in mods and n != m and n != "lib":
                out[m][n].add(str(f.relative_to(src)))
    return mods, out


def sccs(nodes, g):
    index, low, stack, on, res, i = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = i[0]
        i[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, {}):
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
            res.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("--allow", action="append", default=[], help="a pair A,B allowed to import each other")
    a = ap.parse_args()
    src = pathlib.Path(a.src)
    mods, g = edges(src)
    allowed = {frozenset(p.split(",")) for p in a.allow}
    bad = 0
    comps = [c for c in sccs(mods, g) if len(c) > 1]
    for c in comps:
        ok = len(c) == 2 and frozenset(c) in allowed
        bad += 0 if ok else 1
        print(f"{'allowed ' if ok else ''}circle of {len(c)}: {' '.join(c)}")
        for m in c:
            for n in sorted(g[m]):
                if n in c:
                    files = sorted(g[m][n])
                    print(f"    {m} -> {n}   ({', '.join(files[:3])}{' …' if len(files) > 3 else ''})")
    print(f"{len(mods)} modules, {sum(len(v) for v in g.values())} edges, {len(comps)} circles ({bad} not allowed)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

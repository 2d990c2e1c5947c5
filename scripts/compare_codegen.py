#!/usr/bin/env python3
"""Compares the machine code two builds of kiln generate for the same catalog, without a GPU.

  scripts/compare_codegen.py BUILD_A BUILD_B [--family F,...] [--arch A,...] [--jobs N]
                             [--work DIR] [--nvdisasm PATH] [--show N]

Each build's `kiln` prewarms the chosen catalogs (embedded, no daemon) into a cache of its own
under --work (an existing cache there is reused, so a second run compares without compiling).
Variants are paired by family, canonical params and arch, and each pair's cubins are compared:

- `identical`: every ELF section has the same bytes, with the kernel's mangled name (the cache's
  lowered_name) and the translation-unit hash in internal-linkage names replaced by placeholders
  in section names and string tables; a kernel whose parameter types were renamed still compares
  equal, nothing else may differ.
- `same SASS`: the sections differ, but nvdisasm's listing of both (with the instructions'
  encodings) is the same text once those names are replaced (needs nvdisasm: --nvdisasm,
  $NVDISASM, PATH, or the toolkit's bin/).
- `differs`: neither; the first lines of the SASS diff are printed (--show, 0 for none).

The ptxas report (registers, shared memory, spills) is compared too. Prints one line per family
and arch, then the differences; exits 1 if any pair differs or a variant exists on one side only.
Use it on a refactoring of device templates that must not change the generated code.
"""
import argparse
import difflib
import json
import os
import re
import shutil
import sqlite3
import struct
import subprocess
import sys
import tempfile
from collections import defaultdict


def prewarm(kiln, cache_dir, archs, families, jobs):
    """Prewarms into cache_dir; returns the keys of the requested variants."""
    cmd = [kiln, "--embedded", "--cache-dir", cache_dir, "prewarm", "--arch", ",".join(archs), "--jobs", str(jobs),
           "--json"]
    if families:
        cmd += ["--family", ",".join(families)]
    env = dict(os.environ, KILN_MODE="embedded", KILN_SOCKET=os.path.join(cache_dir, "no-daemon.sock"))
    print("+", " ".join(cmd), file=sys.stderr)
    r = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        sys.stderr.write(r.stderr[-4000:])
        sys.exit(f"compare_codegen: prewarm with {kiln} failed (exit {r.returncode})")
    summary = json.loads(r.stdout)
    print(f"  {summary['compiled']} compiled, {summary['cached']} cached in {summary['seconds']:.1f} s",
          file=sys.stderr)
    return [v["key"] for v in summary["variants"]]


def load(cache_dir, keys):
    """{(family, params, arch): (cubin, lowered name, ptxas report)} of the given keys."""
    db = sqlite3.connect(os.path.join(cache_dir, "kernels.sqlite"))
    out = {}
    for key in keys:
        row = db.execute("SELECT family, params, arch, cubin, lowered_name, registers, shared_bytes, spill_bytes "
                         "FROM kernels WHERE key = ?", (key,)).fetchone()
        if row is None:
            sys.exit(f"compare_codegen: {key} is not in {cache_dir}")
        family, params, arch, cubin, name, regs, smem, spill = row
        out[(family, params, arch)] = (bytes(cubin), name, (regs, smem, spill))
    return out


# Names of internal-linkage symbols carry a hash of the translation unit's source
# (_ZN51_INTERNAL_00000000_14_kiln_kernel_cu_78585834_119414kiln...), which any template edit changes.
INTERNAL = re.compile(rb"\d*_INTERNAL_[0-9a-f]{8}_\d+_\w*?_[0-9a-f]{8}_\d+")


def normalize(data, name):
    return INTERNAL.sub(b"INTERNAL", data.replace(name.encode(), b"KERNEL"))


def elf_sections(blob, name):
    """{normalized section name: normalized bytes} of an ELF64 little-endian cubin."""
    if blob[:4] != b"\x7fELF" or blob[4] != 2:
        return {"<not ELF64>": blob}
    shoff, = struct.unpack_from("<Q", blob, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", blob, 0x3A)
    heads = [struct.unpack_from("<IIQQQQIIQQ", blob, shoff + i * shentsize) for i in range(shnum)]
    strtab_off = heads[shstrndx][4]
    # The header but e_phoff and e_shoff, and the program headers but p_offset: longer names move
    # what follows the string tables.
    phoff, = struct.unpack_from("<Q", blob, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", blob, 0x36)
    out = {"<elf header>": blob[:0x20] + blob[0x30:0x40]}
    for i in range(phnum):
        ph = blob[phoff + i * phentsize:phoff + (i + 1) * phentsize]
        out[f"<program header {i}>"] = ph[:8] + ph[16:]
    for i, (sh_name, sh_type, flags, _addr, off, size, link, info, align, entsize) in enumerate(heads):
        end = blob.index(b"\0", strtab_off + sh_name)
        sname = normalize(blob[strtab_off + sh_name:end], name).decode(errors="replace")
        data = b"" if sh_type == 8 else blob[off:off + size]  # SHT_NOBITS holds no bytes
        if sh_type == 3:  # string tables: the strings, names replaced
            data = normalize(data, name)
        elif sh_type == 2:  # symbol table: every field but the name's offset into the string table
            data = b"".join(data[j + 4:j + entsize] for j in range(0, len(data), entsize))
        # A string table's size follows its names; its normalized content is compared instead.
        meta = struct.pack("<IQIIQQ", sh_type, flags, link, info, align, 0 if sh_type == 3 else size)
        out[f"{i}:{sname}"] = meta + data
    return out


def find_nvdisasm(given):
    for c in [given, os.environ.get("NVDISASM"), shutil.which("nvdisasm"), "/usr/local/cuda/bin/nvdisasm"]:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def sass(nvdisasm, blob, name, tmp):
    path = os.path.join(tmp, "k.cubin")
    with open(path, "wb") as f:
        f.write(blob)
    r = subprocess.run([nvdisasm, "-c", "-hex", path], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        return ["<nvdisasm failed: " + r.stderr.strip() + ">"]
    # Names replaced, and runs of blanks collapsed: nvdisasm pads its columns to the longest name.
    return [" ".join(normalize(line.encode(), name).decode().split()) for line in r.stdout.splitlines()]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("build_a")
    ap.add_argument("build_b")
    ap.add_argument("--family", default="", help="comma-separated families (default: all)")
    ap.add_argument("--arch", default="sm_90a,sm_80")
    ap.add_argument("--jobs", type=int, default=2, help="compile threads per prewarm")
    ap.add_argument("--work", help="where the two caches go (default: a temporary folder, removed)")
    ap.add_argument("--nvdisasm", help="nvdisasm to list the SASS of cubins that differ")
    ap.add_argument("--show", type=int, default=40, help="lines of SASS diff per differing variant")
    args = ap.parse_args()
    archs = [a for a in args.arch.split(",") if a]
    families = [f for f in args.family.split(",") if f]
    work = args.work or tempfile.mkdtemp(prefix="kiln-codegen-")
    caches = []
    for side, build in (("a", args.build_a), ("b", args.build_b)):
        kiln = build if os.path.isfile(build) else os.path.join(build, "kiln")
        cache = os.path.join(work, "cache-" + side)
        os.makedirs(cache, exist_ok=True)
        caches.append(load(cache, prewarm(kiln, cache, archs, families, args.jobs)))
    a, b = caches
    nvdisasm = find_nvdisasm(args.nvdisasm)
    counts = defaultdict(lambda: defaultdict(int))
    problems = []
    with tempfile.TemporaryDirectory() as tmp:
        for key in sorted(set(a) | set(b)):
            family, params, arch = key
            if key not in a or key not in b:
                counts[(family, arch)]["only " + ("b" if key not in a else "a")] += 1
                problems.append(f"{family}({params}) {arch}: only in build {'b' if key not in a else 'a'}")
                continue
            (ca, na, ra), (cb, nb, rb) = a[key], b[key]
            if ra != rb:
                problems.append(f"{family}({params}) {arch}: ptxas report {ra} -> {rb} (registers, smem, spill)")
            if elf_sections(ca, na) == elf_sections(cb, nb) and ra == rb:
                counts[(family, arch)]["identical"] += 1
                continue
            if nvdisasm is None:
                counts[(family, arch)]["differs"] += 1
                problems.append(f"{family}({params}) {arch}: cubins differ (no nvdisasm to compare SASS)")
                continue
            sa, sb = sass(nvdisasm, ca, na, tmp), sass(nvdisasm, cb, nb, tmp)
            if sa == sb and ra == rb:
                counts[(family, arch)]["same SASS"] += 1
                continue
            counts[(family, arch)]["differs"] += 1
            diff = list(difflib.unified_diff(sa, sb, "a", "b", lineterm="", n=2))
            problems.append("\n".join([f"{family}({params}) {arch}: SASS differs ({len(diff)} diff lines)"] +
                                      diff[:args.show]))
    for (family, arch), c in sorted(counts.items()):
        total = sum(c.values())
        print(f"{family:<20} {arch:<8} {total:>4} variants: " + ", ".join(f"{v} {k}" for k, v in sorted(c.items())))
    for p in problems:
        print(p)
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{len(a)} variants in a, {len(b)} in b; {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

"""A wheel too large for one device call's carry, sent in parts over several calls.

The device tool carries at most 64 MiB per call and keeps /tmp between the calls of one warm
machine; nvidia-cutlass-dsl's cu13 libraries (flash-attn-4's runtime) are a 92 MB wheel.
Here: cut it into parts spread over carried folders, one per call, each with a manifest; on
the device, gather what each call brought into a staging folder and rebuild every wheel
whose parts are all there, checked against its sha256, under its own file name.

    python3 bench/gpu_setup/wheel_parts.py split WHEEL --into .whl-part1 .whl-part2
    python3 bench/gpu_setup/wheel_parts.py gather --from .whl-part1 .whl-part2 --stage /tmp/wheel-parts --out /tmp/wheels

``gather`` exits 0 when every manifest it has seen is whole (the rebuilt wheels are in
--out), 3 while parts are still missing (it says which), 2 on a part that does not match.
Standard library only (the device image has no extra packages).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys

MANIFEST = ".parts.json"
EXIT_WAITING = 3
EXIT_BAD = 2
DEFAULT_PART = 46_000_000  # two parts of a 92 MB wheel, each well under one call's carry


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def split(wheel: str, dirs: list[str], part_bytes: int = DEFAULT_PART) -> list[str]:
    """Cut ``wheel`` into parts of ``part_bytes``, dealt round the folders in ``dirs``; each
    folder gets the manifest. Returns the part paths."""
    name = os.path.basename(wheel)
    size = os.path.getsize(wheel)
    count = max(1, -(-size // part_bytes))
    manifest = {"wheel": name, "bytes": size, "sha256": _sha256(wheel),
                "parts": [f"{name}.part.{i:02d}" for i in range(count)]}
    paths = []
    with open(wheel, "rb") as fh:
        for i, part in enumerate(manifest["parts"]):
            d = dirs[i % len(dirs)]
            os.makedirs(d, exist_ok=True)
            path = os.path.join(d, part)
            with open(path, "wb") as out:
                out.write(fh.read(part_bytes))
            paths.append(path)
    for d in dirs:
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, name + MANIFEST), "w") as out:
            json.dump(manifest, out, indent=1)
    return paths


class BadPart(Exception):
    pass


def gather(sources: list[str], stage: str, out: str) -> tuple[list[str], dict[str, list[str]]]:
    """Copy the parts and manifests found in ``sources`` into ``stage`` and rebuild each
    complete wheel into ``out``. Returns (wheels in out, {wheel: parts still missing})."""
    os.makedirs(stage, exist_ok=True)
    os.makedirs(out, exist_ok=True)
    for src in sources:
        if not os.path.isdir(src):
            continue
        for f in sorted(os.listdir(src)):
            if f.endswith(MANIFEST) or ".part." in f:
                tmp = os.path.join(stage, f + ".tmp")
                shutil.copyfile(os.path.join(src, f), tmp)
                os.replace(tmp, os.path.join(stage, f))
    whole, missing = [], {}
    for f in sorted(os.listdir(stage)):
        if not f.endswith(MANIFEST):
            continue
        with open(os.path.join(stage, f)) as fh:
            m = json.load(fh)
        target = os.path.join(out, m["wheel"])
        if os.path.exists(target) and _sha256(target) == m["sha256"]:
            whole.append(target)
            continue
        lacking = [p for p in m["parts"] if not os.path.exists(os.path.join(stage, p))]
        if lacking:
            missing[m["wheel"]] = lacking
            continue
        tmp = target + ".tmp"
        with open(tmp, "wb") as dst:
            for p in m["parts"]:
                with open(os.path.join(stage, p), "rb") as src_fh:
                    shutil.copyfileobj(src_fh, dst)
        if os.path.getsize(tmp) != m["bytes"] or _sha256(tmp) != m["sha256"]:
            os.unlink(tmp)
            raise BadPart(f"{m['wheel']}: its parts in {stage} do not add up to the wheel that was split "
                          f"(sha256 {m['sha256'][:12]}…); split it again and send every part")
        os.replace(tmp, target)
        whole.append(target)
    return whole, missing


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="wheel_parts.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="verb", required=True)
    s = sub.add_parser("split", help="cut a wheel into parts over several folders (one per call)")
    s.add_argument("wheel")
    s.add_argument("--into", nargs="+", required=True, metavar="DIR")
    s.add_argument("--part-bytes", type=int, default=DEFAULT_PART)
    g = sub.add_parser("gather", help="on the device: stage what arrived, rebuild the complete wheels")
    g.add_argument("--from", dest="sources", nargs="+", required=True, metavar="DIR")
    g.add_argument("--stage", required=True)
    g.add_argument("--out", required=True)
    a = p.parse_args(argv)
    if a.verb == "split":
        if not a.wheel.endswith(".whl") or not os.path.isfile(a.wheel):
            p.error(f"{a.wheel}: not a wheel file")
        if a.part_bytes <= 0:
            p.error(f"--part-bytes {a.part_bytes}: must be positive")
        for path in split(a.wheel, a.into, a.part_bytes):
            print(path)
        return 0
    try:
        whole, missing = gather(a.sources, a.stage, a.out)
    except BadPart as e:
        print(f"wheel_parts.py: {e}", file=sys.stderr)
        return EXIT_BAD
    for w in whole:
        print(f"whole: {w}")
    for w, parts in missing.items():
        print(f"waiting: {w} lacks {', '.join(parts)}", file=sys.stderr)
    return EXIT_WAITING if missing else 0


if __name__ == "__main__":
    sys.exit(main())

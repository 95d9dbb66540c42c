"""Shrink wheels so that Ray Serve fits what a device call may carry (scripts/ray_wheels.sh):
`python scripts/repack_wheels.py OUT_DIR [NEW_DIR]` moves Ray's wheel from NEW_DIR into OUT_DIR
without the parts serving never loads, and LZMA-compresses every wheel over 1 MiB in OUT_DIR
(pip extracts any zip compression). Wheels repacked before are left as they are."""

from __future__ import annotations

import pathlib
import sys
import zipfile

# Not needed to serve: the Java worker, the dashboard's web UI, the ML libraries (only the
# dashboard's head and ray.serve.llm import them; no dashboard runs, serve.llm is not used).
RAY_DROP = tuple(f"ray/{d}/" for d in ("jars", "dashboard/client/build", "rllib", "tune", "train", "data", "llm"))


def repack(src: pathlib.Path, dst: pathlib.Path, drop: tuple[str, ...] = ()) -> None:
    tmp = dst.with_name(dst.name + ".tmp")
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_LZMA) as zout:
        for info in zin.infolist():
            if not info.filename.startswith(drop):
                zout.writestr(info, zin.read(info), compress_type=zipfile.ZIP_LZMA)
    before = src.stat().st_size
    tmp.replace(dst)
    print(f"{dst.name}: {before / 2**20:.1f} -> {dst.stat().st_size / 2**20:.1f} MiB")


def repacked(wheel: pathlib.Path) -> bool:
    with zipfile.ZipFile(wheel) as z:
        return all(i.compress_type == zipfile.ZIP_LZMA for i in z.infolist())


def main(out_dir: pathlib.Path, new_dir: pathlib.Path | None) -> None:
    for ray in new_dir.glob("ray-*.whl") if new_dir else ():
        repack(ray, out_dir / ray.name, RAY_DROP)
    for wheel in sorted(out_dir.glob("*.whl")):
        if wheel.stat().st_size > 1 << 20 and not repacked(wheel):
            repack(wheel, wheel)


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]) if len(sys.argv) > 2 else None)

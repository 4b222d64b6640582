#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with what deploy/gpu_smoke.sh installs on a GPU machine that has no network:
# cp312 manylinux wheels of the gateway's and lmdeploy's dependencies that such an image lacks (it
# has torch, transformers, tokenizers, triton, uvloop, aiohttp, numpy, pillow, ...), and lmdeploy
# itself without TurboMind (its 355 MB engine library; the check runs the pytorch backend), so
# the whole stays under the device tool's 64 MiB.
#
#   bash deploy/gpu_smoke_wheels.sh [DIR]      # default .whl; run from the repo root, with network
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
PY=${PYTHON:-python3}
mkdir -p "$DIR"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
WHEELS=(
  addict==2.4.0 annotated_types==0.8.0 anyio==4.16.0 apache_tvm_ffi==0.1.11 fastapi==0.165.0 h11==0.16.0
  hiredis==3.5.0 httpcore==1.0.9 httpcore2==2.16.2 httptools==0.9.0 httpx==0.28.1 httpx2==2.16.2
  httpx_aiohttp==0.2.0 idna==3.20 jiter==0.19.0 lmdeploy==0.18.0 mmengine_lite==0.10.7 openai==3.60.0
  opentelemetry_api==1.45.2 opentelemetry_sdk==1.45.2 opentelemetry_semantic_conventions==0.66b2
  orjson==3.13.0 platformdirs==4.14.9 pybase64==1.5.1 pydantic==2.14.4 pydantic_core==2.50.5
  pyzmq==27.3.0 redis==8.2.0 shortuuid==1.0.13 sniffio==1.3.1 starlette==1.10.0 termcolor==3.3.0
  truststore==0.10.5 typing_extensions==4.16.0 typing_inspection==0.4.5 uvicorn==0.55.0
  xgrammar==0.2.9 yapf==0.43.0
)
plat=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64; do
  plat+=(--platform "$p")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" -d "$DIR" "${WHEELS[@]}"
# lmdeploy without TurboMind: the two files dropped, their RECORD lines with them.
"$PY" - "$DIR" <<'PY'
import sys, zipfile
from pathlib import Path

DROP = ("lmdeploy/turbomind/_turbomind", "lmdeploy/turbomind/lib64/libxgrammar.a")
for whl in Path(sys.argv[1]).glob("lmdeploy-*.whl"):
    with zipfile.ZipFile(whl) as z:
        if not any(n.startswith(DROP) for n in z.namelist()):
            continue  # stripped already
        items = [(i, z.read(i)) for i in z.infolist() if not i.filename.startswith(DROP)]
    tmp = whl.with_suffix(".tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as out:
        for info, data in items:
            if info.filename.endswith(".dist-info/RECORD"):
                data = b"".join(l for l in data.splitlines(keepends=True) if not l.startswith(tuple(d.encode() for d in DROP)))
            out.writestr(info, data)
    tmp.replace(whl)
    print(f"{whl.name}: TurboMind left out, {whl.stat().st_size / 1e6:.1f} MB")
PY
du -sh "$DIR"

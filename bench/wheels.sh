#!/usr/bin/env bash
# Download into .whl/ the wheels `python -m bench.serve` needs on the GPU machine beyond its
# image (the server: fastapi, uvicorn and their needs; the client: openai and its needs), and
# pytest-xdist and pytest-timeout for `run_device.sh gputests` (8 workers), for
# Python 3.12 on x86-64 Linux, at the versions the tests run with. Run it in the repository
# root; .whl/ is kept out of git through .git/info/exclude. bench/run_device.sh serve
# installs them there. The image has httpx, h11, idna, anyio, click and prometheus_client,
# but maybe older than these need: h11, idna, anyio and prometheus_client travel too.
set -euo pipefail
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl \
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 annotated-doc==0.0.7 \
  opentelemetry-api==1.45.2 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 \
  typing-inspection==0.4.5 typing_extensions==4.16.0 anyio==4.16.0 sniffio==1.3.1 \
  h11==0.16.0 idna==3.20 prometheus_client==0.26.0 \
  openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 jiter==0.19.0 \
  pytest-xdist==3.8.0 execnet==2.1.2 pytest-timeout==2.4.0
du -ch .whl/*.whl | tail -1

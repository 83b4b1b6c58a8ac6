#!/usr/bin/env bash
# On a CUDA machine (repo root; loraplane need not be installed): the churn trace through `loraplane serve`
# (bench/churn/server.py --gpu), base-only server then the LoRA server on the same trace.
#   OUT=DIR [WHEELS=DIR] bash bench/churn/device_server.sh [server.py args...]
#   WHEELS=DIR installs the server's packages (bench/churn/server-wheels.txt, and admin-s3-wheels.txt for
#   --admin-s3) from wheels into /tmp/site first, for an image without them and without a package index.
#   --admin-s3 loads the adapters through the admin API from moto's S3 server (its moto_server script
#   comes with the wheels, in /tmp/site/bin).
set -o pipefail
source scripts/device_env.sh
O="${OUT:-$PWD/bench/churn/results}"
mkdir -p "$O"
export PYTHONUNBUFFERED=1
if [ -n "$WHEELS" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHEELS"/*.whl || exit 1
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
  export PATH="$PATH:/tmp/site/bin"
fi
python3 -c 'import fastapi, uvicorn, pydantic, boto3, loraplane.http.app, loraplane.serve.main, loraplane.serve.sources' || exit 1
LOG=churn-server
case " $* " in *" --admin-s3 "*)
  LOG=churn-server-admin
  python3 -c 'import moto.server, flask, flask_cors' && command -v moto_server >/dev/null || {
    echo "--admin-s3 needs moto's server (WHEELS=DIR with bench/churn/admin-s3-wheels.txt)"; exit 1; } ;;
esac
python3 bench/churn/server.py --gpu --out "$O" "$@" 2>&1 | tee "$O/$LOG.log" | grep -v '^|'

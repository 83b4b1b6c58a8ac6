#!/usr/bin/env bash
# Regenerates docs/transcripts/adapter-supply-chain.txt: the producer-to-pod flow of `loraplane adapter`
# against a moto S3 server started by hand, then two refusals (tampered weights, unknown signer).
# Usage: bash docs/transcripts/adapter-supply-chain.sh > docs/transcripts/adapter-supply-chain.txt
set -u
REPO=$(cd "$(dirname "$0")/../.." && pwd)
VENV=${VENV:-$REPO/.venv}
export PATH="$VENV/bin:$PATH"
WORK=$(mktemp -d)
cd "$WORK"
PORT=${PORT:-5055}
moto_server -H 127.0.0.1 -p "$PORT" >/dev/null 2>&1 &
MOTO=$!
trap 'kill $MOTO; rm -rf "$WORK"' EXIT
until curl -s -o /dev/null "http://127.0.0.1:$PORT/moto-api/"; do sleep 0.2; done

export AWS_ENDPOINT_URL_S3="http://127.0.0.1:$PORT" AWS_ACCESS_KEY_ID=demo AWS_SECRET_ACCESS_KEY=demo-secret \
  AWS_DEFAULT_REGION=us-east-1
run() { echo "\$ $*"; "$@" 2>&1; echo "[exit $?]"; echo; }

echo "# loraplane adapter supply chain, $(date -u +%Y-%m-%dT%H:%MZ), moto_server on 127.0.0.1:$PORT"
echo "# (S3 credentials reach boto3 only through AWS_* environment variables; endpoint: AWS_ENDPOINT_URL_S3)"
echo
# A tiny llama-shaped base and a PEFT LoRA folder trained "for" it (random weights, torch-free).
python - "$REPO" <<'PY'
import sys; sys.path.insert(0, sys.argv[1] + "/tests")
from adapter_factory import make_base_folder, make_peft_folder
import boto3
make_base_folder("base")
make_peft_folder("support-bot", rank=8, alpha=16, target_modules=("q_proj", "k_proj", "v_proj", "o_proj"))
boto3.client("s3").create_bucket(Bucket="adapters")
PY
run ls base support-bot
run loraplane adapter keygen --out keys --name team-nlp
run loraplane adapter pack support-bot --base base --name support-bot --version v1
run loraplane adapter sign support-bot --key keys/team-nlp.key
run loraplane adapter push support-bot s3://adapters/support-bot/v1/
echo "# the bucket: each file once, named by its sha256; the version's prefix holds the signed manifest"
python - <<'PY'
import boto3
for obj in boto3.client("s3").list_objects_v2(Bucket="adapters")["Contents"]:
    print(f"{obj['Size']:>8}  {obj['Key']}")
PY
echo
echo "# pushing again uploads no file: every blob is stored already (HEAD, size)"
run loraplane adapter push support-bot s3://adapters/support-bot/v1/ --json
DIGEST=$(loraplane adapter inspect s3://adapters/support-bot/v1/ --json | python -c 'import json,sys; print(json.load(sys.stdin)["digest"])')
run loraplane adapter verify s3://adapters/support-bot/v1/ --trusted-keys keys/team-nlp.pub --base base --digest "$DIGEST" --max-rank 64
run loraplane adapter pull s3://adapters/support-bot/v1/ --cache cache --trusted-keys keys/team-nlp.pub --base base --digest "$DIGEST"
echo "# a second pull of the pinned digest is served from the cache (no download)"
run loraplane adapter pull s3://adapters/support-bot/v1/ --cache cache --trusted-keys keys/team-nlp.pub --base base --digest "$DIGEST" --json
run find cache -path '*/adapters/*' -o -path '*/blobs/*'
run loraplane adapter yaml s3://adapters/support-bot/v1/ --base-ref tiny-llama --namespace ml
run loraplane adapter inspect s3://adapters/support-bot/v1/

echo "# --- refusals -------------------------------------------------------------------------"
echo "# an attacker with write access to the bucket replaces the weights (same size, one byte differs)"
python - <<'PY'
import boto3
s3 = boto3.client("s3")
import json
manifest = json.loads(s3.get_object(Bucket="adapters", Key="support-bot/v1/loraplane-manifest.json")["Body"].read())
key = "_loraplane/blobs/sha256/" + manifest["files"]["adapter_model.safetensors"]["sha256"]  # where push put it
data = bytearray(s3.get_object(Bucket="adapters", Key=key)["Body"].read())
data[-1] ^= 0xFF
s3.put_object(Bucket="adapters", Key=key, Body=bytes(data))
PY
run loraplane adapter verify s3://adapters/support-bot/v1/ --trusted-keys keys/team-nlp.pub --base base
run loraplane adapter pull s3://adapters/support-bot/v1/ --cache fresh-cache --trusted-keys keys/team-nlp.pub --base base --json
run find fresh-cache/adapters -mindepth 1
echo "# a consumer that does not trust team-nlp's key"
run loraplane adapter keygen --out other --name someone-else
run loraplane adapter verify s3://adapters/support-bot/v1/ --trusted-keys other/someone-else.pub --json
echo "# the adapter was trained for another base"
run loraplane adapter verify s3://adapters/support-bot/v1/ --trusted-keys keys/team-nlp.pub --base-hash "$(printf 'f%.0s' {1..64})" --manifest-only
echo "# S3 unreachable (exit 3) and a missing version (exit 4)"
run loraplane adapter verify s3://adapters/support-bot/v1/ --trusted-keys keys/team-nlp.pub --endpoint-url http://127.0.0.1:9 --attempts 2
run loraplane adapter verify s3://adapters/support-bot/v9/ --trusted-keys keys/team-nlp.pub

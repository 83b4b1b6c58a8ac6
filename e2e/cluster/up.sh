#!/usr/bin/env bash
# Creates a throwaway kind cluster for the `cluster` test tier, when kind and a container engine exist.
# Prints why and exits 0 when they don't, so callers can run it unconditionally.
set -euo pipefail
name="${LORAPLANE_KIND_CLUSTER:-loraplane-e2e}"
if ! command -v kind >/dev/null 2>&1; then
  echo "skip: kind is not installed (k3s works too: point KUBECONFIG at it)"; exit 0
fi
if ! docker info >/dev/null 2>&1 && ! podman info >/dev/null 2>&1; then
  echo "skip: no container engine answers"; exit 0
fi
kind get clusters | grep -qx "$name" || kind create cluster --name "$name" --wait 120s
kind get kubeconfig --name "$name" > "${KUBECONFIG_OUT:-.kind-kubeconfig}"
echo "cluster $name is up: export KUBECONFIG=${KUBECONFIG_OUT:-.kind-kubeconfig}; make test ARGS='-m cluster'"

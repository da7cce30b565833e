# Sourced by .ci/run (bash, set -euo pipefail).
# The deployment tests (tests/it/deploy.rs) check deploy/ with two validators:
# - kubernetes-validate (PyPI), which carries Kubernetes' JSON schemas inside its package, so it
#   validates offline once installed. It is installed when missing into a virtual environment
#   of its own, kept between runs on this machine, and put on PATH.
# - systemd-analyze (Debian's `systemd` package), whose `verify` reads unit files without a
#   running systemd, so it works in a container. Installed with apt-get when missing.
# Then both are required: if one cannot be had, CI stops here with the reason.
deploy_fail() { echo "error: $1: CI needs it for the deployment tests (tests/it/deploy.rs)" >&2; exit 1; }
deploy_apt() {
    local sudo=()
    if [[ $(id -u) -ne 0 ]]; then
        if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then sudo=(sudo -n); else return 1; fi
    fi
    local apt=("${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get -qq
        -o Acquire::Retries=1 -o Acquire::http::Timeout=20 -o DPkg::Lock::Timeout=120)
    "${apt[@]}" install -y --no-install-recommends "$@" >/dev/null 2>&1 ||
        { "${apt[@]}" update >/dev/null 2>&1 && "${apt[@]}" install -y --no-install-recommends "$@" >/dev/null 2>&1; }
}
if ! command -v systemd-analyze >/dev/null; then
    command -v apt-get >/dev/null || deploy_fail "systemd-analyze unavailable (no apt-get)"
    deploy_apt systemd || deploy_fail "systemd-analyze unavailable (apt-get install systemd failed: offline, or not root)"
fi
systemd-analyze --version >/dev/null 2>&1 || deploy_fail "systemd-analyze does not run"
kubernetes_validate_version=1.37.0
kubernetes_validate_env=${XDG_CACHE_HOME:-$HOME/.cache}/imgpipe-ci/kubernetes-validate-$kubernetes_validate_version
if ! command -v kubernetes-validate >/dev/null; then
    if [[ ! -x $kubernetes_validate_env/bin/kubernetes-validate ]]; then
        command -v python3 >/dev/null || deploy_apt python3 || deploy_fail "kubernetes-validate unavailable (no python3)"
        rm -rf "$kubernetes_validate_env"
        # Debian's python3 makes virtual environments only with python3-venv.
        python3 -m venv "$kubernetes_validate_env" >/dev/null 2>&1 ||
            { deploy_apt python3-venv && rm -rf "$kubernetes_validate_env" && python3 -m venv "$kubernetes_validate_env"; } ||
            deploy_fail "kubernetes-validate unavailable (python3 -m venv failed)"
        "$kubernetes_validate_env/bin/pip" install -q "kubernetes-validate==$kubernetes_validate_version" >/dev/null 2>&1 ||
            { rm -rf "$kubernetes_validate_env"; deploy_fail "kubernetes-validate unavailable (pip install failed: offline?)"; }
    fi
    export PATH="$kubernetes_validate_env/bin:$PATH"
fi
kubernetes-validate --version >/dev/null 2>&1 || deploy_fail "kubernetes-validate does not run"

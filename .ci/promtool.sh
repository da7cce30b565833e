# Sourced by .ci/run (bash, set -euo pipefail).
# The metrics tests (tests/it/events.rs) check the metrics file with `promtool check metrics`,
# which Debian ships in its `prometheus` package. Installing that package would also create a
# system user and start a Prometheus server where init scripts run; CI needs only the one static
# binary. So when promtool is missing, the package is downloaded (no root needed but for a stale
# package list) and promtool alone is unpacked into a directory of its own, put on PATH. If it
# cannot be had, stop CI here with the reason: a green CI must have checked the metrics with it.
promtool_fail() { echo "error: promtool unavailable ($1): CI needs it for the metrics tests" >&2; exit 1; }
if ! command -v promtool >/dev/null; then
    command -v apt-get >/dev/null || promtool_fail "no apt-get"
    promtool_dir=$(mktemp -d /tmp/imgpipe-ci-promtool.XXXXXX)
    promtool_log=$promtool_dir/apt.log
    promtool_download() {
        (cd "$promtool_dir" && apt-get download -qq -o Acquire::Retries=1 -o Acquire::http::Timeout=20 prometheus) >>"$promtool_log" 2>&1
    }
    if ! promtool_download; then
        # The package lists lack it or are stale: refresh them (root, or passwordless sudo).
        promtool_sudo=()
        if [[ $(id -u) -ne 0 ]]; then
            if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then promtool_sudo=(sudo -n); else
                promtool_fail "the package lists lack prometheus; not root and no passwordless sudo to update them"
            fi
        fi
        { "${promtool_sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get -qq -o Acquire::Retries=1 \
            -o Acquire::http::Timeout=20 -o DPkg::Lock::Timeout=120 update >>"$promtool_log" 2>&1 &&
            promtool_download; } || promtool_fail "apt-get failed (offline?), see $promtool_log"
    fi
    dpkg-deb -x "$promtool_dir"/prometheus_*.deb "$promtool_dir/root" ||
        promtool_fail "cannot unpack the prometheus package, see $promtool_dir"
    [[ -x $promtool_dir/root/usr/bin/promtool ]] || promtool_fail "the prometheus package holds no usr/bin/promtool"
    export PATH="$promtool_dir/root/usr/bin:$PATH"
fi
promtool --version >/dev/null 2>&1 || promtool_fail "promtool does not run"

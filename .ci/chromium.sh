# Sourced by .ci/run (bash, set -euo pipefail).
# The HTML report's browser tests (tests/it/report_page.rs, through tests/it/browser.rs) need
# Chromium and chromedriver. Install them when missing (Debian: `chromium chromium-driver`), then
# require them, so a test that cannot start the browser fails instead of skipping. If they cannot
# be installed, stop CI here with the reason: a green CI must have run the browser tests.
chromium_bin=${IMGPIPE_CHROMIUM:-/usr/bin/chromium}
chromedriver_bin=${IMGPIPE_CHROMEDRIVER:-/usr/bin/chromedriver}
chromium_why=unknown
have_chromium() { [[ -x $chromium_bin && -x $chromedriver_bin ]]; }
# Sets $chromium_why and returns 1 when it cannot install. Called from an `if`, so `set -e` is off
# inside: every step checks its own status.
install_chromium() {
    local sudo=() log
    if [[ -n ${IMGPIPE_CHROMIUM:-}${IMGPIPE_CHROMEDRIVER:-} ]]; then
        chromium_why="IMGPIPE_CHROMIUM/IMGPIPE_CHROMEDRIVER point at missing files"; return 1
    fi
    if ! command -v apt-get >/dev/null; then chromium_why="no apt-get"; return 1; fi
    if [[ $(id -u) -ne 0 ]]; then
        if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then sudo=(sudo -n); else
            chromium_why="not root and no passwordless sudo"; return 1
        fi
    fi
    log=$(mktemp) || { chromium_why="mktemp failed"; return 1; }
    local apt=("${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get -qq
        -o Acquire::Retries=1 -o Acquire::http::Timeout=20 -o DPkg::Lock::Timeout=120)
    local install=("${apt[@]}" install -y --no-install-recommends chromium chromium-driver)
    # Refresh the package lists only when they lack the packages or are too stale to fetch them.
    if ! apt-cache show chromium chromium-driver >/dev/null 2>&1 || ! "${install[@]}" >>"$log" 2>&1; then
        if ! { "${apt[@]}" update >>"$log" 2>&1 && "${install[@]}" >>"$log" 2>&1; }; then
            chromium_why="apt-get failed (offline?), see $log"; return 1
        fi
    fi
    rm -f "$log"
}
if ! have_chromium && ! install_chromium; then
    echo "error: Chromium/chromedriver unavailable ($chromium_why): CI needs them for the HTML report's browser tests" >&2
    exit 1
elif ! have_chromium; then
    echo "error: installed chromium chromium-driver but $chromium_bin or $chromedriver_bin is still missing: CI needs them for the HTML report's browser tests" >&2
    exit 1
fi
export IMGPIPE_REQUIRE_CHROMIUM=1

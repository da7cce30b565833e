# Sourced by .ci/run (bash, set -euo pipefail).
# The PostgreSQL state tests (tests/it/postgres.rs) need a server. Install Debian's `postgresql`
# when missing, start a throwaway cluster on 127.0.0.1 (trust auth, fsync off: its data dies
# with CI) and give the tests its URL in IMGPIPE_TEST_POSTGRES. A URL already set is used as it
# is. If no server can be had, stop CI here with the reason: a green CI must have run them.
# IMGPIPE_PG_BIN names the directory of the server's binaries (initdb, pg_ctl) to use instead
# of the newest of /usr/lib/postgresql/*/bin; nothing is installed then.
if [[ -z ${IMGPIPE_TEST_POSTGRES:-} ]]; then
    pg_fail() { echo "error: PostgreSQL unavailable ($1): CI needs it for the PostgreSQL state tests" >&2; exit 1; }
    pg_bin() {
        if [[ -n ${IMGPIPE_PG_BIN:-} ]]; then echo "$IMGPIPE_PG_BIN"; else
            ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1
        fi
    }
    if [[ -n ${IMGPIPE_PG_BIN:-} && ! -x $IMGPIPE_PG_BIN/initdb ]]; then
        pg_fail "IMGPIPE_PG_BIN=$IMGPIPE_PG_BIN holds no initdb"
    fi
    if [[ -z $(pg_bin) || ! -x $(pg_bin)/initdb ]]; then
        pg_sudo=()
        if [[ $(id -u) -ne 0 ]]; then
            if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then pg_sudo=(sudo -n); else
                pg_fail "not root and no passwordless sudo"
            fi
        fi
        command -v apt-get >/dev/null || pg_fail "no apt-get"
        pg_log=$(mktemp)
        pg_apt=("${pg_sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get -qq
            -o Acquire::Retries=1 -o Acquire::http::Timeout=20 -o DPkg::Lock::Timeout=120)
        if ! "${pg_apt[@]}" install -y --no-install-recommends postgresql >>"$pg_log" 2>&1; then
            { "${pg_apt[@]}" update >>"$pg_log" 2>&1 &&
                "${pg_apt[@]}" install -y --no-install-recommends postgresql >>"$pg_log" 2>&1; } ||
                pg_fail "apt-get failed (offline?), see $pg_log"
        fi
        rm -f "$pg_log"
    fi
    pg_dir=$(mktemp -d /tmp/imgpipe-ci-pg.XXXXXX)
    # initdb refuses root: the cluster belongs to the postgres user the package made.
    pg_as=()
    if [[ $(id -u) -eq 0 ]]; then
        pg_as=(runuser -u postgres --)
        chown postgres: "$pg_dir" 2>/dev/null || pg_fail "root, and no postgres user to own the cluster"
    fi
    pg_port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])' 2>/dev/null || echo 54329)
    "${pg_as[@]}" "$(pg_bin)/initdb" -D "$pg_dir/data" -U postgres --auth=trust -E UTF8 --no-locale >"$pg_dir/initdb.log" 2>&1 ||
        pg_fail "initdb failed, see $pg_dir/initdb.log"
    "${pg_as[@]}" "$(pg_bin)/pg_ctl" -D "$pg_dir/data" -l "$pg_dir/log" -w -t 60 \
        -o "-c listen_addresses=127.0.0.1 -p $pg_port -k $pg_dir -c fsync=off -c max_connections=300" start >/dev/null ||
        pg_fail "the server did not start, see $pg_dir/log"
    trap '"${pg_as[@]}" "$(pg_bin)/pg_ctl" -D "$pg_dir/data" -m immediate stop >/dev/null 2>&1 || true' EXIT
    export IMGPIPE_TEST_POSTGRES="postgres://postgres@127.0.0.1:$pg_port/postgres"
fi

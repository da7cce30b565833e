//! An account's rate limit shared through the state database (issue 35): two processes of
//! different pipelines, neither told a rate, on one SQLite file and on one PostgreSQL
//! database, against one sandbox whose token bucket holds 10 calls a second (burst 5): no 429,
//! and the arrivals the sandbox saw never above its bucket; each run gets a fair share while
//! both are ready; a process killed holding a block delays the other no longer than the block;
//! the database cut mid-run (a proxy closed) drops each process to its share, and it says so;
//! back, they draw from the shared limit again.
//!
//! `status` and `runs` show both processes drawing while they run.
//!
//! The sandbox tells its limit in its account record: that is where both runs learn it.

use std::path::Path;

use imgpipe::sandbox::{self, LedgerEntry};

// The benches' proxy that turns into a black hole (`benches/shared_rate.rs` cuts the database
// with it too): one proxy, whose "cut" the bench's figures and this suite's tests both mean.
#[path = "../../benches/support/black_hole.rs"]
mod black_hole;

use crate::binary::Imgpipe;
use crate::common::*;
use crate::run::{config, edit_chain, write};

/// The account's rate. Low enough that the sandbox's burst (5) beyond imgpipe's own (2) is
/// 300 ms of slack for a loaded machine's delays between a call's turn and its arrival, high
/// enough that a block holds two calls.
const RATE: f64 = 10.0;
/// A call's interval at [`RATE`], in µs.
const INTERVAL_US: i64 = (1e6 / RATE) as i64;
const BURST: u32 = 5;
/// Items of each pipeline: `north` pays one generation an item, `south` three tool calls.
const NORTH_ITEMS: usize = 36;
const SOUTH_ITEMS: usize = 12;
const CALLS_EACH: usize = 36;

fn bucket() -> sandbox::Config {
    sandbox::Config {
        rate_limit: Some(RATE),
        rate_burst: Some(BURST),
        rate_scope: sandbox::RateScope::Paid,
        ..config()
    }
}

/// Two pipelines of 36 paid calls each, told apart in the ledger by what they pay for.
fn pipelines(dir: &Path) {
    let mut north = String::from(
        "version: 1\nname: north\noutput_dir: out\npricing: { generation: 4 }\nitems:\n",
    );
    for i in 0..NORTH_ITEMS {
        north += &format!("  - {{ id: n{i:02} }}\n");
    }
    north += "steps:\n  - id: shot\n    generate: { prompt: \"Studio photo of {{ item.id }}\" }\n";
    write(dir, "north.yaml", &north);
    let south = edit_chain(SOUTH_ITEMS, None).replace("name: chain\n", "name: south\n");
    write(dir, "south.yaml", &south);
}

fn is_north(e: &LedgerEntry) -> bool {
    e.operation == "generate"
}

fn run_of<'e>(env: &'e Env, state: &str, pipeline: &str) -> Imgpipe<'e> {
    Imgpipe::on(
        env,
        &["run", &format!("{pipeline}.yaml"), "--run-id", pipeline],
    )
    .state(state)
}

/// Arrival times in µs, in order.
fn arrivals(ledger: &[LedgerEntry]) -> Vec<u64> {
    let mut times: Vec<u64> = ledger.iter().map(|e| e.received_us).collect();
    times.sort_unstable();
    times
}

/// The token bucket's ceiling: between any two arrivals, no more calls than the burst and
/// the rate over the time between them allow (a millisecond of slack for the clock's reading).
fn assert_within_bucket(times: &[u64], rate: f64, burst: u32, what: &str) {
    for (i, first) in times.iter().enumerate() {
        for (j, last) in times.iter().enumerate().skip(i) {
            let calls = (j - i + 1) as f64;
            let allowed = f64::from(burst) + rate * (last - first + 1_000) as f64 / 1e6;
            assert!(
                calls <= allowed,
                "{what}: {calls} calls between {first} µs and {last} µs, above {allowed:.1}: {times:?}"
            );
        }
    }
}

/// While both runs were ready (from the later one's first call to the earlier one's last),
/// each got within 25% of the other's calls.
fn assert_fair(ledger: &[LedgerEntry]) {
    let mut ordered = ledger.to_vec();
    ordered.sort_by_key(|e| e.received_us);
    let first = |north: bool| ordered.iter().position(|e| is_north(e) == north).unwrap();
    let last = |north: bool| ordered.iter().rposition(|e| is_north(e) == north).unwrap();
    let (from, to) = (first(true).max(first(false)), last(true).min(last(false)));
    assert!(from < to, "the runs never overlapped: {ordered:?}");
    let window = &ordered[from..=to];
    let north = window.iter().filter(|e| is_north(e)).count() as f64;
    let south = window.len() as f64 - north;
    assert!(
        north.min(south) >= 0.75 * north.max(south),
        "unfair while both were ready: north {north}, south {south} of {} calls",
        window.len()
    );
}

async fn two_runs_share_the_accounts_rate(env: &Env, state: &str) {
    let dir = env.dir.path();
    pipelines(dir);
    // Both runs stay mid-call until `status` and `runs` have shown them drawing together.
    let hold = env.sandbox.hold();
    let shown = async {
        let drawers = |v: &serde_json::Value| v["rate_drawers"].as_array().map_or(0, Vec::len);
        wait_until_async("status to show both runs drawing from the rate", || async {
            let o = Imgpipe::on(env, &["status", "north", "--json"])
                .state(state)
                .run()
                .await;
            o.status.success() && drawers(&json_stdout(&o)) == 2
        })
        .await;
        let o = Imgpipe::on(env, &["runs", "--json"])
            .state(state)
            .run()
            .await;
        let runs = json_stdout(&o);
        let lines = runs.as_array().unwrap();
        assert!(lines.iter().all(|l| drawers(l) == 1), "{runs}");
        let text = Imgpipe::on(env, &["runs"]).state(state).run().await;
        assert!(
            stdout(&text).contains("draws from account")
                && stdout(&text).contains("with 2 process(es) in all"),
            "{}",
            stdout(&text)
        );
        drop(hold);
    };
    let (north, south, ()) = tokio::join!(
        run_of(env, state, "north").run(),
        run_of(env, state, "south").run(),
        shown
    );
    assert_exit_without_panic(&north, 0);
    assert_exit_without_panic(&south, 0);
    let stats = env.sandbox.stats();
    assert_eq!(stats.rate_limited, 0, "answered 429: {stats:?}");
    let ledger = env.sandbox.ledger();
    assert_eq!(ledger.len(), 2 * CALLS_EACH, "{ledger:?}");
    assert_within_bucket(&arrivals(&ledger), RATE, BURST, "both runs together");
    assert_fair(&ledger);
}

#[tokio::test(flavor = "multi_thread")]
async fn two_processes_on_one_sqlite_file_keep_to_the_accounts_rate_together() {
    let env = start(bucket()).await;
    let state = env.dir.path().join("state.db");
    two_runs_share_the_accounts_rate(&env, &state.to_string_lossy()).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn two_processes_on_one_postgres_database_keep_to_the_accounts_rate_together() {
    let Some(url) = postgres_database("shared_rate").await else {
        return;
    };
    let env = start(bucket()).await;
    two_runs_share_the_accounts_rate(&env, &url).await;
}

/// A process killed (SIGKILL) while it holds a block: its block is simply lost, the other run
/// goes on at the account's rate and finishes without a 429. What the dead process can hold
/// up is bounded by the account's record itself: at the kill, the account's next free moment
/// is at most three blocks ahead (2 calls of 100 ms each at 10/s): the other's block and the
/// killed one's last two, drawn as its previous one ended; never a lease that waits for its
/// holder to be found gone.
#[tokio::test(flavor = "multi_thread")]
async fn a_process_killed_holding_a_block_does_not_starve_the_other() {
    let env = start(bucket()).await;
    let dir = env.dir.path();
    pipelines(dir);
    let state = dir.join("state.db").to_string_lossy().into_owned();
    let mut north = run_of(&env, &state, "north").command().spawn().unwrap();
    let south = run_of(&env, &state, "south").run();
    let killer = async {
        wait_until("the north run's third call", || {
            env.sandbox.ledger().iter().filter(|e| is_north(e)).count() >= 3
        })
        .await;
        send_signal(north.id().unwrap(), libc::SIGKILL);
        wait_child(&mut north, RUN_LIMIT, "the killed north run").await;
        let ahead = ahead_of_now_us(Path::new(&state)).await;
        (env.sandbox.ledger().len(), ahead)
    };
    let (south, (killed_at, ahead)) = tokio::join!(south, killer);
    assert!(
        ahead <= 3 * i64::from(imgpipe::exec::account_rate::block_for(RATE)) * INTERVAL_US,
        "the account's next free moment was {ahead} µs ahead at the kill"
    );
    assert_exit_without_panic(&south, 0);
    let ledger = env.sandbox.ledger();
    let souths = ledger.iter().filter(|e| !is_north(e)).count();
    assert_eq!(
        souths, CALLS_EACH,
        "the south run paid every call: {ledger:?}"
    );
    assert!(
        killed_at < ledger.len(),
        "the south run went on after the kill"
    );
    assert_eq!(env.sandbox.stats().rate_limited, 0);
    assert_within_bucket(&arrivals(&ledger), RATE, BURST, "both runs together");
}

/// How far ahead of now the account's theoretical arrival time is in a SQLite state file (the
/// process clock: one machine), in µs; 0 when it is behind.
async fn ahead_of_now_us(state: &Path) -> i64 {
    use sqlx::{ConnectOptions, Connection};
    let mut conn = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(state)
        .read_only(true)
        .connect()
        .await
        .unwrap();
    let (tat,): (i64,) = sqlx::query_as("SELECT MAX(tat_us) FROM rate_accounts")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    conn.close().await.unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as i64;
    (tat - now).max(0)
}

/// The connection to the database the rate is drawn from cut mid-run (a proxy closed; the
/// runs' records go on through their own connection, `IMGPIPE_TEST_RATE_STATE`): each process
/// says it keeps to its share (a warning, and a `rate.fallback` event to its webhook), and
/// from then on sends no faster than half the account's rate.
#[tokio::test(flavor = "multi_thread")]
async fn the_database_cut_mid_run_drops_each_process_to_its_share_and_it_says_so() {
    let Some(url) = postgres_database("rate_cut").await else {
        return;
    };
    let env = start(bucket()).await;
    pipelines(env.dir.path());
    let mut proxied = url::Url::parse(&url).unwrap();
    let target = std::net::SocketAddr::from((
        std::net::Ipv4Addr::LOCALHOST,
        proxied.port().unwrap_or(5432),
    ));
    let proxy = TcpProxy::start(target).await;
    proxied.set_port(Some(proxy.port)).unwrap();
    let hook = crate::events::receiver(false).await;
    let run = |pipeline| {
        run_of(&env, &url, pipeline)
            .env("IMGPIPE_TEST_RATE_STATE", proxied.as_str())
            .args(&["--notify", &hook.url])
            .run()
    };
    let cutter = async {
        wait_until("six paid calls", || env.sandbox.ledger().len() >= 6).await;
        proxy.close().await;
        env.sandbox.ledger().len()
    };
    let (north, south, cut_at) = tokio::join!(run("north"), run("south"), cutter);
    for ran in [&north, &south] {
        assert_exit_without_panic(ran, 0);
        let said = stderr(ran);
        assert!(
            said.contains(&format!(
                "keeping to this process's share of the account's rate, {:.2} calls/s",
                RATE / 2.0
            )),
            "{said}"
        );
    }
    let told = hook.wait_for("rate.fallback").await.json();
    assert_eq!(told["per_second"], RATE / 2.0, "{told}");
    assert_eq!(told["drawers"], 2, "{told}");
    let mut ledger = env.sandbox.ledger();
    assert_eq!(ledger.len(), 2 * CALLS_EACH);
    ledger.sort_by_key(|e| e.received_us);
    let after = &ledger[cut_at..];
    for north in [true, false] {
        let times: Vec<u64> = after
            .iter()
            .filter(|e| is_north(e) == north)
            .map(|e| e.received_us)
            .collect();
        assert_within_bucket(&times, RATE / 2.0, BURST, "one process after the cut");
    }
}

/// A 429 to one process pauses the other too: the pause is recorded on the account, and the
/// other's next block begins after it. In the 2 s `Retry-After` of the one 429 the sandbox
/// gives, the other process sends at most the rest of the block it held (2 calls) and a call
/// on its way; without the shared pause it would go on at the account's whole rate (16 calls seen).
#[tokio::test(flavor = "multi_thread")]
async fn a_429_to_one_process_pauses_every_process_on_the_account() {
    // The bucket's burst is wide here: the one 429 is the aimed one, never one of a loaded
    // machine's late calls arriving together (the bucket itself is the other tests' claim).
    let env = start(sandbox::Config {
        rate_burst: Some(20),
        ..bucket()
    })
    .await;
    let dir = env.dir.path();
    pipelines(dir);
    let state = dir.join("state.db").to_string_lossy().into_owned();
    let aim = async {
        wait_until("both runs' first calls", || {
            let ledger = env.sandbox.ledger();
            ledger.iter().filter(|e| is_north(e)).count() >= 3
                && ledger.iter().filter(|e| !is_north(e)).count() >= 3
        })
        .await;
        env.sandbox
            .rate_limit_next(std::time::Duration::from_secs(2));
    };
    let (north, south, ()) = tokio::join!(
        run_of(&env, &state, "north").run(),
        run_of(&env, &state, "south").run(),
        aim
    );
    assert_exit_without_panic(&north, 0);
    assert_exit_without_panic(&south, 0);
    let limited = env.sandbox.rate_limits();
    assert_eq!(limited.len(), 1, "the one 429 aimed");
    let at = limited[0];
    let ledger = env.sandbox.ledger();
    // The process that got the 429 is the one whose call has no ledger entry at `at`: find it
    // by which run said so.
    let throttled_north = stderr(&north).contains("rate limited by the service");
    let throttled_south = stderr(&south).contains("rate limited by the service");
    assert!(throttled_north != throttled_south, "one run got the 429");
    let during: Vec<u64> = ledger
        .iter()
        .filter(|e| is_north(e) != throttled_north)
        .map(|e| e.received_us)
        .filter(|t| *t > at && *t < at + 2_000_000)
        .collect();
    assert!(
        during.len() <= 4,
        "the other process sent {} calls during the pause: {during:?}",
        during.len()
    );
}

/// The connection to the rate's database cut, then back (the proxy started again on its
/// port): each process, having said it keeps to its share, says it is back on the shared
/// limit, and both finish. The sandbox holds the calls meanwhile, so neither run can end
/// before the database is back.
#[tokio::test(flavor = "multi_thread")]
async fn when_the_database_answers_again_each_process_draws_from_the_shared_limit_again() {
    let Some(url) = postgres_database("rate_back").await else {
        return;
    };
    let env = start(bucket()).await;
    pipelines(env.dir.path());
    let mut proxied = url::Url::parse(&url).unwrap();
    let target = std::net::SocketAddr::from((
        std::net::Ipv4Addr::LOCALHOST,
        proxied.port().unwrap_or(5432),
    ));
    let proxy = TcpProxy::start(target).await;
    let port = proxy.port;
    proxied.set_port(Some(port)).unwrap();
    let watched = |pipeline| {
        Watched::start(
            run_of(&env, &url, pipeline)
                .env("IMGPIPE_TEST_RATE_STATE", proxied.as_str())
                .command(),
        )
    };
    let (mut north, mut south) = (watched("north"), watched("south"));
    wait_until("six paid calls", || env.sandbox.ledger().len() >= 6).await;
    proxy.close().await;
    let share = "keeping to this process's share of the account's rate";
    north.wait_for_line(share).await;
    south.wait_for_line(share).await;
    let hold = env.sandbox.hold();
    let proxy = TcpProxy::start_on(target, port).await;
    let back = "back on the account's shared rate";
    north.wait_for_line(back).await;
    south.wait_for_line(back).await;
    drop(hold);
    let (north, south) = (north.finish().await, south.finish().await);
    assert_exit_without_panic(&north, 0);
    assert_exit_without_panic(&south, 0);
    // Every call paid once. (A 429 may meet the switch back: the shared limit's burst comes on
    // top of the calls the shares sent just before; the service's pause then holds all.)
    assert_eq!(env.sandbox.ledger().len(), 2 * CALLS_EACH);
    assert_no_request_billed_twice(&env);
    proxy.close().await;
}

/// The whole state database gone silent mid-run (a proxy that stops forwarding and closes
/// nothing: a database that does not answer, not one that refuses): the run does not wait on
/// it for ever. Its run lock's session answers no ping within 10 s, so it stops as if
/// interrupted (exit 130), and once its grace (`--grace 1`) and the bound on its records are
/// over, it ends saying what stays unrecorded. The resume, once the database answers, pays
/// for every task left and pays again nothing recorded before the cut (the calls held at the
/// sandbox's gate across it, billed while nothing could be recorded, are possibly billed).
#[tokio::test(flavor = "multi_thread")]
async fn a_run_whose_database_stops_answering_ends_in_bounded_time_and_resumes() {
    let Some(url) = postgres_database("rate_silent").await else {
        return;
    };
    let env = start(bucket()).await;
    pipelines(env.dir.path());
    let mut proxied = url::Url::parse(&url).unwrap();
    let target = std::net::SocketAddr::from((
        std::net::Ipv4Addr::LOCALHOST,
        proxied.port().unwrap_or(5432),
    ));
    let proxy = black_hole::BlackHole::start(target);
    proxied.set_port(Some(proxy.port)).unwrap();
    env.sandbox.hold_calls();
    env.sandbox.let_through(6);
    // The bound on its records 3 s rather than 30 (`IMGPIPE_TEST_RECORD_WITHIN_SECS`, a
    // test-only setting): the same end, said the same way, 27 s sooner.
    let mut north = run_of(&env, proxied.as_str(), "north")
        .args(&["--grace", "1"])
        .env("IMGPIPE_TEST_RECORD_WITHIN_SECS", "3")
        .watched();
    wait_until("six calls paid and a seventh held", || {
        env.sandbox.ledger().len() >= 6 && env.sandbox.held_calls() >= 1
    })
    .await;
    // Billed is not yet recorded: the cut comes once the six answers are in the database
    // (read past the proxy), so that "recorded before the cut" is what the end checks.
    wait_until_async("the six paid calls recorded", || async {
        use sqlx::Connection;
        let mut conn = state_connection(&url).await;
        let (n,): (i64,) =
            sqlx::query_as("SELECT COUNT(*) FROM attempts WHERE outcome = 'succeeded'")
                .fetch_one(&mut conn)
                .await
                .unwrap();
        conn.close().await.unwrap();
        n >= 6
    })
    .await;
    proxy.cut();
    env.sandbox.release_calls();
    north
        .wait_for_line_within("no answer within 10s", std::time::Duration::from_secs(60))
        .await;
    let north = north.finish().await;
    assert_exit_without_panic(&north, 130);
    assert!(
        stderr(&north).contains("the state database did not take the run's records within 3s"),
        "{}",
        stderr(&north)
    );
    let paid_while_cut = env.sandbox.ledger().len();
    assert!(
        paid_while_cut >= 7,
        "the held call was billed: {paid_while_cut}"
    );
    // Each call billed while nothing could be recorded is named, with the command that fetches
    // its images without paying again.
    for e in &env.sandbox.ledger()[6..paid_while_cut] {
        let named = format!("`imgpipe job {} --out DIR`", e.job_id);
        assert!(
            stderr(&north).contains(&named),
            "{named} in {}",
            stderr(&north)
        );
    }
    // The proxy's connections close with it: the server ends their sessions and the run lock.
    drop(proxy);
    let resumed = Imgpipe::on(&env, &["resume", "north"])
        .state(&url)
        .run()
        .await;
    assert_exit_without_panic(&resumed, 0);
    // Every task paid for; paid again only what was billed while the database could record
    // nothing (those calls stay possibly billed, and `--on-ambiguous retry` calls again).
    let ledger = env.sandbox.ledger();
    let silent: std::collections::HashSet<&str> = ledger[6..paid_while_cut]
        .iter()
        .map(|e| e.request.as_str())
        .collect();
    let mut seen = std::collections::HashSet::new();
    for e in &ledger {
        assert!(
            seen.insert(e.request.as_str()) || silent.contains(e.request.as_str()),
            "paid twice, though recorded before the cut: {e:?}"
        );
    }
    assert_eq!(seen.len(), CALLS_EACH, "every task paid: {ledger:?}");
}

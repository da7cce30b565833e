//! Promises of README that no other test would miss if they broke. On a PostgreSQL state
//! ("Beyond one machine", "Exit codes"): the password of a `--state` URL appears nowhere a user
//! or a log reader sees it, and a database that is not imgpipe's (empty, another
//! application's, a newer imgpipe's) is refused with exit 2 and left exactly as it was. And a
//! one-off command the service answers with 400 exits 2, having written and paid nothing.

use sqlx::Connection;

use crate::common::*;
use crate::run::{edit_chain, write};

const SECRET: &str = "pg-secret-7781";

/// The tables of the database's public schema, sorted.
async fn tables(url: &str) -> Vec<String> {
    let mut conn = pg_connect(url).await;
    let rows: Vec<(String,)> = sqlx::query_as(
        "SELECT table_name::text FROM information_schema.tables
         WHERE table_schema = 'public' ORDER BY table_name",
    )
    .fetch_all(&mut conn)
    .await
    .unwrap();
    conn.close().await.unwrap();
    rows.into_iter().map(|r| r.0).collect()
}

async fn execute(url: &str, sql: &'static str) {
    let mut conn = pg_connect(url).await;
    sqlx::raw_sql(sql).execute(&mut conn).await.unwrap();
    conn.close().await.unwrap();
}

/// The same database's URL with a password in it; the tests' server trusts loopback, so it
/// is accepted and ignored, as a real one would check it.
fn with_password(url: &str) -> String {
    let mut url = url::Url::parse(url).unwrap();
    url.set_password(Some(SECRET)).unwrap();
    url.to_string()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_postgres_password_reaches_no_output_log_or_row() {
    let Some(url) = postgres_database("secret").await else {
        return;
    };
    let url = with_password(&url);
    let env = start_default().await;
    let dir = env.dir.path();
    write(dir, "p.yaml", &edit_chain(2, None));
    // A run that stops part way prints the command that continues it, state URL included.
    let run = Imgpipe::on(
        &env,
        &["-vv", "run", "p.yaml", "--run-id", "r", "--until", "clean"],
    )
    .cwd(dir)
    .state(&url)
    .run()
    .await;
    assert_exit(&run, 7);
    let status = Imgpipe::on(&env, &["-vv", "status", "r"])
        .cwd(dir)
        .state(&url)
        .run()
        .await;
    assert_exit(&status, 0);
    let runs = Imgpipe::on(&env, &["runs", "--json"])
        .cwd(dir)
        .state(&url)
        .run()
        .await;
    assert_exit(&runs, 0);
    for (what, o) in [("run -vv", &run), ("status -vv", &status), ("runs", &runs)] {
        let text = format!("{}{}", stdout(o), stderr(o));
        assert!(!text.contains(SECRET), "{what} shows the password:\n{text}");
    }
    let hint = stderr(&run);
    assert!(
        hint.contains("--state postgres://postgres@127.0.0.1"),
        "the continue command names the database without its password: {hint}"
    );
    let mut conn = pg_connect(&url).await;
    let (rows,): (i64,) = sqlx::query_as(
        "SELECT COUNT(*) FROM runs
         WHERE pipeline_text LIKE '%' || $1 || '%' OR plan_json LIKE '%' || $1 || '%'
            OR output_dir LIKE '%' || $1 || '%' OR COALESCE(stop_reason, '') LIKE '%' || $1 || '%'",
    )
    .bind(SECRET)
    .fetch_one(&mut conn)
    .await
    .unwrap();
    conn.close().await.unwrap();
    assert_eq!(rows, 0, "no run's row holds the password");
}

#[tokio::test(flavor = "multi_thread")]
async fn commands_that_only_read_make_no_tables_in_an_empty_postgres_database() {
    let Some(url) = postgres_database("empty").await else {
        return;
    };
    let env = start_default().await;
    let dir = env.dir.path();
    for args in [
        &["status", "r"][..],
        &["report", "r"],
        &["runs"],
        &["spend"],
        &["cap", "list"],
    ] {
        let o = Imgpipe::on(&env, args).cwd(dir).state(&url).run().await;
        assert_exit(&o, 2);
        assert!(
            tables(&url).await.is_empty(),
            "`{}` made tables in an empty database",
            args.join(" ")
        );
    }
    assert_nothing_billed(&env);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_postgres_database_of_another_application_is_refused_and_left_alone() {
    let Some(url) = postgres_database("other_app").await else {
        return;
    };
    execute(
        &url,
        "CREATE TABLE customers (id BIGINT PRIMARY KEY, name TEXT)",
    )
    .await;
    let env = start_default().await;
    let dir = env.dir.path();
    write(dir, "p.yaml", &edit_chain(1, None));
    let o = Imgpipe::on(&env, &["run", "p.yaml"])
        .cwd(dir)
        .state(&url)
        .run()
        .await;
    assert_exit(&o, 2);
    assert_eq!(
        tables(&url).await,
        ["customers"],
        "nothing added, nothing removed"
    );
    assert_nothing_billed(&env);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_postgres_database_from_a_newer_imgpipe_is_refused_and_left_alone() {
    let Some(url) = postgres_database("newer").await else {
        return;
    };
    let env = start_default().await;
    let dir = env.dir.path();
    write(dir, "p.yaml", &edit_chain(1, None));
    assert_exit(
        &Imgpipe::on(&env, &["run", "p.yaml", "--run-id", "r"])
            .cwd(dir)
            .state(&url)
            .run()
            .await,
        0,
    );
    execute(
        &url,
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time)
         VALUES (99991231000000, 'from the future', true, '\\x00', 0)",
    )
    .await;
    let before = tables(&url).await;
    let calls = env.sandbox.ledger().len();
    for args in [&["runs"][..], &["run", "p.yaml", "--run-id", "s"]] {
        let o = Imgpipe::on(&env, args).cwd(dir).state(&url).run().await;
        assert_exit(&o, 2);
        assert!(
            stderr(&o).contains("newer imgpipe"),
            "`{}`: {}",
            args.join(" "),
            stderr(&o)
        );
    }
    assert_eq!(tables(&url).await, before);
    assert_eq!(env.sandbox.ledger().len(), calls, "nothing billed");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_one_off_command_the_service_refuses_as_invalid_exits_2_and_writes_nothing() {
    let env = start_default().await;
    let dir = env.dir.path();
    // The client cannot know which images the service can read: the sandbox answers 400.
    let missing = format!("{}assets/nosuch.png", env.sandbox.base_url());
    for args in [
        vec![
            "tool",
            "erase",
            "--object-name",
            "the cable",
            "--image-url",
            &missing,
            "--out",
            "out",
        ],
        vec![
            "generate",
            "--prompt",
            "a lamp",
            "--image-url",
            &missing,
            "--out",
            "out",
        ],
    ] {
        let mut cmd = Imgpipe::new(&args).cwd(dir).command();
        cmd.env("IMGPIPE_BASE_URL", env.sandbox.base_url().as_str())
            .env("IMGPIPE_API_KEY", env.sandbox.key());
        let o = finish(cmd).await;
        assert_exit(&o, 2);
        assert!(stderr(&o).contains("400"), "{}: {}", args[0], stderr(&o));
        assert!(!dir.join("out").exists(), "{}: nothing written", args[0]);
    }
    assert_nothing_billed(&env);
}

/// A redirect would carry `X-API-Key` to wherever it points: the client follows none, so the
/// key and the paid call go nowhere but to the service named.
#[tokio::test(flavor = "multi_thread")]
async fn the_client_follows_no_redirect_with_the_key() {
    use axum::Router;
    use axum::http::{StatusCode, header::LOCATION};
    use axum::response::IntoResponse;
    use axum::routing::{get, post};

    let elsewhere = Fake::start(|base| {
        let image = format!("{base}img/0.png");
        Router::new()
            .route(
                "/v1/images/generations",
                post(move || async move { axum::Json(generation("job_x", &image)) }),
            )
            .route(
                "/v1/account",
                get(|| async { axum::Json(serde_json::json!({"credits": 5})) }),
            )
    })
    .await;
    let (to_generate, to_account) = (
        elsewhere.url("/v1/images/generations"),
        elsewhere.url("/v1/account"),
    );
    let service = Fake::start(move |_| {
        Router::new()
            .route(
                "/v1/images/generations",
                post(move || async move {
                    (StatusCode::TEMPORARY_REDIRECT, [(LOCATION, to_generate)]).into_response()
                }),
            )
            .route(
                "/v1/account",
                get(move || async move {
                    (StatusCode::FOUND, [(LOCATION, to_account)]).into_response()
                }),
            )
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let generate = service
        .run(&["generate", "--prompt", "x", "--out", "out"], dir.path())
        .await;
    let account = service.run(&["account"], dir.path()).await;
    assert_eq!(service.count("POST", "/v1/images/generations"), 1);
    assert_eq!(service.count("GET", "/v1/account"), 1);
    assert_eq!(
        elsewhere.total(),
        0,
        "a redirect was followed: {}{}",
        stderr(&generate),
        stderr(&account)
    );
    assert_ne!(generate.status.code(), Some(0), "{}", stderr(&generate));
    assert_ne!(account.status.code(), Some(0), "{}", stderr(&account));
    assert!(!dir.path().join("out").exists(), "nothing written");
}

/// A service that echoes the key in its error (a 401 naming the key it refused) never gets it
/// onto the terminal.
#[tokio::test(flavor = "multi_thread")]
async fn a_key_the_service_echoes_is_scrubbed_from_what_is_shown() {
    use axum::Router;
    use axum::http::StatusCode;
    use axum::response::IntoResponse;
    use axum::routing::{get, post};

    let echo = || {
        let body = serde_json::json!({"error": {"message": format!("invalid API key {FAKE_KEY}"), "key": FAKE_KEY}});
        (StatusCode::UNAUTHORIZED, axum::Json(body)).into_response()
    };
    let service = Fake::start(move |_| {
        Router::new()
            .route(
                "/v1/images/generations",
                post(move || async move { echo() }),
            )
            .route("/v1/account", get(move || async move { echo() }))
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    for args in [
        &["generate", "--prompt", "x", "--out", "out"][..],
        &["account"],
        &["-vv", "account", "--json"],
    ] {
        let o = service.run(args, dir.path()).await;
        assert_ne!(o.status.code(), Some(0));
        let shown = format!("{}{}", stdout(&o), stderr(&o));
        assert!(
            !shown.contains(FAKE_KEY),
            "`{}` shows the key:\n{shown}",
            args.join(" ")
        );
    }
}

/// The password of a PostgreSQL state comes from `PGPASSWORD` or `~/.pgpass`, as libpq's does,
/// against a server that checks it (a throwaway cluster of the test's own: `scram-sha-256` on
/// 127.0.0.1); a wrong one, from either place or the URL, is refused with exit 1 and an error
/// that says what failed and never shows the password.
#[tokio::test(flavor = "multi_thread")]
async fn a_postgres_password_comes_from_pgpassword_or_pgpass_and_a_wrong_one_is_never_shown() {
    const ADMIN: &str = "admin-pw-5520";
    const RIGHT: &str = "right-pw-9034";
    const WRONG: &str = "wrong-pw-1177";
    let Some(cluster) = crate::cluster::Cluster::start(ADMIN).await else {
        return;
    };
    let mut admin = pg_connect(&cluster.url("postgres", Some(ADMIN), "postgres")).await;
    for sql in [
        format!("CREATE ROLE imgpipe LOGIN PASSWORD '{RIGHT}'"),
        "CREATE DATABASE imgpipe OWNER imgpipe".to_owned(),
    ] {
        within(
            &sql,
            sqlx::raw_sql(sqlx::AssertSqlSafe(sql.clone())).execute(&mut admin),
        )
        .await
        .unwrap();
    }
    admin.close().await.unwrap();
    let state = cluster.url("imgpipe", None, "imgpipe");
    let env = start_default().await;
    let dir = env.dir.path();
    write(dir, "p.yaml", &edit_chain(1, None));
    let run = |run_id: &str| Imgpipe::on(&env, &["run", "p.yaml", "--run-id", run_id]);

    // PGPASSWORD: the run, its lock and its writes.
    let by_env = run("by-env")
        .state(&state)
        .env("PGPASSWORD", RIGHT)
        .run()
        .await;
    assert_exit(&by_env, 0);

    // ~/.pgpass (0600, as libpq wants it) in the HOME the command gets.
    let pgpass = Imgpipe::home_in(dir).join(".pgpass");
    let line = format!("127.0.0.1:{}:imgpipe:imgpipe:{RIGHT}\n", cluster.port);
    std::fs::write(&pgpass, line).unwrap();
    std::fs::set_permissions(&pgpass, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    assert_exit(&run("by-file").state(&state).run().await, 0);
    let runs = Imgpipe::on(&env, &["runs"])
        .cwd(dir)
        .state(&state)
        .run()
        .await;
    assert_exit(&runs, 0);
    for run_id in ["by-env", "by-file"] {
        assert!(stdout(&runs).contains(run_id), "{}", stdout(&runs));
    }
    std::fs::remove_file(&pgpass).unwrap();

    // Wrong, from PGPASSWORD and from the URL: refused, the password nowhere in what is said.
    let wrong_env = run("wrong")
        .state(&state)
        .env("PGPASSWORD", WRONG)
        .run()
        .await;
    let in_url = cluster.url("imgpipe", Some(WRONG), "imgpipe");
    let wrong_url = run("wrong").state(&in_url).run().await;
    for (how, o) in [("PGPASSWORD", &wrong_env), ("the URL", &wrong_url)] {
        assert_exit(o, 1);
        let said = format!("{}{}", stdout(o), stderr(o));
        assert!(
            said.contains("password authentication failed for user \"imgpipe\""),
            "a wrong password in {how} said as such:\n{said}"
        );
        assert!(
            said.contains(&format!(
                "postgres://imgpipe@127.0.0.1:{}/imgpipe",
                cluster.port
            )),
            "the database named, without the password:\n{said}"
        );
        assert!(
            said.contains("hint: give the password of the URL's user in PGPASSWORD or ~/.pgpass"),
            "the hint says where the password goes:\n{said}"
        );
        for secret in [WRONG, RIGHT, ADMIN] {
            assert!(!said.contains(secret), "{how}: a password shown:\n{said}");
        }
    }
    assert_eq!(
        env.sandbox.ledger().len(),
        2 * 3,
        "only the two runs that got in paid"
    );
}

/// A PostgreSQL state whose server takes the connection and never answers (a host frozen, a
/// network dropping every packet) stops the command with exit 1 and says so within the
/// connection's bound, instead of holding it (or a CronJob) for ever. The "server" is a
/// listening socket on 127.0.0.1 that never accepts: the kernel completes the handshake, and
/// nothing answers the startup message.
#[tokio::test(flavor = "multi_thread")]
async fn a_postgres_server_that_never_answers_stops_the_command_saying_so() {
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = silent.local_addr().unwrap().port();
    let state = format!("postgres://imgpipe:{SECRET}@127.0.0.1:{port}/imgpipe");
    let dir = tempfile::tempdir().unwrap();
    let command = |args: &'static [&'static str]| {
        Imgpipe::new(args)
            .cwd(dir.path())
            .state(&state)
            .limit(std::time::Duration::from_secs(90))
            .run()
    };
    // Both at once: each waits out the bound, and the test need not wait it twice.
    let both: [&'static [&'static str]; 2] = [&["status", "some-run"], &["runs"]];
    let ran = futures::future::join_all(both.map(command)).await;
    for (args, o) in both.into_iter().zip(ran) {
        assert_exit(&o, 1);
        let said = format!("{}{}", stdout(&o), stderr(&o));
        assert!(
            said.contains("the server did not answer within 10s"),
            "`{}` said why it stopped:\n{said}",
            args.join(" ")
        );
        assert!(!said.contains(SECRET), "no password shown:\n{said}");
    }
    drop(silent);
}

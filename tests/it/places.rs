//! Places the user names for state and outputs: a URL where a path is expected is refused
//! (exit 2, naming the option or field) and never created as a relative path such as
//! `./s3:/bucket/`; `file:///abs` is the path it names.

use std::path::Path;

use crate::common::*;

const PIPELINE: &str = "version: 1
name: places
items:
  - { id: a }
steps:
  - id: shot
    generate: { prompt: \"a mug\", n: 1, size: 2K }
";

/// Everything in `dir` but the pipeline file: what a refused command must not have made.
fn made(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n != "p.yaml")
        .collect();
    names.sort();
    names
}

#[tokio::test(flavor = "multi_thread")]
async fn a_url_given_for_state_or_outputs_is_refused_and_nothing_is_created() {
    let dir = tempfile::tempdir().unwrap();
    let cwd = dir.path();
    std::fs::write(cwd.join("p.yaml"), PIPELINE).unwrap();
    let state = cwd.join("st.db");
    let state = state.to_str().unwrap();
    let mysql = "mysql://root@127.0.0.1:3306/imgpipe";
    let cases: [(&[&str], &str); 4] = [
        (
            &["run", "p.yaml", "--sandbox", "--state", mysql],
            "the state database",
        ),
        (
            &[
                "run",
                "p.yaml",
                "--sandbox",
                "--state",
                state,
                "--out",
                "ftp://shots/full",
            ],
            "the output place",
        ),
        (
            &["status", "r1", "--state", "sqlite://st.db"],
            "the state database",
        ),
        (
            &[
                "generate",
                "--sandbox",
                "--prompt",
                "x",
                "--out",
                "gs://b/p",
            ],
            "the output place",
        ),
    ];
    for (args, what) in cases {
        let o = imgpipe(None, args, cwd).await;
        assert_exit_without_panic(&o, 2);
        let err = stderr(&o);
        assert!(
            err.contains(what) && err.contains(":// URL"),
            "{args:?}: {err}"
        );
        assert!(
            err.contains("local path"),
            "says what to give instead: {err}"
        );
        assert_eq!(
            made(cwd),
            Vec::<String>::new(),
            "{args:?} created something"
        );
    }

    let mut cmd = Imgpipe::new(&["run", "p.yaml", "--sandbox"])
        .cwd(cwd)
        .command();
    cmd.env("IMGPIPE_STATE", mysql);
    let o = finish(cmd).await;
    assert_exit_without_panic(&o, 2);
    let err = stderr(&o);
    assert!(
        err.contains("IMGPIPE_STATE") && err.contains("mysql:// URL"),
        "{err}"
    );
    assert_eq!(made(cwd), Vec::<String>::new());
}

/// A postgres:// state is a backend, not a path: when its server cannot be reached the run
/// says so at once, names the URL without its password, and creates nothing locally.
#[tokio::test(flavor = "multi_thread")]
async fn an_unreachable_postgres_state_is_said_at_once_and_nothing_is_created() {
    let dir = tempfile::tempdir().unwrap();
    let cwd = dir.path();
    std::fs::write(cwd.join("p.yaml"), PIPELINE).unwrap();
    // A port nothing listens on: bound, then let go.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("postgres://imgpipe:s3cret-pw@127.0.0.1:{port}/imgpipe");
    let started = std::time::Instant::now();
    let o = imgpipe(None, &["run", "p.yaml", "--sandbox", "--state", &url], cwd).await;
    assert_exit_without_panic(&o, 1);
    let all = format!("{}{}", stdout(&o), stderr(&o));
    assert!(
        all.contains(&format!("postgres://imgpipe@127.0.0.1:{port}/imgpipe")),
        "names the database: {all}"
    );
    assert!(
        !all.contains("s3cret-pw"),
        "never shows the password: {all}"
    );
    assert!(
        started.elapsed() < std::time::Duration::from_secs(20),
        "a refused connection is not waited on for the pool's timeout"
    );
    assert_eq!(made(cwd), Vec::<String>::new());
}

#[tokio::test(flavor = "multi_thread")]
async fn an_output_dir_url_in_a_pipeline_file_is_an_error_at_its_line() {
    let dir = tempfile::tempdir().unwrap();
    let cwd = dir.path();
    let text = PIPELINE.replace(
        "name: places\n",
        "name: places\noutput_dir: ftp://shots/full\n",
    );
    std::fs::write(cwd.join("p.yaml"), text).unwrap();
    let o = imgpipe(None, &["validate", "p.yaml"], cwd).await;
    assert_exit_without_panic(&o, 2);
    let err = format!("{}{}", stdout(&o), stderr(&o));
    assert!(
        err.contains("p.yaml:3:") && err.contains("output_dir `ftp://shots/full` is a ftp:// URL"),
        "{err}"
    );
    let o = imgpipe(
        None,
        &["run", "p.yaml", "--sandbox", "--state", "st.db"],
        cwd,
    )
    .await;
    assert_exit_without_panic(&o, 2);
    assert_eq!(made(cwd), Vec::<String>::new());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_file_url_is_the_absolute_path_it_names() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("shots");
    let url = format!("file://{}", out.display());
    let o = imgpipe(
        None,
        &["generate", "--sandbox", "--prompt", "a mug", "--out", &url],
        dir.path(),
    )
    .await;
    assert_exit_without_panic(&o, 0);
    let files: Vec<_> = std::fs::read_dir(&out).unwrap().collect();
    assert_eq!(files.len(), 1, "one image in {}", out.display());
    let o = imgpipe(
        None,
        &[
            "generate",
            "--sandbox",
            "--prompt",
            "a mug",
            "--out",
            "file://shots",
        ],
        dir.path(),
    )
    .await;
    assert_exit_without_panic(&o, 2);
    assert!(stderr(&o).contains("absolute path"), "{}", stderr(&o));
}

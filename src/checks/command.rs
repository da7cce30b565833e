//! The command check: a program the user names judges each output. It runs without a shell,
//! the output's path is one argument (in place of `{file}`), a bounded number run at once, and
//! what it prints is read as data: `{"score": 0.7, "reason": "…"}`, never a path or a command.
//! Exit 0 passes, 1 fails; anything else (a crash, a signal, the timeout, a program that
//! cannot start) cannot judge, which is not the image's fault.

use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;

use tokio::io::AsyncReadExt;
use tokio::process::Command;
use tokio::sync::Semaphore;

use crate::checks::{Outcome, Verdict};
use crate::pipeline::checks::{CheckName, CommandCheck, FILE_PLACEHOLDER};

/// Command checks running at once: each is a process of its own (often a model in Python),
/// and a night of 100,000 outputs must not start them by the hundred.
pub const MAX_COMMANDS_AT_ONCE: usize = 4;
/// The most of a command's stdout read: a verdict is a line of JSON, not a file.
const MAX_STDOUT_BYTES: u64 = 64 * 1024;

/// Runs command checks, a bounded number at a time (shared by every step of a run).
#[derive(Clone, Debug)]
pub struct Commands {
    permits: Arc<Semaphore>,
}

impl Default for Commands {
    fn default() -> Self {
        Commands::new(MAX_COMMANDS_AT_ONCE)
    }
}

impl Commands {
    pub fn new(at_once: usize) -> Commands {
        Commands {
            permits: Arc::new(Semaphore::new(at_once.max(1))),
        }
    }

    /// Runs `check` on the output at `file` and reads its verdict.
    pub async fn judge(&self, check: &CommandCheck, file: &Path) -> Verdict {
        let Ok(_permit) = self.permits.acquire().await else {
            return Verdict::not_checked(CheckName::Command, "the run is stopping");
        };
        let argv = arguments(&check.argv, file);
        let mut command = Command::new(&argv[0]);
        command
            .args(&argv[1..])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true);
        let mut child = match command.spawn() {
            Ok(child) => child,
            Err(e) => {
                return Verdict::not_checked(
                    CheckName::Command,
                    format!("`{}` could not start: {e}", argv[0]),
                );
            }
        };
        let mut stdout = String::new();
        let waited = tokio::time::timeout(check.timeout, async {
            if let Some(out) = child.stdout.take() {
                // Output past the bound or not UTF-8 is no verdict's data: it is left unread.
                let _ = out.take(MAX_STDOUT_BYTES).read_to_string(&mut stdout).await;
            }
            child.wait().await
        })
        .await;
        match waited {
            Err(_) => {
                // Dropping the child kills it (`kill_on_drop`); waiting reaps it.
                let _ = child.kill().await;
                Verdict::not_checked(
                    CheckName::Command,
                    format!("no verdict after {} s", check.timeout.as_secs()),
                )
            }
            Ok(Err(e)) => {
                Verdict::not_checked(CheckName::Command, format!("could not wait for it: {e}"))
            }
            Ok(Ok(status)) => verdict(status.code(), &stdout),
        }
    }
}

/// The argv with every `{file}` replaced by the output's path.
fn arguments(argv: &[String], file: &Path) -> Vec<String> {
    let path = file.to_string_lossy();
    argv.iter()
        .map(|a| a.replace(FILE_PLACEHOLDER, &path))
        .collect()
}

/// The verdict of a program that exited with `code` (`None` for a signal), printing `stdout`.
fn verdict(code: Option<i32>, stdout: &str) -> Verdict {
    let (score, reason) = said(stdout);
    let outcome = match code {
        Some(0) => Outcome::Passed,
        Some(1) => Outcome::Failed,
        Some(other) => {
            return Verdict::not_checked(
                CheckName::Command,
                format!("exited with status {other}, neither 0 (pass) nor 1 (fail)"),
            );
        }
        None => return Verdict::not_checked(CheckName::Command, "ended by a signal"),
    };
    let reason = reason.unwrap_or_else(|| match outcome {
        Outcome::Passed => "the command passed it".into(),
        _ => "the command failed it".into(),
    });
    Verdict::new(CheckName::Command, outcome, score, reason)
}

/// The score and reason a program printed as `{"score": …, "reason": …}`, if it did.
fn said(stdout: &str) -> (Option<f64>, Option<String>) {
    let Ok(serde_json::Value::Object(fields)) = serde_json::from_str(stdout.trim()) else {
        return (None, None);
    };
    let score = fields.get("score").and_then(serde_json::Value::as_f64);
    let reason = fields
        .get("reason")
        .and_then(serde_json::Value::as_str)
        .map(str::to_owned);
    (score, reason)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn sh(script: &str, timeout: Duration) -> CommandCheck {
        // The test's program is a shell script; imgpipe itself never runs one for a check.
        CommandCheck {
            argv: vec![
                "sh".into(),
                "-c".into(),
                script.into(),
                "judge".into(),
                "{file}".into(),
            ],
            timeout,
        }
    }

    async fn judge(script: &str) -> Verdict {
        let file = Path::new("/tmp/a b; rm -rf ~/x.png");
        Commands::default()
            .judge(&sh(script, Duration::from_secs(20)), file)
            .await
    }

    #[tokio::test]
    async fn exit_0_passes_and_1_fails_with_what_was_printed() {
        let v = judge(r#"echo '{"score": 0.7, "reason": "sharp enough"}'"#).await;
        assert_eq!(
            (v.outcome, v.score, v.reason.as_str()),
            (Outcome::Passed, Some(0.7), "sharp enough")
        );
        let v = judge(r#"printf '%s' '{"score": 0.1, "reason": "blurry\nvery"}'; exit 1"#).await;
        assert_eq!(
            (v.outcome, v.score, v.reason.as_str()),
            (Outcome::Failed, Some(0.1), "blurry very")
        );
        let v = judge("echo not json; exit 1").await;
        assert_eq!((v.outcome, v.score), (Outcome::Failed, None));
    }

    #[tokio::test]
    async fn the_path_is_one_argument_never_read_by_a_shell() {
        let v = judge(r#"[ "$1" = '/tmp/a b; rm -rf ~/x.png' ] && [ $# -eq 1 ]"#).await;
        assert_eq!(v.outcome, Outcome::Passed, "{v:?}");
    }

    #[tokio::test]
    async fn a_crash_a_missing_program_and_no_verdict_cannot_judge() {
        for script in ["exit 2", "kill -9 $$"] {
            let v = judge(script).await;
            assert_eq!(
                (v.outcome, v.score),
                (Outcome::NotChecked, None),
                "{script}: {v:?}"
            );
        }
        let missing = CommandCheck {
            argv: vec!["/nonexistent/judge".into(), "{file}".into()],
            timeout: Duration::from_secs(5),
        };
        let v = Commands::default()
            .judge(&missing, Path::new("x.png"))
            .await;
        assert_eq!(v.outcome, Outcome::NotChecked);
        assert!(v.reason.contains("could not start"), "{v:?}");
    }

    #[tokio::test]
    async fn a_command_that_never_returns_is_stopped_at_its_timeout() {
        let check = sh("sleep 600", Duration::from_secs(1));
        let v = Commands::default().judge(&check, Path::new("x.png")).await;
        assert_eq!(v.outcome, Outcome::NotChecked);
        assert_eq!(v.reason, "no verdict after 1 s");
    }
}

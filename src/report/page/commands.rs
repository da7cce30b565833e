//! The commands a page offers to paste: `imgpipe reroll RUN_ID TASK…`, which the page's script
//! builds from the outputs ticked, and `imgpipe resume RUN_ID`, each with the flags that find
//! the run's state database again. Words are quoted as `crate::shell` quotes them, and the
//! script quotes the task words the same way.

use crate::run_id::RunId;
use std::path::Path;

use crate::shell::quote;
use crate::store::{Location, SANDBOX_FILE, default_path};

/// What the page needs to build its commands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Commands {
    /// `imgpipe reroll RUN_ID`: the ticked tasks follow.
    pub reroll: String,
    /// What follows the tasks: ` --state …`, ` --sandbox`, or nothing.
    pub flags: String,
    /// The database is a file on the host that made the report, which the page does not
    /// name: the page of a run in object storage is read from the bucket, on other hosts.
    pub unnamed_state: bool,
}

impl Commands {
    /// The commands of run `run_id` recorded in `state`; `portable` for the page of a run in
    /// object storage, which names no local file.
    pub(super) fn new(run_id: &RunId, state: &Location, portable: bool) -> Commands {
        let unnamed_state = portable && matches!(state, Location::File(_));
        let flags = if unnamed_state {
            Vec::new()
        } else {
            state_flags(state, default_path().as_deref())
        };
        Commands {
            reroll: format!("imgpipe reroll {}", quote(run_id)),
            flags: flags.iter().map(|w| format!(" {w}")).collect(),
            unnamed_state,
        }
    }

    /// `imgpipe resume RUN_ID` and the flags.
    pub(super) fn resume(&self, run_id: &RunId) -> String {
        format!("imgpipe resume {}{}", quote(run_id), self.flags)
    }
}

/// The words that find database `state` again, `default` being the database a command uses
/// without flags: none for that one, `--sandbox` for the sandbox's beside it, else `--state`
/// with an absolute path, or a PostgreSQL URL as shown (never with a password).
fn state_flags(state: &Location, default: Option<&Path>) -> Vec<String> {
    match state {
        Location::File(path) => {
            let path = std::path::absolute(path).unwrap_or_else(|_| path.clone());
            if default == Some(path.as_path()) {
                Vec::new()
            } else if default.map(|d| d.with_file_name(SANDBOX_FILE)) == Some(path.clone()) {
                vec!["--sandbox".to_owned()]
            } else {
                vec!["--state".to_owned(), quote(&path.display().to_string())]
            }
        }
        Location::Postgres(url) => vec!["--state".to_owned(), quote(&url.to_string())],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_database_other_than_the_default_is_named_and_a_password_never() {
        let default = Path::new("/home/u/.local/state/imgpipe/state.db");
        let at = |s: &str| state_flags(&Location::parse(s, "state").unwrap(), Some(default));
        assert!(at("/home/u/.local/state/imgpipe/state.db").is_empty());
        assert_eq!(at("/home/u/.local/state/imgpipe/sandbox.db"), ["--sandbox"]);
        assert_eq!(at("/srv/my runs.db"), ["--state", "'/srv/my runs.db'"]);
        let pg = at("postgres://ops:secret@db.internal:5432/imgpipe");
        assert_eq!(pg[0], "--state");
        assert!(!pg[1].contains("secret"), "{pg:?}");
        assert!(pg[1].contains("db.internal:5432/imgpipe"), "{pg:?}");
        let commands = Commands {
            reroll: "imgpipe reroll r1".into(),
            flags: " --state /x.db".into(),
            unnamed_state: false,
        };
        assert_eq!(
            commands.resume(&crate::run_id::RunId::from("a b")),
            "imgpipe resume 'a b' --state /x.db"
        );
    }
}

//! Where the state is: a SQLite file (a path, or `file:///…`) or a PostgreSQL database
//! (`postgres://…`). Any other URL is refused: taken for a relative path, it would create
//! `./mysql:/…` and go on as if nothing were wrong.

use std::fmt;
use std::path::{Path, PathBuf};

use crate::place::{local_path, url_scheme};

/// Where a state database is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Location {
    /// A SQLite file on this machine.
    File(PathBuf),
    /// A PostgreSQL database, shared by every host that names it.
    Postgres(PgUrl),
}

impl Location {
    /// What the user wrote for `--state` or `IMGPIPE_STATE` (`what` names it in the message).
    pub fn parse(place: &str, what: &str) -> Result<Location, String> {
        match url_scheme(place) {
            Some(s)
                if s.eq_ignore_ascii_case("postgres") || s.eq_ignore_ascii_case("postgresql") =>
            {
                PgUrl::parse(place, what).map(Location::Postgres)
            }
            Some(s) if !s.eq_ignore_ascii_case("file") => Err(format!(
                "{what} `{}` is a {s}:// URL: give a local path (a SQLite file) or a postgres://user@host:port/database URL",
                redact(place)
            )),
            _ => local_path(place, what).map(Location::File),
        }
    }

    /// The SQLite file, when the state is one.
    pub fn file(&self) -> Option<&Path> {
        match self {
            Location::File(path) => Some(path),
            Location::Postgres(_) => None,
        }
    }
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Location::File(path) => write!(f, "{}", path.display()),
            Location::Postgres(url) => write!(f, "{url}"),
        }
    }
}

/// A PostgreSQL URL. Shown, it never carries a password or query parameters (which may hold
/// one): passwords belong in `PGPASSWORD` or a `~/.pgpass` file, which libpq and imgpipe read.
#[derive(Clone, PartialEq, Eq)]
pub struct PgUrl {
    url: String,
    shown: String,
}

impl PgUrl {
    fn parse(place: &str, what: &str) -> Result<PgUrl, String> {
        let parsed = url::Url::parse(place)
            .map_err(|e| format!("{what} `{}` is not a valid URL: {e}", redact(place)))?;
        if parsed.host_str().is_none_or(str::is_empty) {
            return Err(format!(
                "{what} `{}` names no host: write postgres://user@host:port/database",
                redact(place)
            ));
        }
        Ok(PgUrl {
            url: place.to_owned(),
            shown: redact(place),
        })
    }

    /// The URL to connect with, password included: for the driver only, never to be shown.
    pub(crate) fn secret(&self) -> &str {
        &self.url
    }
}

impl fmt::Display for PgUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.shown)
    }
}

impl fmt::Debug for PgUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PgUrl({})", self.shown)
    }
}

/// `scheme://user@host:port/path`, without a password, query or fragment: what a message or a
/// command to paste may show.
fn redact(place: &str) -> String {
    match url::Url::parse(place) {
        Ok(mut u) => {
            let _ = u.set_password(None);
            u.set_query(None);
            u.set_fragment(None);
            u.to_string()
        }
        // Not a URL at all: show its scheme only, in case the rest holds a secret.
        Err(_) => format!("{}://…", url_scheme(place).unwrap_or("?")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_postgres_url_is_never_shown_with_its_password() {
        let l = Location::parse(
            "postgres://alice:hunter2@db.example:5432/imgpipe?password=hunter3",
            "--state",
        )
        .unwrap();
        let shown = format!("{l} {l:?}");
        assert!(!shown.contains("hunter"), "{shown}");
        assert!(shown.contains("alice@db.example:5432/imgpipe"), "{shown}");
        match l {
            Location::Postgres(u) => assert!(u.secret().contains("hunter2")),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn other_urls_are_refused_and_paths_stay_paths() {
        let err = Location::parse("mysql://root:pw@h/db", "--state").unwrap_err();
        assert!(err.contains("mysql://") && !err.contains("pw"), "{err}");
        assert_eq!(
            Location::parse("file:///tmp/s.db", "--state").unwrap(),
            Location::File("/tmp/s.db".into())
        );
        assert_eq!(
            Location::parse("rel/s.db", "--state").unwrap(),
            Location::File("rel/s.db".into())
        );
    }
}

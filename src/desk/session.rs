//! The page's session: a secret of its own in a cookie, never the token.
//!
//! A browser sends a host's cookies to every port of it, so a cookie holding the token that
//! spends would reach any local server the browser visits. The URL with the token (which the
//! desk prints) instead opens a session: a new random secret the desk keeps, in a cookie named
//! for its port (a second desk's cookie is another cookie, and its secret is not one of
//! ours). The session only reads: a change still needs the token in its `Authorization`
//! header.

use std::sync::Mutex;

use super::Token;

/// The sessions kept at once, the oldest forgotten first. Each opening of the token's URL
/// makes one (a tab, a reload of the printed URL): a person has a few, and the set stays a
/// few kilobytes whoever calls.
pub const MOST_SESSIONS: usize = 32;

/// The live sessions' secrets, the newest last.
#[derive(Default)]
pub struct Sessions {
    live: Mutex<Vec<Token>>,
}

impl Sessions {
    /// A new session: its secret, 256 random bits as the token's. The oldest session is
    /// forgotten when [`MOST_SESSIONS`] are live.
    pub fn open(&self) -> std::io::Result<Token> {
        let secret = Token::new()?;
        let mut live = self.live.lock().unwrap_or_else(|e| e.into_inner());
        if live.len() >= MOST_SESSIONS {
            live.remove(0);
        }
        live.push(secret.clone());
        Ok(secret)
    }

    /// Whether `given` is a live session's secret (each compared in constant time).
    pub fn holds(&self, given: &str) -> bool {
        let live = self.live.lock().unwrap_or_else(|e| e.into_inner());
        live.iter().fold(false, |found, s| s.matches(given) | found)
    }
}

/// The name of the cookie of the desk on `port`: one desk's cookie is never another's.
pub fn cookie_name(port: u16) -> String {
    format!("imgpipe_desk_{port}")
}

/// The `Set-Cookie` value that gives the browser `secret` for the desk on `port`: sent back
/// only to the desk's own pages (`SameSite=Strict`), out of reach of scripts (`HttpOnly`).
pub fn set_cookie(port: u16, secret: &Token) -> String {
    format!(
        "{}={}; HttpOnly; SameSite=Strict; Path=/",
        cookie_name(port),
        secret.reveal()
    )
}

/// The values of the cookies named `name` in a `Cookie` header.
pub fn cookies<'c>(header: &'c str, name: &'c str) -> impl Iterator<Item = &'c str> {
    header
        .split(';')
        .filter_map(|c| c.trim().split_once('='))
        .filter(move |(k, _)| *k == name)
        .map(|(_, v)| v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_is_its_own_secret_kept_bounded_and_named_for_its_port() {
        let sessions = Sessions::default();
        let first = sessions.open().unwrap();
        assert!(sessions.holds(first.reveal()));
        assert!(!sessions.holds(""));
        assert!(!sessions.holds(Token::new().unwrap().reveal()));
        for _ in 0..MOST_SESSIONS {
            sessions.open().unwrap();
        }
        assert!(!sessions.holds(first.reveal()), "the oldest forgotten");
        assert_eq!(sessions.live.lock().unwrap().len(), MOST_SESSIONS);

        let cookie = set_cookie(8123, &first);
        assert!(cookie.starts_with("imgpipe_desk_8123="), "{cookie}");
        assert!(cookie.contains("; HttpOnly; SameSite=Strict; Path=/"));
        let header = format!("imgpipe_desk_9=a; imgpipe_desk_8123={}", first.reveal());
        let name = cookie_name(8123);
        let found: Vec<_> = cookies(&header, &name).collect();
        assert_eq!(found, [first.reveal()]);
    }
}

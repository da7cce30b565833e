//! The API key, kept out of every log line, error message, file and database row by its type.

use std::fmt;
use std::path::Path;

/// A secret that prints as `[redacted]` however it is formatted; only [`ApiKey::expose`] yields
/// the value, and only the client calls it, to build the `X-API-Key` header.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey(String);

/// Why no usable key could be read.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("the API key is empty")]
    Empty,
    #[error("the API key contains characters that cannot be sent in an HTTP header")]
    NotHeaderSafe,
    /// The path is not repeated: a key pasted where the path belongs would be printed.
    #[error("cannot read the API key file: {source}")]
    File {
        #[source]
        source: std::io::Error,
    },
}

impl ApiKey {
    /// Takes a key, trimming surrounding white space (a trailing newline in a key file is usual).
    pub fn new(raw: impl Into<String>) -> Result<Self, KeyError> {
        let raw = raw.into();
        let key = raw.trim();
        if key.is_empty() {
            return Err(KeyError::Empty);
        }
        if !key.bytes().all(|b| (0x21..0x7f).contains(&b)) {
            return Err(KeyError::NotHeaderSafe);
        }
        Ok(ApiKey(key.to_owned()))
    }

    pub fn from_file(path: &Path) -> Result<Self, KeyError> {
        let text = std::fs::read_to_string(path).map_err(|source| KeyError::File { source })?;
        ApiKey::new(text)
    }

    pub fn expose(&self) -> &str {
        &self.0
    }

    /// The account this key opens at the service at `base`, as the state database names it:
    /// a SHA-256 digest of the address and the key, from which neither can be read back.
    pub fn account_digest(&self, base: &str) -> String {
        use sha2::Digest;
        let mut hash = sha2::Sha256::new();
        hash.update(b"imgpipe account\n");
        hash.update(base.trim_end_matches('/').as_bytes());
        hash.update(b"\n");
        hash.update(self.0.as_bytes());
        hex::encode(hash.finalize())
    }

    /// Replaces every occurrence of the key in `text`: servers sometimes echo what they got.
    pub fn redact(&self, text: &str) -> String {
        text.replace(&self.0, "[redacted]")
    }
}

impl fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ApiKey([redacted])")
    }
}

impl fmt::Display for ApiKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[redacted]")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn never_formats_its_value() {
        let key = ApiKey::new("sk-secret-123\n").unwrap();
        assert_eq!(key.expose(), "sk-secret-123");
        assert!(!format!("{key} {key:?} {key:#?}").contains("secret"));
        assert_eq!(key.redact("bad key sk-secret-123"), "bad key [redacted]");
        assert!(matches!(ApiKey::new("  \n"), Err(KeyError::Empty)));
        let account = key.account_digest("http://127.0.0.1:9/");
        assert!(
            !account.contains("secret") && account.len() == 64,
            "{account}"
        );
        assert_eq!(account, key.account_digest("http://127.0.0.1:9"));
        assert_ne!(account, key.account_digest("http://127.0.0.1:8"));
        let other = ApiKey::new("sk-secret-124").unwrap();
        assert_ne!(account, other.account_digest("http://127.0.0.1:9"));
        assert!(matches!(ApiKey::new("a b"), Err(KeyError::NotHeaderSafe)));
    }
}

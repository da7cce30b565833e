//! The desk's token: 256 random bits made at start, printed only in the URL, compared in
//! constant time, never logged (its `Debug` hides it).

use std::fmt;

/// A secret that every request to the desk carries.
#[derive(Clone)]
pub struct Token(String);

impl Token {
    /// 32 bytes from the operating system's generator, as 64 hex digits.
    pub fn new() -> std::io::Result<Token> {
        let mut raw = [0u8; 32];
        getrandom::fill(&mut raw).map_err(|e| std::io::Error::other(e.to_string()))?;
        Ok(Token(hex::encode(raw)))
    }

    /// The token as it goes in the URL.
    pub fn reveal(&self) -> &str {
        &self.0
    }

    /// Whether `given` is the token, in a time that does not depend on where they differ.
    pub fn matches(&self, given: &str) -> bool {
        let (a, b) = (self.0.as_bytes(), given.as_bytes());
        if a.len() != b.len() {
            return false;
        }
        a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Token(…)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_is_256_random_bits_matched_whole_and_never_shown() {
        let (a, b) = (Token::new().unwrap(), Token::new().unwrap());
        assert_eq!(a.reveal().len(), 64);
        assert_ne!(a.reveal(), b.reveal());
        assert!(a.matches(a.reveal()));
        assert!(!a.matches(b.reveal()));
        assert!(!a.matches(&a.reveal()[..63]));
        assert!(!a.matches(""));
        assert!(!format!("{a:?}").contains(a.reveal()));
    }
}

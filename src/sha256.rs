//! A sha256 as imgpipe writes and keeps it: 64 lowercase hex digits. Made only by hashing
//! ([`Sha256Sum::of_digest`], [`Sha256Sum::of_bytes`]) or by a strict parse where text comes
//! in (the state database), so a value of this type is always a digest, never a path, a job id
//! or an empty string. A leaf: like the run id's module, it depends on nothing but std, serde,
//! sha2 and hex; the store binds it as text (`store::ids`).

use std::fmt;
use std::ops::Deref;

#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(transparent)]
pub struct Sha256Sum(String);

/// Text that is not 64 lowercase hex digits.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("not a sha256 (64 lowercase hex digits): {0:?}")]
pub struct NotSha256(pub String);

impl Sha256Sum {
    /// The digest a hasher finished with (32 bytes), written as hex.
    pub fn of_digest(digest: impl AsRef<[u8]>) -> Sha256Sum {
        Sha256Sum(hex::encode(digest))
    }

    /// The sha256 of `bytes`.
    pub fn of_bytes(bytes: &[u8]) -> Sha256Sum {
        Sha256Sum::of_digest(<sha2::Sha256 as sha2::Digest>::digest(bytes))
    }

    /// `text` when it is a sha256 as imgpipe writes one; an error for anything else.
    pub fn parse(text: &str) -> Result<Sha256Sum, NotSha256> {
        let hex = |b: u8| b.is_ascii_digit() || (b'a'..=b'f').contains(&b);
        if text.len() == 64 && text.bytes().all(hex) {
            Ok(Sha256Sum(text.to_owned()))
        } else {
            Err(NotSha256(text.to_owned()))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Sha256Sum {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Read as text where text is wanted: a message, a header, a statement's parameter.
impl Deref for Sha256Sum {
    type Target = str;

    fn deref(&self) -> &str {
        &self.0
    }
}

impl PartialEq<str> for Sha256Sum {
    fn eq(&self, other: &str) -> bool {
        self.0 == other
    }
}

impl<'de> serde::Deserialize<'de> for Sha256Sum {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Sha256Sum, D::Error> {
        let text = String::deserialize(d)?;
        Sha256Sum::parse(&text).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_sixty_four_lowercase_hex_digits_are_a_sha256() {
        let empty = Sha256Sum::of_bytes(b"");
        assert_eq!(
            empty.as_str(),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        assert_eq!(Sha256Sum::parse(empty.as_str()), Ok(empty.clone()));
        for bad in [
            "",
            "abc",
            &empty.to_uppercase(),
            &format!("{empty}0"),
            &"g".repeat(64),
        ] {
            assert!(Sha256Sum::parse(bad).is_err(), "{bad:?}");
        }
        let json = serde_json::to_string(&empty).unwrap();
        assert_eq!(serde_json::from_str::<Sha256Sum>(&json).unwrap(), empty);
        assert!(serde_json::from_str::<Sha256Sum>("\"recorded\"").is_err());
    }
}

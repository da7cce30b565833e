//! Words of a command as a POSIX shell reads them back: the commands imgpipe prints for the
//! user to paste (continue a run, reroll tasks) quote their words here, and the report's
//! script quotes the same way (`report/page.js`).

/// Characters that never need quoting.
pub const PLAIN: &str = "-_./:=@%+,";

/// `word` as is when it is plain (ASCII letters, digits and [`PLAIN`]), else single-quoted.
pub fn quote(word: &str) -> String {
    let plain = !word.is_empty()
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || PLAIN.contains(c));
    if plain {
        word.to_owned()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

#[cfg(test)]
mod tests {
    use super::quote;

    #[test]
    fn words_are_quoted_only_when_a_shell_would_split_or_expand_them() {
        assert_eq!(quote("daily.yaml"), "daily.yaml");
        assert_eq!(quote("/srv/shots/key"), "/srv/shots/key");
        assert_eq!(quote("my key"), "'my key'");
        assert_eq!(quote("it's"), r"'it'\''s'");
        assert_eq!(quote("$HOME"), "'$HOME'");
        assert_eq!(quote(""), "''");
        assert_eq!(quote("mug/clean[0]"), "'mug/clean[0]'");
    }
}

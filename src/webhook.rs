//! A webhook's address, checked once: the pipeline file's `notify`, the `--notify` flag and
//! the alerts' sender all take a URL only through [`check_url`]. A leaf, so the checks of a
//! pipeline file and the command line can use it without depending on what sends the alerts.

use std::net::IpAddr;

use url::Url;

/// A webhook URL: https, or http to a loopback address (a receiver on the same host).
pub fn check_url(s: &str) -> Result<Url, String> {
    let url = Url::parse(s.trim()).map_err(|e| format!("the notify URL is not a URL: {e}"))?;
    let loopback = match url.host() {
        Some(url::Host::Ipv4(ip)) => IpAddr::V4(ip).is_loopback(),
        Some(url::Host::Ipv6(ip)) => IpAddr::V6(ip).is_loopback(),
        _ => false,
    };
    match url.scheme() {
        "https" if url.host().is_some() => Ok(url),
        "http" if loopback => Ok(url),
        "http" => {
            Err("the notify URL must be https (plain http only to 127.0.0.1 or [::1])".into())
        }
        other => Err(format!("the notify URL must be https, not {other}:")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_https_or_loopback_http_is_taken() {
        assert!(check_url("https://hooks.example.com/x").is_ok());
        assert!(check_url("http://127.0.0.1:9/hook").is_ok());
        assert!(check_url("http://[::1]:9/hook").is_ok());
        assert!(check_url("http://hooks.example.com/x").is_err());
        assert!(check_url("http://10.0.0.1/x").is_err());
        assert!(check_url("ftp://127.0.0.1/x").is_err());
        assert!(check_url("not a url").is_err());
    }
}

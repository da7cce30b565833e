//! Signed, expiring result URLs, as the service issues them: an HMAC over the image id and the
//! expiry instant, so a URL can be neither forged nor extended.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

pub(super) struct Signer {
    secret: [u8; 32],
    /// URLs expiring at or before this instant (ms) are refused whatever the clock says: set
    /// by [`Signer::expire_all`].
    expired_through: AtomicU64,
}

/// Why a signed URL was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    Forged,
    Expired,
}

impl Signer {
    pub(super) fn new(secret: [u8; 32]) -> Self {
        Signer {
            secret,
            expired_through: AtomicU64::new(0),
        }
    }

    /// The expiry of a URL issued now to live `ttl`: always after every URL expired by
    /// [`Signer::expire_all`], even within the same millisecond.
    pub(super) fn expires_after(&self, ttl: Duration) -> u64 {
        let at = now_ms().saturating_add(u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX));
        at.max(
            self.expired_through
                .load(Ordering::SeqCst)
                .saturating_add(1),
        )
    }

    /// Expires every URL issued so far to live at most `ttl`, as if its lifetime had passed.
    pub(super) fn expire_all(&self, ttl: Duration) {
        let through = now_ms().saturating_add(u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX));
        self.expired_through.fetch_max(through, Ordering::SeqCst);
    }

    fn mac(&self, image_id: &str, expires_ms: u64) -> HmacSha256 {
        let mut mac =
            HmacSha256::new_from_slice(&self.secret).expect("HMAC accepts keys of any length");
        mac.update(image_id.as_bytes());
        mac.update(b".");
        mac.update(expires_ms.to_string().as_bytes());
        mac
    }

    /// The query string (`expires=..&sig=..`) for `image_id`, valid until `expires_ms`.
    pub(super) fn sign(&self, image_id: &str, expires_ms: u64) -> String {
        let sig = hex::encode(self.mac(image_id, expires_ms).finalize().into_bytes());
        format!("expires={expires_ms}&sig={sig}")
    }

    /// Checks a signature in constant time, then the expiry.
    pub(super) fn verify(
        &self,
        image_id: &str,
        expires_ms: u64,
        sig_hex: &str,
    ) -> Result<(), Refusal> {
        let sig = hex::decode(sig_hex).map_err(|_| Refusal::Forged)?;
        self.mac(image_id, expires_ms)
            .verify_slice(&sig)
            .map_err(|_| Refusal::Forged)?;
        if now_ms() >= expires_ms || expires_ms <= self.expired_through.load(Ordering::SeqCst) {
            return Err(Refusal::Expired);
        }
        Ok(())
    }
}

pub(super) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signatures_bind_id_and_expiry() {
        let signer = Signer::new([7; 32]);
        let later = now_ms() + 60_000;
        let query = signer.sign("img_1", later);
        let sig = query.split("sig=").nth(1).unwrap();
        assert_eq!(signer.verify("img_1", later, sig), Ok(()));
        assert_eq!(signer.verify("img_2", later, sig), Err(Refusal::Forged));
        assert_eq!(signer.verify("img_1", later + 1, sig), Err(Refusal::Forged));
        let past = now_ms() - 1;
        let sig = signer
            .sign("img_1", past)
            .split("sig=")
            .nth(1)
            .unwrap()
            .to_owned();
        assert_eq!(signer.verify("img_1", past, &sig), Err(Refusal::Expired));
    }

    #[test]
    fn expiring_every_url_refuses_those_issued_and_none_issued_after() {
        let signer = Signer::new([7; 32]);
        let ttl = Duration::from_secs(3600);
        let issued = signer.expires_after(ttl);
        let sig = |at: u64| {
            signer
                .sign("img_1", at)
                .split("sig=")
                .nth(1)
                .unwrap()
                .to_owned()
        };
        let first = sig(issued);
        assert_eq!(signer.verify("img_1", issued, &first), Ok(()));
        signer.expire_all(ttl);
        assert_eq!(
            signer.verify("img_1", issued, &first),
            Err(Refusal::Expired)
        );
        // Issued after, even within the same millisecond: valid.
        let fresh = signer.expires_after(ttl);
        assert!(fresh > issued);
        assert_eq!(signer.verify("img_1", fresh, &sig(fresh)), Ok(()));
    }
}

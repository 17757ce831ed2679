//! Peer authentication of the control plane (docs/protocol.md, "mbal peer").
//!
//! Control commands (`mbal move`, `mbal debug ...`, `mbal replica ...`:
//! everything but `mbal hello`, `mbal map`, `mbal load` and `mbal peer`
//! itself, see [`is_control`]) are accepted only on a connection that proved
//! it knows the cluster secret. The proof is a challenge: the server answers
//! `mbal peer` with `NONCE <32 hex digits>`, a fresh random nonce; the peer
//! sends `mbal peer <hex HMAC-SHA256(secret, nonce bytes)>` and gets `OK`
//! (or `CLIENT_ERROR bad peer credentials`). The secret never crosses the
//! wire and a recorded answer is worth nothing on another connection.
//!
//! Pure functions, no I/O but reading a secret file: the server, the routing
//! client, the bench and the CLI share them.

use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::path::Path;

type HmacSha256 = Hmac<Sha256>;

/// Bytes of a nonce.
pub const NONCE_LEN: usize = 16;
/// Shortest secret accepted (bytes).
pub const MIN_SECRET_LEN: usize = 16;

/// The first word of every `mbal` command that is *not* control: the data
/// plane's routing commands and the handshake itself.
const DATA_PLANE: &[&str] = &["hello", "map", "load", "peer"];

/// Is `mbal <word> ...` a control command? Default-deny: every word but
/// `hello`, `map`, `load` and `peer` is (so are words added later).
pub fn is_control(word: &str) -> bool {
    !DATA_PLANE.contains(&word)
}

/// A cluster secret. Its `Debug` form never shows it.
#[derive(Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Secret(Vec<u8>);

impl Secret {
    /// A secret of at least [`MIN_SECRET_LEN`] bytes.
    pub fn new(bytes: Vec<u8>) -> Result<Secret, String> {
        if bytes.len() < MIN_SECRET_LEN {
            return Err(format!("a cluster secret must be at least {MIN_SECRET_LEN} bytes"));
        }
        Ok(Secret(bytes))
    }

    /// Read a secret file; trailing whitespace (the file's line end) is not
    /// part of the secret.
    pub fn from_file(path: &Path) -> Result<Secret, String> {
        let mut bytes = std::fs::read(path).map_err(|e| format!("reading secret file {}: {e}", path.display()))?;
        while bytes.last().is_some_and(|b| b.is_ascii_whitespace()) {
            bytes.pop();
        }
        Secret::new(bytes).map_err(|e| format!("{}: {e}", path.display()))
    }

    pub fn bytes(&self) -> &[u8] {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

impl TryFrom<String> for Secret {
    type Error = String;
    fn try_from(s: String) -> Result<Secret, String> {
        Secret::new(s.into_bytes())
    }
}

impl From<Secret> for String {
    fn from(s: Secret) -> String {
        String::from_utf8_lossy(&s.0).into_owned()
    }
}

/// A fresh random nonce (the operating system's generator through
/// `rand`'s thread RNG, a CSPRNG).
pub fn new_nonce() -> [u8; NONCE_LEN] {
    rand::random()
}

/// Lower-case hex.
pub fn to_hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for &b in bytes {
        s.push(DIGITS[(b >> 4) as usize] as char);
        s.push(DIGITS[(b & 15) as usize] as char);
    }
    s
}

/// Hex (either case) to bytes; None if not an even number of hex digits.
pub fn from_hex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    let digit = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    s.as_bytes().chunks(2).map(|p| Some(digit(p[0])? << 4 | digit(p[1])?)).collect()
}

fn mac(secret: &Secret, nonce: &[u8]) -> HmacSha256 {
    let mut m = HmacSha256::new_from_slice(secret.bytes()).expect("HMAC takes a key of any length");
    m.update(nonce);
    m
}

/// The peer's answer to a `NONCE <hex>` challenge: the hex of
/// HMAC-SHA256(secret, nonce bytes). None if `nonce_hex` is not hex.
pub fn response(secret: &Secret, nonce_hex: &str) -> Option<String> {
    let nonce = from_hex(nonce_hex)?;
    Some(to_hex(&mac(secret, &nonce).finalize().into_bytes()))
}

/// Does `answer_hex` prove knowledge of `secret` for `nonce`? (Compared in
/// constant time.)
pub fn verify(secret: &Secret, nonce: &[u8], answer_hex: &str) -> bool {
    match from_hex(answer_hex) {
        Some(answer) => mac(secret, nonce).verify_slice(&answer).is_ok(),
        None => false,
    }
}

/// The request line that asks for a challenge.
pub const HELLO: &[u8] = b"mbal peer\r\n";

/// Given the server's reply line to [`HELLO`] (`NONCE <hex>`, without its
/// line end), the request line that answers it.
pub fn answer_line(secret: &Secret, reply: &str) -> Result<String, String> {
    let hex =
        reply.strip_prefix("NONCE ").ok_or_else(|| format!("mbal peer: expected NONCE, got {:?}", reply.trim_end()))?;
    let r = response(secret, hex.trim_end()).ok_or_else(|| format!("mbal peer: bad nonce {hex:?}"))?;
    Ok(format!("mbal peer {r}\r\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret() -> Secret {
        Secret::new(b"0123456789abcdef-cluster".to_vec()).unwrap()
    }

    #[test]
    fn classification_is_default_deny() {
        for w in ["hello", "map", "load", "peer"] {
            assert!(!is_control(w), "{w}");
        }
        for w in ["move", "debug", "replica", "anything-new", ""] {
            assert!(is_control(w), "{w}");
        }
    }

    #[test]
    fn hex_round_trips() {
        let b: Vec<u8> = (0..=255).collect();
        assert_eq!(from_hex(&to_hex(&b)).unwrap(), b);
        assert_eq!(from_hex("0aFF"), Some(vec![10, 255]));
        assert_eq!(from_hex("abc"), None);
        assert_eq!(from_hex("zz"), None);
    }

    /// RFC 4231 test case 2 checks the HMAC itself.
    #[test]
    fn hmac_sha256_known_answer() {
        let m = {
            let mut m = HmacSha256::new_from_slice(b"Jefe").unwrap();
            m.update(b"what do ya want for nothing?");
            m.finalize().into_bytes()
        };
        assert_eq!(to_hex(&m), "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
    }

    #[test]
    fn the_right_secret_verifies_and_others_do_not() {
        let s = secret();
        let nonce = new_nonce();
        let r = response(&s, &to_hex(&nonce)).unwrap();
        assert!(verify(&s, &nonce, &r));
        assert!(verify(&s, &nonce, &r.to_uppercase()));
        let other = Secret::new(b"another secret of enough bytes".to_vec()).unwrap();
        assert!(!verify(&other, &nonce, &r));
        assert!(!verify(&s, &new_nonce(), &r), "an answer is bound to its nonce");
        assert!(!verify(&s, &nonce, "00"));
        assert!(!verify(&s, &nonce, "not hex"));
        assert_ne!(new_nonce(), new_nonce());
    }

    #[test]
    fn answer_line_and_secret_rules() {
        let s = secret();
        let line = answer_line(&s, "NONCE 00112233445566778899aabbccddeeff").unwrap();
        assert!(line.starts_with("mbal peer ") && line.ends_with("\r\n") && line.len() == 10 + 64 + 2, "{line}");
        assert!(answer_line(&s, "CLIENT_ERROR x").is_err());
        assert!(Secret::new(b"short".to_vec()).is_err());
        assert_eq!(format!("{:?}", s), "Secret(..)");
        let dir = std::env::temp_dir().join(format!("mbal-secret-{}", std::process::id()));
        std::fs::write(&dir, b"0123456789abcdef-cluster\n").unwrap();
        assert_eq!(Secret::from_file(&dir).unwrap(), s, "the line end is not part of the secret");
        std::fs::remove_file(&dir).unwrap();
    }
}

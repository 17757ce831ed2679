//! The users of `-Y FILE` (memcached's auth file), as the settings hold them: a leaf of the
//! server's modules, so that `config` needs nothing of `auth`, which checks connections
//! against them.

use std::path::Path;

/// The users of `-Y FILE`. Its `Debug` form shows only how many.
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    users: Vec<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Credentials({} users)", self.users.len())
    }
}

impl Credentials {
    /// memcached's auth file: one `user:password` per line (the password is
    /// everything after the first `:` up to the line end; empty lines are
    /// skipped). A line without `:` is an error, as in memcached.
    pub fn parse(text: &[u8]) -> Result<Credentials, String> {
        let mut users = Vec::new();
        for (n, line) in text.split(|&b| b == b'\n').enumerate() {
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            if line.is_empty() {
                continue;
            }
            let Some(colon) = line.iter().position(|&b| b == b':') else {
                return Err(format!("line {}: a malformed entry, should be 'user:password'", n + 1));
            };
            if colon == 0 {
                return Err(format!("line {}: empty user name", n + 1));
            }
            users.push((line[..colon].to_vec(), line[colon + 1..].to_vec()));
        }
        if users.is_empty() {
            return Err("no users (lines 'user:password')".into());
        }
        Ok(Credentials { users })
    }

    pub fn load(path: &Path) -> Result<Credentials, String> {
        let text = std::fs::read(path).map_err(|e| format!("-Y {}: {e}", path.display()))?;
        Credentials::parse(&text).map_err(|e| format!("-Y {}: {e}", path.display()))
    }

    /// Are these a user's name and password? Every entry is compared, each
    /// in time independent of where the bytes differ.
    pub fn check(&self, user: &[u8], pass: &[u8]) -> bool {
        let mut ok = false;
        for (u, p) in &self.users {
            ok |= same(u, user) & same(p, pass);
        }
        ok
    }
}

/// Constant-time equality for equal lengths (lengths are not secret).
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

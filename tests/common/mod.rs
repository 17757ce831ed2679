//! Helpers for the root package's integration tests, which run the `mbal` binary.

pub mod cluster;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

/// A child process this test started; stopped with SIGTERM (by pid) when dropped. `cluster
/// up` stops its servers, then exits.
pub struct Kill(pub Child);

impl Drop for Kill {
    fn drop(&mut self) {
        unsafe { libc::kill(self.0.id() as libc::pid_t, libc::SIGTERM) };
        let _ = self.0.wait();
    }
}

/// The `mbal` binary.
pub fn mbal() -> Command {
    Command::new(env!("CARGO_BIN_EXE_mbal"))
}

#[allow(dead_code)] // not every test file uses it
/// Spawn `mbal cluster up ...` (`up`, its arguments set) and wait for its report: the main
/// address of each of its `servers` once they listen.
pub fn cluster_up(mut up: Command, servers: usize) -> (Kill, Vec<String>) {
    let mut up = up.stdout(Stdio::piped()).stderr(Stdio::null()).spawn().expect("cluster up");
    let out = up.stdout.take().unwrap();
    let guard = Kill(up);
    let mut addrs = Vec::new();
    for line in BufReader::new(out).lines() {
        let line = line.unwrap();
        if let Some(rest) = line.trim().strip_prefix("server ") {
            addrs.push(rest.split_whitespace().nth(1).unwrap().to_string());
        }
        if line.starts_with("Ctrl-C") {
            break;
        }
    }
    assert_eq!(addrs.len(), servers, "{addrs:?}");
    (guard, addrs)
}

//! `mbal cluster up --tls-* --secret-file`: the cluster file it writes has
//! `[tls]` and the secret, its members listen with TLS (with -Y, passed
//! with --server-arg) and the tools that read the file (`mbal stats
//! --cluster`, `mbal top --cluster`, `mbal proxy --cluster`) talk TLS to
//! them, and the proxy logs in upstream. Real processes, real handshakes.

use mbal_tls::test_certs::Pki;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

struct Kill(Child);

impl Drop for Kill {
    fn drop(&mut self) {
        // SIGTERM to the processes this test started (by pid).
        unsafe { libc::kill(self.0.id() as libc::pid_t, libc::SIGTERM) };
        let _ = self.0.wait();
    }
}

fn mbal() -> Command {
    Command::new(env!("CARGO_BIN_EXE_mbal"))
}

/// Start `mbal cluster up` with TLS (verify_mode 2), a secret and -Y; the
/// servers' addresses once they listen.
fn tls_cluster(pki: &Pki) -> (Kill, Vec<String>, std::path::PathBuf) {
    pki.server("member");
    pki.client("peer");
    std::fs::write(pki.dir.join("secret"), "a cluster secret of 32 bytes....\n").unwrap();
    std::fs::write(pki.dir.join("users"), "app:pw\n").unwrap();
    let file = pki.dir.join("cluster.toml");
    let p = |f: &str| pki.dir.join(f).to_str().unwrap().to_string();
    let mut up = mbal()
        .args(["cluster", "up", "--servers", "2", "--workers", "2", "-m", "16", "--file", &p("cluster.toml")])
        .args(["--tls-ca", &p("ca.pem"), "--tls-cert", &p("member.pem"), "--tls-key", &p("member.key")])
        .args(["--tls-verify-mode", "2", "--tls-client-cert", &p("peer.pem"), "--tls-client-key", &p("peer.key")])
        .args(["--secret-file", &p("secret")])
        .arg(format!("--server-arg=-Y{}", p("users")))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("cluster up");
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
    assert_eq!(addrs.len(), 2, "{addrs:?}");
    (guard, addrs, file)
}

#[test]
fn cluster_up_with_tls_and_the_tools_that_read_its_file() {
    let pki = Pki::new("up");
    let (_up, addrs, file) = tls_cluster(&pki);
    let text = std::fs::read_to_string(&file).unwrap();
    assert!(text.contains("[tls]") && text.contains("verify_mode = 2") && text.contains("secret_file"), "{text}");
    // A plaintext client gets nowhere: the members speak TLS only.
    let mut plain = TcpStream::connect(&addrs[0]).unwrap();
    plain.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    plain.write_all(b"version\r\n").unwrap();
    let mut buf = [0u8; 64];
    assert!(!matches!(plain.read(&mut buf), Ok(n) if n > 0 && buf.starts_with(b"VERSION")));

    let stats = mbal().args(["stats", "--cluster", file.to_str().unwrap(), "--interval", "0.1"]).output().unwrap();
    let out = String::from_utf8_lossy(&stats.stdout);
    assert!(stats.status.success(), "{out}\n{}", String::from_utf8_lossy(&stats.stderr));
    let top = mbal().args(["top", "--cluster", file.to_str().unwrap(), "--iterations", "1"]).output().unwrap();
    let out = String::from_utf8_lossy(&top.stdout);
    assert!(top.status.success(), "{out}\n{}", String::from_utf8_lossy(&top.stderr));
    assert!(out.contains("mbal top: 2 servers, 4 workers"), "{out}");
}

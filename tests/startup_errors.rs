//! A startup error is one clear line on stderr and a non-zero exit, never a
//! backtrace, even with RUST_BACKTRACE=1: the real binary, bad options.

use std::net::TcpListener;
use std::process::Command;
use std::time::Duration;

/// Run `mbal server <args>` with backtraces asked for; it must exit on its own.
fn start_fails(args: &[&str]) -> (i32, String) {
    let child = Command::new(env!("CARGO_BIN_EXE_mbal"))
        .arg("server")
        .args(args)
        .env("RUST_BACKTRACE", "1")
        .env_remove("RUST_LOG")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn mbal");
    // Bounded: a server that started by mistake is killed (by its pid) after 20 s.
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    let out = match rx.recv_timeout(Duration::from_secs(20)) {
        Ok(out) => out.expect("output"),
        Err(_) => {
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
            panic!("mbal server {args:?} did not exit");
        }
    };
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stderr).into_owned())
}

fn assert_one_line(args: &[&str], want: &str) {
    let (code, err) = start_fails(args);
    assert_ne!(code, 0, "{args:?} exited 0; stderr: {err}");
    assert_eq!(err.lines().count(), 1, "{args:?}: not one line:\n{err}");
    assert!(err.starts_with("mbal: "), "{args:?}: {err}");
    assert!(err.contains(want), "{args:?}: {err:?} lacks {want:?}");
    assert!(!err.contains("backtrace") && !err.contains("panicked"), "{args:?}: {err}");
}

#[test]
fn port_in_use() {
    let held = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = held.local_addr().unwrap().port().to_string();
    assert_one_line(&["-p", &port, "-t", "1"], "Address already in use");
    drop(held);
}

#[test]
fn bad_flag_values() {
    assert_one_line(&["-p", "99999"], "invalid value '99999'");
    assert_one_line(&["-t", "x"], "invalid value 'x'");
    assert_one_line(&["-t", "0", "-p", "0"], "-t must be between 1 and 256");
    assert_one_line(&["-B", "udp"], "-B must be ascii, binary or auto");
    assert_one_line(&["-I", "2m", "-m", "3"], "half of -m");
    assert_one_line(&["-m", "8192", "-I", "2g"], "larger than 1g");
    assert_one_line(&["--no-such-flag"], "unexpected argument '--no-such-flag'");
    assert_one_line(&["-d"], "-d (daemonize");
}

#[test]
fn bad_extended_options() {
    assert_one_line(&["-o", "bogus"], "-o bogus: unknown option");
    assert_one_line(&["-o", "modern,idle_timeout"], "-o idle_timeout: missing value");
    assert_one_line(&["-o", "hash_algorithm=md5"], "unknown 'md5'");
    assert_one_line(&["-o", "ssl_key=k.pem"], "need -Z (--enable-ssl) to turn TLS on");
    assert_one_line(&["-Z", "-o", "ssl_chain_cert=/nonexistent/c.pem"], "certificate file /nonexistent/c.pem");
    assert_one_line(&["-o", "ext_path=/tmp/x:1G"], "-o ext_path is not supported");
}

#[test]
fn missing_or_bad_config_file() {
    assert_one_line(&["--config", "/nonexistent/mbal.toml"], "reading config file /nonexistent/mbal.toml");
    let dir = std::env::temp_dir().join(format!("mbal-startup-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("bad.toml");
    std::fs::write(&f, "port = 1\nbogus = 2\n").unwrap();
    assert_one_line(&["--config", f.to_str().unwrap()], "unknown field `bogus`");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_coordinator_that_cannot_be_reached_or_refuses_is_one_line() {
    let dir = std::env::temp_dir().join(format!("mbal-startup-coord-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("cluster.toml");
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    std::fs::write(&file, format!("workers = 1\n[[servers]]\naddr = \"127.0.0.1:{port}\"\n")).unwrap();
    let f = file.to_str().unwrap();
    // Nothing listens at the coordinator's address.
    let closed = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
    let args = ["--cluster", f, "--id", "0", "--coordinator", &closed, "--coordinator-wait-ms", "300"];
    assert_one_line(&args, "coordinator");
    // --coordinator without a cluster file.
    assert_one_line(&["--coordinator", &closed], "--coordinator needs --cluster");
    let _ = std::fs::remove_dir_all(&dir);
}

//! `mbal coordinator` from a cluster file, and `mbal cluster members` against it: the real
//! binary on loopback.

use std::io::{BufRead, BufReader};
use std::process::Stdio;

#[allow(dead_code)] // cluster_up: not used here
mod common;
use common::{mbal, Kill};

#[test]
fn coordinator_starts_from_a_cluster_file_and_members_lists_its_servers() {
    let dir = std::env::temp_dir().join(format!("mbal-coord-cli-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("cluster.toml");
    std::fs::write(
        &file,
        "workers = 2\ncachelets_per_worker = 2\nvn_count = 64\n[[servers]]\naddr = \"127.0.0.1:20000\"\n\
         [[servers]]\naddr = \"127.0.0.1:20100\"\n",
    )
    .unwrap();
    // Bad timing: one clear line, exit 1.
    let out = mbal()
        .args(["coordinator", "--listen", "127.0.0.1:0", "--lease-ms", "600", "--cluster"])
        .arg(&file)
        .arg("--data-dir")
        .arg(dir.join("data"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.starts_with("mbal: ") && err.contains("failure timeout") && err.lines().count() == 1, "{err}");

    let mut child = mbal()
        .args(["coordinator", "--listen", "127.0.0.1:0", "--print-ports", "--failure-timeout-ms", "60000"])
        .args(["--lease-ms", "1000", "--cluster"])
        .arg(&file)
        .arg("--data-dir")
        .arg(dir.join("data"))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    let _guard = Kill(child);
    let mut line = String::new();
    BufReader::new(out).read_line(&mut line).unwrap();
    let ports: serde_json::Value = serde_json::from_str(&line).expect("--print-ports JSON");
    let addr = ports["main"].as_str().unwrap().to_string();
    let out = mbal().args(["cluster", "members", "--coordinator", &addr]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines[0].starts_with("epoch 1  servers up 2"), "{text}");
    assert_eq!(lines.len(), 4, "{text}");
    for (i, l) in lines[2..].iter().enumerate() {
        let f: Vec<&str> = l.split_whitespace().collect();
        assert_eq!(&f[..5], [&i.to_string()[..], &format!("127.0.0.1:{}", 20000 + 100 * i)[..], "up", "2", "4"], "{l}");
    }
    assert!(dir.join("data").join("state.json").exists());
    drop(_guard);
    let _ = std::fs::remove_dir_all(&dir);
}

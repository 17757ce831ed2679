//! `mbal bench --user --password-file` against a server started with -Y:
//! plain and routed runs authenticate every connection; a wrong password
//! stops the run with the server's answer. (One test: the login is the
//! process's, set by each run.)

use mbal_bench::workload::WorkloadKind;
use mbal_bench::{run, BenchArgs, ServerLoadMode};
use mbal_server::auth::Credentials;
use mbal_server::config::Settings;
use std::sync::Arc;

#[test]
fn bench_runs_authenticate() {
    let s = Settings {
        port: 0,
        threads: 2,
        memory_limit: 16 << 20,
        auth: Some(Arc::new(Credentials::parse(b"bench:pw-123\n").unwrap())),
        ..Settings::default()
    };
    let srv = mbal_server::start(s).unwrap();
    let dir = std::env::temp_dir().join(format!("mbal-bench-auth-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let good = dir.join("good");
    std::fs::write(&good, "pw-123\n").unwrap();
    let bad = dir.join("bad");
    std::fs::write(&bad, "nope\n").unwrap();
    let args = |routed: bool, pw: &std::path::Path| BenchArgs {
        server: vec![srv.main_addr.to_string()],
        routed,
        quiet: true,
        keys: 100,
        duration: Some(30.0),
        max_ops: Some(300),
        workload: WorkloadKind::C,
        server_load: ServerLoadMode::Off,
        user: Some("bench".into()),
        password_file: Some(pw.to_path_buf()),
        ..BenchArgs::default()
    };
    for routed in [false, true] {
        let r = run(args(routed, &good)).unwrap();
        assert_eq!((r.totals.ops, r.totals.errors), (300, 0), "routed {routed}");
    }
    let e = format!("{:#}", run(args(false, &bad)).unwrap_err());
    assert!(e.contains("CLIENT_ERROR authentication failure"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
    srv.shutdown();
}
